"""Per-tensor FP8 quantization with Transformer Engine's scaling rules (current and delayed).

``real = data * scale_inv`` with ``data = saturate(real * scale)`` cast to e4m3 / e5m2 with
round-to-nearest-even. How ``scale`` is chosen:

* current scaling (``tensorwise``, TE's ``Float8CurrentScaling``): from this tensor's own amax,
  ``scale = fp8_max / amax``; amax 0 or inf gives 1, an infinite quotient the largest fp32
  (TE's ``compute_scale_from_amax`` with epsilon 0, no power-of-two rounding);
* delayed scaling (TE's ``DelayedScaling``): the scale computed after the previous steps. Each
  quantization writes its amax into ``amax_history[0]``; then (``update_delayed_scaling``)
  ``amax = max(history)`` (``max``) or ``history[0]`` (``most_recent``), the history is rolled
  one slot (``history[0]`` becomes the oldest entry, zeroed) and
  ``scale = fp8_max / amax / 2**margin``, the old scale kept where amax is 0 or not finite.

The amax is reduced (MAX) over a process group before use, so every rank holding a piece of
the same logical tensor uses one scale, as TE's amax reduction does.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.quantization.tensor import QuantizedTensor
from megatron.core.utils import apply_keeping_fp32

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
_FP32_MAX = torch.finfo(torch.float32).max


def fp8_max(fmt: str) -> float:
    """Largest finite value of ``fmt`` (``e4m3``: 448, ``e5m2``: 57344)."""
    if fmt not in FP8_MAX:
        raise ValueError(f"FP8 format {fmt!r}: must be one of {sorted(FP8_MAX)}")
    return FP8_MAX[fmt]


def tensor_amax(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``max |x|`` as a 1-element fp32 tensor (0 for an empty ``x``), reduced (MAX) over ``group``."""
    if x.numel() == 0:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        amax = x.detach().abs().amax().float().reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def current_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """TE's current-scaling rule: ``fp8_max / amax`` (1 for amax 0 or inf, fp32 max for an inf quotient)."""
    scale = torch.full_like(amax, fp8_max(fmt)) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(scale)
    return torch.where(bad, torch.ones_like(scale), scale)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``x [rows, cols]`` times ``scale``, saturated to +-fp8_max and rounded to nearest even."""
    limit = fp8_max(fmt)
    scaled = (x.float() * scale).clamp_(-limit, limit)  # [rows, cols] fp32, NaN stays NaN
    data = scaled.to(FP8_DTYPES[fmt])
    scale_inv = scale.reciprocal().reshape(1, 1)
    return QuantizedTensor(data, scale_inv, (max(x.size(0), 1), max(x.size(1), 1)))


def quantize_current(x: torch.Tensor, fmt: str, group: Optional[dist.ProcessGroup] = None) -> QuantizedTensor:
    """Tensorwise (current) scaling of a 2-D ``x``, the amax reduced over ``group``."""
    return cast_to_fp8(x, current_scale(tensor_amax(x, group), fmt), fmt)


class DelayedScalingState(torch.nn.Module):
    """One tensor's delayed-scaling state: ``amax_history [len]`` and ``scale [1]`` (persistent buffers).

    Buffers, so they travel with the module's ``state_dict`` into every checkpoint format.
    Activation recomputation, as in TE: a checkpointed forward (``phase="checkpointed"``) keeps the
    scale it used; its recompute (``phase="recompute"``) quantizes with that scale and records nothing.
    """

    def __init__(self, fmt: str, history_len: int, algo: str, margin: int) -> None:
        super().__init__()
        if history_len < 1:
            raise ValueError(f"fp8_amax_history_len={history_len}: must be >= 1")
        if algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={algo!r}: must be one of {AMAX_COMPUTE_ALGOS}")
        self.fmt, self.algo, self.margin = fmt, algo, margin
        fp8_max(fmt)
        self.register_buffer("amax_history", torch.zeros(history_len, dtype=torch.float32))
        self.register_buffer("scale", torch.ones(1, dtype=torch.float32))
        self._checkpointed_scales: deque = deque()

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the model; dtype casts (``Float16Module``'s ``.to(bf16)``) do not: the state stays fp32."""
        return apply_keeping_fp32(self, fn, recurse, ("amax_history", "scale"))

    def quantize(
        self, x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, phase: Optional[str] = None
    ) -> QuantizedTensor:
        """Quantize ``x`` with the current scale, record its (reduced) amax, update the scale."""
        if self.amax_history.device != x.device:
            self.to(x.device)
        if phase == "recompute":
            return cast_to_fp8(x, self._checkpointed_scales.popleft(), self.fmt)
        scale = self.scale.clone()
        if phase == "checkpointed":
            self._checkpointed_scales.append(scale)
        out = cast_to_fp8(x, scale, self.fmt)
        self.amax_history[0] = tensor_amax(x, group)[0]
        update_delayed_scaling(self.amax_history, self.scale, self.fmt, self.algo, self.margin)
        return out


@torch.no_grad()
def update_delayed_scaling(history: torch.Tensor, scale: torch.Tensor, fmt: str, algo: str, margin: int) -> None:
    """TE's delayed-scaling update, in place: amax from the history, roll it, new scale from the amax."""
    amax = history.max() if algo == "max" else history[0].clone()
    if history.numel() > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()  # a fill on the device; `= 0.0` copies a CPU scalar to it
    new = torch.full_like(scale, fp8_max(fmt)) / amax / (2.0**margin)
    keep = (amax <= 0) | ~torch.isfinite(amax)
    scale.copy_(torch.where(keep, scale, new))
