"""GPTDataset: fixed-length causal-LM samples cut from a shuffled stream of documents.

The three indices (document, sample, shuffle) are built by ``helpers`` and cached as .npy
files whose names carry the hash of everything that determines them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import DType
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, load_or_build_indices
from megatron.core.transformer.masks import build_attention_mask

# Label id of padding when the tokenizer defines none; never a real token id.
_NO_PAD_ID = -1
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def index_cache_dir(config: Any, dataset_path: Optional[str], class_name: str) -> Optional[str]:
    """Where a dataset caches its indices: ``config.path_to_cache``, else ``<data dir>/cache/<class_name>_indices``;
    None for pathless data."""
    if config.path_to_cache is not None:
        return config.path_to_cache
    if dataset_path is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(dataset_path)), "cache", f"{class_name}_indices")


def special_token(tokenizer: Any, name: str) -> Optional[int]:
    """The tokenizer's ``name`` token id, or None when it has none.

    Our tokenizers raise (NotImplementedError) for a missing special token rather than
    return a sentinel; a dataset treats both the same way.
    """
    try:
        return getattr(tokenizer, name, None)
    except NotImplementedError:
        return None


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """GPT-specific settings on top of the shared dataset config (Megatron field names)."""

    reset_position_ids: bool = False
    """Position ids restart after every end-of-document token."""

    reset_attention_mask: bool = False
    """Tokens cannot attend across an end-of-document token."""

    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token."""

    create_attention_mask: bool = True
    """Return the ``[1, s, s]`` attention mask (True = masked) with every sample."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the short last sample of the validation split instead of padding it."""

    add_extra_token_to_sequence: bool = True
    """Samples hold ``sequence_length + 1`` tokens so inputs and labels are both full length."""

    object_storage_cache_path: Optional[str] = None
    """Local cache of object-storage data: object storage is not supported yet (None only)."""

    data_parallel_size: int = 1
    """Upstream reads it only for hybrid context parallelism (not supported yet): no effect."""

    sequence_parallel_size: int = 0
    """Upstream reads it only for hybrid context parallelism (not supported yet): no effect."""

    hybrid_context_parallel: bool = False
    """Upstream's variable-length context-parallel batching: not supported yet (False only)."""

    sequences_per_dataset: Optional[Dict[str, Any]] = None
    """Upstream's per-prefix sequence counts that skip reading the indices: not supported yet."""

    token_dtype_code: Optional[int] = field(init=False, default=None)
    """Derived: the ``DType`` code of the token ids for the tokenizer's vocabulary (uint16 or int32)."""

    context_parallel_size: Optional[int] = None
    """Upstream reads it only for hybrid context parallelism (not supported yet): no effect."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.object_storage_cache_path is not None or self.hybrid_context_parallel or self.sequences_per_dataset:
            raise ValueError(
                "object_storage_cache_path / hybrid_context_parallel / sequences_per_dataset: not supported yet"
            )
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is not None:
            wide = vocab_size > np.iinfo(np.uint16).max + 1  # upstream's rule (ids up to 65535 fit uint16)
            self.token_dtype_code = DType.code_from_dtype(np.int32 if wide else np.uint16)
        needs_eod = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if needs_eod and special_token(self.tokenizer, "eod") is None:
            raise ValueError(
                "tokenizer: reset_position_ids, reset_attention_mask and eod_mask_loss "
                f"need a tokenizer with an eod id, got {self.tokenizer!r}"
            )


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: Optional[int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
):
    """Masks and positions of one left-to-right sample.

    A document ends with its eod token: the token right after an eod starts a new document.

    Args:
        tokens: ``[s]`` input token ids.

    Returns:
        ``(attention_mask [1, s, s] bool with True = masked, or None; loss_mask [s] float;
        position_ids [s] long)``.
    """
    s = tokens.numel()
    loss_mask = torch.ones(s, dtype=torch.float)
    is_eod = tokens == eod_token if eod_token is not None else torch.zeros(s, dtype=torch.bool)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(s, dtype=torch.long)
    # Document number of every position: eods strictly before it.
    doc = torch.cumsum(is_eod.long(), 0) - is_eod.long()
    position_ids = positions
    if reset_position_ids:
        starts = torch.where(torch.cat([torch.ones(1, dtype=torch.bool), is_eod[:-1]]), positions, 0)
        position_ids = positions - torch.cummax(starts, 0).values
    attention_mask = None
    if create_attention_mask:
        blocked = build_attention_mask(s, s)  # [s, s]
        if reset_attention_mask:
            blocked |= doc[:, None] != doc[None, :]
        attention_mask = blocked.unsqueeze(0)  # [1, s, s]
    return attention_mask, loss_mask, position_ids


class GPTDataset(MegatronDataset):
    """Samples of ``sequence_length`` (+1) tokens over the documents ``indexed_indices``.

    Args:
        indexed_dataset: the low-level dataset (IndexedDataset or the mock one).
        dataset_path: its path prefix; decides the default cache folder.
        indexed_indices: document ids of this split.
        num_samples: samples requested (None: one epoch).
        index_split: which split.
        config: GPTDatasetConfig.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        tokenizer = config.tokenizer
        self._eod = special_token(tokenizer, "eod")
        pad = special_token(tokenizer, "pad")
        self._pad = _NO_PAD_ID if pad is None else int(pad)
        self._extra = int(config.add_extra_token_to_sequence)
        self._causal_mask: Optional[torch.Tensor] = None
        self.path_to_cache = self._cache_dir()
        stem = f"{self.unique_description_hash}-{type(self).__name__}-{index_split.name}"
        arrays = load_or_build_indices(
            self.path_to_cache, stem, self.unique_description, _INDEX_NAMES, self._build_indices
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        return list(MegatronDataset._key_config_attributes()) + [
            "add_extra_token_to_sequence",
            "drop_last_partial_validation_sequence",
        ]

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> Any:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def _cache_dir(self) -> Optional[str]:
        return index_cache_dir(self.config, self.dataset_path, type(self).__name__)

    def _drop_last_partial(self) -> bool:
        if self.index_split == Split.valid:
            return self.config.drop_last_partial_validation_sequence
        return True

    def _build_indices(self) -> Dict[str, np.ndarray]:
        """Build the document, sample and shuffle indices from one seeded RandomState."""
        cfg = self.config
        lengths = np.asarray(self.dataset.sequence_lengths)
        tokens_per_epoch = int(lengths[self.indices].astype(np.int64).sum())
        num_epochs = helpers.get_num_epochs(
            tokens_per_epoch, cfg.sequence_length, self.num_samples, cfg.add_extra_token_to_sequence
        )
        separate, before_last = helpers.separate_last_epoch(
            num_epochs, tokens_per_epoch, cfg.sequence_length, self.num_samples, cfg.add_extra_token_to_sequence
        )
        rng = np.random.RandomState(cfg.random_seed)
        document_index = helpers.build_document_index(self.indices, num_epochs, rng, separate)
        sample_index = helpers.build_sample_index(
            lengths, document_index, cfg.sequence_length, self._drop_last_partial(), cfg.add_extra_token_to_sequence
        )
        total = sample_index.shape[0] - 1
        shuffle_index = helpers.build_shuffle_index(before_last if separate else total, total, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``sequence_length + add_extra_token`` raw tokens of sample ``idx`` (padded if short)."""
        i = int(self.shuffle_index[idx])
        first_pos, first_offset = (int(v) for v in self.sample_index[i])
        last_pos, last_offset = (int(v) for v in self.sample_index[i + 1])
        parts: List[np.ndarray] = []
        for pos in range(first_pos, last_pos + 1):
            offset = first_offset if pos == first_pos else 0
            length = last_offset + self._extra - offset if pos == last_pos else None
            parts.append(np.asarray(self.dataset.get(int(self.document_index[pos]), offset=offset, length=length)))
        text = np.concatenate(parts).astype(np.int64)
        short = self.config.sequence_length + self._extra - text.size
        if short > 0:
            text = np.concatenate([text, np.full(short, self._pad, dtype=np.int64)])
        return text

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """One sample; ``idx=None`` gives a padding sample whose loss mask is all zero."""
        text = torch.from_numpy(self.sample_tokens(0 if idx is None else idx))
        if self._extra:
            tokens, labels = text[:-1].clone(), text[1:].clone()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1)
            labels[-1] = self._pad
        attention_mask, loss_mask, position_ids = self._masks(tokens)
        loss_mask[labels == self._pad] = 0.0
        # Pad ids may be outside the vocabulary: map them to 0 (their loss is masked).
        tokens[tokens == self._pad] = 0
        labels[labels == self._pad] = 0
        if idx is None:
            loss_mask.zero_()
        sample = OrderedDict(tokens=tokens, labels=labels)
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _masks(self, tokens: torch.Tensor):
        cfg = self.config
        reuse_causal = cfg.create_attention_mask and not cfg.reset_attention_mask
        mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens,
            self._eod,
            cfg.reset_position_ids,
            cfg.reset_attention_mask,
            cfg.eod_mask_loss,
            cfg.create_attention_mask and not (reuse_causal and self._causal_mask is not None),
        )
        if reuse_causal:
            # The plain causal mask is the same for every sample; build its s*s bools once.
            self._causal_mask = mask if self._causal_mask is None else self._causal_mask
            mask = self._causal_mask
        return mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents: lengths and tokens follow from the seed alone, no files.

    Document ``i`` has random tokens in ``[1, vocab_size)`` and ends with the eod token.
    """

    def __init__(
        self,
        seed: int = 0,
        num_documents: int = 100_000,
        max_sequence_length: int = 4096,
        vocab_size: int = 256,
        eod: int = 0,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size}: mock data needs at least 2 token ids")
        self.seed, self.vocab_size, self.eod = seed, vocab_size, eod
        self.sequence_lengths = (
            np.random.RandomState(seed).randint(1, max_sequence_length, size=num_documents).astype(np.int32)
        )

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def __getitem__(self, idx: int) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        tokens = np.random.RandomState([self.seed, int(idx)]).randint(1, self.vocab_size, size=n).astype(np.int64)
        tokens[-1] = self.eod
        return tokens

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        doc = self[idx]
        return doc[offset:] if length is None else doc[offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (``--mock-data``); indices are not cached to disk."""

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        tokenizer = config.tokenizer
        vocab = getattr(tokenizer, "vocab_size", None) or 256
        eod = special_token(tokenizer, "eod")
        return MockGPTLowLevelDataset(
            seed=config.random_seed,
            vocab_size=vocab,
            eod=0 if eod is None else eod,
            max_sequence_length=max(2 * config.sequence_length, 8),
        )
