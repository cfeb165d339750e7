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
