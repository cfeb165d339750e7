"""Learning-rate and weight-decay schedule applied to an optimizer's param groups.

The scheduler counts abstract *steps*; it does not know whether a step is an
iteration or a sample. Megatron's training loop counts in samples: it builds the
scheduler with warmup/decay lengths in samples (``iters x global batch size``
for iteration-based runs) and calls ``step(increment=global_batch_size)`` after
every iteration, so a batch-size ramp-up advances the schedule by what was
actually consumed.

Per param group, ``max_lr`` / ``min_lr`` override the scheduler's values and
``lr_mult`` / ``wd_mult`` scale the result (e.g. no weight decay on biases).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _cosine_down(ratio: float) -> float:
    """1 at ratio 0, 0 at ratio 1, following half a cosine period."""
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


def wsd_anneal_coefficient(style: str, ratio: float) -> float:
    """Fraction of (max_lr - min_lr) left after ``ratio`` of the WSD anneal phase."""
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return _cosine_down(ratio)
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"lr_wsd_decay_style={style!r}: must be one of {WSD_DECAY_STYLES}")


def get_canonical_lr_for_logging(param_groups: List[Dict[str, Any]]) -> Optional[float]:
    """The ``lr`` of the first param group marked ``default_config`` (on the base schedule); None if none is.

    Groups with a decoupled LR or an LR multiplier are not on the base schedule, so they are skipped.
    """
    return next((group.get("lr") for group in param_groups if group.get("default_config", False)), None)


class OptimizerParamScheduler:
    """Warmup then decay of the learning rate; optional weight-decay increase."""

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, max_lr, min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.override_opt_param_scheduler = bool(override_opt_param_scheduler)
        self.use_checkpoint_opt_param_scheduler = bool(use_checkpoint_opt_param_scheduler)
        self._check()
        self.num_steps = 0
        self.step(0)

    def _check(self) -> None:
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"min_lr={self.min_lr}, max_lr={self.max_lr}: need 0 <= min_lr <= max_lr")
        if self.init_lr > self.max_lr:
            raise ValueError(f"OptimizerParamScheduler.init_lr={self.init_lr} must not exceed max_lr={self.max_lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r}: must be one of {LR_DECAY_STYLES}")
        if self.lr_decay_steps <= 0 or not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(
                f"lr_warmup_steps={self.lr_warmup_steps}, lr_decay_steps={self.lr_decay_steps}: "
                "need 0 <= warmup < decay and decay > 0"
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or self.lr_wsd_decay_style is None:
                raise ValueError(
                    "lr_decay_style='WSD' needs OptimizerParamScheduler.wsd_decay_steps and "
                    "OptimizerParamScheduler.lr_wsd_decay_style"
                )
            wsd_anneal_coefficient(self.lr_wsd_decay_style, 0.0)  # validates the style name
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"start_wd={self.start_wd}, end_wd={self.end_wd}: need 0 <= start <= end")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"wd_incr_style={self.wd_incr_style!r}: must be one of {WD_INCR_STYLES}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"wd_incr_style='constant' needs start_wd == end_wd, got {self.start_wd}, {self.end_wd}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True are mutually exclusive"
            )

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: Dict[str, Any]) -> float:
        """Learning rate of ``param_group`` at the current step (before ``lr_mult``)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warmup, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # lr ~ 1/sqrt(step), continuous with the end of warmup.
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        return min_lr + self._decay_coefficient(n) * (max_lr - min_lr)

    def _decay_coefficient(self, n: int) -> float:
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_decay_style == "cosine":
            return _cosine_down(ratio)
        # WSD: stable at max_lr, then anneal over the last wsd_decay_steps.
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        return wsd_anneal_coefficient(self.lr_wsd_decay_style, (n - anneal_start) / self.wsd_decay_steps)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps and write lr / weight_decay into every param group."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _pick(self, current: Any, saved: Any, name: str) -> Any:
        """Our value with --override-opt-param-scheduler, else the checkpoint's (which must match
        ours unless --use-checkpoint-opt-param-scheduler)."""
        if self.override_opt_param_scheduler:
            logger.info("using %s=%s from the arguments (checkpoint had %s)", name, current, saved)
            return current
        if not self.use_checkpoint_opt_param_scheduler and current != saved:
            raise ValueError(
                f"OptimizerParamScheduler: {name}={current} from the arguments but {saved} in the "
                "checkpoint; set use_checkpoint_opt_param_scheduler=True or "
                "override_opt_param_scheduler=True"
            )
        return saved

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the schedule; accepts Megatron's older key names."""

        def saved(*keys: str) -> Any:
            return next(state_dict[k] for k in keys if k in state_dict)

        self.max_lr = self._pick(self.max_lr, saved("max_lr", "start_lr"), "max_lr")
        self.min_lr = self._pick(self.min_lr, saved("min_lr"), "min_lr")
        self.lr_warmup_steps = self._pick(
            self.lr_warmup_steps, saved("lr_warmup_steps", "warmup_steps", "warmup_iter"), "lr_warmup_steps"
        )
        self.lr_decay_steps = self._pick(
            self.lr_decay_steps, saved("lr_decay_steps", "decay_steps", "end_iter"), "lr_decay_steps"
        )
        self.lr_decay_style = self._pick(self.lr_decay_style, saved("lr_decay_style", "decay_style"), "lr_decay_style")
        if "start_wd" in state_dict:
            for name in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
                setattr(self, name, self._pick(getattr(self, name), state_dict[name], name))
        self.num_steps = 0
        self.step(saved("num_steps", "num_iters"))
