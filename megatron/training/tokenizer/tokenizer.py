"""Megatron-LM's ``megatron.training.tokenizer.tokenizer`` path, for code written against it.

Our tokenizers live in ``megatron.core.tokenizers``; this module gives the names downstream
code imports from Megatron-LM's training package: ``build_tokenizer(args)`` and ``_NullTokenizer``.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any, List, Optional

from megatron.core.tokenizers import TOKENIZER_KEYWORDS, MegatronTokenizer, NullTokenizer
from megatron.core.tokenizers import build_tokenizer as core_build_tokenizer
from megatron.training.validation import vocab_size_with_padding

__all__ = ["_NullTokenizer", "_vocab_size_with_padding", "build_tokenizer"]


def build_tokenizer(args: argparse.Namespace, **kwargs: Any) -> MegatronTokenizer:
    """Megatron-LM's ``build_tokenizer(args)``: the tokenizer ``args.tokenizer_type`` names.

    ``args`` needs only the attributes that type reads (a missing one takes the flag's default),
    plus ``make_vocab_size_divisible_by`` and ``tensor_model_parallel_size`` for the padded size,
    which is set as ``args.padded_vocab_size`` unless already set (e.g. from a checkpoint's arguments).
    Upstream hands ``kwargs`` to Hugging Face's ``from_pretrained``; that is not supported yet.
    """
    if kwargs:
        raise ValueError(f"build_tokenizer: extra keyword arguments {sorted(kwargs)} are not supported yet")
    defaults = inspect.signature(core_build_tokenizer).parameters
    keywords = {name: getattr(args, name, defaults[name].default) for name in TOKENIZER_KEYWORDS}
    tokenizer = core_build_tokenizer(args.tokenizer_type, **keywords)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size: int, args: argparse.Namespace, logging_enabled: bool = True) -> int:
    """``orig_vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by x`` TP (Megatron-LM's helper)."""
    padded = vocab_size_with_padding(
        orig_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    if logging_enabled and getattr(args, "rank", 0) == 0:
        extra = padded - orig_vocab_size
        print(f" > padded vocab (size: {orig_vocab_size}) with {extra} dummy tokens (new size: {padded})")
    return padded


class _NullTokenizer(NullTokenizer):
    """Megatron-LM's ``_NullTokenizer``: ``NullTokenizer`` with upstream's sentinels.

    Ids ``0 .. vocab_size-1`` are text, ``vocab_size`` is eod (so ``.vocab_size`` is one more);
    ``cls``, ``sep`` and ``mask`` are ``-1`` and ``additional_special_tokens_ids`` is None, as
    upstream returns them (our ``NullTokenizer`` raises ``MissingSpecialTokenError`` instead);
    ``vocab`` / ``inv_vocab`` raise ``NotImplementedError``.
    """

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def offsets(self, ids: List[int], text: str) -> List[int]:
        """Character offset of each id in ``detokenize(ids)`` (ids joined by single spaces)."""
        starts, position = [], 0
        for token_id in ids:
            starts.append(position)
            position += len(str(token_id)) + 1
        return starts

    @property
    def vocab(self):  # noqa: D102 - upstream has no vocabulary table here
        raise NotImplementedError("_NullTokenizer has no vocab")

    @property
    def inv_vocab(self):  # noqa: D102
        raise NotImplementedError("_NullTokenizer has no inv_vocab")

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        return None
