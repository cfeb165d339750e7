"""What the checkpoint formats share: the common-state file name, per-rank RNG files, the layout record,
and the agreements that make a per-rank failure stop every rank."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional

import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.dist_checkpointing.write_errors import WRITE_FAILURES, describe_write_failure
from megatron.core.parallel_state import ProcessGroupCollection

logger = logging.getLogger(__name__)

COMMON_FILE = "common.json"
RNG_DIR = "rng"


def layout(groups: ProcessGroupCollection) -> Dict[str, int]:
    """World size and TP/PP/DP/CP (and EP when > 1) sizes: RNG states are restored only under the same."""
    sizes = {
        "world_size": dist.get_world_size(),
        "tp": groups.size_of("tp"),
        "pp": groups.size_of("pp"),
        "dp": groups.size_of("dp"),
        "cp": groups.size_of("cp"),
    }
    if groups.size_of("ep") > 1:  # absent at EP=1, as in checkpoints written before expert parallelism
        sizes["ep"] = groups.size_of("ep")
    return sizes


def same_layout(common: Dict[str, Any], groups: ProcessGroupCollection, where: str) -> bool:
    """Whether ``common`` was saved under this run's layout (if not: a warning that RNG states stay)."""
    if common.get("layout") == layout(groups):
        return True
    logger.warning(
        "%s was saved with layout %s, this run is %s: RNG states are not restored",
        where,
        common.get("layout"),
        layout(groups),
    )
    return False


def rng_path(iter_dir: str, rank: int) -> str:
    """``rng/rank_{rank:05d}.json``: one rank's RNG states in a torch_dist checkpoint."""
    return os.path.join(iter_dir, RNG_DIR, f"rank_{rank:05d}.json")


def agreed_write(write: Callable[[], None], directory: str, writer: Optional[bool] = None) -> None:
    """Run ``write`` on the writer ranks (default: rank 0); if it fails on any rank, all raise with the cause.

    Every local write of a save ends in one of these before the next collective, so a full
    disk on one rank stops all of them instead of leaving the others in a barrier.
    """
    error = None
    if (dist.get_rank() == 0) if writer is None else writer:
        try:
            write()
        except WRITE_FAILURES as e:
            error = describe_write_failure(e, directory)
    agree_on_error(error, None)


def agreed_read(read: Callable[[], Any]) -> Any:
    """Run a per-rank read on every rank; if it fails on any rank, every rank raises with the cause."""
    error, result = None, None
    try:
        result = read()
    except CheckpointingError as e:
        error = str(e)
    agree_on_error(error, None)
    return result
