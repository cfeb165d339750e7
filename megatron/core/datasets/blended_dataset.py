"""BlendedDataset: several datasets interleaved by weight."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import _json_default
from megatron.core.datasets.utils import description_hash, load_or_build_indices, normalize

_INDEX_NAMES = ("dataset_index", "dataset_sample_index")


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from ``datasets`` so that after n samples dataset i gave about ``w_i * n``.

    Args:
        datasets: the component datasets (each long enough for its share; the builder gives
            each a 0.5% surplus).
        weights: one non-negative weight per dataset, normalised here; None concatenates the
            datasets whole.
        size: number of samples; None means the sum of the component lengths (only without
            weights).
        config: the dataset configuration (``path_to_cache`` enables the on-disk cache).
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Optional[Sequence[float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if not datasets:
            raise ValueError("datasets: a blend needs at least one dataset")
        if weights is not None and len(weights) != len(datasets):
            raise ValueError(f"weights: {len(weights)} weights for {len(datasets)} datasets")
        if weights is None and size is not None and size > sum(len(d) for d in datasets):
            raise ValueError(f"size={size}: an unweighted blend has only {sum(len(d) for d in datasets)} samples")
        if weights is not None and size is None:
            raise ValueError("size=None: a weighted blend needs a size")
        self.datasets = list(datasets)
        self.weights = None if weights is None else normalize(weights)
        self.size = sum(len(d) for d in datasets) if size is None else int(size)
        self.config = config
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("datasets", [d.unique_identifiers for d in self.datasets]),
                ("weights", self.weights),
                ("size", self.size),
            ]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4, default=_json_default)
        self.unique_description_hash = description_hash(self.unique_description)
        stem = f"{self.unique_description_hash}-{type(self).__name__}"
        arrays = load_or_build_indices(
            config.path_to_cache, stem, self.unique_description, _INDEX_NAMES, self._build_indices
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_sizes()

    def _build_indices(self) -> Dict[str, np.ndarray]:
        if self.weights is None:
            dataset_index, sample_index = helpers.build_exhaustive_blending_indices([len(d) for d in self.datasets])
            dataset_index, sample_index = dataset_index[: self.size], sample_index[: self.size]
        else:
            dataset_index, sample_index = helpers.build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def _check_sizes(self) -> None:
        """Every component must hold the samples the blend will ask of it."""
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        short: List[str] = [
            f"dataset {i}: needs {int(c)}, has {len(d)}"
            for i, (c, d) in enumerate(zip(counts, self.datasets))
            if c > len(d)
        ]
        if short:
            raise RuntimeError("blended dataset components too small: " + "; ".join(short))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return OrderedDict([("dataset_id", dataset_id)] + list(sample.items()))
