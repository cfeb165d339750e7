"""Named wall-clock timers with levels, reported across ranks (Megatron's ``Timers`` API).

``timers = Timers(log_level=1, log_option="minmax")``; ``timers("forward", log_level=1).start()``
... ``.stop()``; ``timers.log(["forward"])`` gathers every rank's elapsed time and formats
the max, (min, max) or every rank's value. A timer whose level is above ``log_level``
is a shared dummy: its calls cost nothing and it never reports.

Reporting is a collective over ``group`` (all ranks of the default group when none is
given): every rank must call ``log``/``write`` with the same names, in the same order.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.utils import comm_device

MAX_LOG_LEVEL = 2
LOG_OPTIONS = ("max", "minmax", "all")
NAME_WIDTH = 48  # names are padded with dots to this width in the report


def _synchronize() -> None:
    # Kernels run asynchronously: without a sync the clock would stop before the work ends.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _DummyTimer:
    """Stands in for a timer above the active log level: every call is a no-op."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError("a timer above the timing log level has no elapsed time")


class Timer:
    """One wall-clock timer; accumulates across start/stop pairs until reset (seconds)."""

    def __init__(self, name: str, group: Optional[Any] = None) -> None:
        self.name = name
        self._group = group
        self._elapsed = 0.0
        self._started = False
        self._start_time = 0.0

    def _barrier(self, barrier: bool) -> None:
        if barrier and dist.is_available() and dist.is_initialized():
            dist.barrier(group=self._group)

    def start(self, barrier: bool = False) -> None:
        """Start the clock; ``barrier`` first waits for every rank of the group."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._barrier(barrier)
        _synchronize()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop the clock and add the interval to the elapsed total."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._barrier(barrier)
        _synchronize()
        self._elapsed += time.perf_counter() - self._start_time
        self._started = False

    def reset(self) -> None:
        """Zero the total and stop the clock."""
        self._elapsed = 0.0
        self._started = False

    @property
    def is_running(self) -> bool:
        return self._started

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Total seconds so far; a running timer keeps running (it is read, not stopped)."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        total = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return total


class Timers:
    """A registry of named timers with a level each (0: coarse ... 2: finest).

    Args:
        log_level: timers with a higher level are dummies (``--timing-log-level``).
        log_option: ``"max"``, ``"minmax"`` or ``"all"`` (``--timing-log-option``).
        group: process group the report gathers over; None means the default
            (world) group, since timings compare every rank of the job.
    """

    def __init__(self, log_level: int, log_option: str, group: Optional[Any] = None) -> None:
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"timing log_level={log_level} must be in [0, {MAX_LOG_LEVEL}]")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"timing log_option={log_option!r} must be one of {LOG_OPTIONS}")
        self.log_level = log_level
        self.log_option = log_option
        self._group = group
        self._timers: Dict[str, Timer] = {}
        self._levels: Dict[str, int] = {}
        self._dummy = _DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None) -> Any:
        """The timer ``name``, created on first use; ``log_level`` defaults to the finest level."""
        if name in self._timers:
            if log_level is not None and log_level != self._levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log_level={self._levels[name]}, "
                    f"now asked with log_level={log_level}"
                )
            return self._timers[name]
        level = MAX_LOG_LEVEL if log_level is None else log_level
        if not 0 <= level <= MAX_LOG_LEVEL:
            raise ValueError(f"timer {name!r}: log_level={level} must be in [0, {MAX_LOG_LEVEL}]")
        if level > self.log_level:
            return self._dummy
        self._timers[name] = Timer(name, self._group)
        self._levels[name] = level
        return self._timers[name]

    # ------------------------------------------------------------------ gathering
    def _world(self) -> tuple:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self._group), dist.get_world_size(self._group)
        return 0, 1

    def _all_ranks_elapsed(self, names: Sequence[str], reset: bool, barrier: bool) -> torch.Tensor:
        """``[world, len(names)]`` seconds; NaN where a rank has no such timer."""
        rank, world = self._world()
        mine = torch.full((len(names),), float("nan"), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in self._timers:
                mine[i] = self._timers[name].elapsed(reset=reset, barrier=barrier)
        if world == 1:
            return mine.unsqueeze(0)
        # gloo and NCCL both gather; NCCL needs the tensor on this rank's device.
        device = comm_device(self._group)
        pieces = [torch.empty_like(mine, device=device) for _ in range(world)]
        # non_blocking: a host-to-device copy without it waits for the GPU (only the final .cpu() must).
        dist.all_gather(pieces, mine.to(device, non_blocking=True), group=self._group)
        return torch.stack(pieces).cpu()

    def _min_max(self, names: Sequence[str], reset: bool, barrier: bool, normalizer: float) -> Dict[str, tuple]:
        """name -> (min, max) seconds over the ranks that have the timer."""
        table = self._all_ranks_elapsed(names, reset, barrier) / normalizer
        result = {}
        for i, name in enumerate(names):
            column = table[:, i]
            present = column[~torch.isnan(column)]
            if present.numel():
                result[name] = (present.min().item(), present.max().item())
        return result

    # ------------------------------------------------------------------ reporting
    def get_string(
        self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True, barrier: bool = False
    ) -> Optional[str]:
        """The report for ``names`` in ms (collective); None when no rank has any of them."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer={normalizer} must be positive")
        if self.log_option == "all":
            return self._all_string(names, normalizer, reset, barrier)
        stats = self._min_max(names, reset, barrier, normalizer)
        if not stats:
            return None
        if self.log_option == "max":
            lines = [f"    {n.ljust(NAME_WIDTH, '.')}: {hi * 1000.0:.2f}" for n, (_, hi) in stats.items()]
            return "\n".join(["max time across ranks (ms):"] + lines)
        lines = [
            f"    {n.ljust(NAME_WIDTH, '.')}: ({lo * 1000.0:.2f}, {hi * 1000.0:.2f})" for n, (lo, hi) in stats.items()
        ]
        return "\n".join(["(min, max) time across ranks (ms):"] + lines)

    def _all_string(self, names: Sequence[str], normalizer: float, reset: bool, barrier: bool) -> Optional[str]:
        table = self._all_ranks_elapsed(names, reset, barrier) / normalizer
        lines: List[str] = []
        for i, name in enumerate(names):
            column = table[:, i]
            if torch.isnan(column).all():
                continue
            lines.append(f"    {name}:")
            lines += [f"        rank {r:2d}: {t * 1000.0:.2f}" for r, t in enumerate(column.tolist()) if t == t]
        return "\n".join(["times across ranks (ms):"] + lines) if lines else None

    def log(
        self,
        names: Sequence[str],
        rank: Optional[int] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> Optional[str]:
        """Gather, print on ``rank`` (default: the last rank) and return the report (collective)."""
        text = self.get_string(names, normalizer=normalizer, reset=reset, barrier=barrier)
        my_rank, world = self._world()
        if text is not None and my_rank == (world - 1 if rank is None else rank):
            print(text, flush=True)
        return text

    def write(
        self,
        names: Sequence[str],
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = False,
        barrier: bool = False,
    ) -> None:
        """Add each timer's max over ranks (seconds) as scalar ``<name>-time`` (collective).

        ``writer`` needs ``add_scalar(tag, value, step)``; pass None on ranks that
        do not write (they must still call, for the gather).
        """
        stats = self._min_max(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, hi) in stats.items():
            writer.add_scalar(f"{name}-time", hi, iteration)
