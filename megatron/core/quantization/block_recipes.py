"""Block-scaled recipes (``blockwise``, ``mxfp8``, ``nvfp4``) as one operand quantizer per recipe.

Each takes a GEMM operand ``x [rows, k]`` laid out with the GEMM's inner dimension last, its role
(``input`` / ``weight`` / ``grad_output``), the GEMM (``fprop`` / ``dgrad`` / ``wgrad``) and the
element format, and returns a ``QuantizedTensor`` with its blocks along ``k``, as Transformer
Engine's row-/column-wise copies are for that GEMM:

* ``blockwise`` (TE ``Float8BlockScaling``): 128x128 tiles for weights (the same tiles in either
  orientation), 1x128 for activations and gradients, power-of-two fp32 scales;
* ``mxfp8`` (TE ``MXFP8BlockScaling``): 1x32 blocks with e8m0 scales for every operand;
* ``nvfp4`` (TE ``NVFP4BlockScaling``): ``nvfp4.NVFP4_LINEAR_RECIPE`` per (gemm, operand): 16x16
  weight tiles, stochastic rounding of gradients, the random Hadamard transform on both wgrad
  operands (with one sign vector, so it cancels in the product).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core.quantization.blockwise import quantize_blockwise
from megatron.core.quantization.mxfp8 import quantize_mxfp8
from megatron.core.quantization.nvfp4 import quantize_nvfp4_operand
from megatron.core.quantization.tensor import QuantizedTensor

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK_RECIPES = ("blockwise", "mxfp8", "nvfp4")


class BlockOperandQuantizer:
    """``(x, role, gemm, fmt) -> QuantizedTensor`` for one block recipe (nvfp4 keeps its RNG and signs)."""

    def __init__(self, recipe: str, seed: int = 0) -> None:
        if recipe not in BLOCK_RECIPES:
            raise ValueError(f"block recipe {recipe!r}: must be one of {BLOCK_RECIPES}")
        self.recipe = recipe
        self.generator: Optional[torch.Generator] = None
        self.signs: Optional[torch.Tensor] = None
        if recipe == "nvfp4":
            from megatron.core.quantization.hadamard import random_signs

            self.generator = torch.Generator().manual_seed(seed)  # stochastic rounding of gradients
            self.signs = random_signs(torch.Generator().manual_seed(seed + 1))  # [16], shared by wgrad operands
        self._quantize: Callable[..., QuantizedTensor] = getattr(self, f"_{recipe}")

    def __call__(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        return self._quantize(x, role, gemm, fmt)

    def _blockwise(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        block = (128, 128) if role == "weight" else (1, 128)
        return quantize_blockwise(x, FP8_DTYPES[fmt], block)

    def _mxfp8(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        return quantize_mxfp8(x, FP8_DTYPES[fmt])

    def _nvfp4(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        if self.generator.device != x.device:
            self.generator = torch.Generator(device=x.device).manual_seed(self.generator.initial_seed())
        signs = self.signs.to(x.device) if gemm == "wgrad" else None
        return quantize_nvfp4_operand(x.float(), gemm, role, self.generator, signs)
