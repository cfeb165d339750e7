"""OptimizerConfig: which optimizer, its hyper-parameters, precision and loss scaling.

Field names follow Megatron Core's ``OptimizerConfig`` so that the application maps
``--lr``, ``--weight-decay``, ``--adam-beta1``, ``--loss-scale`` ... one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.model_parallel_config import require_one_precision

OPTIMIZERS = ("adam", "sgd")


def _require_range(name: str, value: float, low: float, high: float, high_open: bool = False) -> None:
    bad = value < low or (value >= high if high_open else value > high)
    if bad:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r}: must be in [{low}, {high}{bracket}")


@dataclass
class OptimizerConfig:
    """Optimizer settings (Megatron field names).

    ``lr`` / ``min_lr`` are the scheduler's maximum and floor; the scheduler writes the
    current value into each param group. ``decoupled_lr`` / ``decoupled_min_lr`` replace
    them for the embedding and output-layer weights. ``loss_scale`` fixes the fp16 loss
    scale; when it is None and ``fp16`` is set, the scale is dynamic (``initial_loss_scale``,
    ``min_loss_scale``, ``loss_scale_window``, ``hysteresis``). ``clip_grad`` <= 0 disables
    clipping (the norm is still computed and returned).
    """

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01

    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False

    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    timers: Optional[object] = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: must be one of {OPTIMIZERS}")
        require_one_precision(self.fp16, self.bf16)
        for name in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value!r}: must be >= 0")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} must not exceed lr={self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r}: must be >= 0")
        _require_range("adam_beta1", self.adam_beta1, 0.0, 1.0, high_open=True)
        _require_range("adam_beta2", self.adam_beta2, 0.0, 1.0, high_open=True)
        _require_range("sgd_momentum", self.sgd_momentum, 0.0, 1.0)
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps={self.adam_eps!r}: must be > 0")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale={self.loss_scale!r}: must be > 0 (or None for a dynamic scale)")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(
                f"initial_loss_scale={self.initial_loss_scale}, min_loss_scale={self.min_loss_scale}: must be > 0"
            )
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"min_loss_scale={self.min_loss_scale} must not exceed initial_loss_scale={self.initial_loss_scale}"
            )
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"loss_scale_window={self.loss_scale_window}, hysteresis={self.hysteresis}: must be >= 1")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True requires use_distributed_optimizer=True")
        if self.fp16 and self.params_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"fp16=True with params_dtype={self.params_dtype}: expected torch.float16")
        if self.bf16 and self.params_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"bf16=True with params_dtype={self.params_dtype}: expected torch.bfloat16")
