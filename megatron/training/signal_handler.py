"""Graceful exit on a signal (``--exit-signal-handler``): finish the step, save, exit 0.

A scheduler (Slurm's ``--signal``, a preemption) sends SIGTERM to every rank, but not
at the same instant; the handler only records the signal, and the training loop asks
all ranks once per step whether any of them received it, so they stop together.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.utils import comm_device


class DistributedSignalHandler:
    """Records ``sig`` while installed; ``signals_received()`` agrees on it across ranks."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> "DistributedSignalHandler":
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self._received = True

    def signals_received(self) -> bool:
        """True on every rank if any rank received the signal (a collective call)."""
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32, device=comm_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
