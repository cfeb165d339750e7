"""FP4 e2m1 elements: rounding (nearest-even or stochastic) and packing two per byte.

e2m1 has 1 sign, 2 exponent (bias 1) and 1 mantissa bit; its magnitudes, indexed by the 3-bit code,
are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Values are held unpacked as float32 (exactly representable);
``pack_e2m1`` stores them as 4-bit codes, two per byte (element ``2j`` in the low nibble, ``2j+1`` in
the high nibble, the layout of ``torch.float4_e2m1fn_x2``).
"""

from __future__ import annotations

from typing import Optional

import torch

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index = 3-bit magnitude code
_SIGN_BIT = 0x8


def _grid(device: torch.device) -> torch.Tensor:
    """``E2M1_MAGNITUDES`` as float32 ``[8]`` on ``device``, computed there (no host-to-device copy):
    code ``c = 2e + m`` is ``m / 2`` for ``e = 0`` (subnormal), else ``2^(e-1) * (1 + m / 2)``."""
    code = torch.arange(len(E2M1_MAGNITUDES), dtype=torch.float32, device=device)  # [8]
    exponent = torch.floor(code / 2)
    mantissa = code - 2 * exponent
    return torch.where(exponent == 0, mantissa / 2, torch.exp2(exponent - 1) * (1 + mantissa / 2))


def _round_up(
    magnitude: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, index: torch.Tensor, u: Optional[torch.Tensor]
) -> torch.Tensor:
    """Whether each magnitude goes to ``upper``: nearest (ties to the even code ``index``) or, given
    uniform draws ``u`` in ``[0, 1)``, with probability ``(magnitude - lower) / (upper - lower)``."""
    if u is None:
        middle = (lower + upper) / 2  # exact: grid values have two significant bits
        return (magnitude > middle) | ((magnitude == middle) & (index % 2 == 1))
    gap = torch.where(upper > lower, upper - lower, torch.ones_like(upper))
    return u < (magnitude - lower) / gap


def round_e2m1(y: torch.Tensor, stochastic: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Round ``y`` to e2m1 values (float32, same shape), saturating at ±6; NaN/inf give NaN.

    ``stochastic=False``: round to nearest, ties to even. ``stochastic=True``: round up to the next
    representable magnitude with probability equal to the distance from the one below over the gap,
    so ``E[round(y)] = y`` inside ``[-6, 6]``; draws come from ``generator`` (seeded: reproducible).
    Blackwell's ``cvt.rs`` draws its own random bits, so the distribution matches TE, not the stream.
    """
    y = y.float().contiguous()
    finite = torch.isfinite(y)
    magnitude = torch.where(finite, y.abs(), torch.zeros_like(y)).clamp(max=E2M1_MAX)
    grid = _grid(y.device)
    index = torch.bucketize(magnitude, grid, right=True) - 1  # largest code with grid <= magnitude
    lower, upper = grid[index], grid[(index + 1).clamp(max=len(E2M1_MAGNITUDES) - 1)]
    u = torch.rand(y.shape, generator=generator, device=y.device) if stochastic else None
    rounded = torch.where(_round_up(magnitude, lower, upper, index, u), upper, lower)
    rounded = torch.where(y < 0, -rounded, rounded)
    return torch.where(finite, rounded, torch.full_like(rounded, float("nan")))


def e2m1_codes(values: torch.Tensor, check: bool = True) -> torch.Tensor:
    """4-bit codes (uint8, sign in bit 3) of e2m1 ``values``; raises if one is not representable.

    ``check=False`` skips that test (a host read of the device) for values known to be e2m1.
    """
    grid = _grid(values.device)
    magnitude = values.float().abs()
    index = torch.bucketize(magnitude, grid)  # exact match -> its own index
    index = index.clamp(max=len(E2M1_MAGNITUDES) - 1)
    if check and not torch.equal(grid[index], magnitude):
        raise ValueError("pack_e2m1 takes e2m1 values only (finite, from round_e2m1); got others")
    return index.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)


def pack_e2m1(values: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Pack e2m1 ``values [rows, cols]`` (cols even) into bytes ``[rows, cols // 2]`` (uint8); ``check``
    as in ``e2m1_codes``."""
    if values.dim() != 2 or values.shape[1] % 2:
        raise ValueError(f"pack_e2m1 needs [rows, even cols], got {tuple(values.shape)}")
    codes = e2m1_codes(values, check).view(values.shape[0], -1, 2)  # [rows, cols/2, 2]
    return codes[..., 0] | (codes[..., 1] << 4)  # [rows, cols/2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: bytes ``[rows, n]`` (uint8 or float4_e2m1fn_x2) to float32 ``[rows, 2n]``."""
    packed = packed.view(torch.uint8)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [rows, 2n]
    magnitude = _grid(packed.device)[(codes & 0x7).long()]
    return torch.where((codes & _SIGN_BIT) != 0, -magnitude, magnitude)
