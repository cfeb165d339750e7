"""GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt`` (``--tokenizer-type GPT2BPETokenizer``)."""

from __future__ import annotations

import json
from typing import Dict, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizersLibraryMixin, check_file

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(TokenizersLibraryMixin, MegatronTokenizer):
    """GPT-2 byte-level BPE, run by the Rust ``tokenizers`` library.

    As in Megatron, ``<|endoftext|>`` is only the eod id: the string inside a text is encoded as
    ordinary characters, so a document cannot forge a document boundary.

    Args:
        vocab_file: GPT-2 ``vocab.json`` (token to id).
        merge_file: GPT-2 ``merges.txt`` (one merge per line, optional ``#version`` header).
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        check_file(vocab_file, "vocab_file", "GPT-2 vocab.json")
        check_file(merge_file, "merge_file", "GPT-2 merges.txt")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        with open(vocab_file, encoding="utf-8") as f:
            self._vocab: Dict[str, int] = json.load(f)
        if EOD_TOKEN not in self._vocab:
            raise ValueError(f"vocab_file={vocab_file!r} has no {EOD_TOKEN} token (the eod)")
        self._special_ids = {"eod": self._vocab[EOD_TOKEN]}
        self._tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        # GPT-2's own split regex, no space added in front of the text.
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)
