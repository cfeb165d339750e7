"""MXFP8 (OCP Microscaling v1.0): 32-element blocks along the reduction dim, e8m0 shared scales.

An e8m0 byte ``b`` encodes ``2^(b - 127)`` (``b = 0xFF`` is NaN); the block's values are
``data * 2^(b - 127)`` with ``data`` in e4m3 (or e5m2). Two ways to pick the exponent ``e``:

* ``"te"`` (default, Transformer Engine's kernels): the smallest ``e`` with ``amax / 2^e <= fp8_max``,
  i.e. ``e = ceil(log2(amax / fp8_max))`` — the scale is rounded *up*, nothing saturates. We compute
  it exactly; TE multiplies ``amax`` by a rounded ``1/fp8_max`` first, which can only differ when
  ``amax`` is within one fp32 ulp of ``fp8_max * 2^k``.
* ``"ocp"`` (the spec's reference): ``e = floor(log2(amax)) - emax_elem`` with ``emax_elem = 8`` (e4m3)
  or ``15`` (e5m2); up to ``1.99 * 2^emax_elem`` may result, and values above ``fp8_max`` saturate.

``e`` is clamped to e8m0's range ``[-127, 127]``; an all-zero block gets ``e = -127`` (byte 0, as TE);
a block holding a NaN or inf gets the NaN scale byte ``0xFF`` (the spec: the whole block decodes to NaN).
Blocks run along columns: quantize the transpose for the other GEMM orientation.
"""

from __future__ import annotations

import torch

from megatron.core.quantization.formats import block_amax, cast_fp8, check_operand, expand_blocks, fp8_max
from megatron.core.quantization.tensor import QuantizedTensor

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
MX_SCALE_ROUNDINGS = ("te", "ocp")


def _ceil_log2_ratio(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Smallest integer ``e`` with ``amax <= max_value * 2^e`` (``amax > 0`` finite), int32, exact."""
    amax64 = amax.double()
    e = torch.ceil(torch.log2(amax64 / max_value)).to(torch.int32)  # off by at most one
    e = torch.where(amax64 > torch.ldexp(torch.full_like(amax64, max_value), e.double()), e + 1, e)
    below = amax64 <= torch.ldexp(torch.full_like(amax64, max_value), (e - 1).double())
    return torch.where(below, e - 1, e)


def shared_exponent(amax: torch.Tensor, dtype: torch.dtype, rounding: str = "te") -> torch.Tensor:
    """Unbiased block exponent ``e`` (scale ``2^e``) per block, int32, clamped to ``[-127, 127]``."""
    if rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} must be one of {MX_SCALE_ROUNDINGS}")
    positive = torch.where(amax > 0, amax.float(), torch.ones_like(amax, dtype=torch.float32))
    if rounding == "te":
        e = _ceil_log2_ratio(positive, fp8_max(dtype))
    else:
        emax_elem = int(torch.frexp(torch.tensor(fp8_max(dtype)))[1]) - 1  # floor(log2(fp8_max))
        e = torch.frexp(positive)[1] - 1 - emax_elem  # floor(log2(amax)) - emax_elem
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def e8m0_bytes(exponent: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The e8m0 encoding ``e + 127`` as ``torch.float8_e8m0fnu``, NaN (0xFF) where not ``finite``."""
    biased = torch.where(finite, exponent + E8M0_BIAS, torch.full_like(exponent, E8M0_NAN))
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_mxfp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, rounding: str = "te") -> QuantizedTensor:
    """Quantize ``x [rows, cols]`` to MXFP8: 1x32 blocks, e8m0 scales in ``scale_raw``, fp32 in ``scale_inv``."""
    block = (1, MX_BLOCK)
    check_operand(x, block)
    x32 = x.float()
    amax = block_amax(x32, block)  # [rows, ceil(cols/32)]
    exponent = shared_exponent(amax, dtype, rounding)  # [rows, ceil(cols/32)]
    finite = torch.isfinite(amax)
    scale = torch.ldexp(torch.ones_like(amax), -exponent.float())  # 2^-e, exact
    data = cast_fp8(x32, expand_blocks(scale, block, tuple(x.shape)), dtype)  # [rows, cols]
    raw = e8m0_bytes(exponent, finite)
    return QuantizedTensor(data=data, scale_inv=raw.float(), block=block, scale_raw=raw)
