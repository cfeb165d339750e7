"""Text tokenizers with Megatron's types, files and interface.

Importing this package loads only the standard library; each tokenizer imports its library
(``tokenizers``, ``sentencepiece``, ``tiktoken``, ``transformers``) when it is built.
"""

from megatron.core.tokenizers.base import MegatronTokenizer, MissingSpecialTokenError
from megatron.core.tokenizers.build import TOKENIZER_KEYWORDS, TOKENIZER_TYPES, build_tokenizer
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.null import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import TikTokenizer
from megatron.core.tokenizers.wordpiece import BertWordPieceTokenizer

__all__ = [
    "TOKENIZER_KEYWORDS",
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "MegatronTokenizer",
    "MissingSpecialTokenError",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "build_tokenizer",
]
