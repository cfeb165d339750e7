"""Small helpers shared across the core library."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor must live to travel over ``group``: this rank's GPU for NCCL, else the CPU.

    Scalars that steer control flow (flags, norms, counts) are created on the CPU; NCCL only
    moves device tensors, gloo only host tensors, so collectives on them go through here.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into_tensor(
    output: torch.Tensor, input_: torch.Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False
):
    """Gather equal pieces into one tensor (``all_gather_single`` where torch has it, else its older name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input_: torch.Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False
):
    """Sum over ranks and keep this rank's equal piece (``reduce_scatter_single`` where torch has it)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_, group=group, async_op=async_op)
