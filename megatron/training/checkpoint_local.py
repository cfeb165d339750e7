"""Local non-persistent checkpoints (``--non-persistent-ckpt-type local``): each rank's own state on node-local disk.

```
LOCAL/iter_0000006/rank_{rank:05d}.pt     this rank's model state, optimizer state (the distributed optimizer:
                                          its own shard), RNG states and the common state (torch.save, tensors
                                          and plain data only: read with weights_only=True)
LOCAL/iter_0000006/rank_{rank:05d}.done   written last (JSON: iteration, layout, size and SHA-256 of the .pt):
                                          without it the rank's file is never used
```

A rank reads only its own file, so a local checkpoint loads only under the layout that wrote it, and
only when every rank holds a complete one of the same iteration (``agreed_iteration``: one collective).
``--non-persistent-local-ckpt-algo fully_parallel`` and ``atomic`` both use this one writer. Each rank
removes its other local checkpoints (older ones, or stale ones an earlier job left) once every rank has
completed the new one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError, checksums
from megatron.core.dist_checkpointing.serialization import read_json, write_json_atomic
from megatron.core.utils import unwrap_model
from megatron.training.checkpoint_formats.common import agreed_read, agreed_write

logger = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"iter_(\d{7,})")


def rank_file(root: str, iteration: int, rank: int, suffix: str = ".pt") -> str:
    """``root/iter_{iteration:07d}/rank_{rank:05d}{suffix}`` (``.pt``: the state; ``.done``: the marker)."""
    return os.path.join(root, f"iter_{iteration:07d}", f"rank_{rank:05d}{suffix}")


def save_local(
    root: str,
    iteration: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    common: Dict[str, Any],
    rng_state: Optional[Dict[str, Any]],
) -> None:
    """Collective: every rank writes its file, then its marker; once all have, each removes its other ones."""
    rank = dist.get_rank()
    state = {
        "common": common,
        "model": [dc.model_state_to_save(unwrap_model(chunk)) for chunk in model_chunks],
        "optimizer": None if optimizer is None else optimizer.state_dict(),  # positional: this rank's own state
        "rng": rng_state,
    }
    agreed_write(lambda: _write(root, iteration, rank, state), root, writer=True)
    _remove_others(root, iteration, rank)


def _write(root: str, iteration: int, rank: int, state: Dict[str, Any]) -> None:
    path = rank_file(root, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    marker = rank_file(root, iteration, rank, ".done")
    if os.path.exists(marker):  # rewriting: the old marker must not vouch for the new file meanwhile
        os.remove(marker)
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    entry = {
        "iteration": iteration,
        "layout": state["common"]["layout"],
        "bytes": os.path.getsize(path),
        checksums.ALGORITHM: checksums.file_digest(path),
    }
    write_json_atomic(marker, entry)


def _remove_others(root: str, iteration: int, rank: int) -> None:
    """This rank's files of every other local checkpoint; a directory goes once no rank's file is left in it."""
    for other, folder in _iteration_dirs(root):
        if other == iteration:
            continue
        for suffix in (".done", ".pt"):  # the marker first: a half-removed checkpoint is never complete
            path = rank_file(root, other, rank, suffix)
            if os.path.exists(path):
                os.remove(path)
        try:
            os.rmdir(folder)
        except OSError as e:  # other ranks of this node still hold files there: the last one removes it
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise


def _iteration_dirs(root: str) -> List[Tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _ITER_DIR.fullmatch(n))]
    return sorted(found)


def complete_iterations(root: str, rank: int, layout: Dict[str, int]) -> Set[int]:
    """Iterations whose file this rank holds complete (marker present, size as recorded) under ``layout``."""
    found = set()
    for iteration, _ in _iteration_dirs(root):
        marker = rank_file(root, iteration, rank, ".done")
        try:
            with open(marker) as f:
                entry = json.load(f)
            complete = os.path.getsize(rank_file(root, iteration, rank)) == entry["bytes"]
        except (OSError, ValueError, KeyError, TypeError):  # no marker, unreadable, or no file: incomplete
            continue
        if complete and entry.get("iteration") == iteration and entry.get("layout") == layout:
            found.add(iteration)
    return found


def agreed_iteration(root: str, layout: Dict[str, int]) -> Optional[int]:
    """Collective (one all-gather): the newest iteration every rank holds complete, or None."""
    mine = sorted(complete_iterations(root, dist.get_rank(), layout))
    everyone: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    common = set(everyone[0] or [])
    for found in everyone[1:]:
        common &= set(found or [])
    return max(common) if common else None


def load_local(
    root: str,
    iteration: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    load_rng: bool,
    verify: bool,
    check_args: Optional[Callable[[Any, str], None]],
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Every rank reads its own file into the model (and optimizer unless None); (common state, RNG or None).
    A failure on one rank raises on every rank."""
    path = rank_file(root, iteration, dist.get_rank())

    def read() -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        if verify:
            marker = rank_file(root, iteration, dist.get_rank(), ".done")
            entry = read_json(marker, "local checkpoint marker")
            name = os.path.basename(path)
            checksums.verify_files(os.path.dirname(path), {name: entry}, [name], marker)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - truncated, corrupt or holding non-plain objects
            raise CheckpointingError(f"cannot read local checkpoint {path}: {e}") from e
        if check_args is not None:
            check_args(state["common"].get("args"), path)
        for chunk, saved in zip(model_chunks, state["model"]):
            try:
                unwrap_model(chunk).load_state_dict(saved, strict=True)
            except RuntimeError as e:
                raise CheckpointingError(f"{path}: model state does not fit: {e}") from e
        if optimizer is not None:
            if state["optimizer"] is None:
                raise CheckpointingError(
                    f"{path} has no optimizer state (saved with --no-save-optim?); load with --no-load-optim"
                )
            optimizer.load_state_dict(state["optimizer"])
        return state["common"], state["rng"] if load_rng else None

    return agreed_read(read)
