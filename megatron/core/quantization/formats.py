"""Helpers shared by the block-scaled quantizers: block amax, scale broadcast, saturating FP8 cast.

A block ``(br, bc)`` covers ``br`` rows and ``bc`` columns of a ``[rows, cols]`` operand; edge blocks
are ragged (the tensor is zero-padded to whole blocks, which leaves every amax unchanged).
"""

from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP32_MAX = torch.finfo(torch.float32).max


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype={dtype} is not an FP8 format; expected one of {FP8_DTYPES}")
    return float(torch.finfo(dtype).max)


def check_operand(x: torch.Tensor, block: Tuple[int, int]) -> None:
    """Raise unless ``x`` is a 2-D floating tensor and ``block`` two positive ints."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"expected a 2-D floating tensor [rows, cols], got shape {tuple(x.shape)} {x.dtype}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block={block} must be two positive sizes (rows, cols)")


def num_blocks(shape: Tuple[int, int], block: Tuple[int, int]) -> Tuple[int, int]:
    """``(ceil(rows / br), ceil(cols / bc))``."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def block_view(x: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """``x [rows, cols]`` zero-padded to whole blocks, viewed as ``[nbr, br, nbc, bc]``."""
    nbr, nbc = num_blocks(tuple(x.shape), block)
    pad_rows, pad_cols = nbr * block[0] - x.shape[0], nbc * block[1] - x.shape[1]
    padded = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))  # [nbr*br, nbc*bc]
    return padded.view(nbr, block[0], nbc, block[1])


def block_amax(x: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """Largest magnitude per block, ``[nbr, nbc]`` fp32 (NaN if the block holds a NaN)."""
    return block_view(x.float().abs(), block).amax(dim=(1, 3))  # [nbr, nbc]


def expand_blocks(per_block: torch.Tensor, block: Tuple[int, int], shape: Tuple[int, int]) -> torch.Tensor:
    """Broadcast ``per_block [nbr, nbc]`` to every element: ``[rows, cols]``."""
    out = per_block.repeat_interleave(block[0], dim=0)[: shape[0]]  # [rows, nbc]
    return out.repeat_interleave(block[1], dim=1)[:, : shape[1]]  # [rows, cols]


def saturate(scaled: torch.Tensor, max_abs: float, finite: torch.Tensor) -> torch.Tensor:
    """Clamp ``scaled`` to ``[-max_abs, max_abs]``; NaN where the *input* was not finite.

    Overflow from rounding saturates (the recipes' ``satfinite`` cast); a NaN or inf input becomes
    NaN, so an overflow upstream stays visible to the loss scaler instead of turning into ``max``.
    """
    clamped = scaled.clamp(-max_abs, max_abs)
    return torch.where(finite, clamped, torch.full_like(clamped, float("nan")))


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(saturate(x * scale))`` with round-to-nearest-even; ``x``, ``scale`` ``[rows, cols]`` fp32."""
    return saturate(x * scale, fp8_max(dtype), torch.isfinite(x)).to(dtype)
