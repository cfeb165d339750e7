"""BERT WordPiece from ``vocab.txt`` (``BertWordPieceLowerCase`` / ``BertWordPieceCase``)."""

from __future__ import annotations

from typing import Dict, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizersLibraryMixin, check_file
from megatron.core.tokenizers.sentencepiece_tokenizers import extra_id_tokens

REQUIRED_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
# Google's BERT gives up on words longer than this and emits [UNK] (the Rust default is 100).
MAX_CHARS_PER_WORD = 200


def read_vocab_txt(path: str) -> Dict[str, int]:
    """Reads a BERT ``vocab.txt``: one token per line, the id is the line number."""
    with open(path, encoding="utf-8") as f:
        return {line.strip(): i for i, line in enumerate(f)}


class BertWordPieceTokenizer(TokenizersLibraryMixin, MegatronTokenizer):
    """BERT's WordPiece, run by the Rust ``tokenizers`` library.

    As in Megatron, ``[BOS]``, ``[EOS]`` and ``vocab_extra_ids`` sentinels ``<extra_id_N>`` are
    appended to the vocabulary when absent; like all bracketed strings they are split as
    punctuation when they appear in text, never recognised as one token.

    Args:
        vocab_file: BERT ``vocab.txt``.
        lower_case: lower-case and strip accents before splitting (uncased BERT).
        vocab_extra_ids: number of T5 sentinels to add.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        check_file(vocab_file, "vocab_file", "BERT vocab.txt")
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        self.tokenizer_type = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        self._vocab = read_vocab_txt(vocab_file)
        missing = [t for t in REQUIRED_TOKENS if t not in self._vocab]
        if missing:
            raise ValueError(f"vocab_file={vocab_file!r} lacks the BERT tokens {missing}")
        model = models.WordPiece(dict(self._vocab), unk_token="[UNK]", max_input_chars_per_word=MAX_CHARS_PER_WORD)
        self._tokenizer = Tokenizer(model)
        self._tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
        )
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer.decoder = decoders.WordPiece(prefix="##")
        self._special_ids = {
            role: self._vocab[t]
            for role, t in (("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"), ("mask", "[MASK]"))
        }
        self._special_ids.update(bos=self._add_token("[BOS]"), eos=self._add_token("[EOS]"))
        self._extra_ids = [self._add_token(t) for t in extra_id_tokens(vocab_extra_ids)]

    def _add_token(self, token: str) -> int:
        # Only our vocabulary grows: the WordPiece model never emits these ids from text.
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        return self._vocab[token]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Joins word pieces (``##`` continues a word); ``[PAD]`` and ``[CLS]`` are dropped."""
        drop = (self.pad, self.cls)
        tokens = [self.inv_vocab[i] for i in ids if i not in drop]
        return self._tokenizer.decoder.decode(tokens)
