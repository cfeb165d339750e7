"""Blockwise FP8 and MXFP8 quantizers, bit for bit against NumPy references of the recipes.

The references decode every FP8 code from its fields (``float_reference.py``), walk the blocks with
plain slices and pick scales by the rule stated in words (TE: ``fp8_max / amax`` in fp32, mantissa
cleared; MX: smallest power of two found by search, or the spec's ``floor(log2 amax) - emax``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.core.quantization.blockwise import quantize_blockwise
from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.mxfp8 import quantize_mxfp8
from megatron.core.quantization.storage import storage_bytes
from tests.unit_tests.float_reference import E4M3, E5M2, blocks, round_nearest_even

FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
FLT_MAX = np.finfo(np.float32).max


def wide_range(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values times 2^k with k varying by row and column: blocks of very different magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    k = torch.randint(-30, 30, (rows, 1), generator=g) + torch.randint(-8, 8, (1, cols), generator=g)
    return x * torch.exp2(k.float())


def assert_same_values(got: torch.Tensor, want: np.ndarray) -> None:
    """Equal values (NaN where NaN), compared exactly in float64."""
    got64 = got.double().numpy()
    assert np.array_equal(np.isnan(got64), np.isnan(want))
    mismatch = ~np.isnan(want) & (got64 != want)
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, e.g. got {got64[mismatch][:4]} want {want[mismatch][:4]}"
    )


def ref_blockwise(x: np.ndarray, fmt, block, power_of_two: bool, epsilon: float = 0.0):
    """(values, scale_inv) of TE's blockwise recipe, one block at a time."""
    x = x.astype(np.float32)
    nbr, nbc = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
    scale_inv = np.zeros((nbr, nbc), np.float32)
    values = np.zeros(x.shape)
    for bi, bj, rs, cs in blocks(x.shape, block):
        amax = max(np.float32(np.max(np.abs(x[rs, cs]))), np.float32(epsilon))
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scale = np.float32(fmt.max) / amax
        if np.isinf(scale):
            scale = np.float32(FLT_MAX)
        if power_of_two:
            scale = np.float32(2.0 ** (np.frexp(scale)[1] - 1))  # largest power of two <= scale
        if amax == 0 or not np.isfinite(amax):
            scale = np.float32(1.0)
        scale_inv[bi, bj] = np.float32(1.0) / scale
        with np.errstate(over="ignore", invalid="ignore"):
            values[rs, cs] = round_nearest_even(x[rs, cs] * scale, fmt)
    return values, scale_inv


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (7, 33)])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_blockwise_matches_reference(dtype, block, power_of_two):
    x = wide_range(150, 300)  # ragged: 300 = 2*128 + 44 columns, 150 = 128 + 22 rows
    q = quantize_blockwise(x, dtype=dtype, block=block, power_of_two_scales=power_of_two)
    values, scale_inv = ref_blockwise(x.numpy(), FORMATS[dtype], block, power_of_two)
    assert q.data.dtype == dtype and q.block == block
    assert_same_values(q.data, values)
    assert np.array_equal(q.scale_inv.numpy(), scale_inv)
    if power_of_two:
        assert torch.all(torch.frexp(q.scale_inv)[0] == 0.5)  # every scale a power of two


def test_blockwise_scale_fits_amax_without_saturation():
    x = wide_range(4, 256)
    for power_of_two in (True, False):
        q = quantize_blockwise(x, power_of_two_scales=power_of_two)
        amax = x.abs().view(4, 2, 128).amax(-1)
        amax_q = q.data.float().abs().view(4, 2, 128).amax(-1)
        assert torch.all(amax_q <= 448)
        if power_of_two:  # a rounded-down power-of-two scale leaves headroom: amax*scale in (224, 448]
            assert torch.all(amax_q > 224) and torch.all(amax / q.scale_inv.view(4, 2) <= 448)


def test_blockwise_ties_and_subnormals_round_to_even():
    # block amax 448 -> scale exactly 1, so the listed values are rounded as they are
    x = torch.tensor([[448.0, 1.0625, 1.1875, -(2.0**-10), 3 * 2.0**-10, 2.0**-12, 12.5, -232.0]])
    q = quantize_blockwise(x, block=(1, 8))
    assert q.scale_inv.item() == 1.0
    want = [448.0, 1.0, 1.25, -0.0, 2.0**-8, 0.0, 12.0, -224.0]  # ties to the even mantissa
    assert q.data.float()[0].tolist() == want
    assert_same_values(q.data, round_nearest_even(x.numpy(), E4M3))


def test_blockwise_zero_epsilon_and_nonfinite_blocks():
    x = torch.zeros(3, 8)
    x[1] = torch.linspace(-1e-30, 1e-30, 8)
    x[2, :4] = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    q = quantize_blockwise(x, block=(1, 4), power_of_two_scales=False, amax_epsilon=1e-20)
    values, scale_inv = ref_blockwise(x.numpy(), E4M3, (1, 4), False, epsilon=1e-20)
    assert_same_values(q.data, values)
    assert np.array_equal(q.scale_inv.numpy(), scale_inv)
    assert q.scale_inv[0, 0] == 1 / (np.float32(448) / np.float32(1e-20))  # zero block: epsilon is its amax
    assert q.scale_inv[2, 0] == 1.0 and q.data[2, :4].float().isnan().tolist() == [False, True, True, False]
    no_eps = quantize_blockwise(torch.zeros(2, 4), block=(1, 4))
    assert torch.all(no_eps.scale_inv == 1.0) and torch.all(no_eps.data.float() == 0)


def test_blockwise_tiny_amax_scale_clamps_to_float_max():
    x = torch.full((1, 4), 1e-38)  # 448 / 1e-38 overflows fp32
    q = quantize_blockwise(x, block=(1, 4), power_of_two_scales=False)
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(FLT_MAX)
    assert torch.equal(q.scale_inv, torch.tensor(ref_blockwise(x.numpy(), E4M3, (1, 4), False)[1]))


def test_blockwise_dequantize_error_is_half_ulp():
    x = wide_range(64, 256, seed=3)
    q = quantize_blockwise(x, block=(128, 128))
    scale = 1 / q.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:64]  # [64, 256]
    err = (q.dequantize() - x).abs()
    normal = (x * scale).abs() >= 2.0**-6  # e4m3's smallest normal
    assert torch.all(err[normal] <= 2.0**-4 * x.abs()[normal])  # 3 mantissa bits: half an ulp
    assert torch.all(err[~normal] <= 2.0**-10 / scale[~normal])  # subnormal spacing 2^-9


def ref_mx_exponent(amax: float, fmt, rounding: str) -> int:
    """The block exponent by definition: search (TE) or floor(log2 amax) - emax_elem (OCP), clamped."""
    if amax == 0:
        return -127
    if rounding == "te":
        return next(e for e in range(-127, 128) if amax <= fmt.max * 2.0**e)
    emax_elem = int(np.floor(np.log2(fmt.max)))
    return int(np.clip(np.frexp(amax)[1] - 1 - emax_elem, -127, 127))


def ref_mxfp8(x: np.ndarray, fmt, rounding: str):
    """(values, e8m0 bytes) of MXFP8, one 1x32 block at a time."""
    nbc = -(-x.shape[1] // 32)
    raw = np.zeros((x.shape[0], nbc), np.uint8)
    values = np.zeros(x.shape)
    for bi, bj, rs, cs in blocks(x.shape, (1, 32)):
        amax = float(np.max(np.abs(x[rs, cs])))
        if not np.isfinite(amax):
            raw[bi, bj], values[rs, cs] = 0xFF, np.where(np.isfinite(x[rs, cs]), 0.0, np.nan)
            continue
        e = ref_mx_exponent(amax, fmt, rounding)
        raw[bi, bj] = e + 127
        values[rs, cs] = round_nearest_even(x[rs, cs].astype(np.float64) * 2.0**-e, fmt)
    return values, raw


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("rounding", ["te", "ocp"])
def test_mxfp8_matches_reference(dtype, rounding):
    x = wide_range(40, 100, seed=1)  # 100 = 3*32 + 4: a ragged last block
    x[0, :32] = 0.0
    x[1, :32] = 448.0 * 2.0**-3  # amax exactly fp8_max * 2^k: TE keeps k
    x[2, :32] = 1e-40  # subnormal fp32 amax: exponent clamps at -127
    q = quantize_mxfp8(x, dtype=dtype, rounding=rounding)
    values, raw = ref_mxfp8(x.numpy(), FORMATS[dtype], rounding)
    assert q.block == (1, 32) and q.data.dtype == dtype and q.scale_raw.dtype == torch.float8_e8m0fnu
    assert np.array_equal(q.scale_raw.view(torch.uint8).numpy(), raw)
    assert np.array_equal(q.scale_inv.double().numpy(), 2.0 ** (raw.astype(np.float64) - 127))
    data = q.data.float().double().numpy()
    finite = ~np.isnan(values)
    assert np.array_equal(data[finite], values[finite])


def test_mxfp8_rounding_te_never_saturates_ocp_may():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 480.0, 1.0  # floor(log2 480) = 8 = emax_elem: OCP scale 2^0, 480 saturates to 448
    x[0, 32] = 300.0
    te, ocp = quantize_mxfp8(x, rounding="te"), quantize_mxfp8(x, rounding="ocp")
    assert te.scale_raw.view(torch.uint8).tolist() == [[128, 127]]  # 480 / 2 = 240 fits; 300 fits at 2^0
    assert ocp.scale_raw.view(torch.uint8).tolist() == [[127, 127]]
    assert te.dequantize()[0, 0] == 480.0 and ocp.dequantize()[0, 0] == 448.0


def test_mxfp8_nonfinite_block_decodes_to_nan():
    x = torch.ones(2, 64)
    x[0, 5] = float("inf")
    q = quantize_mxfp8(x)
    assert q.scale_raw.view(torch.uint8).tolist() == [[0xFF, 119], [119, 119]]  # amax 1: 2^-8 * 448 >= 1
    deq = q.dequantize()
    assert deq[0, :32].isnan().all() and torch.equal(deq[0, 32:], x[0, 32:]) and torch.equal(deq[1], x[1])


def test_mxfp8_rejects_unknown_rounding_and_non_fp8_dtype():
    with pytest.raises(ValueError, match="rounding"):
        quantize_mxfp8(torch.ones(1, 32), rounding="nearest")
    with pytest.raises(ValueError, match="FP8"):
        quantize_blockwise(torch.ones(1, 32), dtype=torch.bfloat16)


def test_emulated_gemm_equals_reference_matmul_of_dequantized_operands():
    a, b = wide_range(48, 200, seed=4) * 1e-3, wide_range(24, 200, seed=5)
    qa, qb = quantize_mxfp8(a), quantize_blockwise(b, block=(128, 128))
    va, _ = ref_mxfp8(a.numpy(), E4M3, "te")
    vb, sb = ref_blockwise(b.numpy(), E4M3, (128, 128), True)
    scale_a = 2.0 ** (qa.scale_raw.view(torch.uint8).double().numpy() - 127)  # checked bit-exact above
    ra = va * np.repeat(scale_a, 32, axis=1)[:, :200]
    rb = vb * np.repeat(np.repeat(sb.astype(np.float64), 128, 0), 128, 1)[:24, :200]
    want = ra @ rb.T  # float64
    got = emulated_gemm(qa, qb, torch.float32).double().numpy()
    bound = 200 * np.finfo(np.float32).eps * (np.abs(ra) @ np.abs(rb).T)  # fp32 accumulation
    assert np.all(np.abs(got - want) <= bound)
    assert emulated_gemm(qa, qb).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shared last dim"):
        emulated_gemm(qa, quantize_mxfp8(b[:, :64]))


def test_storage_bytes_follow_the_table():
    x = torch.randn(256, 512)
    numel = 256 * 512
    assert storage_bytes(quantize_blockwise(x)) == numel + 4 * numel // 128
    assert storage_bytes(quantize_blockwise(x, block=(128, 128))) == numel + 4 * numel // 128**2
    assert storage_bytes(quantize_mxfp8(x)) == numel + numel // 32  # one e8m0 byte per 32 values
