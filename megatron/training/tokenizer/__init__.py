"""The tokenizer named by the flags, and the padded vocabulary size the model uses.

``build_tokenizer(args)`` is Megatron-LM's name (``tokenizer.py``); ``build_tokenizer_from_args`` is the run's.
"""

from __future__ import annotations

import argparse

from megatron.core.tokenizers import TOKENIZER_KEYWORDS, MegatronTokenizer
from megatron.core.tokenizers import build_tokenizer as core_build_tokenizer
from megatron.training.tokenizer.tokenizer import build_tokenizer
from megatron.training.validation import vocab_size_with_padding

__all__ = ["build_tokenizer", "build_tokenizer_from_args"]


def build_tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizer:
    """Build ``--tokenizer-type`` from its files and set ``args.padded_vocab_size``.

    The vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by`` x TP so
    that every tensor-parallel rank holds an equal, aligned slice of the embedding.
    """
    tokenizer = core_build_tokenizer(args.tokenizer_type, **{name: getattr(args, name) for name in TOKENIZER_KEYWORDS})
    args.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    return tokenizer
