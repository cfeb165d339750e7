"""Small helpers of the training application: rank-aware printing (Megatron's names), provider calls."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch.distributed as dist

from megatron.core.utils import unwrap_model  # noqa: F401 - Megatron-LM's training.utils exports it


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


def call_with_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with only the keyword arguments its signature accepts.

    Providers written for Megatron-LM take ``(pre_process, post_process)`` and read
    ``get_args()``; ours also accept ``config``, ``args``, ``tokenizer`` and ``pg_collection``.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
