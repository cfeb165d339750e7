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

nvfp4's per-tensor amax is reduced (MAX) over ``amax_group`` (the linear's TP group), so an
operand split over TP ranks, or a sequence-parallel input quantized piece by piece, has the one
global scale of the whole tensor and TP=2 quantizes as one rank does. Transformer Engine sets
this amax reduction only on the tensors it all-gathers under sequence parallelism (a
column-parallel input, a row-parallel output gradient) and keeps a weight shard's own amax; here
every nvfp4 operand is reduced: one fp32 all-reduce per quantization, a no-op on replicated ones. Its stochastic
rounding draws from a generator seeded per call by ``(seed, TP rank, calls so far)``; the call
count is the buffer ``sr_calls``, so checkpoints carry it (a plain int64 tensor) and a resumed run
draws what the straight run would have drawn. The Hadamard signs are fixed by ``seed``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.quantization.blockwise import quantize_blockwise
from megatron.core.quantization.hadamard import random_signs
from megatron.core.quantization.mxfp8 import MX_BLOCK, quantize_mxfp8
from megatron.core.quantization.nvfp4 import NVFP4_BLOCK, NVFP4_LINEAR_RECIPE, quantize_nvfp4_operand
from megatron.core.quantization.tensor import QuantizedTensor

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK_RECIPES = ("blockwise", "mxfp8", "nvfp4")
BLOCKWISE_1D = 128
# Block length along the inner dim of activation and gradient operands (1xN blocks).
ROW_BLOCK = {"blockwise": BLOCKWISE_1D, "mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK}
_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finalizer: a well-spread 64-bit hash of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sr_seed(seed: int, rank: int, call: int) -> int:
    """The generator seed of stochastic-rounding call ``call`` on TP rank ``rank`` (< 2**63)."""
    return _mix64(_mix64(_mix64(seed) ^ rank) ^ call) >> 1


class BlockOperandQuantizer(torch.nn.Module):
    """``(x, role, gemm, fmt) -> QuantizedTensor`` for one block recipe (nvfp4: SR state, signs, amax group)."""

    def __init__(self, recipe: str, amax_group: Optional[dist.ProcessGroup] = None, seed: int = 0) -> None:
        super().__init__()
        if recipe not in BLOCK_RECIPES:
            raise ValueError(f"block recipe {recipe!r}: must be one of {BLOCK_RECIPES}")
        self.recipe, self.amax_group, self.seed = recipe, amax_group, seed
        # nvfp4: [16] ±1, shared by the wgrad operands; a buffer so it moves with the model (no copy per
        # call), not persistent: ``seed`` fixes it
        signs = random_signs(torch.Generator().manual_seed(seed + 1)) if recipe == "nvfp4" else None
        self.register_buffer("signs", signs, persistent=False)
        if recipe == "nvfp4":
            self.register_buffer("sr_calls", torch.zeros(1, dtype=torch.int64))  # stochastic roundings so far
            self._calls, self._calls_version = 0, self.sr_calls._version
        self._quantize: Callable[..., QuantizedTensor] = getattr(self, f"_{recipe}")

    def forward(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        return self._quantize(x, role, gemm, fmt)

    def _blockwise(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        block = (BLOCKWISE_1D, BLOCKWISE_1D) if role == "weight" else (1, BLOCKWISE_1D)
        return quantize_blockwise(x, FP8_DTYPES[fmt], block)

    def _mxfp8(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        return quantize_mxfp8(x, FP8_DTYPES[fmt])

    def _nvfp4(self, x: torch.Tensor, role: str, gemm: str, fmt: str) -> QuantizedTensor:
        recipe = NVFP4_LINEAR_RECIPE.get((gemm, role))
        generator = self._next_generator(x.device) if recipe is not None and recipe.stochastic_rounding else None
        signs = self.signs if gemm == "wgrad" else None
        return quantize_nvfp4_operand(x.float(), gemm, role, generator, signs, amax_group=self.amax_group)

    def _next_generator(self, device: torch.device) -> torch.Generator:
        """A generator for the next stochastic rounding; counts the call in ``sr_calls`` (no host read).

        The count is mirrored in Python; a load into the buffer (either checkpoint format writes it
        in place, bumping its version) is read back once.
        """
        if self._calls_version != self.sr_calls._version:
            self._calls = int(self.sr_calls.item())
        rank = dist.get_rank(self.amax_group) if self.amax_group is not None else 0
        generator = torch.Generator(device=device).manual_seed(sr_seed(self.seed, rank, self._calls))
        self._calls += 1
        self.sr_calls.fill_(self._calls)
        self._calls_version = self.sr_calls._version
        return generator
