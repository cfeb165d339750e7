"""Scalar sinks of the training logger: a TensorBoard writer and a W&B run behind one object.

Both are optional and opened only on the rank that logs. W&B runs offline unless asked
otherwise, and keeps every file (run, cache, config) under its save directory, so a run
on a machine without network neither hangs nor writes to the home directory. A sink whose
package is not installed is left out with a warning naming its flag (``open_or_warn``).
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any, Callable, Dict, Mapping, Optional

import torch

logger = logging.getLogger(__name__)


def open_tensorboard(log_dir: str, queue_size: int) -> Any:
    """A ``SummaryWriter`` on ``log_dir`` that buffers up to ``queue_size`` events."""
    from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

    os.makedirs(log_dir, exist_ok=True)
    return SummaryWriter(log_dir=log_dir, max_queue=queue_size)


def open_wandb(
    project: str,
    exp_name: str,
    save_dir: str,
    entity: Optional[str],
    mode: str,
    run_config: Optional[Mapping[str, Any]] = None,
) -> Any:
    """A W&B run in ``<save_dir>/wandb/`` (``offline-run-*`` in offline mode)."""
    save_dir = os.path.abspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    # W&B reads these at import and init; defaults would point at ~/.cache and ~/.config.
    for var, sub in (
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        os.environ.setdefault(var, os.path.join(save_dir, sub))
    import wandb

    settings = wandb.Settings(console="off", silent=True, save_code=False)
    return wandb.init(
        project=project,
        name=exp_name,
        entity=entity,
        dir=save_dir,
        mode=mode,
        config=dict(run_config or {}),
        settings=settings,
    )


def open_or_warn(flag: str, value: Any, package: str, opener: Callable[[], Any]) -> Any:
    """``opener()``, or None when ``package`` cannot be imported: a warning names ``flag`` and training goes on.

    This is Megatron's behaviour for TensorBoard (it warns and writes no logs); W&B gets the same,
    so a missing optional package never kills the logging rank and, with it, every rank waiting on it.
    """
    try:
        return opener()
    except ImportError as err:
        logger.warning(
            "%s=%s: the %s package cannot be imported (%s); training continues without it", flag, value, package, err
        )
        return None


def device_memory_scalars() -> Dict[str, float]:
    """Memory counters for TensorBoard: the CUDA allocator's, or the host's peak RSS on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "mem-allocated-bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "mem-max-allocated-bytes": float(stats.get("allocated_bytes.all.peak", 0)),
            "mem-allocated-count": float(stats.get("allocation.all.current", 0)),
        }
    # Linux reports ru_maxrss in KiB.
    return {"mem-max-rss-bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0}


class ScalarWriters:
    """Sends each scalar to TensorBoard and W&B (either may be None).

    TensorBoard also gets ``<tag> vs samples`` keyed by consumed samples when given;
    W&B has one step axis, so it gets the iteration-keyed value only, gathered into
    one ``log`` call per step (``commit``).
    """

    def __init__(self, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run
        self._pending: Dict[str, float] = {}
        self._pending_step: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def add_scalar(self, tag: str, value: float, step: int, samples: Optional[int] = None) -> None:
        """One scalar at ``step`` (and at ``samples`` on TensorBoard's ``vs samples`` tag)."""
        value = float(value)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, step)
            if samples is not None:
                self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb_run is not None:
            if self._pending_step is not None and step != self._pending_step:
                self.commit()
            self._pending[tag] = value
            self._pending_step = step

    def add_text(self, tag: str, text: str) -> None:
        """Text for TensorBoard (W&B gets configuration through its run config instead)."""
        if self.tensorboard is not None:
            self.tensorboard.add_text(tag, text)

    def commit(self) -> None:
        """Send the scalars gathered for W&B's current step."""
        if self.wandb_run is not None and self._pending:
            self.wandb_run.log(self._pending, step=self._pending_step)
        self._pending = {}
        self._pending_step = None

    def flush(self) -> None:
        self.commit()
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        """Flush and close both; W&B's ``finish`` also stops its background service."""
        self.flush()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
            import wandb

            wandb.teardown()  # no service process may outlive the run (tests, short jobs)
