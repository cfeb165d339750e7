"""Tokenizers over a SentencePiece ``tokenizer.model``.

Three Megatron types share one model file format and differ in their special tokens:

* ``SentencePieceTokenizer``: adds ``<CLS> <SEP> <EOD> <MASK>`` (and pad/bos/eos pieces when the
  model lacks them) after the model's pieces, plus ``--vocab-extra-ids`` T5 sentinels. These strings
  are recognised inside text. Used by BERT/T5-style models.
* ``GPTSentencePieceTokenizer``: the model's pieces only; eod is the model's eos.
* ``Llama2Tokenizer``: like the GPT one, but every text starts with bos.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, check_file, default_num_threads, register_library


def extra_id_tokens(count: int) -> List[str]:
    """T5 sentinel strings ``<extra_id_0> ... <extra_id_{count-1}>``."""
    return [f"<extra_id_{i}>" for i in range(count)]


class _SentencePieceBase(MegatronTokenizer):
    """Loads the model; encodes with SentencePiece's native multi-threaded batch encoder."""

    def __init__(self, tokenizer_model: str, num_threads: Optional[int] = None):
        check_file(tokenizer_model, "tokenizer_model", "SentencePiece tokenizer.model")
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        self._num_threads = num_threads or default_num_threads()
        self._vocab: Optional[Dict[str, int]] = None

    def _encode(self, texts: List[str], add_bos: bool = False) -> List[List[int]]:
        return self._sp.encode(texts, add_bos=add_bos, num_threads=self._num_threads)

    def _piece_or_none(self, piece_id: int) -> Optional[str]:
        """The piece of a model-defined special id; None when the model disables it (id -1)."""
        if 0 <= piece_id < self._sp.get_piece_size():
            return self._sp.id_to_piece(piece_id)
        return None

    def _model_vocab(self) -> Dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = self._model_vocab()
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str) -> List[int]:
        return self.batch_tokenize([text])[0]

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        return self._encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """SentencePiece model used as is; eod is the model's eos (``--tokenizer-model``)."""

    tokenizer_type = "GPTSentencePieceTokenizer"

    def special_id(self, role: str) -> Optional[int]:
        # The model's own bos/eos/pad pieces (absent ones have id -1); eod is the eos.
        model_ids = {
            "bos": self._sp.bos_id(),
            "eos": self._sp.eos_id(),
            "eod": self._sp.eos_id(),
            "pad": self._sp.pad_id(),
        }
        piece_id = model_ids.get(role, -1)
        return piece_id if self._piece_or_none(piece_id) is not None else None


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2's SentencePiece tokenizer: bos is prepended to every text, no eos is appended."""

    tokenizer_type = "Llama2Tokenizer"

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        return self._encode(list(texts), add_bos=True)


class SentencePieceTokenizer(_SentencePieceBase):
    """SentencePiece model plus Megatron's special tokens (see the module docstring).

    Args:
        tokenizer_model: path of the SentencePiece ``tokenizer.model``.
        vocab_extra_ids: number of T5 sentinels ``<extra_id_N>`` to add.
        num_threads: threads for batch encoding; default one per available core.
    """

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str, vocab_extra_ids: int = 0, num_threads: Optional[int] = None):
        super().__init__(tokenizer_model, num_threads)
        self._vocab = self._model_vocab()
        self._special: Dict[str, int] = {}
        self._special_ids = {
            role: self._add_special(t)
            for role, t in (("cls", "<CLS>"), ("sep", "<SEP>"), ("eod", "<EOD>"), ("mask", "<MASK>"))
        }
        for role, piece_id, default in (
            ("pad", self._sp.pad_id(), "<PAD>"),
            ("bos", self._sp.bos_id(), "<BOS>"),
            ("eos", self._sp.eos_id(), "<EOS>"),
        ):
            self._special_ids[role] = self._add_special(self._piece_or_none(piece_id) or default)
        self._extra_ids = [self._add_special(t) for t in extra_id_tokens(vocab_extra_ids)]
        self._inv_special = {i: t for t, i in self._special.items()}
        # Longest first, so that at one position the longest special string wins.
        alternatives = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in alternatives))

    def _add_special(self, token: str) -> int:
        """Registers a special string, appending it to the vocabulary when the model lacks it."""
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        # Cut every text at its special strings, encode all plain pieces of all texts in one
        # native call, then stitch the special ids back in between.
        pieces: List[str] = []
        layouts: List[List[object]] = []
        for text in texts:
            layout: List[object] = []
            start = 0
            for match in self._special_re.finditer(text):
                layout.append(len(pieces))
                pieces.append(text[start : match.start()])
                layout.append(self._special[match.group()])
                start = match.end()
            layout.append(len(pieces))
            pieces.append(text[start:])
            layouts.append(layout)
        encoded = self._encode(pieces)
        return [self._stitch(layout, encoded) for layout in layouts]

    @staticmethod
    def _stitch(layout: List[object], encoded: List[List[int]]) -> List[int]:
        """Layout items alternate: index into ``encoded`` (a piece), special id, piece, ..."""
        ids: List[int] = []
        for k, item in enumerate(layout):
            if k % 2 == 0:
                ids.extend(encoded[item])
            else:
                ids.append(item)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        # Megatron's convention: each special token is written between single spaces.
        parts: List[str] = []
        run: List[int] = []
        for i in ids:
            if i in self._inv_special:
                parts.append(self._sp.decode(run) + " " + self._inv_special[i] + " ")
                run = []
            else:
                run.append(i)
        parts.append(self._sp.decode(run))
        return "".join(parts)


@register_library("sentencepiece")
def _sentencepiece_from_pretrained(tokenizer_path: Optional[str], **kwargs) -> GPTSentencePieceTokenizer:
    """``MegatronTokenizer.from_pretrained`` for the sentencepiece library: the model's own pieces."""
    return GPTSentencePieceTokenizer(tokenizer_path, **kwargs)
