"""``--ckpt-format torch``: Megatron's legacy per-rank files, read back only under the layout that saved them.

```
iter_0001000/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   one file per TP/PP rank (the pp suffix when PP > 1)
iter_0001000/checksums.json                                   size and SHA-256 of each .pt file (written after them)
```
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError, checksums
from megatron.core.dist_checkpointing.serialization import read_json, write_json_atomic
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.fp8_utils import drop_fp8_checkpoint_values
from megatron.core.utils import unwrap_model
from megatron.training.checkpoint_formats.base import (
    TORCH,
    TORCH_DIST,
    CheckpointFormat,
    Loaded,
    LoadRequest,
    SaveRequest,
)
from megatron.training.checkpoint_formats.common import agreed_read, agreed_write, same_layout

logger = logging.getLogger(__name__)

LEGACY_FILE = "model_optim_rng.pt"
LEGACY_CHECKSUMS = "checksums.json"  # size and SHA-256 of each .pt file, written last


def legacy_file(iter_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` (the pp suffix only when PP > 1)."""
    folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(iter_dir, folder, LEGACY_FILE)


class TorchLegacyFormat(CheckpointFormat):
    """The data-parallel rank 0 of each TP/PP position writes one ``torch.save`` file."""

    name = TORCH
    marker = "mp_rank_*"

    def detect(self, names: Sequence[str]) -> bool:
        """Any ``mp_rank_*`` folder."""
        return any(name.startswith("mp_rank_") for name in names)

    def validate(self, groups: ProcessGroupCollection) -> None:
        """Per-rank files cannot hold expert-parallel shards."""
        if groups.size_of("ep") > 1:
            raise CheckpointingError(
                f"--ckpt-format {TORCH} with expert_model_parallel_size={groups.size_of('ep')}: "
                f"not supported yet (use --ckpt-format {TORCH_DIST})"
            )

    def save(self, request: SaveRequest) -> None:
        """Writers gather their DP group's RNG states, save their file, then ``checksums.json`` is written."""
        iter_dir, model_chunks = request.iter_dir, request.model_chunks
        optimizer, groups = request.optimizer, request.groups
        common, rng_state = request.common, request.rng_state
        rng: List[Any] = [None] * groups.size_of("dp")
        if rng_state is not None:
            dist.all_gather_object(rng, rng_state, group=groups.dp)
        # On every rank: the distributed optimizer gathers its DP slices collectively.
        optim_state = optimizer.state_dict_by_param_name(model_chunks) if optimizer is not None else None
        writer = groups.rank_in("dp") == 0 and groups.rank_in("cp") == 0
        path = legacy_file(iter_dir, groups.rank_in("tp"), groups.rank_in("pp"), groups.size_of("pp"))
        state: Dict[str, Any] = {}
        if writer:
            flops = common["train_state"].get("num_floating_point_operations_so_far", 0)
            state = dict(common, num_floating_point_operations_so_far=flops)
            if rng_state is not None:
                state["rng_state"] = rng
            for i, chunk in enumerate(model_chunks):
                state["model" if len(model_chunks) == 1 else f"model{i}"] = dc.model_state_to_save(unwrap_model(chunk))
            if optim_state is not None:
                state["optimizer"] = optim_state
        agreed_write(lambda: _write_torch_file(path, state), iter_dir, writer=writer)
        drop_fp8_checkpoint_values(model_chunks)
        _record_checksums(iter_dir, path if writer else None)

    def load(self, request: LoadRequest) -> Loaded:
        """Per-rank files and no collective inside: one rank's failure stops every rank."""
        return agreed_read(lambda: _load(request))

    def saved_args(self, iter_dir: str) -> Any:
        """The first legacy file's ``args``, memory-mapped (the tensors are not read)."""
        for folder in ("mp_rank_00", "mp_rank_00_000"):
            path = os.path.join(iter_dir, folder, LEGACY_FILE)
            if os.path.isfile(path):
                try:
                    return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("args")
                except Exception as e:  # noqa: BLE001 - truncated, corrupt or holding non-plain objects
                    raise CheckpointingError(f"cannot read legacy checkpoint {path}: {e}") from e
        raise CheckpointingError(
            f"{iter_dir}: neither mp_rank_00/{LEGACY_FILE} nor mp_rank_00_000/{LEGACY_FILE} "
            "holds the arguments --use-checkpoint-args needs"
        )


def _record_checksums(iter_dir: str, written: Optional[str]) -> None:
    """Collective: each writer hashes its file (still in the page cache); rank 0 writes ``checksums.json``."""
    entry: Dict[str, Any] = {}

    def digest() -> None:
        entry[os.path.relpath(written, iter_dir).replace(os.sep, "/")] = {
            "bytes": os.path.getsize(written),
            checksums.ALGORITHM: checksums.file_digest(written),
        }

    agreed_write(digest, iter_dir, writer=written is not None)
    entries: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    files = {name: value for part in entries for name, value in part.items()}
    table = {"algorithm": checksums.ALGORITHM, "files": files}
    agreed_write(lambda: write_json_atomic(os.path.join(iter_dir, LEGACY_CHECKSUMS), table), iter_dir)


def _verify_file(iter_dir: str, path: str) -> None:
    """This rank's legacy file against ``checksums.json`` (older checkpoints have none: a warning).

    A mismatch raises on the rank that reads the file; ``load`` makes every rank raise.
    """
    where = os.path.join(iter_dir, LEGACY_CHECKSUMS)
    if not os.path.isfile(where):
        logger.warning("%s not found (saved before checksums, or by Megatron-LM): %s is not verified", where, path)
        return
    files = checksums.check_table(read_json(where, "legacy checkpoint checksums"), where)
    name = os.path.relpath(path, iter_dir).replace(os.sep, "/")
    if name not in files:
        raise CheckpointingError(f"{where} does not list {path}: the file was added after the save")
    checksums.verify_files(iter_dir, files, [name], where)


def _write_torch_file(path: str, state: Dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, then rename. Through a Python file object, so that a failed
    write keeps its ``OSError`` (errno) in the exception chain instead of only "unexpected pos"."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
    os.replace(path + ".tmp", path)


def _load(request: LoadRequest) -> Loaded:
    """Every key of the file must fit the model (``load_state_dict(strict=True)``) whatever
    ``--dist-ckpt-strictness`` says: as in Megatron, that flag is for torch_dist checkpoints."""
    iter_dir, model_chunks = request.iter_dir, request.model_chunks
    optimizer, groups = request.optimizer, request.groups
    path = legacy_file(iter_dir, groups.rank_in("tp"), groups.rank_in("pp"), groups.size_of("pp"))
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"legacy checkpoint file not found: {path} (a torch-format checkpoint loads only "
            "under the TP/PP layout that saved it)"
        )
    if request.verify_checkpoint:
        _verify_file(iter_dir, path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or holding non-plain objects
        raise CheckpointingError(f"cannot read legacy checkpoint {path}: {e}") from e
    if request.check_args is not None:
        request.check_args(state.get("args"), path)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        try:
            unwrap_model(chunk).load_state_dict(state[key], strict=True)
        except (KeyError, RuntimeError) as e:
            raise CheckpointingError(f"{path}: model state does not fit: {e}") from e
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointingError(
                f"{path} has no optimizer state (saved with --no-save-optim?); load with --no-load-optim or --finetune"
            )
        optimizer.load_state_dict_by_param_name(model_chunks, state["optimizer"])
    rng = None
    if request.load_rng:
        if "rng_state" not in state:
            raise CheckpointingError(f"{path} has no RNG state (saved with --no-save-rng?); load with --no-load-rng")
        if same_layout(state, groups, path):
            rng = state["rng_state"][groups.rank_in("dp")]
    return state, rng
