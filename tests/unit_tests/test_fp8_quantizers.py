"""FP8 per-tensor quantizers, delayed scaling and the quantized GEMM against independent references.

* ``quantize_current`` / ``cast_to_fp8`` equal a NumPy reference bit for bit: the scale
  ``float32(fp8_max) / amax`` (TE's current scaling, 1 for amax 0), saturation at +-fp8_max and
  round-to-nearest-even over a table of every finite e4m3 / e5m2 value built from the bit layout.
* ``DelayedScalingState`` follows a plain-Python transcription of Transformer Engine's delayed
  scaling over six steps: history written at slot 0 then rolled, ``max`` / ``most_recent``,
  margin, the old scale kept for an all-zero step; the quantization uses the previous scale.
* ``quantized_matmul`` equals dequantize -> fp64 matmul within fp32 accumulation error (per-tensor
  through ``torch._scaled_mm``, and block-scaled operands through the emulated path).
"""

import numpy as np
import pytest
import torch

from megatron.core.quantization import QuantizedTensor
from megatron.core.quantization.fp8 import DelayedScalingState, cast_to_fp8, quantize_current
from megatron.core.quantization.fp8_gemm import check_fp8_dims, quantized_matmul, transpose

MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_table(fmt: str) -> np.ndarray:
    """Every finite non-negative value of ``fmt`` in code order (so an even index = even mantissa)."""
    exp_bits, man_bits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    values = []
    for e in range(2**exp_bits):
        for m in range(2**man_bits):
            if fmt == "e4m3" and e == 15 and m == 7:
                continue  # e4m3fn's NaN
            if fmt == "e5m2" and e == 31:
                continue  # inf / NaN
            frac = m / 2**man_bits
            values.append(frac * 2.0 ** (1 - bias) if e == 0 else (1 + frac) * 2.0 ** (e - bias))
    return np.array(values, dtype=np.float64)


def ref_round(v: np.ndarray, fmt: str) -> np.ndarray:
    """Saturate to +-max, then round |v| to the nearest table value, ties to the even code."""
    table = fp8_table(fmt)
    a = np.minimum(np.abs(v.astype(np.float64)), MAX[fmt])
    hi = np.clip(np.searchsorted(table, a), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(v) * table[pick]


def ref_current(x: torch.Tensor, fmt: str):
    """(values, scale) of tensorwise current scaling computed in NumPy float32."""
    xs = x.numpy().astype(np.float32)
    amax = np.float32(np.abs(xs).max())
    scale = np.float32(1.0) if amax == 0 else np.float32(MAX[fmt]) / amax
    return ref_round(xs * scale, fmt), scale


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 40, generator=g) * 3
    x[0, :6] = torch.tensor([0.0, 1e-30, -2.5e-3, 7.0, -7.0, 1e-6])
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_current_scaling_bitwise(fmt):
    x = _inputs()
    q = quantize_current(x, fmt)
    values, scale = ref_current(x, fmt)
    assert q.data.dtype == (torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2)
    assert q.scale_inv.shape == (1, 1) and q.block == (24, 40)
    assert np.float32(q.scale_inv.item()) == np.float32(1.0) / scale
    np.testing.assert_array_equal(q.data.float().numpy(), values)
    zero = quantize_current(torch.zeros(16, 16), fmt)
    assert zero.scale_inv.item() == 1.0 and zero.data.float().abs().sum() == 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_and_ties(fmt):
    table = fp8_table(fmt)
    mids = ((table[1:40] + table[:39]) / 2).astype(np.float32)  # exact ties between neighbours
    over = np.array([MAX[fmt] * 1.01, MAX[fmt] * 4, -MAX[fmt] * 1e3], dtype=np.float32)
    v = torch.from_numpy(np.concatenate([mids, -mids, over]).reshape(1, -1))
    q = cast_to_fp8(v, torch.ones(1), fmt)
    np.testing.assert_array_equal(q.data.float().numpy(), ref_round(v.numpy(), fmt))
    assert q.data.float().abs().max().item() == MAX[fmt]  # saturated, never inf/NaN


def hand_delayed(amaxes, length, algo, margin, fp8max):
    """Transformer Engine's delayed scaling in plain Python: (scale used per step, final history, final scale)."""
    history, scale, used = [np.float32(0)] * length, np.float32(1), []
    for amax in amaxes:
        used.append(scale)
        history[0] = np.float32(amax)
        chosen = max(history) if algo == "max" else history[0]
        history = history[1:] + [history[0]]  # torch.roll(-1)
        history[0] = np.float32(0)
        if chosen > 0 and np.isfinite(chosen):
            scale = np.float32(np.float32(fp8max) / chosen) / np.float32(2.0**margin)
    return used, history, scale


@pytest.mark.parametrize("algo,length,margin", [("max", 3, 0), ("most_recent", 3, 1), ("max", 1, 2)])
def test_delayed_scaling_matches_hand_reference(algo, length, margin):
    g = torch.Generator().manual_seed(1)
    mags = [2.0, 0.5, 8.0, 0.0, 1.0, 3.0]  # step 4 is all zeros: the scale is kept
    xs = [torch.randn(16, 32, generator=g) * m for m in mags]
    state = DelayedScalingState("e4m3", length, algo, margin)
    used = []
    for x in xs:
        before = state.scale.clone()
        q = state.quantize(x)
        used.append(before.item())
        np.testing.assert_array_equal(q.data.float().numpy(), ref_round(x.numpy() * before.numpy(), "e4m3"))
    amaxes = [np.float32(x.abs().max().item()) for x in xs]
    ref_used, ref_history, ref_scale = hand_delayed(amaxes, length, algo, margin, 448.0)
    assert used == [float(s) for s in ref_used]
    np.testing.assert_array_equal(state.amax_history.numpy(), np.array(ref_history, dtype=np.float32))
    assert state.scale.item() == float(ref_scale)


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation error bound: k * eps32 * |a| |b|^T."""
    return a.size(1) * torch.finfo(torch.float32).eps * (a.abs() @ b.abs().t())


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_scaled_mm_equals_dequantized_matmul(fmts):
    g = torch.Generator().manual_seed(2)
    a = quantize_current(torch.randn(48, 64, generator=g), fmts[0])
    b = quantize_current(torch.randn(32, 64, generator=g) * 0.1, fmts[1])
    da, db = a.dequantize().double(), b.dequantize().double()
    out = quantized_matmul(a, b, torch.float32)  # [48, 32]
    ref = da @ db.t()
    assert ((out.double() - ref).abs() <= _bound(da, db) + 1e-30).all()
    c = quantize_current(torch.randn(48, 32, generator=g), fmts[1])
    wgrad = quantized_matmul(transpose(a), transpose(c), torch.float32)  # A^T C [64, 32], the wgrad layout
    dc = c.dequantize().double()
    assert ((wgrad.double() - da.t() @ dc).abs() <= _bound(da.t(), dc.t()) + 1e-30).all()
    bf16 = quantized_matmul(a, b, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), ref.float(), rtol=2**-8, atol=1e-6)


def test_block_scaled_operands_use_the_exact_emulation():
    g = torch.Generator().manual_seed(3)
    data = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(32, 4, generator=g) + 0.5  # one scale per 1x16 block
    a = QuantizedTensor(data, scales, (1, 16))
    b = quantize_current(torch.randn(16, 64, generator=g), "e4m3")
    out = quantized_matmul(a, b, torch.float32)
    da, db = a.dequantize().double(), b.dequantize().double()
    assert ((out.double() - da @ db.t()).abs() <= _bound(da, db) + 1e-30).all()


def test_fp8_dims_must_be_multiples_of_16():
    check_fp8_dims("ok", 32, 48)
    with pytest.raises(ValueError, match=r"layer 1 mlp.linear_fc1: .*input size divisible by 16, got \[32, 40\]"):
        check_fp8_dims("layer 1 mlp.linear_fc1", 32, 40)


def test_delayed_state_stays_fp32_when_the_model_is_cast():
    state = torch.nn.Sequential(DelayedScalingState("e4m3", 4, "max", 0)).to(torch.bfloat16)
    assert state[0].amax_history.dtype == torch.float32 and state[0].scale.dtype == torch.float32
