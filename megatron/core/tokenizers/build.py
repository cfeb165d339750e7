"""``build_tokenizer``: Megatron's ``--tokenizer-type`` name and flags to a tokenizer object."""

from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional

from megatron.core.tokenizers.base import MegatronTokenizer
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

# Each builder takes the full keyword set of build_tokenizer and uses the flags its type reads.
_BUILDERS: Dict[str, Callable[..., MegatronTokenizer]] = {
    "GPT2BPETokenizer": lambda a: GPT2BPETokenizer(a["vocab_file"], a["merge_file"]),
    "BertWordPieceLowerCase": lambda a: BertWordPieceTokenizer(
        a["vocab_file"], lower_case=True, vocab_extra_ids=a["vocab_extra_ids"]
    ),
    "BertWordPieceCase": lambda a: BertWordPieceTokenizer(
        a["vocab_file"], lower_case=False, vocab_extra_ids=a["vocab_extra_ids"]
    ),
    "SentencePieceTokenizer": lambda a: SentencePieceTokenizer(
        a["tokenizer_model"], vocab_extra_ids=a["vocab_extra_ids"]
    ),
    "GPTSentencePieceTokenizer": lambda a: GPTSentencePieceTokenizer(a["tokenizer_model"]),
    "Llama2Tokenizer": lambda a: Llama2Tokenizer(a["tokenizer_model"]),
    "HuggingFaceTokenizer": lambda a: HuggingFaceTokenizer(
        a["tokenizer_model"], trust_remote_code=a["trust_remote_code"]
    ),
    "TikTokenizer": lambda a: TikTokenizer(
        a["tokenizer_model"],
        a["tiktoken_pattern"],
        vocab_size=a["vocab_size"],
        num_special_tokens=a["tiktoken_num_special_tokens"],
        special_tokens=a["tiktoken_special_tokens"],
    ),
    "NullTokenizer": lambda a: NullTokenizer(a["vocab_size"]),
}

TOKENIZER_TYPES = tuple(_BUILDERS)
# Only these types have T5 sentinels; elsewhere --vocab-extra-ids would be silently ignored.
_EXTRA_IDS_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer")


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_extra_ids: int = 0,
    tiktoken_pattern: Optional[str] = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: Optional[List[str]] = None,
    trust_remote_code: bool = False,
) -> MegatronTokenizer:
    """Builds the tokenizer Megatron's ``--tokenizer-type`` names; arguments mirror its flags.

    Args:
        tokenizer_type: one of :data:`TOKENIZER_TYPES`.
        vocab_file: ``--vocab-file`` (GPT-2 vocab.json, BERT vocab.txt).
        merge_file: ``--merge-file`` (GPT-2 merges.txt).
        tokenizer_model: ``--tokenizer-model`` (SentencePiece model, tiktoken ranks file,
            Hugging Face directory or tokenizer.json).
        vocab_size: ``--vocab-size`` (NullTokenizer, TikTokenizer).
        vocab_extra_ids: ``--vocab-extra-ids`` T5 sentinels (BERT and SentencePieceTokenizer).
        tiktoken_pattern: ``--tiktoken-pattern``: v1, v2 or a regex.
        tiktoken_num_special_tokens: ``--tiktoken-num-special-tokens``.
        tiktoken_special_tokens: ``--tiktoken-special-tokens``.
        trust_remote_code: ``--trust-remote-code`` (HuggingFaceTokenizer).

    Raises:
        ValueError: unknown type, a flag the type cannot honour, or a missing required flag.
        FileNotFoundError: a named file does not exist.
    """
    if tokenizer_type not in _BUILDERS:
        raise ValueError(
            f"tokenizer_type={tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
        )
    if vocab_extra_ids and tokenizer_type not in _EXTRA_IDS_TYPES:
        raise ValueError(
            f"vocab_extra_ids={vocab_extra_ids} is not supported by "
            f"{tokenizer_type}; only by {', '.join(_EXTRA_IDS_TYPES)}"
        )
    return _BUILDERS[tokenizer_type](
        dict(
            vocab_file=vocab_file,
            merge_file=merge_file,
            tokenizer_model=tokenizer_model,
            vocab_size=vocab_size,
            vocab_extra_ids=vocab_extra_ids,
            tiktoken_pattern=tiktoken_pattern,
            tiktoken_num_special_tokens=tiktoken_num_special_tokens,
            tiktoken_special_tokens=tiktoken_special_tokens,
            trust_remote_code=trust_remote_code,
        )
    )


# The keyword arguments of ``build_tokenizer``, each filled by the Megatron flag of the same name
# (training and preprocessing build the tokenizer from the same flags).
TOKENIZER_KEYWORDS = tuple(inspect.signature(build_tokenizer).parameters)[1:]
