"""NVFP4 (e2m1 values, e4m3 block scales, fp32 global scale), stochastic rounding and the RHT.

References are NumPy, built from the format definitions (``float_reference.py``) and the recipe's
formulas stated in words; statistical checks use a seeded generator and 5-sigma bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.core.quantization.fp4 import pack_e2m1, round_e2m1, unpack_e2m1
from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.hadamard import hadamard_matrix, random_hadamard_transform, random_signs
from megatron.core.quantization.nvfp4 import NVFP4_LINEAR_RECIPE, quantize_nvfp4, quantize_nvfp4_operand
from megatron.core.quantization.storage import storage_bytes
from tests.unit_tests.float_reference import E2M1, E4M3, blocks, neighbours, round_nearest_even

FLT_MAX = np.float32(np.finfo(np.float32).max)


def spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values times 2^k, k varying by row and by 16-column group, plus a zero and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    k = torch.randint(-6, 6, (rows, 1), generator=g) + torch.randint(-3, 3, (1, -(-cols // 16)), generator=g)
    x = x * torch.exp2(k.float()).repeat_interleave(16, dim=1)[:, :cols]
    x[0, :16] = 0.0
    x[1, :16] *= 1e-9  # its e4m3 block scale underflows to 0: the block dequantizes to 0
    return x


def ref_nvfp4(x: np.ndarray, block):
    """(values, block scales, global decode scale, scaled inputs) of the NVFP4 recipe."""
    x = x.astype(np.float32)
    amax = np.float32(np.max(np.abs(x)))
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.float32(448 * 6) / amax
    s_enc = np.float32(1) if amax == 0 or not np.isfinite(s_enc) else np.minimum(s_enc, FLT_MAX)
    s_dec = np.float32(1) / s_enc
    nbr, nbc = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
    s_b, values, scaled = np.zeros((nbr, nbc)), np.zeros(x.shape), np.zeros(x.shape, np.float32)
    for bi, bj, rs, cs in blocks(x.shape, block):
        s_b[bi, bj] = round_nearest_even(np.array((np.max(np.abs(x[rs, cs])) / np.float32(6)) * s_enc), E4M3)
        with np.errstate(divide="ignore", over="ignore"):
            encode = np.minimum(np.float32(1) / (np.float32(s_b[bi, bj]) * s_dec), FLT_MAX)
            scaled[rs, cs] = np.clip(x[rs, cs] * encode, -FLT_MAX, FLT_MAX)
        values[rs, cs] = round_nearest_even(scaled[rs, cs], E2M1)
    return values, s_b, s_dec, scaled


def test_e2m1_round_nearest_even_matches_definition():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # every tie between neighbours
    y = np.concatenate([np.arange(-8, 8, 1 / 64), mids, -mids, [1e-30, 6.0, 7.5, 1e9]]).astype(np.float32)
    got = round_e2m1(torch.from_numpy(y))
    assert np.array_equal(got.numpy(), round_nearest_even(y, E2M1))
    assert round_e2m1(torch.from_numpy(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # even codes
    assert round_e2m1(torch.tensor([float("nan"), float("inf")])).isnan().all()


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_nvfp4_matches_reference(block):
    x = spread(20, 72)  # ragged: 72 = 4*16 + 8 columns, 20 = 16 + 4 rows
    q = quantize_nvfp4(x, block=block)
    values, s_b, s_dec, _ = ref_nvfp4(x.numpy(), block)
    assert q.block == block and q.element_format == "e2m1" and q.scale_raw.dtype == torch.float8_e4m3fn
    assert np.array_equal(q.data.numpy(), values)
    assert np.array_equal(q.scale_raw.float().numpy(), s_b) and np.array_equal(q.scale_inv.numpy(), s_b)
    assert q.global_scale_inv.item() == s_dec
    assert torch.all(q.dequantize()[1, :16] == 0) and torch.all(q.data[0, :16] == 0)
    assert q.scale_raw.float().max() <= 448


def test_nvfp4_global_scale_puts_tensor_amax_at_the_top_of_both_ranges():
    x = spread(8, 64, seed=2)
    q = quantize_nvfp4(x)
    amax = x.abs().max()
    assert q.global_scale_inv.item() == (np.float32(1) / (np.float32(2688) / np.float32(amax))).item()
    assert q.scale_raw.float().max() == 448  # the amax block's scale: amax / 6 * s_enc = 448
    assert q.data.abs().max() == 6
    shared = quantize_nvfp4(x, global_amax=amax * 4)  # e.g. reduced over a TP group
    assert shared.global_scale_inv.item() == (np.float32(1) / (np.float32(2688) / np.float32(amax * 4))).item()


def test_nvfp4_zero_and_nonfinite_inputs():
    zero = quantize_nvfp4(torch.zeros(2, 32))
    assert zero.global_scale_inv.item() == 1.0 and torch.all(zero.scale_inv == 0) and torch.all(zero.data == 0)
    x = torch.ones(1, 32)
    x[0, 3] = float("nan")
    q = quantize_nvfp4(x, global_amax=torch.tensor(1.0))
    assert q.data[0, 3].isnan() and q.scale_raw.float()[0, 0].isnan()  # NaN stays visible
    assert torch.all(q.data[0, 16:] == 6)


def test_stochastic_rounding_is_reproducible_and_picks_a_neighbour():
    y = torch.from_numpy(np.linspace(-7, 7, 4001, dtype=np.float32))
    a = round_e2m1(y, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = round_e2m1(y, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = round_e2m1(y, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    lo, hi = neighbours(y.numpy(), E2M1)
    mag = a.abs().double().numpy()
    assert np.all((mag == lo) | (mag == hi))
    assert not torch.equal(a, round_e2m1(y))  # it is not round-to-nearest


def test_stochastic_rounding_is_unbiased():
    y = torch.tensor([0.1, 0.3, 0.8, 1.1, 1.6, 2.2, 2.9, 3.3, 4.7, 5.5, -0.4, -2.6, -5.9, 1.5, 6.0])
    n = 4000
    draws = round_e2m1(y.expand(n, -1), stochastic=True, generator=torch.Generator().manual_seed(0)).double()
    lo, hi = neighbours(y.numpy(), E2M1)
    p = (np.abs(y.double().numpy()) - lo) / np.where(hi > lo, hi - lo, 1)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(draws.mean(0).numpy() - y.double().numpy()) <= 5 * sigma + 1e-12)
    assert np.all(draws.std(0).numpy()[[13, 14]] == 0)  # representable values never move


def test_nvfp4_stochastic_rounding_keeps_scales_and_is_unbiased():
    x = spread(3, 48, seed=3)[2:].expand(3000, -1).contiguous()  # one row pattern, 3000 draws
    g = torch.Generator().manual_seed(1)
    sr, rn = quantize_nvfp4(x, stochastic_rounding=True, generator=g), quantize_nvfp4(x)
    assert torch.equal(sr.scale_raw.view(torch.uint8), rn.scale_raw.view(torch.uint8))
    again = quantize_nvfp4(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sr.data, again.data)
    _, s_b, s_dec, scaled = ref_nvfp4(x[:1].numpy(), (1, 16))
    lo, hi = neighbours(scaled[0], E2M1)
    assert np.all((sr.data.abs().numpy() == lo) | (sr.data.abs().numpy() == hi))
    inside = np.abs(scaled[0]) <= 6  # saturated elements are biased by design
    p = (np.abs(scaled[0]) - lo) / np.where(hi > lo, hi - lo, 1)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / x.shape[0]) + 1e-6
    err = sr.data.double().mean(0).numpy() - scaled[0]
    assert np.all(np.abs(err[inside]) <= 5 * sigma[inside])


def test_pack_unpack_round_trip_and_nibble_layout():
    values_ref, codes_ref = E2M1.magnitudes()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 32), generator=g)  # every sign and magnitude, incl. -0
    mags = torch.from_numpy(values_ref[np.argsort(codes_ref)]).float()[codes & 7]
    values = torch.where(codes >= 8, -mags, mags)
    packed = pack_e2m1(values)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 16)
    assert torch.equal(packed.long(), codes[:, 0::2] | (codes[:, 1::2] << 4))  # element 2j in the low nibble
    back = unpack_e2m1(packed.view(torch.float4_e2m1fn_x2))
    assert torch.equal(back, values) and torch.equal(torch.signbit(back), torch.signbit(values))
    with pytest.raises(ValueError, match="e2m1 values only"):
        pack_e2m1(torch.full((1, 2), 0.7))
    with pytest.raises(ValueError, match="even cols"):
        pack_e2m1(torch.zeros(1, 3))


def test_hadamard_matrix_and_inverse():
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i & j)
    assert np.array_equal(hadamard_matrix(16).double().numpy(), (-1.0) ** popcount / 4)  # Sylvester
    signs = random_signs(torch.Generator().manual_seed(3))
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(signs, random_signs(torch.Generator().manual_seed(3)))
    q = (-1.0) ** popcount / 4 * signs.double().numpy()[None, :]  # H diag(s)
    assert np.allclose(q @ q.T, np.eye(16), atol=1e-15)
    x = torch.randn(5, 48)
    y = random_hadamard_transform(x, signs)
    assert np.allclose(y.double().numpy(), (x.double().numpy().reshape(5, 3, 16) @ q).reshape(5, 48), atol=1e-5)
    assert torch.allclose(random_hadamard_transform(y, signs, inverse=True), x, atol=1e-5)


def test_hadamard_keeps_gemm_and_spreads_outliers():
    signs = random_signs(torch.Generator().manual_seed(4))
    a, b = torch.randn(6, 64), torch.randn(5, 64)
    ra, rb = random_hadamard_transform(a, signs), random_hadamard_transform(b, signs)
    assert torch.allclose(ra @ rb.T, a @ b.T, atol=1e-4)
    spike = torch.zeros(1, 16)
    spike[0, 9] = 8.0
    assert torch.allclose(random_hadamard_transform(spike, signs).abs(), torch.full((1, 16), 2.0))


def test_recipe_table_follows_nvidia_nvfp4():
    gemms = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"), "wgrad": ("grad_output", "input")}
    assert set(NVFP4_LINEAR_RECIPE) == {(gemm, op) for gemm, ops in gemms.items() for op in ops}
    for (gemm, operand), recipe in NVFP4_LINEAR_RECIPE.items():
        assert recipe.stochastic_rounding == (operand == "grad_output")  # gradients only
        assert recipe.hadamard == (gemm == "wgrad")  # both wgrad operands, nothing else
        assert recipe.block == ((16, 16) if operand == "weight" else (1, 16))


def test_nvfp4_emulated_gemm_and_storage():
    a, b = spread(24, 64, seed=5), spread(40, 64, seed=6)
    qa, qb = quantize_nvfp4(a), quantize_nvfp4(b, block=(16, 16))
    ra_vals, ra_s, ra_g, _ = ref_nvfp4(a.numpy(), (1, 16))
    rb_vals, rb_s, rb_g, _ = ref_nvfp4(b.numpy(), (16, 16))
    ra = ra_vals * np.repeat(ra_s, 16, 1) * float(ra_g)
    rb = rb_vals * np.repeat(np.repeat(rb_s, 16, 0), 16, 1)[:40] * float(rb_g)
    want = ra @ rb.T  # float64
    got = emulated_gemm(qa, qb, torch.float32).double().numpy()
    bound = 70 * np.finfo(np.float32).eps * (np.abs(ra) @ np.abs(rb).T)  # fp32 dequantize + accumulate
    assert np.all(np.abs(got - want) <= bound)
    assert storage_bytes(qa) == 24 * 64 // 2 + 24 * 64 // 16 + 4  # 4-bit values, e4m3 per 16, fp32 global
    assert storage_bytes(qb) == 40 * 64 // 2 + 3 * 4 + 4  # ragged 16x16 tiles: 3 x 4 scales


def test_operand_quantizer_applies_the_recipe():
    g = torch.Generator().manual_seed(9)
    dy, x, w = torch.randn(64, 96, generator=g), torch.randn(64, 48, generator=g), torch.randn(96, 48, generator=g)
    signs = random_signs(torch.Generator().manual_seed(10))
    wgrad_dy = quantize_nvfp4_operand(dy.T, "wgrad", "grad_output", torch.Generator().manual_seed(11), signs)
    want = quantize_nvfp4(random_hadamard_transform(dy.T, signs), (1, 16), True, torch.Generator().manual_seed(11))
    assert torch.equal(wgrad_dy.data, want.data) and torch.equal(wgrad_dy.scale_inv, want.scale_inv)
    assert quantize_nvfp4_operand(w, "fprop", "weight").block == (16, 16)
    wgrad_x = quantize_nvfp4_operand(x.T, "wgrad", "input", hadamard_signs=signs)
    exact = dy.T @ x  # [96, 48]: the RHT cancels in the product, only FP4 error is left
    err = (emulated_gemm(wgrad_dy, wgrad_x, torch.float32) - exact).norm() / exact.norm()
    assert err < 0.25, err
    with pytest.raises(ValueError, match="hadamard_signs"):
        quantize_nvfp4_operand(x.T, "wgrad", "input")
    with pytest.raises(ValueError, match="not in the recipe"):
        quantize_nvfp4_operand(x, "fprop", "grad_output")
