"""T5 span corruption: masked N-grams of a sentence run become sentinels in the encoder input
and ``sentinel + original tokens`` in the decoder targets.

Same samples as megatron-core 0.16.1's ``T5MaskedWordPieceDataset`` for the same files, config
and seed: the sample index and the masking are :class:`MaskedWordPieceDataset`'s (shared with
BERT); each sample draws only from ``RandomState((random_seed + idx) % 2**32)`` for its masking.
For spans ``s1 .. sk`` (sentinels ``x1 .. xk`` from ``tokenizer.additional_special_tokens_ids``)::

    text_enc = tokens with each span replaced by its sentinel        (pad: 0)
    text_dec = [BOS] x1 s1 x2 s2 .. xk sk                            (pad: 0)
    labels   =       x1 s1 x2 s2 .. xk sk [EOS]                      (pad: -1, or 0 without [PAD])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from megatron.core.datasets.bert_dataset import MockSentenceDataset, mock_token_ids
from megatron.core.datasets.gpt_dataset import special_token
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig, pad_token_id
from megatron.core.datasets.utils import Split

# The encoder's budget keeps room for two tokens, as upstream (which reserves a <bos> and an <eos>).
_RESERVED = 2


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """T5 settings (megatron-core field names). ``sequence_length`` is the encoder length
    (``--encoder-seq-length``), mirrored into ``sequence_length_encoder``.

    The masking defaults are Megatron's ``pretrain_t5.py`` values: up to 10-grams of whole words
    with SpanBERT's geometric lengths, no permutation.
    """

    masking_max_ngram: int = 10
    masking_use_geometric_distribution: bool = True

    sequence_length_encoder: Optional[int] = field(init=False, default=None)
    """The encoder length: always ``sequence_length``."""

    sequence_length_decoder: Optional[int] = None
    """The decoder length (``--decoder-seq-length``): ``[BOS]`` + sentinels + masked tokens fit in it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        if self.sequence_length < _RESERVED + 1:
            raise ValueError(f"sequence_length={self.sequence_length}: must be >= 3 (2 are reserved, as upstream)")
        length = self.sequence_length_decoder
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            raise ValueError(
                f"T5MaskedWordPieceDatasetConfig.sequence_length_decoder={length!r}: must be an integer >= 2 "
                "([BOS] and one sentinel)"
            )
        missing = [name for name in ("bos", "eos") if special_token(self.tokenizer, name) is None]
        if missing:
            raise ValueError(f"tokenizer {type(self.tokenizer).__name__} lacks {', '.join(missing)}: T5 needs both")
        if not list(getattr(self.tokenizer, "additional_special_tokens_ids", None) or []):
            raise ValueError(
                f"tokenizer {type(self.tokenizer).__name__} has no sentinel tokens (additional_special_tokens_ids "
                "is empty): T5 span corruption needs them; build the tokenizer with vocab_extra_ids=N "
                "(Megatron's T5 examples use 100)"
            )


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """T5 span-corruption samples over a sentence-split IndexedDataset.

    ``dataset[i]`` is a dict of int64 NumPy arrays ``text_enc``, ``enc_mask``
    (``sequence_length``), ``text_dec``, ``labels``, ``loss_mask``, ``dec_mask``
    (``sequence_length_decoder``) and the int ``truncated``. The masks are 1-D: 1 at a real
    token, 0 at padding (and, as upstream, at any token equal to the pad id).

    Args:
        indexed_dataset: the sentence-split low-level dataset (one sentence suffices).
        dataset_path: its path prefix; decides the default cache folder.
        indexed_indices: the (contiguous) document ids of this split.
        num_samples: samples requested (whole epochs are built); None: one epoch.
        index_split: which split.
        config: T5MaskedWordPieceDatasetConfig.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: T5MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        tokenizer = config.tokenizer
        self._pad_token_id = pad_token_id(tokenizer)
        self._sentinels = [int(i) for i in tokenizer.additional_special_tokens_ids]
        self._bos, self._eos = int(tokenizer.bos), int(tokenizer.eos)
        self.sample_index = self._build_sample_index(config.sequence_length - _RESERVED, 1)

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        return list(MaskedWordPieceDataset._key_config_attributes()) + ["sequence_length_decoder"]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, np.ndarray]]:
        first, end, target = (int(v) for v in self.sample_index[idx])
        tokens = [t for i in range(first, end) for t in np.asarray(self.dataset[i]).tolist()]
        rng = np.random.RandomState((self.config.random_seed + int(idx)) % 2**32)
        truncated = len(tokens) > target
        tokens = tokens[:target]
        # The encoder keeps the masking's tokens: permuted ones stay permuted (spans are dropped).
        masking = self._create_masked_lm_predictions(tokens, target, rng)
        encoder, targets = self._corrupt(idx, masking.tokens, masking.spans)
        return self._arrays(encoder, targets, truncated)

    def _corrupt(
        self, idx: int, tokens: List[int], spans: List[Tuple[List[int], List[int]]]
    ) -> Tuple[List[int], List[int]]:
        """The encoder input and the decoder targets (sentinel + original tokens per span)."""
        if len(spans) > len(self._sentinels):
            raise ValueError(
                f"sample {idx}: {len(spans)} masked spans but the tokenizer has only {len(self._sentinels)} "
                f"sentinels (vocab_extra_ids={len(self._sentinels)}): raise it "
                "(megatron-core fails here with an IndexError)"
            )
        encoder: List[int] = []
        targets: List[int] = []
        start = 0
        for sentinel, (positions, labels) in zip(self._sentinels, spans):
            encoder += tokens[start : positions[0]] + [sentinel]
            targets += [sentinel] + labels
            start = positions[-1] + 1
        encoder += tokens[start:]
        return encoder, targets

    def _arrays(self, encoder: List[int], targets: List[int], truncated: bool) -> Dict[str, Any]:
        """Pad as upstream: pad ids, masks from them, then pad ids become 0 (labels pad with -1)."""
        enc_length = self.config.sequence_length_encoder
        dec_length = self.config.sequence_length_decoder
        used = len(targets) + 1
        if used > dec_length:
            raise ValueError(
                f"T5MaskedWordPieceDatasetConfig.sequence_length_decoder={dec_length}: a sample needs {used} "
                "decoder tokens ([BOS], sentinels and masked tokens): raise it (megatron-core fails here with an "
                "AssertionError)"
            )
        pad = self._pad_token_id
        text_enc = _padded(encoder, enc_length, pad)
        text_dec = _padded([self._bos, *targets], dec_length, pad)
        labels = _padded([*targets, self._eos], dec_length, -1)
        enc_mask = (text_enc != pad).astype(np.int64)
        dec_mask = (text_dec != pad).astype(np.int64)
        loss_mask = np.zeros(dec_length, dtype=np.int64)
        loss_mask[:used] = 1
        for array in (text_enc, text_dec, labels):
            array[array == pad] = 0
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }

    def _get_token_mask(self, rng: np.random.RandomState) -> Optional[int]:
        """Always ``[MASK]`` (no draw): masked tokens leave the encoder input anyway."""
        return self.config.tokenizer.mask


def _padded(ids: List[int], length: int, value: int) -> np.ndarray:
    """``ids`` as int64, padded on the right with ``value`` to ``length``."""
    array = np.full(length, value, dtype=np.int64)
    array[: len(ids)] = ids
    return array


class MockT5MaskedWordPieceDataset(T5MaskedWordPieceDataset):
    """T5MaskedWordPieceDataset over BERT's :class:`MockSentenceDataset` for ``--mock-data``
    (megatron-core has no T5 mock).

    Tokens are the tokenizer's ids other than its special ones ([CLS], [SEP], [PAD], [MASK],
    [BOS], [EOS] and the sentinels), so ``##`` pieces occur and whole-word masking is exercised.
    """

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: T5MaskedWordPieceDatasetConfig) -> Any:
        tok = config.tokenizer
        roles = ("cls", "sep", "pad", "mask", "bos", "eos")
        ids = mock_token_ids(tok, roles, also=tok.additional_special_tokens_ids)
        return MockSentenceDataset(config.random_seed, ids, max_sentence_length=max(2, config.sequence_length // 4))
