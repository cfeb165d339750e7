"""BlendedMegatronDatasetConfig: what every dataset of the blended-dataset stack needs to know."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.core.datasets.utils import (
    Blend,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)


def _check_blend(name: str, blend: Blend) -> None:
    """Validate one ``(prefixes, weights)`` pair; ``name`` is the field it came from."""
    if not isinstance(blend, (tuple, list)) or len(blend) != 2:
        raise ValueError(f"{name}={blend!r}: expected a (prefixes, weights) pair")
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{name}={blend!r}: needs at least one path prefix")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{name}: {len(weights)} weights for {len(prefixes)} prefixes")
        for weight, prefix in zip(weights, prefixes):
            if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(
                    f"{name}: weight {weight!r} of {prefix} must be a finite number (weights={list(weights)})"
                )
        if any(w < 0 for w in weights) or not 0 < sum(weights) < math.inf:
            raise ValueError(f"{name}: weights={list(weights)} must be non-negative with a positive sum")


@dataclass
class BlendedMegatronDatasetConfig:
    """Settings shared by all datasets (Megatron Core field names).

    At most one of ``blend`` and ``blend_per_split`` is given; with neither the data are synthetic
    (``mock`` becomes True and, as upstream, ``split`` is ``"1,1,1"``). ``mock=True`` may also be
    passed (``--mock-data``; the split then defaults to Megatron's ``"969,30,1"``).
    """

    random_seed: int
    """Seed of the document and sample shuffles."""

    sequence_length: int
    """Input tokens per sample."""

    blend: Optional[Blend] = None
    """``(prefixes, weights)``: one data set split into train/valid/test by ``split``."""

    blend_per_split: Optional[List[Optional[Blend]]] = None
    """Separate ``(prefixes, weights)`` for train, valid and test (entries may be None)."""

    multiple_validation_sets: Optional[bool] = None
    """One validation dataset per validation prefix: not supported yet (None or False only)."""

    full_validation: Optional[bool] = None
    """Validate on the whole validation split each time: not supported yet (None or False only)."""

    split: Optional[str] = None
    """Split of ``blend`` documents, e.g. ``"969,30,1"``; normalised to fractions."""

    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    """Derived from ``split``: the ``(begin, end)`` fractions of each split."""

    num_dataset_builder_threads: int = 1
    """Accepted for compatibility; datasets are built one after another."""

    path_to_cache: Optional[str] = None
    """Where index arrays are cached; None means ``<data dir>/cache/<DatasetClass>_indices``."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files rather than reading them."""

    mock: bool = False
    """Synthetic data, no files (``--mock-data``, or neither blend given)."""

    tokenizer: Optional[Any] = None
    """Tokenizer: supplies eod/pad ids and identifies the vocabulary in cache keys."""

    mid_level_dataset_surplus: float = 0.005
    """Extra samples each blended component is built with, so the blend never runs short."""

    allow_ambiguous_pad_tokens: Optional[bool] = False
    """Upstream's opt-in to a pad id shared with another special token: not supported yet."""

    fast_cache_load: bool = False
    """Upstream skips re-reading index headers; ours are memory-mapped anyway: no effect."""

    defer_npy_index_mmap: bool = False
    """Upstream maps cached index arrays on first use; a loading-time knob: no effect."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_length, int) or self.sequence_length < 1:
            raise ValueError(f"sequence_length={self.sequence_length!r}: must be a positive integer")
        if not isinstance(self.random_seed, int):
            raise ValueError(f"random_seed={self.random_seed!r}: must be an integer")
        unbuilt = ("multiple_validation_sets", "full_validation", "allow_ambiguous_pad_tokens")
        on = [f"{name}=True" for name in unbuilt if getattr(self, name)]
        if on:
            raise ValueError(f"{', '.join(on)}: not supported yet")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(f"mid_level_dataset_surplus={self.mid_level_dataset_surplus}: must be >= 0")
        self._check_sources()
        if self.split is not None:
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))

    def _check_sources(self) -> None:
        """At most one of blend / blend_per_split (none with mock); split goes with blend."""
        if not self.mock and self.blend is None and self.blend_per_split is None:
            self.mock, self.split = True, "1,1,1"  # upstream's synthetic data and even split
        if self.mock:
            if self.split is None:
                self.split = "969,30,1"  # Megatron's default split when none is given
            return
        if self.blend is not None and self.blend_per_split is not None:
            raise ValueError(
                "blend and blend_per_split: at most one may be given (none with mock=True), "
                f"got blend={self.blend!r}, blend_per_split={self.blend_per_split!r}"
            )
        if self.blend is not None:
            _check_blend("blend", self.blend)
            if self.split is None:
                raise ValueError("split=None: a split is required with blend (e.g. '969,30,1')")
            return
        if len(self.blend_per_split) != 3:
            raise ValueError(f"blend_per_split has {len(self.blend_per_split)} entries: need 3 (train, valid, test)")
        for name, entry in zip(("train", "valid", "test"), self.blend_per_split):
            if entry is not None:
                _check_blend(f"blend_per_split[{name}]", entry)
        if self.split is not None:
            raise ValueError(f"split={self.split!r}: must be None with blend_per_split")
