"""Graceful exit on a signal (``--exit-signal-handler``): finish the step, save, exit 0.

A scheduler (Slurm's ``--signal``, a preemption) sends SIGTERM to every rank, but not
at the same instant; the handler only records the signal, and the training loop asks
all ranks once per step whether any of them received it, so they stop together.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Optional


class DistributedSignalHandler:
    """Records ``sig`` while installed (this rank only; see ``received``)."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> DistributedSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self._received = True

    @property
    def received(self) -> bool:
        """Whether this rank got the signal; the loop agrees on it across ranks with its other exit checks."""
        return self._received
