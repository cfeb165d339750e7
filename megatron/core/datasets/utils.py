"""Small shared pieces of the dataset stack: splits, blends, sample counts and the index cache."""

from __future__ import annotations

import enum
import hashlib
import os
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

Blend = Tuple[List[str], Optional[List[float]]]


class Split(enum.Enum):
    """The three dataset splits, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: Sequence[float]) -> List[float]:
    """Scale non-negative ``weights`` to sum to one."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.isfinite(w).all() or (w < 0).any() or not 0 < w.sum() < np.inf:
        raise ValueError(f"weights={list(weights)}: must be finite, non-negative, with a positive sum")
    return (w / w.sum()).tolist()


def parse_and_normalize_split(split: str) -> List[float]:
    """Parse ``"969,30,1"`` (or ``"969/30/1"``) into three fractions summing to one.

    Missing trailing entries are zero, as in Megatron (``"90,10"`` has no test split).
    """
    separator = "," if "," in split else "/"
    try:
        parts = [float(s) for s in split.split(separator) if s.strip()]
    except ValueError as err:
        raise ValueError(f"split={split!r}: expected up to three numbers like '969,30,1'") from err
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"split={split!r}: expected one to three numbers, got {len(parts)}")
    parts += [0.0] * (3 - len(parts))
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split={split!r}: parts must be non-negative with a positive sum")
    return normalize(parts)


def convert_split_vector_to_split_matrix(fractions: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Turn split fractions into ``(begin, end)`` bookends per split; None for an empty split."""
    bookends = np.concatenate(([0.0], np.cumsum(fractions)))
    bookends[-1] = 1.0  # guard against 0.9999999 from the sum of floats
    return [None if b == e else (float(b), float(e)) for b, e in zip(bookends[:-1], bookends[1:])]


def split_document_ranges(
    num_documents: int, split_matrix: Sequence[Optional[Tuple[float, float]]]
) -> List[Optional[Tuple[int, int]]]:
    """Documents of each split: ``[round(b_k * N), round(b_{k+1} * N))``, or None."""
    return [
        None if bookends is None else (int(round(bookends[0] * num_documents)), int(round(bookends[1] * num_documents)))
        for bookends in split_matrix
    ]


def get_blend_from_list(blend: Optional[Sequence[str]]) -> Optional[Blend]:
    """Parse a ``--data-path`` list: ``["A", "B"]`` or ``["0.3", "A", "0.7", "B"]``.

    Returns:
        ``(prefixes, weights)`` with ``weights`` None for an unweighted list; None for no list.
    """
    if not blend:
        return None
    if len(blend) == 1:
        return [blend[0]], None
    try:
        float(blend[0])
    except ValueError:
        return list(blend), None
    if len(blend) % 2:
        raise ValueError(f"data path {list(blend)}: weighted lists alternate weight and prefix")
    weights, prefixes = [], []
    for weight, prefix in zip(blend[0::2], blend[1::2]):
        try:
            weights.append(float(weight))
        except ValueError as err:
            raise ValueError(f"data path {list(blend)}: {weight!r} is not a weight") from err
        prefixes.append(prefix.strip())
    return prefixes, weights


def get_num_samples(train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int) -> List[int]:
    """Samples needed per split: [train, valid, test], as Megatron's training loop asks for."""
    train = train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return [train, valid, test]


def description_hash(description: str) -> str:
    """MD5 of a dataset's JSON description: the key of its cached indices."""
    return hashlib.md5(description.encode("utf-8")).hexdigest()


def _is_builder_rank() -> bool:
    """Rank 0 builds caches when torch.distributed is up; any process builds otherwise."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency, kept defensive
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _save_atomically(path: str, array: np.ndarray) -> None:
    """Write ``array`` beside ``path`` then rename, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npy.tmp")
    with os.fdopen(fd, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def load_or_build_indices(
    cache_dir: Optional[str],
    stem: str,
    description: str,
    names: Sequence[str],
    build: Callable[[], Dict[str, np.ndarray]],
) -> Dict[str, np.ndarray]:
    """Memory-map cached index arrays, or build them (and cache them on the builder rank).

    Files are ``{cache_dir}/{stem}-{name}.npy`` plus ``{stem}-description.txt``; ``stem`` must
    carry the hash of ``description`` so that a changed setting never matches a stale file.

    Raises:
        RuntimeError: the cache is missing on a rank that does not build it (rank 0 must build
            first and the ranks meet at a barrier; see BlendedMegatronDatasetBuilder).
    """
    if cache_dir is None:
        return build()
    paths = {name: os.path.join(cache_dir, f"{stem}-{name}.npy") for name in names}
    if all(os.path.isfile(p) for p in paths.values()):
        return {name: np.load(p, mmap_mode="r", allow_pickle=False) for name, p in paths.items()}
    if not _is_builder_rank():
        missing = [p for p in paths.values() if not os.path.isfile(p)]
        raise RuntimeError(f"index cache missing on a non-zero rank: {missing}; rank 0 builds it first")
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f"{stem}-description.txt"), "w") as f:
        f.write(description)
    for name, p in paths.items():
        _save_atomically(p, arrays[name])
    return arrays


def compile_helpers() -> None:
    """Megatron-core's hook to build its C++ dataset helpers; a no-op here.

    Our index builders (``megatron/core/datasets/helpers.py``) are NumPy, so nothing needs
    compiling. Kept so that scripts written against Megatron-core, which call it once on rank 0
    before building datasets, run unchanged.
    """
