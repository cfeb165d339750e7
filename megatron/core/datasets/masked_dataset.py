"""Masked WordPiece datasets: the sentence-run sample index and the masked-LM corruption.

Same samples as megatron-core 0.16.1's ``MaskedWordPieceDataset`` for the same files, config
and seed: the index follows ``helpers.build_mapping`` (see ``sentence_mapping.py``) and the
masking draws from the per-sample ``RandomState`` in upstream's order. WordPiece marks every
piece of a word but the first with a leading ``##``.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Set, Tuple

import numpy as np

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import special_token
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.sentence_mapping import LONG_SENTENCE_LEN, build_mapping, eligible_documents
from megatron.core.datasets.utils import load_or_build_indices

# Pad id when the tokenizer has none or its pad id is also its eos/eod id (as megatron-core).
NO_PAD_ID = -1
# SpanBERT's span-length distribution: geometric with this p, clipped at masking_max_ngram.
GEOMETRIC_P = 0.2
_MASKING_FIELDS = (
    "masking_probability",
    "short_sequence_probability",
    "masking_max_ngram",
    "masking_do_full_word",
    "masking_do_permutation",
    "masking_use_longer_ngrams",
    "masking_use_geometric_distribution",
)


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Masked-LM settings (megatron-core field names; defaults are ``pretrain_bert.py``'s values,
    where megatron-core has no defaults and requires every field)."""

    masking_probability: float = 0.15
    """Share of the tokens to mask (``--mask-prob``)."""

    short_sequence_probability: float = 0.1
    """Probability of a target length below the maximum (``--short-seq-prob``)."""

    masking_max_ngram: int = 3
    """Longest N-gram (of words, or pieces) masked at once."""

    masking_do_full_word: bool = True
    """Mask whole words: a ``##`` piece joins the candidate of the piece before it."""

    masking_do_permutation: bool = False
    """Also shuffle the tokens of some other N-grams among themselves."""

    masking_use_longer_ngrams: bool = False
    """Favour long N-grams (probabilities proportional to N instead of 1/N)."""

    masking_use_geometric_distribution: bool = False
    """Draw N from SpanBERT's geometric distribution (p = 0.2) clipped at ``masking_max_ngram``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _MASKING_FIELDS:
            if getattr(self, name) is None:
                raise ValueError(f"{name}=None: must be set")
        if self.tokenizer is None:
            raise ValueError("tokenizer=None: masked WordPiece datasets need the tokenizer (cls, sep, mask, inv_vocab)")
        # special_token reads any attribute the tokenizer may lack (or raise NotImplementedError for).
        missing = [name for name in ("cls", "sep", "mask", "inv_vocab") if special_token(self.tokenizer, name) is None]
        if missing:
            raise ValueError(
                f"tokenizer {type(self.tokenizer).__name__} lacks {', '.join(missing)}: masked-LM data needs a "
                "WordPiece vocabulary with [CLS], [SEP] and [MASK] "
                "(tokenizer_type='BertWordPieceLowerCase' or 'BertWordPieceCase')"
            )
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(f"masking_probability={self.masking_probability}: must be in (0, 1)")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(f"short_sequence_probability={self.short_sequence_probability}: must be in [0, 1]")
        if not isinstance(self.masking_max_ngram, int) or self.masking_max_ngram < 1:
            raise ValueError(f"masking_max_ngram={self.masking_max_ngram!r}: must be a positive integer")
        if self.masking_use_geometric_distribution and self.masking_do_permutation:
            raise ValueError(
                "masking_use_geometric_distribution=True with masking_do_permutation=True: "
                "the two cannot be combined (as in megatron-core)"
            )
        if not 0 <= self.random_seed < 2**31 - 1:
            raise ValueError(f"random_seed={self.random_seed}: the sample index needs 0 <= seed < 2**31 - 1")


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or -1 when it has none or it collides with eos/eod (as megatron-core)."""
    pad = special_token(tokenizer, "pad")
    if pad is None:
        return NO_PAD_ID
    if pad in (special_token(tokenizer, "eos"), special_token(tokenizer, "eod")):
        return NO_PAD_ID
    return int(pad)


class MaskedLMPredictions(NamedTuple):
    """What masking did to one sample's tokens."""

    tokens: List[int]
    """The tokens after masking (and permutation)."""
    positions: List[int]
    """Masked (and permuted) positions, ascending."""
    labels: List[int]
    """The original ids at ``positions``."""
    spans: List[Tuple[List[int], List[int]]]
    """Each masked N-gram as (its positions, their original ids), by first position (permuted
    N-grams are not spans)."""


def ngram_probabilities(max_ngram: int, longer: bool) -> Tuple[np.ndarray, np.ndarray]:
    """N values ``1..max_ngram`` and their probabilities (1/N normalised, reversed if ``longer``)."""
    nvals = np.arange(1, max_ngram + 1, dtype=np.int64)
    probs = 1.0 / nvals
    probs = probs / probs.sum(keepdims=True)
    return nvals, probs[::-1] if longer else probs


class MaskedWordPieceDataset(MegatronDataset):
    """Base of the masked WordPiece datasets (BERT) over a sentence-split IndexedDataset.

    Documents are runs of sentences (``document_indices``); a sample is a run of whole sentences
    of one document. Subclasses build ``self.sample_index`` with :meth:`_build_sample_index`
    and provide :meth:`_get_token_mask`.
    """

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """Documents, not sentences: the splits divide documents."""
        return int(low_level_dataset.document_indices.shape[0]) - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: MaskedWordPieceDatasetConfig) -> Any:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        return list(MegatronDataset._key_config_attributes()) + list(_MASKING_FIELDS)

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def _cache_dir(self) -> Optional[str]:
        """The configured cache, else ``<data dir>/cache/<Class>_indices``; None without files."""
        if self.config.path_to_cache is not None:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        folder = os.path.dirname(os.path.abspath(self.dataset_path))
        return os.path.join(folder, "cache", f"{type(self).__name__}_indices")

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> np.ndarray:
        """Load or build ``{hash}-{Class}-sample_index.npy``: rows (first, end, target length)."""
        self.path_to_cache = self._cache_dir()
        stem = f"{self.unique_description_hash}-{type(self).__name__}"

        def build() -> dict:
            return {"sample_index": self._new_sample_index(sequence_length, min_sentences_per_sample)}

        return load_or_build_indices(self.path_to_cache, stem, self.unique_description, ("sample_index",), build)[
            "sample_index"
        ]

    def _document_bounds(self) -> np.ndarray:
        """Sentence bounds of this split's (contiguous) documents, end of the last included."""
        ends = np.append(self.indices, self.indices[-1] + 1)
        return np.asarray(self.dataset.document_indices)[ends]

    def _new_sample_index(self, sequence_length: int, min_sentences: int) -> np.ndarray:
        bounds = self._document_bounds()
        lengths = np.asarray(self.dataset.sequence_lengths)
        self._check_usable_documents(bounds, lengths, min_sentences)
        cfg = self.config
        return build_mapping(
            bounds, lengths, self.num_samples, sequence_length, cfg.short_sequence_probability, cfg.random_seed,
            min_sentences,
        )  # fmt: skip

    def _check_usable_documents(self, bounds: np.ndarray, lengths: np.ndarray, min_sentences: int) -> None:
        """Raise a ValueError saying why and how to fix it when no document can give a sample."""
        if eligible_documents(bounds, lengths, min_sentences).size:
            return
        counts = np.diff(bounds)
        where = f"{self.dataset_path} ({self.index_split.name} split, {counts.size} documents)"
        if min_sentences > 1 and counts.size and int(counts.max()) < min_sentences:
            raise ValueError(
                f"{where}: every document has fewer than {min_sentences} sentences, but the classification "
                "head (next-sentence / sentence-order prediction) needs two per sample. Preprocess the data "
                "with tools/preprocess_data.py --split-sentences, or set classification_head=False "
                "(bert_binary_head=False)."
            )
        raise ValueError(
            f"{where}: no document gives a sample: each is empty or has a sentence longer than "
            f"{LONG_SENTENCE_LEN} tokens (such documents are skipped). Preprocess with "
            "tools/preprocess_data.py --split-sentences."
        )

    def _word_candidates(self, token_ids: List[int]) -> List[List[int]]:
        """Positions to mask, grouped into words when ``masking_do_full_word`` ([CLS]/[SEP] never)."""
        tok = self.config.tokenizer
        special = (tok.cls, tok.sep)
        inv_vocab = tok.inv_vocab
        candidates: List[List[int]] = []
        for i, token in enumerate(token_ids):
            if token in special:
                continue
            continues_word = inv_vocab[token].startswith("##")
            if continues_word and self.config.masking_do_full_word and candidates:
                candidates[-1].append(i)
            else:
                candidates.append([i])
        return candidates

    @staticmethod
    def _ngram_positions(candidates: List[List[int]], start: int, n: int) -> List[int]:
        """Token positions of the N-gram of ``n`` candidates from ``start`` (fewer at the end)."""
        return [i for word in candidates[start : start + n] for i in word]

    def _fit_ngram(
        self, candidates: List[List[int]], start: int, n: int, used: int, budget: float
    ) -> Optional[List[int]]:
        """The longest N-gram from ``start`` of at most ``n`` candidates that fits the budget."""
        while n >= 1:
            positions = self._ngram_positions(candidates, start, n)
            if budget >= used + len(positions):
                return positions
            n -= 1
        return None

    def _draw_n(self, rng: np.random.RandomState, draw_choice: Callable[..., Any]) -> int:
        """The initial N of a candidate N-gram."""
        if self.config.masking_use_geometric_distribution:
            return min(int(rng.geometric(GEOMETRIC_P)), self.config.masking_max_ngram)
        nvals, probs = ngram_probabilities(self.config.masking_max_ngram, self.config.masking_use_longer_ngrams)
        return int(draw_choice(nvals, p=probs / probs.sum(keepdims=True)))

    def _mask_ngrams(
        self,
        token_ids: List[int],
        candidates: List[List[int]],
        order: List[int],
        budget: float,
        rng: np.random.RandomState,
    ) -> Tuple[List[int], List[Tuple[int, int]], Set[int], List[Tuple[List[int], List[int]]]]:
        """Mask N-grams in ``order`` until ``budget`` tokens are masked (replacement from
        :meth:`_get_token_mask`); returns the tokens, (position, label) pairs, masked positions
        and the masked N-grams as (positions, labels) in masking order."""
        masked = list(token_ids)
        labelled: List[Tuple[int, int]] = []
        taken: Set[int] = set()
        spans: List[Tuple[List[int], List[int]]] = []
        for start in order:
            if len(labelled) >= budget:
                break
            positions = self._fit_ngram(candidates, start, self._draw_n(rng, rng.choice), len(labelled), budget)
            if positions is None or any(i in taken for i in positions):
                continue
            for i in positions:
                taken.add(i)
                replacement = self._get_token_mask(rng)
                masked[i] = token_ids[i] if replacement is None else replacement
                labelled.append((i, token_ids[i]))
            spans.append((positions, [token_ids[i] for i in positions]))
        return masked, labelled, taken, spans

    def _permute_ngrams(
        self,
        masked: List[int],
        candidates: List[List[int]],
        order: List[int],
        budget: float,
        taken: Set[int],
        rng: np.random.RandomState,
    ) -> List[Tuple[int, int]]:
        """Shuffle the tokens of unmasked N-grams among themselves; returns their (position, label).

        As upstream, N is drawn from NumPy's global RandomState, not the sample's (so these
        samples depend on the process's global seed too).
        """
        chosen: Set[int] = set()
        for start in order:
            if len(chosen) >= budget:
                break
            positions = self._fit_ngram(candidates, start, self._draw_n(rng, np.random.choice), len(chosen), budget)
            if positions is None or any(i in taken or i in chosen for i in positions):
                continue
            chosen.update(positions)
        targets = sorted(chosen)
        sources = list(targets)
        rng.shuffle(sources)
        before = list(masked)
        for target, source in zip(targets, sources):
            masked[target] = before[source]
        return [(i, before[i]) for i in targets]

    def _create_masked_lm_predictions(
        self, token_ids: List[int], target_sequence_length: int, rng: np.random.RandomState
    ) -> MaskedLMPredictions:
        """Mask (and optionally permute) N-grams of ``token_ids``, drawing from ``rng`` in
        megatron-core's order (shuffle, mask, shuffle, permute)."""
        cfg = self.config
        candidates = self._word_candidates(token_ids)
        budget = min(
            cfg.masking_probability * target_sequence_length,
            max(1, int(round(len(token_ids) * cfg.masking_probability))),
        )
        order = list(range(len(candidates)))
        rng.shuffle(order)
        masked, labelled, taken, spans = self._mask_ngrams(token_ids, candidates, order, budget, rng)
        rng.shuffle(order)
        if cfg.masking_do_permutation:
            labelled += self._permute_ngrams(masked, candidates, order, budget, taken, rng)
        labelled.sort(key=lambda pair: pair[0])
        spans.sort(key=lambda span: span[0][0])
        return MaskedLMPredictions(masked, [p for p, _ in labelled], [t for _, t in labelled], spans)

    @abc.abstractmethod
    def _get_token_mask(self, rng: np.random.RandomState) -> Optional[int]:
        """The id replacing a masked token, or None to keep it."""
