"""MegatronDataset: the base of every split dataset built on a low-level (indexed) dataset."""

from __future__ import annotations

import abc
import json
from collections import OrderedDict
from typing import Any, Dict, Iterable, Optional, Union

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, description_hash

# What a MegatronDataset is built on (Megatron-core's alias): an IndexedDataset or any sized iterable.
LowLevelDataset = Union[IndexedDataset, Iterable]


def tokenizer_identity(tokenizer: Any) -> Any:
    """What identifies a tokenizer in a cache key: its own identifiers, else class and vocab size."""
    if tokenizer is None:
        return None
    own = getattr(tokenizer, "unique_identifiers", None)
    if own is not None:
        return own
    return {"class": type(tokenizer).__name__, "vocab_size": getattr(tokenizer, "vocab_size", None)}


class MegatronDataset(abc.ABC, torch.utils.data.Dataset):
    """One split of one low-level dataset, with a description that keys its cached indices.

    Args:
        dataset: the low-level dataset (e.g. an IndexedDataset).
        dataset_path: its path prefix (None for synthetic data).
        indices: the low-level document ids this split may use.
        num_samples: samples requested; None means one pass over the documents.
        index_split: which split this is.
        config: the dataset configuration.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.unique_identifiers = self._identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4, default=_json_default)
        self.unique_description_hash = description_hash(self.unique_description)

    def _identifiers(self) -> OrderedDict[str, Any]:
        """Everything that determines this dataset's indices, in a stable order."""
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        # The files' content identity: data re-preprocessed under the same prefix gets new indices.
        identity = getattr(self.dataset, "identity", None)
        if callable(identity):
            ids["dataset_identity"] = identity()
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.index_split.name
        # The exact documents, not only the split string: blend_per_split has no split.
        ids["documents"] = _describe_documents(self.indices)
        for attr in self._key_config_attributes():
            value = getattr(self.config, attr)
            ids[attr] = tokenizer_identity(value) if attr == "tokenizer" else value
        return ids

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        """Config fields that change the indices; subclasses extend the list."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of documents of a low-level dataset (its ``len``; upstream's base raises instead)."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        """Open the low-level dataset at ``dataset_path``; subclasses the builder uses must override it.

        Not abstract, as upstream: a subclass built from an in-memory dataset need not define it.
        """
        raise NotImplementedError("MegatronDataset.build_low_level_dataset: a subclass must define it")

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abc.abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Any]:
        """One sample."""


def _describe_documents(indices: np.ndarray) -> Any:
    """A contiguous id range as ``[first, count]``; anything else by the hash of its bytes."""
    n = int(indices.size)
    if n == 0:
        return [0, 0]
    first = int(indices[0])
    if int(indices[-1]) - first == n - 1 and (n < 2 or bool((np.diff(indices) == 1).all())):
        return [first, n]
    return description_hash(np.ascontiguousarray(indices, dtype=np.int64).tobytes().hex())


def _json_default(obj: Any) -> Any:
    """JSON fallback for nested identifiers (datasets inside a blend)."""
    identifiers = getattr(obj, "unique_identifiers", None)
    if identifiers is not None:
        return identifiers
    return repr(obj)
