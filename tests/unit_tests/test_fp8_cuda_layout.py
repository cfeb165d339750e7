"""The operands ``fp8_gemm`` hands to ``torch._scaled_mm`` obey the CUDA kernel's rules, on the CPU.

The reference is torch's own meta kernel of ``_scaled_mm``: a meta tensor counts as a CUDA tensor
there, so it applies CUDA's checks (first operand row-major, second column-major, the inner and
output dimensions multiples of 16, fp32 one-element scales). Every real call of an FP8 linear's
forward and backward is replayed on meta tensors of the same sizes, strides and dtypes; the
checks the meta kernel leaves to the CUDA kernel (not both e5m2, an output dtype cuBLASLt has,
scales on the operands' device) are asserted here. Token counts that are not multiples of 16
(5 tokens, as an MoE expert may get) are the case a CPU-only layout would get wrong.
"""

import pytest
import torch

from megatron.core.quantization.fp8 import quantize_current
from megatron.core.quantization.fp8_gemm import quantized_matmul
from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.recipes import LinearQuantizer, QuantRecipe
from megatron.core.tensor_parallel.linear_function import parallel_linear

CUDA_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Every ``torch._scaled_mm`` call, checked against the CUDA rules before it runs."""
    real, calls = torch._scaled_mm, []

    def checked(*args, **kwargs):
        assert len(args) == 4 and set(kwargs) == {"out_dtype"}, "torch's names: (self, mat2, scale_a, scale_b)"
        mat1, mat2, scale_a, scale_b = args
        out_dtype = kwargs.get("out_dtype")
        meta_out = real(_on_meta(mat1), _on_meta(mat2), _on_meta(scale_a), _on_meta(scale_b), **kwargs)
        assert meta_out.shape == (mat1.size(0), mat2.size(1))
        assert not (mat1.dtype == mat2.dtype == torch.float8_e5m2), "cuBLASLt has no e5m2 x e5m2 GEMM"
        assert out_dtype in CUDA_OUT_DTYPES, out_dtype
        assert scale_a.device == scale_b.device == mat1.device == mat2.device
        assert scale_a.dim() == 0 and scale_b.dim() == 0
        calls.append((tuple(mat1.shape), tuple(mat2.shape), mat1.dtype, mat2.dtype, out_dtype))
        return real(mat1, mat2, scale_a, scale_b, **kwargs)  # positional, as torch's signature names them

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    return calls


def test_the_meta_reference_rejects_a_cpu_only_layout():
    """The reference has teeth: the unpadded wgrad layout (5 tokens inner) and a row-major mat2 fail."""
    a = torch.zeros(32, 5).to(torch.float8_e4m3fn)
    b = torch.zeros(48, 5).to(torch.float8_e4m3fn)
    one = torch.ones(())
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(_on_meta(a), _on_meta(b.t()), _on_meta(one), _on_meta(one), out_dtype=torch.float32)
    c = torch.zeros(32, 32).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="col_major"):
        torch._scaled_mm(_on_meta(c), _on_meta(c.contiguous()), _on_meta(one), _on_meta(one), out_dtype=torch.float32)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("tokens", [5, 16])
def test_fp8_linear_gemms_follow_the_cuda_rules(scaled_mm_calls, recipe, tokens):
    """Forward, dgrad and wgrad of an FP8 linear: three kernel calls per step, all CUDA-legal, exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 32, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    quantizer = LinearQuantizer(QuantRecipe(recipe, "hybrid"), None)
    out = parallel_linear(x, w, None, None, quantizer=quantizer)  # [tokens, 1, 48]
    out.float().pow(2).sum().backward()
    assert len(scaled_mm_calls) == 3
    kinds = {(c[2], c[3]) for c in scaled_mm_calls}
    assert (torch.float8_e5m2, torch.float8_e4m3fn) in kinds  # dgrad / wgrad with e5m2 gradients
    assert out.shape == (tokens, 1, 48) and x.grad.shape == x.shape and w.grad.shape == w.shape


def test_padding_changes_no_value(scaled_mm_calls):
    """Padded to [16, 32] x [32, 48]: the result equals the exact emulation on the unpadded operands."""
    g = torch.Generator().manual_seed(1)
    a = quantize_current(torch.randn(5, 40, generator=g), "e4m3")  # k = 40: padded to 48
    b = quantize_current(torch.randn(7, 40, generator=g), "e5m2")
    out = quantized_matmul(a, b, torch.float32)  # [5, 7]
    assert scaled_mm_calls[0][:2] == ((16, 48), (48, 16))
    torch.testing.assert_close(out, emulated_gemm(a, b, torch.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["both_e5m2", "float64_out"])
def test_no_kernel_variant_falls_back_to_the_emulation(scaled_mm_calls, case):
    """Where CUDA has no ``_scaled_mm`` variant the GEMM is emulated (no kernel call), same values."""
    g = torch.Generator().manual_seed(2)
    fmt_b = "e5m2" if case == "both_e5m2" else "e4m3"
    out_dtype = torch.float64 if case == "float64_out" else torch.float32
    a = quantize_current(torch.randn(16, 32, generator=g), "e5m2")
    b = quantize_current(torch.randn(16, 32, generator=g), fmt_b)
    out = quantized_matmul(a, b, out_dtype)
    assert scaled_mm_calls == [] and out.dtype == out_dtype
    torch.testing.assert_close(out, emulated_gemm(a, b, out_dtype))
