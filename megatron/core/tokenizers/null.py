"""A tokenizer for text that is already ids (``--tokenizer-type NullTokenizer``)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, register_library


class NullTokenizer(MegatronTokenizer):
    """Text is whitespace-separated integer ids; used for benchmarks and mock data.

    As in Megatron, ``--vocab-size N`` gives ids ``0 .. N-1`` for text and one more id, ``N``,
    for eod, so :attr:`vocab_size` is ``N + 1``.

    Args:
        vocab_size: number of text ids (``--vocab-size``).
    """

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"vocab_size={vocab_size} must be a positive integer for NullTokenizer")
        self._text_vocab_size = int(vocab_size)
        self._special_ids = {"eod": self._text_vocab_size}  # Megatron's null eod: one past the text ids

    @property
    def vocab_size(self) -> int:
        return self._text_vocab_size + 1

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


@register_library("null", "null-text")
def _null_from_pretrained(tokenizer_path: Optional[str], vocab_size: int) -> NullTokenizer:
    """``MegatronTokenizer.from_pretrained`` for the null library: no files, ``vocab_size`` text ids."""
    del tokenizer_path  # the null tokenizer reads no file
    return NullTokenizer(vocab_size)
