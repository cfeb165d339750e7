"""Token ids of the training data against the model's vocabulary, checked once before training.

Data preprocessed with a bigger tokenizer than the one given holds ids the embedding table lacks:
with TP=1 the run dies inside torch, with TP>1 every rank masks ids outside its slice and the run
trains on zero vectors. ``check_token_ids_in_vocabulary`` stops it first and names the prefix.

The smallest and largest id of each ``.bin`` take one chunked scan; they are cached in a small
JSON file in the dataset's index cache folder, together with the identity of the files they were
computed from (sizes, modification times, inodes, index digest, a sampled digest of the ``.bin``).
An entry whose identity differs from the files now on disk is recomputed, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

_CACHE_FORMAT = 1
_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK_BYTES = 64 * 1024
Source = Tuple[IndexedDataset, Optional[str]]  # a dataset and the folder that caches its token range


class TokenIdOutOfVocabularyError(ValueError):
    """A data prefix holds token ids outside ``[0, padded vocabulary size)``."""


def bin_sample_digest(path: str, blocks: int = _SAMPLE_BLOCKS, block_bytes: int = _SAMPLE_BLOCK_BYTES) -> str:
    """BLAKE2b of ``blocks`` evenly spaced blocks of a file (all of it when that is smaller): a few MiB read.

    Catches a ``.bin`` rewritten with other tokens but the same lengths within one tick of the
    file system's clock, which leaves size and modification time unchanged.
    """
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= blocks * block_bytes:
            h.update(f.read())
        else:
            for k in range(blocks):
                f.seek((size - block_bytes) * k // (blocks - 1))
                h.update(f.read(block_bytes))
    return h.hexdigest()


def file_identity(dataset: IndexedDataset) -> Dict[str, Any]:
    """What a cached token range is valid for: the path, content identity, both files' mtime (ns)
    and inode, and a sampled digest of the ``.bin``."""
    identity: Dict[str, Any] = {"prefix": os.path.abspath(dataset.path_prefix), **dataset.identity()}
    for name, path in (("idx", get_idx_path(dataset.path_prefix)), ("bin", get_bin_path(dataset.path_prefix))):
        st = os.stat(path)
        identity[f"{name}_mtime_ns"], identity[f"{name}_inode"] = st.st_mtime_ns, st.st_ino
    identity["bin_sample"] = bin_sample_digest(get_bin_path(dataset.path_prefix))
    return identity


def token_range_cache_path(cache_dir: str, path_prefix: str) -> str:
    """``{cache_dir}/{name}-{hash of the absolute prefix}-token_range.json``."""
    key = hashlib.md5(os.path.abspath(path_prefix).encode("utf-8")).hexdigest()[:16]
    return os.path.join(cache_dir, f"{os.path.basename(path_prefix)}-{key}-token_range.json")


def _read_entry(path: str, identity: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The cached entry if it exists and was computed from exactly these files, else None."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        warnings.warn(f"{path}: unreadable token range cache ({err}); computing it again", stacklevel=2)
        return None
    if not isinstance(entry, dict) or entry.get("format") != _CACHE_FORMAT or entry.get("identity") != identity:
        return None  # stale: the files changed since it was written
    return entry


def _write_entry(path: str, entry: Dict[str, Any]) -> None:
    """Write atomically (temporary file, rename); an unwritable folder only costs a rescan next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json.tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(
            f"{path}: cannot cache the token range ({err}); the .bin will be scanned again next run", stacklevel=2
        )


def cached_token_range(dataset: IndexedDataset, cache_dir: Optional[str]) -> Optional[Tuple[int, int]]:
    """``(min id, max id)`` of ``dataset`` (None when it holds no token), from the cache when valid."""
    identity = file_identity(dataset)
    path = token_range_cache_path(cache_dir, dataset.path_prefix) if cache_dir else None
    entry = _read_entry(path, identity) if path else None
    if entry is None:
        found = dataset.token_range()
        entry = {
            "format": _CACHE_FORMAT,
            "identity": identity,
            "min": None if found is None else found[0],
            "max": None if found is None else found[1],
        }
        if path:
            _write_entry(path, entry)
    return None if entry["max"] is None else (int(entry["min"]), int(entry["max"]))


def collect_indexed_datasets(datasets: Iterable[Any]) -> List[Source]:
    """The distinct IndexedDatasets inside ``datasets``, in order, each with its cache folder.

    Follows ``BlendedDataset.datasets`` and ``GPTDataset.dataset`` (whose ``path_to_cache`` is the
    folder); None entries and synthetic (mock) datasets contribute nothing.
    """
    found: Dict[str, Source] = {}

    def visit(obj: Any, cache_dir: Optional[str]) -> None:
        if isinstance(obj, IndexedDataset):
            found.setdefault(os.path.abspath(obj.path_prefix), (obj, cache_dir))
        elif isinstance(getattr(obj, "datasets", None), (list, tuple)):
            for child in obj.datasets:
                visit(child, cache_dir)
        elif getattr(obj, "dataset", None) is not None:
            visit(obj.dataset, getattr(obj, "path_to_cache", None) or cache_dir)

    for dataset in datasets:
        if dataset is not None:
            visit(dataset, None)
    return list(found.values())


def find_out_of_vocabulary(sources: Iterable[Source], vocab_size: int, vocab_origin: str = "") -> Optional[str]:
    """The error message for every source holding an id outside ``[0, vocab_size)``; None if all fit."""
    origin = f" ({vocab_origin})" if vocab_origin else ""
    problems = []
    for dataset, cache_dir in sources:
        found = cached_token_range(dataset, cache_dir)
        if found is None:
            continue
        low, high = found
        if high >= vocab_size:
            problems.append(
                f"data prefix {dataset.path_prefix} holds token id {high} but the padded vocabulary"
                f"{origin} has {vocab_size} entries (ids 0..{vocab_size - 1})"
            )
        elif low < 0:
            problems.append(f"data prefix {dataset.path_prefix} holds the negative token id {low}")
    if not problems:
        return None
    return (
        "; ".join(problems) + ". The data was probably preprocessed with another tokenizer: preprocess it "
        "with this one, or train with the tokenizer it was made with."
    )


def check_token_ids_in_vocabulary(
    datasets: Iterable[Any], vocab_size: int, vocab_origin: str = "", group: Optional[Any] = None
) -> None:
    """Raise ``TokenIdOutOfVocabularyError`` on every rank if a dataset holds an id outside the vocabulary.

    Args:
        datasets: built datasets (GPTDataset, BlendedDataset, IndexedDataset; None is skipped).
        vocab_size: rows of the embedding table (the padded vocabulary size).
        vocab_origin: how that size came about, for the message (flags).
        group: with torch.distributed initialised, the ranks that call this together (None: all).
            Its first rank scans and caches; its verdict, or its failure, is broadcast, so all
            ranks raise the same error at the same point and none waits for a failed peer.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        message = find_out_of_vocabulary(collect_indexed_datasets(datasets), vocab_size, vocab_origin)
        if message:
            raise TokenIdOutOfVocabularyError(message)
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    verdict: List[Any] = [None]
    failure: Optional[BaseException] = None
    if dist.get_rank() == src:
        try:
            verdict[0] = (
                "checked",
                find_out_of_vocabulary(collect_indexed_datasets(datasets), vocab_size, vocab_origin),
            )
        except Exception as err:  # every error must reach the other ranks, which are waiting below
            failure, verdict[0] = err, ("failed", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(verdict, src=src, group=group)
    kind, text = verdict[0]
    if failure is not None:
        raise failure
    if kind == "failed":
        raise RuntimeError(f"the token id check failed on rank {src}: {text}")
    if text:
        raise TokenIdOutOfVocabularyError(text)
