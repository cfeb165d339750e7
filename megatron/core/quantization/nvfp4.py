"""NVFP4: e2m1 values, an e4m3 scale per 16 elements (or 16x16 tile) and a per-tensor fp32 scale.

Two-level scaling as in Transformer Engine's ``NVFP4BlockScaling``:

* global encode scale ``s_enc = (448 * 6) / global_amax`` (fp32; ``FLT_MAX`` if it overflows, ``1``
  when ``global_amax`` is 0, inf or NaN); ``global_scale_inv = 1 / s_enc``;
* block decode scale ``s_b = e4m3((block_amax / 6) * s_enc)`` (round to nearest even, saturating);
  TE's current kernel multiplies by ``s_enc * fp32(1/6)`` instead, which can differ by an fp32 ulp
  before the e4m3 rounding; we follow the formula of TE's documentation;
* each value is encoded as ``e2m1(x * min(1 / (s_b * global_scale_inv), FLT_MAX))``, rounded to
  nearest even or stochastically;
* ``real = data * s_b * global_scale_inv``: ``scale_inv`` holds ``s_b`` exactly (fp32), ``scale_raw``
  its e4m3 bytes, ``global_scale_inv`` the per-tensor factor.

A block whose ``s_b`` underflows to 0 dequantizes to 0. NaN/inf inputs give NaN values.
``NVFP4_LINEAR_RECIPE`` says which operand of a linear layer's three GEMMs gets which treatment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.quantization.formats import FP32_MAX, block_amax, check_operand, expand_blocks, saturate
from megatron.core.quantization.fp4 import E2M1_MAX, round_e2m1
from megatron.core.quantization.fp8 import tensor_amax
from megatron.core.quantization.hadamard import random_hadamard_transform
from megatron.core.quantization.tensor import QuantizedTensor

NVFP4_BLOCK = 16
E4M3_MAX = 448.0
NVFP4_BLOCKS = ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK))


@dataclass(frozen=True)
class NVFP4OperandRecipe:
    """How one GEMM operand is quantized: scale ``block``, stochastic rounding, random Hadamard transform."""

    block: Tuple[int, int]
    stochastic_rounding: bool
    hadamard: bool


# NVIDIA's NVFP4 training recipe (TE ``NVFP4BlockScaling`` defaults, "Pretraining LLMs with NVFP4"):
# weights use 16x16 tiles so the row- and column-wise copies agree; gradients are stochastically
# rounded; the RHT is applied to both weight-gradient operands only. Keys: (gemm, operand).
NVFP4_LINEAR_RECIPE: Dict[Tuple[str, str], NVFP4OperandRecipe] = {
    ("fprop", "input"): NVFP4OperandRecipe((1, NVFP4_BLOCK), stochastic_rounding=False, hadamard=False),
    ("fprop", "weight"): NVFP4OperandRecipe((NVFP4_BLOCK, NVFP4_BLOCK), stochastic_rounding=False, hadamard=False),
    ("dgrad", "grad_output"): NVFP4OperandRecipe((1, NVFP4_BLOCK), stochastic_rounding=True, hadamard=False),
    ("dgrad", "weight"): NVFP4OperandRecipe((NVFP4_BLOCK, NVFP4_BLOCK), stochastic_rounding=False, hadamard=False),
    ("wgrad", "grad_output"): NVFP4OperandRecipe((1, NVFP4_BLOCK), stochastic_rounding=True, hadamard=True),
    ("wgrad", "input"): NVFP4OperandRecipe((1, NVFP4_BLOCK), stochastic_rounding=False, hadamard=True),
}


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``s_enc = 448 * 6 / global_amax`` as an fp32 scalar (``FLT_MAX`` on overflow, 1 if degenerate)."""
    amax = global_amax.float().reshape(())
    scale = amax.new_full((), E4M3_MAX * E2M1_MAX) / amax  # a true division (not 1/amax * c), on amax's device
    scale = scale.clamp(max=FP32_MAX)
    degenerate = (amax == 0) | ~torch.isfinite(amax) | (scale == 0)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def block_decode_scale(amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales ``[nbr, nbc]`` (``torch.float8_e4m3fn``) from block amaxes and ``s_enc``."""
    scaled = (amax / E2M1_MAX) * s_enc  # fp32, NaN for a block holding NaN
    return saturate(scaled.clamp(max=FP32_MAX), E4M3_MAX, torch.isfinite(amax)).to(torch.float8_e4m3fn)


def quantize_nvfp4(
    x: torch.Tensor,
    block: Tuple[int, int] = (1, NVFP4_BLOCK),
    stochastic_rounding: bool = False,
    generator: Optional[torch.Generator] = None,
    global_amax: Optional[torch.Tensor] = None,
) -> QuantizedTensor:
    """Quantize ``x [rows, cols]`` to NVFP4 with ``block`` 1x16 or 16x16 scales.

    ``global_amax`` defaults to ``max|x|``; pass the amax reduced over a TP/SP group so every rank
    uses the same global scale. ``generator`` drives stochastic rounding (seed it to reproduce).
    """
    if tuple(block) not in NVFP4_BLOCKS:
        raise ValueError(f"block={block} must be one of {NVFP4_BLOCKS}")
    check_operand(x, block)
    x32 = x.float()
    if global_amax is None:
        global_amax = x32.abs().max()
    s_enc = global_encode_scale(global_amax)  # []
    s_dec = 1.0 / s_enc  # []
    s_b = block_decode_scale(block_amax(x32, block), s_enc)  # [nbr, nbc] e4m3
    encode = (1.0 / (s_b.float() * s_dec)).clamp(max=FP32_MAX)  # [nbr, nbc]; s_b == 0 -> FLT_MAX
    scaled = x32 * expand_blocks(encode, block, tuple(x.shape))  # [rows, cols]
    scaled = scaled.clamp(-FP32_MAX, FP32_MAX)  # finite x * FLT_MAX saturates to ±6, as TE's satfinite
    values = round_e2m1(scaled, stochastic_rounding, generator)  # [rows, cols] float32
    values = torch.where(torch.isfinite(x32), values, torch.full_like(values, float("nan")))
    return QuantizedTensor(
        data=values,
        scale_inv=s_b.float(),
        block=tuple(block),
        scale_raw=s_b,
        global_scale_inv=s_dec,
        element_format="e2m1",
    )


def quantize_nvfp4_operand(
    x: torch.Tensor,
    gemm: str,
    operand: str,
    generator: Optional[torch.Generator] = None,
    hadamard_signs: Optional[torch.Tensor] = None,
    global_amax: Optional[torch.Tensor] = None,
    amax_group: Optional[dist.ProcessGroup] = None,
) -> QuantizedTensor:
    """Quantize GEMM operand ``x [rows, k]`` (reduction dim last) as ``NVFP4_LINEAR_RECIPE`` says.

    ``gemm`` is fprop / dgrad / wgrad, ``operand`` input / weight / grad_output. Where the recipe
    applies the RHT, ``hadamard_signs`` (the ±1 vector shared by both wgrad operands) is required and
    ``global_amax``, if given, must be that of the transformed tensor; otherwise it is the
    (transformed) ``x``'s amax reduced (MAX) over ``amax_group``: give the group of ranks holding
    pieces of one tensor so that they share its global scale.
    """
    recipe = NVFP4_LINEAR_RECIPE.get((gemm, operand))
    if recipe is None:
        raise ValueError(f"(gemm, operand)=({gemm!r}, {operand!r}) is not in the recipe: {sorted(NVFP4_LINEAR_RECIPE)}")
    if recipe.hadamard:
        if hadamard_signs is None:
            raise ValueError(f"the {gemm} {operand} operand gets the random Hadamard transform: pass hadamard_signs")
        x = random_hadamard_transform(x, hadamard_signs)  # [rows, k]
    if global_amax is None and amax_group is not None:
        global_amax = tensor_amax(x, amax_group)  # [1]
    return quantize_nvfp4(x, recipe.block, recipe.stochastic_rounding, generator, global_amax)
