"""BERT masked-LM samples: ``[CLS] A [SEP] B [SEP]`` from sentence runs, masked and padded.

Each sample's randomness comes from ``RandomState((random_seed + idx) % 2**32)``, drawn in
megatron-core 0.16.1's order (pivot, swap, truncation, masking), so our samples equal its
``BERTMaskedWordPieceDataset`` samples for the same files, config and seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from megatron.core.datasets.gpt_dataset import special_token
from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    pad_token_id,
)
from megatron.core.datasets.utils import Split


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """BERT settings on top of the masked-LM ones."""

    classification_head: bool = True
    """Next-sentence (sentence-order) prediction: two sentences at least, B swapped with A half
    the time (``--bert-binary-head``; False is ``--bert-no-binary-head``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.classification_head, bool):
            raise ValueError(f"classification_head={self.classification_head!r}: must be True or False")
        if self.sequence_length < 4:
            raise ValueError(f"sequence_length={self.sequence_length}: must be >= 4 ([CLS] A [SEP] B [SEP])")


def split_pair(
    sentences: List[List[int]], classification_head: bool, rng: np.random.RandomState
) -> Tuple[List[int], List[int], bool]:
    """Segments A and B of a sample and whether they were swapped (the "random next" label)."""
    pivot, swapped = len(sentences), False
    if classification_head:
        if len(sentences) < 2:
            raise ValueError(f"a sample of {len(sentences)} sentence(s): the classification head needs two")
        pivot = int(rng.randint(low=1, high=len(sentences))) if len(sentences) >= 3 else 1
        swapped = bool(rng.random() < 0.5)
    a = [t for s in sentences[:pivot] for t in s]
    b = [t for s in sentences[pivot:] for t in s]
    return (b, a, swapped) if swapped else (a, b, swapped)


def truncate_pair(a: List[int], b: List[int], max_tokens: int, rng: np.random.RandomState) -> bool:
    """Drop tokens from the front or back (a coin each) of the longer segment until both fit."""
    if len(a) + len(b) <= max_tokens:
        return False
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]
    return True


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """BERT samples over a sentence-split IndexedDataset.

    ``dataset[i]`` is a dict of NumPy arrays of ``sequence_length`` int64 (``text``, ``types``,
    ``labels`` (-1 where not masked), ``padding_mask`` (1 = real token), ``loss_mask``) and two
    ints (``is_random``: A and B were swapped; ``truncated``).

    Args:
        indexed_dataset: the sentence-split low-level dataset.
        dataset_path: its path prefix; decides the default cache folder.
        indexed_indices: the (contiguous) document ids of this split.
        num_samples: samples requested (whole epochs are built); None: one epoch.
        index_split: which split.
        config: BERTMaskedWordPieceDatasetConfig.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BERTMaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        tokenizer = config.tokenizer
        self._pad_token_id = pad_token_id(tokenizer)
        self.token_lookup = list(tokenizer.inv_vocab.keys())
        # Room for [CLS] and two [SEP].
        min_sentences = 2 if config.classification_head else 1
        self.sample_index = self._build_sample_index(config.sequence_length - 3, min_sentences)

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        return list(MaskedWordPieceDataset._key_config_attributes()) + ["classification_head"]

    def _tokens_and_types(self, a: List[int], b: List[int]) -> Tuple[List[int], List[int]]:
        tok = self.config.tokenizer
        tokens = [tok.cls, *a, tok.sep]
        types = [0] * len(tokens)
        if b:
            tokens += [*b, tok.sep]
            types += [1] * (len(b) + 1)
        return tokens, types

    def __getitem__(self, idx: int) -> Dict[str, Union[int, np.ndarray]]:
        first, end, target = (int(v) for v in self.sample_index[idx])
        sentences = [np.asarray(self.dataset[i]).tolist() for i in range(first, end)]
        rng = np.random.RandomState((self.config.random_seed + int(idx)) % 2**32)
        a, b, swapped = split_pair(sentences, self.config.classification_head, rng)
        truncated = truncate_pair(a, b, target, rng)
        tokens, types = self._tokens_and_types(a, b)
        masking = self._create_masked_lm_predictions(tokens, target, rng)
        return self._arrays(masking.tokens, types, masking.positions, masking.labels, swapped, truncated)

    def _arrays(
        self,
        tokens: List[int],
        types: List[int],
        positions: List[int],
        labels: List[int],
        swapped: bool,
        truncated: bool,
    ) -> Dict[str, Any]:
        """Pad to ``sequence_length``; pad ids become 0 in ``text`` and ``labels`` (as upstream)."""
        length, pad = self.config.sequence_length, self._pad_token_id
        extra = length - len(tokens)
        text = np.pad(np.array(tokens, dtype=np.int64), (0, extra), constant_values=pad)
        segment = np.pad(np.array(types, dtype=np.int64), (0, extra), constant_values=pad)
        padding_mask = np.ones(length, dtype=np.int64)
        padding_mask[text == pad] = pad
        label_ids = np.full(length, -1, dtype=np.int64)
        label_ids[positions] = labels
        loss_mask = np.zeros(length, dtype=np.int64)
        loss_mask[positions] = 1
        text[text == pad] = 0
        label_ids[label_ids == pad] = 0
        return {
            "text": text,
            "types": segment,
            "labels": label_ids,
            "is_random": int(swapped),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _get_token_mask(self, rng: np.random.RandomState) -> Optional[int]:
        """80%: [MASK]; 10%: a uniformly random vocabulary id; 10%: keep the token (None)."""
        if rng.random() < 0.8:
            return self.config.tokenizer.mask
        if rng.random() >= 0.5:
            return self.token_lookup[rng.randint(0, len(self.token_lookup))]
        return None


class MockSentenceDataset:
    """Synthetic sentence-split documents for ``--mock-data``, a function of the seed alone.

    Document ``d`` has 2 to 8 sentences (so a classification head always has pairs) of 1 to
    ``max_sentence_length`` tokens drawn uniformly from ``token_ids``.
    """

    def __init__(self, seed: int, token_ids: np.ndarray, num_documents: int = 10_000, max_sentence_length: int = 64):
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty: mock BERT data needs ordinary (non-special) token ids")
        rng = np.random.RandomState(seed)
        sentences_per_doc = rng.randint(2, 9, size=num_documents)
        self.document_indices = np.concatenate([[0], np.cumsum(sentences_per_doc)]).astype(np.int64)
        num_sentences = int(self.document_indices[-1])
        self.sequence_lengths = rng.randint(1, max_sentence_length + 1, size=num_sentences).astype(np.int32)
        self.seed, self.token_ids = seed, np.asarray(token_ids, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.RandomState([self.seed, int(idx)])
        return self.token_ids[rng.randint(0, self.token_ids.size, size=int(self.sequence_lengths[idx]))]


class MockBERTMaskedWordPieceDataset(BERTMaskedWordPieceDataset):
    """BERTMaskedWordPieceDataset over :class:`MockSentenceDataset` (megatron-core has no BERT mock).

    Tokens are the tokenizer's ids other than [CLS], [SEP], [PAD] and [MASK], so ``##`` pieces
    occur and whole-word masking is exercised.
    """

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: BERTMaskedWordPieceDatasetConfig) -> Any:
        ids = mock_token_ids(config.tokenizer, ("cls", "sep", "pad", "mask"))
        return MockSentenceDataset(config.random_seed, ids, max_sentence_length=max(2, config.sequence_length // 4))


def mock_token_ids(tokenizer: Any, roles: Iterable[str], also: Iterable[int] = ()) -> np.ndarray:
    """The tokenizer's ids, ascending, without its ``roles`` special tokens and the ids ``also``."""
    special = {special_token(tokenizer, name) for name in roles} | set(also)
    return np.array(sorted(i for i in tokenizer.inv_vocab if i not in special), dtype=np.int64)
