"""Each fused op (megatron/core/fusions, the fused RoPE) against its unfused reference, forward and backward.

The masked softmax (explicit-score attention) runs causal with query-key layer scaling, with an additive
bias, and unmasked in the scores' dtype.

Tolerances: fp32 within 1e-6 relative (the same math in another order; bias-dropout-add and RoPE are the
reference's own operations, so eager they are bitwise); bf16 within 2e-2 (one bf16 rounding, 2^-8, of
values a few units large; the fused forms compute in fp32 inside and round once). The default tier runs
the regions eagerly (``TORCHDYNAMO_DISABLE=1``, tests/conftest.py); ``test_fused_regions_compile_once``
compiles them and counts the compilations. Model-level equality under TP + SP and activation
recomputation is the speed-flag invariance suite's rows (tests/unit_tests/training/speed_invariance.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import jit
from megatron.core.fusions.fused_activations import fused_activation, fused_swiglu
from megatron.core.fusions.fused_bias_dropout import fused_bias_dropout_add
from megatron.core.fusions.fused_norm import fused_rms_norm
from megatron.core.fusions.fused_softmax import fused_scale_mask_softmax, scale_mask_softmax
from megatron.core.transformer.norms import RMSNorm
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _grads(fn, *inputs):
    """(output, gradients of every input) of ``fn`` under a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))
    return out.detach(), [leaf.grad for leaf in leaves if leaf.requires_grad]


def _same(fused, reference, dtype):
    (out, grads), (ref_out, ref_grads) = fused, reference
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **TOL[dtype])


def _rms_reference(x, gamma):
    """The model's unfused RMSNorm (``--no-persist-layer-norm``)."""
    return RMSNorm._normalize(SimpleNamespace(fused=False, eps=1e-5), x, gamma, None)


def _swiglu_reference(x):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _bda_reference(x, bias, residual):
    torch.manual_seed(3)
    return residual + F.dropout(x + bias, p=0.25, training=True)


def _bda_fused(x, bias, residual):
    torch.manual_seed(3)
    return fused_bias_dropout_add(x, bias, residual, 0.25, True)


def _cases(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 2, 16, dtype=dtype)  # [s, b, h]
    gamma = (1 + 0.1 * torch.randn(16)).to(dtype)
    bias = torch.randn(16, dtype=dtype)
    t = torch.randn(6, 2, 4, 8, dtype=dtype)  # [s, b, n, d]
    freqs = torch.randn(6, 1, 1, 6)  # [s, 1, 1, r]: a partial rotation
    scores = 4 * torch.randn(2, 3, 6, 6, dtype=dtype)  # [b, heads, sq, sk]
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # [sq, sk], True: blocked
    position_bias = torch.randn(1, 3, 6, 6).masked_fill(causal, torch.finfo(torch.float32).min)  # additive, fp32

    def softmax_case(mask, coeff, in_fp32):
        args = (mask, 0.3, coeff, in_fp32, dtype)
        return (lambda a: fused_scale_mask_softmax(a, *args), lambda a: scale_mask_softmax(a, *args), (scores,))

    return {
        "masked_softmax_causal_qk_layer_scaling": softmax_case(causal, 3.0, True),
        "masked_softmax_additive_bias": softmax_case(position_bias, 1.0, True),
        "softmax_unmasked_in_dtype": softmax_case(None, 1.0, False),
        "rmsnorm": (lambda a, g: fused_rms_norm(a, g, 1e-5), _rms_reference, (x, gamma)),
        "swiglu": (fused_swiglu, _swiglu_reference, (x,)),
        "gelu": (lambda a: fused_activation(a, F.gelu), F.gelu, (x,)),
        "bias_dropout_add": (_bda_fused, _bda_reference, (x, bias, x.flip(0))),
        "bias_add_eval": (
            lambda a, b, r: fused_bias_dropout_add(a, b, r, 0.25, False),
            lambda a, b, r: r + (a + b),
            (x, bias, x.flip(0)),
        ),
        "rope": (
            lambda a: apply_rotary_pos_emb(a, freqs, False, 0.9, fused=True),
            lambda a: apply_rotary_pos_emb(a, freqs, False, 0.9),
            (t,),
        ),
        "rope_interleaved": (
            lambda a: apply_rotary_pos_emb(a, freqs, True, fused=True),
            lambda a: apply_rotary_pos_emb(a, freqs, True),
            (t,),
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_ops_match_their_references(dtype):
    for name, (fused, reference, inputs) in _cases(dtype).items():
        try:
            _same(_grads(fused, *inputs), _grads(reference, *inputs), dtype)
        except AssertionError as error:
            raise AssertionError(f"{name} ({dtype}): {error}") from None


def test_fused_norm_and_swiglu_save_only_their_input_and_statistics():
    """Saved bytes under bf16: RMSNorm keeps x (bf16) + rstd (fp32 per row), not an fp32 copy; SwiGLU keeps x."""
    x = torch.randn(8, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    gamma = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            fn()
        return sum(sizes)

    rows = 8 * 2
    fused_norm = saved_bytes(lambda: fused_rms_norm(x, gamma, 1e-5))
    assert fused_norm == x.numel() * 2 + rows * 4 + gamma.numel() * 2
    assert saved_bytes(lambda: _rms_reference(x, gamma)) > fused_norm + x.numel() * 4  # an fp32 copy and more
    assert saved_bytes(lambda: fused_swiglu(x)) == x.numel() * 2
    assert saved_bytes(lambda: _swiglu_reference(x)) >= x.numel() * 2 * 3 // 2


def _compile_counts():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def compiling(monkeypatch):
    """torch.compile on (the default tier turns dynamo off), fresh caches before and after."""
    import torch._dynamo

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    torch._dynamo.reset()
    jit.set_jit_fuser_enabled(True)
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


def test_fused_regions_compile_once_per_shape(compiling):
    """The bias-add region: compiled once for a shape, not again on later steps (a new shape would compile
    once more: ``dynamic=False``); with the fuser off nothing compiles."""
    assert jit.jit_fuser_enabled()
    x, bias = torch.randn(4, 2, 8), torch.randn(8)
    before = _compile_counts()
    for _ in range(3):
        out = fused_bias_dropout_add(x, bias, x, 0.0, True)
    assert _compile_counts() - before == 1
    torch.testing.assert_close(out, x + (x + bias))
    assert any(name.startswith("_bias_add") for name, _ in jit.compile_log())
    jit.set_jit_fuser_enabled(False)  # --disable-jit-fuser: eager, nothing compiled
    fused_bias_dropout_add(torch.randn(7, 2, 8), bias, torch.randn(7, 2, 8), 0.0, True)  # a new shape
    assert _compile_counts() - before == 1
    jit.set_jit_fuser_enabled(True)


def test_a_region_that_cannot_compile_runs_unfused_with_a_warning(monkeypatch, caplog):
    """No C++ compiler for Inductor (or any compile failure): the region warns once and runs eagerly."""
    calls = []

    def compile_that_fails(fn, **kwargs):
        def run(*args):
            calls.append(args)
            raise RuntimeError("no working C++ compiler found")

        return run

    monkeypatch.setattr(jit, "jit_fuser_enabled", lambda: True)
    monkeypatch.setattr(torch, "compile", compile_that_fails)

    def _double(x):
        return x * 2

    region, x = jit.jit_fuser(_double), torch.arange(3.0)
    with caplog.at_level("WARNING", logger=jit.__name__):
        assert torch.equal(region(x), x * 2) and torch.equal(region(x), x * 2)
    assert len(calls) == 1  # tried once, then eager
    assert "_double runs unfused (compiling failed: RuntimeError: no working C++ compiler found)" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_fused_ops_match_their_references(compiling, dtype):
    """Every region compiled (fullgraph: a graph break raises), against the eager references; each compiles
    once: a second call of every case adds no graph."""
    cases = _cases(dtype)
    for name, (fused, reference, inputs) in cases.items():
        try:
            _same(_grads(fused, *inputs), _grads(reference, *inputs), dtype)
        except AssertionError as error:
            raise AssertionError(f"compiled {name} ({dtype}): {error}") from None
    graphs = _compile_counts()
    for fused, _, inputs in cases.values():
        _grads(fused, *inputs)
    assert _compile_counts() == graphs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weight_gradient_accumulates_in_fp32_inside_the_gemm(dtype):
    """--gradient-accumulation-fusion with a bf16/fp16 weight and an fp32 main_grad: main_grad gains the fp32
    product of the operands (no per-microbatch rounding of dW to the weight's dtype), over two microbatches."""
    from megatron.core.tensor_parallel.linear_function import parallel_linear

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 16).to(dtype))
    weight.main_grad = torch.randn(24, 16)  # fp32, as DDP's buffer
    want = weight.main_grad.clone()
    for _ in range(2):
        x = torch.randn(5, 3, 16).to(dtype).requires_grad_()  # [s, b, h]
        dy = torch.randn(5, 3, 24).to(dtype)
        parallel_linear(x, weight, None, None, fuse_wgrad_accumulation=True).backward(dy)
        want += dy.reshape(-1, 24).float().t() @ x.detach().reshape(-1, 16).float()
    torch.testing.assert_close(weight.main_grad, want, rtol=1e-6, atol=1e-5)
    assert weight.grad_added_to_main_grad
    rounded = (dy.reshape(-1, 24).t() @ x.detach().reshape(-1, 16)).float()  # what the old path added
    assert not torch.equal(rounded, dy.reshape(-1, 24).float().t() @ x.detach().reshape(-1, 16).float())
