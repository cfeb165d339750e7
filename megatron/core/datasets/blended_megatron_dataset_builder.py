"""BlendedMegatronDatasetBuilder: the train/valid/test datasets of a config, built rank 0 first."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Type

import numpy as np
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, normalize, split_document_ranges

_WHOLE = [(0.0, 1.0)] * 3  # blend_per_split: every split takes all documents of its own blend


class BlendedMegatronDatasetBuilder:
    """Builds ``[train, valid, test]`` datasets of class ``cls`` as the config describes.

    When torch.distributed is initialized, rank 0 builds first (and writes the index caches),
    the ranks of ``group`` meet at a barrier, then the other ranks build by loading the caches.
    Every rank of ``group`` must call ``build``.

    Args:
        cls: a MegatronDataset subclass (GPTDataset, MockGPTDataset, ...).
        sizes: samples wanted for train, valid and test: 0 builds no dataset for that split, None
            one epoch of its documents (unweighted blends only, as in Megatron-core).
        is_built_on_rank: whether this rank needs the datasets (others get None).
        config: the dataset configuration.
        group: process group of the barrier (must hold global rank 0, which writes the
            caches); None is the default (world) group.
    """

    def __init__(
        self,
        cls: Type[MegatronDataset],
        sizes: Sequence[Optional[int]],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
        group: Optional[Any] = None,
    ) -> None:
        if len(sizes) != 3:
            raise ValueError(f"sizes={list(sizes)}: need three entries (train, valid, test)")
        if any(s is not None and s < 0 for s in sizes):
            raise ValueError(f"sizes={list(sizes)}: must be non-negative")
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, list(sizes), is_built_on_rank, config
        self.group = group
        self._check_none_sizes()

    def _check_none_sizes(self) -> None:
        """A None size (one epoch) cannot be split over weighted blend components: Megatron-core asserts."""
        if self.config.mock:
            return
        for split in Split:
            if self.config.blend_per_split is None:
                blend = self.config.blend
            else:
                blend = self.config.blend_per_split[split.value]
            if blend is not None and self.sizes[split.value] is None and blend[1] is not None:
                raise AssertionError(
                    f"sizes[{split.value}]=None ({split.name}): one epoch of a weighted blend is undefined; "
                    f"give a size, or no weights (blend weights={blend[1]})"
                )

    def build(self) -> List[Optional[Any]]:
        """The three datasets; None where the size is 0 or this rank does not build."""
        if self.config.mock:
            return self._build_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend is not None:
            prefixes, weights = self.config.blend
            return self._build_blend(prefixes, weights, self.config.split_matrix, self.sizes)
        datasets: List[Optional[Any]] = [None, None, None]
        for i, blend in enumerate(self.config.blend_per_split):
            if blend is not None and self.sizes[i] != 0:  # None: one epoch
                sizes = [0, 0, 0]
                sizes[i] = self.sizes[i]
                datasets[i] = self._build_blend(blend[0], blend[1], _WHOLE, sizes)[i]
        return datasets

    def _build_blend(
        self,
        prefixes: Sequence[str],
        weights: Optional[Sequence[float]],
        split_matrix: Sequence[Optional[tuple]],
        sizes: Sequence[Optional[int]],
    ) -> List[Optional[Any]]:
        """One prefix: its splits directly; several: each split blended over the prefixes."""
        if len(prefixes) == 1 and weights is None:
            return self._build_splits(prefixes[0], split_matrix, sizes)
        if weights is not None:
            weights = normalize(weights)
            surplus = self.config.mid_level_dataset_surplus
            per_prefix = [[_with_surplus(s, w, surplus) for s in sizes] for w in weights]
        else:
            per_prefix = [[0 if s == 0 else None for s in sizes] for _ in prefixes]  # one epoch of each
        components = [self._build_splits(p, split_matrix, s) for p, s in zip(prefixes, per_prefix)]
        blended: List[Optional[Any]] = [None, None, None]
        for i in range(3):
            if sizes[i] == 0 or split_matrix[i] is None:
                continue
            parts = [c[i] for c in components]
            weights_i, size_i = weights, sizes[i]
            if weights is None and parts[0] is not None:
                # Unweighted: one epoch of each, mixed in proportion to their lengths.
                weights_i = [len(p) for p in parts]
                size_i = sum(weights_i) if sizes[i] is None else min(sizes[i], sum(weights_i))
            blended[i] = self._build_on_ranks(BlendedDataset, parts, weights_i, size_i, self.config)
        return blended

    def _build_splits(
        self, prefix: Optional[str], split_matrix: Sequence[Optional[tuple]], sizes: Sequence[Optional[int]]
    ) -> List[Optional[Any]]:
        """The three split datasets of one low-level dataset (None for empty splits)."""
        wanted = [split_matrix[i] is not None and sizes[i] != 0 for i in range(3)]
        if not any(wanted):
            return [None, None, None]
        low_level = self.cls.build_low_level_dataset(prefix, self.config) if self.is_built_on_rank() else None
        num_documents = self.cls.numel_low_level_dataset(low_level) if low_level is not None else 0
        ranges = split_document_ranges(num_documents, split_matrix)
        datasets: List[Optional[Any]] = [None, None, None]
        for i, split in enumerate(Split):
            if wanted[i] and low_level is not None and ranges[i][0] == ranges[i][1]:
                raise ValueError(
                    f"split {split.name}: no documents ({ranges[i]} of {num_documents} in "
                    f"{prefix}) but {sizes[i]} samples requested; change BlendedMegatronDatasetConfig.split"
                )
            if wanted[i]:
                indices = np.arange(ranges[i][0], ranges[i][1], dtype=np.int64) if low_level is not None else None
                datasets[i] = self._build_on_ranks(self.cls, low_level, prefix, indices, sizes[i], split, self.config)
        return datasets

    def _build_on_ranks(self, cls: Type, *args: Any) -> Optional[Any]:
        """Build on rank 0, barrier, then build (load caches) on the other ranks."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return cls(*args) if self.is_built_on_rank() else None
        rank = dist.get_rank()
        dataset = None
        if rank == 0 and self.is_built_on_rank():
            dataset = cls(*args)
        dist.barrier(group=self.group)
        if rank != 0 and self.is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _with_surplus(size: Optional[int], weight: float, surplus: float) -> Optional[int]:
    """Samples a blend component is built with: its share of ``size`` plus the surplus."""
    if not size:
        return size
    return int(math.ceil(math.ceil(size * weight) * (1 + surplus)))
