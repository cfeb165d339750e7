"""Small rank-aware printing helpers of the training application (Megatron's names)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _rank_and_world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_0() -> bool:
    """True on global rank 0, or when not distributed."""
    return _rank_and_world()[0] == 0


def is_last_rank() -> bool:
    """True on the last global rank (it holds the last pipeline stage, hence the loss)."""
    rank, world = _rank_and_world()
    return rank == world - 1


def print_rank_0(message: Any) -> None:
    """Print (flushed) on rank 0 only."""
    if is_rank_0():
        print(message, flush=True)


def print_rank_last(message: Any) -> None:
    """Print (flushed) on the last rank only."""
    if is_last_rank():
        print(message, flush=True)
