"""OptimizerConfig: which optimizer, its hyper-parameters, precision and loss scaling.

Field names follow Megatron Core's ``OptimizerConfig`` so that the application maps
``--lr``, ``--weight-decay``, ``--adam-beta1``, ``--loss-scale`` ... one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core import compatibility
from megatron.core.model_parallel_config import require_one_precision
from megatron.core.optimizer.muon import MATMUL_PRECISIONS, QUINTIC_COEFFICIENTS, SCALE_MODES, TP_MODES

OPTIMIZERS = ("adam", "sgd", "muon")


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

    Every field of megatron-core 0.16 exists with its default, in its order. Those of features not
    built here (the precision-aware optimizer's non-fp32 dtypes, Adam without
    decoupled weight decay, weight decay on QK layernorms, overlapping the gather with the step,
    the config logger) raise ``ValueError`` when set off their default (``_refuse_unbuilt``).
    ``optimizer_cpu_offload`` steps through ``HybridDeviceOptimizer`` (``_check_cpu_offload``: adam or
    sgd, ``optimizer_offload_fraction`` in [0, 1]); ``use_torch_optimizer_for_cpu_offload``,
    ``overlap_cpu_optimizer_d2h_h2d`` and the pinning switches change nothing here (both sides are
    torch optimizers; copies are synchronous). ``use_precision_aware_optimizer`` (adam and the
    distributed optimizer, as upstream asserts) with the default fp32 ``main_*`` / ``exp_avg*`` dtypes
    computes what our distributed optimizer computes already (fp32 main parameters and moments);
    the ``muon_*`` fields matter once ``optimizer="muon"``
    (``_check_muon``: ``muon_tp_mode`` blockwise, duplicated or distributed); ``fp8_recipe``,
    ``store_param_remainders`` and ``barrier_with_L1_time`` (a timing barrier) have no effect.
    """

    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False

    fp8_recipe: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"

    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0

    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True

    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[object] = None
    config_logger_dir: str = ""

    def _refuse_unbuilt(self) -> None:
        """``ValueError`` naming every field of an unbuilt feature that is off its default."""
        defaults = {
            "apply_wd_to_qk_layernorm": False,
            "reuse_grad_buf_for_mxfp8_param_ag": False,
            "main_grads_dtype": torch.float32,
            "main_params_dtype": torch.float32,
            "exp_avg_dtype": torch.float32,
            "exp_avg_sq_dtype": torch.float32,
            "decoupled_weight_decay": True,
            "overlap_param_gather_with_optimizer_step": False,
            "config_logger_dir": "",
        }
        off = [f"{name}={getattr(self, name)!r}" for name, value in defaults.items() if getattr(self, name) != value]
        if off:
            raise ValueError(f"{', '.join(off)}: not supported yet (only the default)")

    def _check_cpu_offload(self) -> None:
        """``optimizer_cpu_offload`` and ``use_precision_aware_optimizer``: what they combine with."""
        if self.optimizer_cpu_offload:
            _require_range("optimizer_offload_fraction", self.optimizer_offload_fraction, 0.0, 1.0)
            if self.optimizer not in ("adam", "sgd"):
                raise ValueError(
                    f"optimizer_cpu_offload=True with optimizer={self.optimizer!r}: only adam and sgd "
                    "are offloaded (HybridDeviceOptimizer)"
                )
        if self.use_precision_aware_optimizer and (self.optimizer != "adam" or not self.use_distributed_optimizer):
            raise ValueError(
                f"use_precision_aware_optimizer=True with optimizer={self.optimizer!r}, use_distributed_optimizer="
                f"{self.use_distributed_optimizer}: needs optimizer='adam' and use_distributed_optimizer=True"
            )

    def _check_muon(self) -> None:
        """The ``muon_*`` fields and what Muon does not combine with yet (``optimizer="muon"`` only)."""
        _require_range("muon_momentum", self.muon_momentum, 0.0, 1.0, high_open=True)
        choices = {"muon_scale_mode": SCALE_MODES, "muon_fp32_matmul_prec": MATMUL_PRECISIONS, "muon_tp_mode": TP_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be one of {allowed} with optimizer='muon'")
        steps = len(QUINTIC_COEFFICIENTS)
        if self.muon_num_ns_steps < 1 or self.muon_num_ns_steps % steps:
            raise ValueError(f"muon_num_ns_steps={self.muon_num_ns_steps}: must be a positive multiple of {steps}")

    def __post_init__(self) -> None:
        self._refuse_unbuilt()
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
        if self.optimizer == "muon":
            self._check_muon()
        self._check_cpu_offload()
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
        compatibility.check(self)
        if self.fp16 and self.params_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"fp16=True with params_dtype={self.params_dtype}: expected torch.float16")
        if self.bf16 and self.params_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"bf16=True with params_dtype={self.params_dtype}: expected torch.bfloat16")


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """``OptimizerConfig`` for Adam (Megatron-core's subclass): ``optimizer="adam"`` and the Adam fields."""

    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """``OptimizerConfig`` for SGD (Megatron-core's subclass): ``optimizer="sgd"`` and ``sgd_momentum``."""

    optimizer: str = "sgd"
