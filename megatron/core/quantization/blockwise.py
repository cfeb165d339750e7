"""FP8 blockwise scaling (Transformer Engine's ``Float8BlockScaling``, DeepSeek-V3 style).

One fp32 scale per ``1x128`` block (TE's default for activations and gradients) or ``128x128``
tile (weights). Following TE's recipe:

* ``scale = fp8_max / max(amax, epsilon)`` in fp32 (round to nearest), ``epsilon = 0`` by default;
* a block whose amax is 0, inf or NaN gets ``scale = 1``; a scale that overflows fp32 becomes
  ``FLT_MAX``;
* power-of-two scales by default: the scale's mantissa bits are cleared, i.e. it is rounded *down*
  to a power of two, so the block's amax still fits without saturation (TE's default; its
  ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` is our ``power_of_two_scales=False``);
* ``scale_inv = 1 / scale`` (fp32), ``data = fp8(saturate(x * scale))`` rounded to nearest even.

E4M3 is TE's default for every tensor of this recipe (gradients included).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron.core.quantization.formats import (
    FP32_MAX,
    block_amax,
    cast_fp8,
    check_operand,
    expand_blocks,
    fp8_max,
)
from megatron.core.quantization.tensor import QuantizedTensor

_EXPONENT_AND_SIGN_MASK = -(1 << 23)  # 0xFF800000 as int32: keeps sign and exponent bits


def round_down_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """Clear the mantissa bits of positive normal fp32 values: ``2^floor(log2(x))``."""
    return (x.float().contiguous().view(torch.int32) & _EXPONENT_AND_SIGN_MASK).view(torch.float32)


def scale_from_amax(
    amax: torch.Tensor, max_value: float, power_of_two: bool = True, epsilon: float = 0.0
) -> torch.Tensor:
    """Quantization scale per block (``x * scale`` fits ``max_value``) from ``amax``, same shape, fp32."""
    amax = amax.float().clamp_min(epsilon)  # NaN stays NaN
    scale = torch.full_like(amax, max_value) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    if power_of_two:
        scale = round_down_to_power_of_two(scale)
    degenerate = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def quantize_blockwise(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: Tuple[int, int] = (1, 128),
    power_of_two_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> QuantizedTensor:
    """Quantize ``x [rows, cols]`` to FP8 with one scale per ``block`` (ragged edge blocks allowed)."""
    check_operand(x, block)
    x32 = x.float()
    amax = block_amax(x32, block)  # [nbr, nbc]
    scale = scale_from_amax(amax, fp8_max(dtype), power_of_two_scales, amax_epsilon)  # [nbr, nbc]
    data = cast_fp8(x32, expand_blocks(scale, block, tuple(x.shape)), dtype)  # [rows, cols]
    return QuantizedTensor(data=data, scale_inv=1.0 / scale, block=tuple(block))
