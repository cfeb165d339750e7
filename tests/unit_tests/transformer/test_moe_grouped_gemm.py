"""``moe_grouped_gemm``: ``GroupedMLP`` (two ``torch._grouped_mm`` calls over the local experts)
equals ``SequentialMLP`` (one MLP call per expert) in output and every gradient, with and without
biases, gated or not, with an expert that gets no tokens; fp32 at rtol 1e-5 / atol 1e-6 (only
the order of float additions inside the GEMMs differs). Where ``_grouped_mm`` does not take the
dtype (fp64) it runs the loop. The two classes have the same parameters, so their state dicts
load into each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import experts
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.gpu.fake_cuda import fake_world

T, E, H, FFN = 13, 4, 8, 16
RTOL, ATOL = 1e-5, 1e-6
VARIANTS = {
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False),
    "gelu_bias": dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True),
}


class _CountGroupedMM(TorchDispatchMode):
    """Counts ``_grouped_mm`` calls and logs each one's group sizes and operand shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.groups = []  # (group sizes, shapes of the two operands)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            self.calls += 1
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            self.groups.append((sizes, tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **kwargs)


def _routing():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=g)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, logits.topk(2, dim=1).indices, True)
    routing_map[:, 1] = False  # an expert without tokens
    return torch.softmax(logits, dim=-1), routing_map


def _pair(variant: str, groups, dtype=torch.float32):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        params_dtype=dtype,
        **VARIANTS[variant],
    )
    torch.manual_seed(0)
    sequential = SequentialMLP(E, config, pg_collection=groups)
    grouped = GroupedMLP(E, config, pg_collection=groups)
    grouped.load_state_dict(sequential.state_dict())  # the same keys and shapes, both ways
    sequential.load_state_dict(grouped.state_dict())
    with torch.no_grad():
        for p in sequential.parameters():
            if p.dim() == 1:
                p.normal_()  # non-zero biases, so their use is checked
        grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def _run(module, tokens, probs, routing_map, dy):
    tokens, probs = tokens.detach().requires_grad_(True), probs.detach().requires_grad_(True)
    with _CountGroupedMM() as counter:
        out = module(tokens, probs, routing_map)
        out.backward(dy)
    grads = {n: p.grad for n, p in module.named_parameters()}
    _run.groups = counter.groups
    return out.detach(), tokens.grad, probs.grad, grads, counter.calls


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grouped_equals_sequential_in_output_and_every_gradient(variant):
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        sequential, grouped = _pair(variant, groups)
        assert list(sequential.state_dict()) == list(grouped.state_dict())
        probs, routing_map = _routing()
        g = torch.Generator().manual_seed(6)
        tokens, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        ref = _run(sequential, tokens, probs, routing_map, dy)
        got = _run(grouped, tokens, probs, routing_map, dy)
        assert (ref[-1], got[-1]) == (0, 6), "two grouped GEMMs forward; backward: dX and dW of each"
        for name, a, b in zip(("output", "token grad", "prob grad"), got[:3], ref[:3]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{variant} {name}: {m}")
        assert got[3].keys() == ref[3].keys()
        for name in ref[3]:
            assert got[3][name] is not None, f"{name}: every expert gets a gradient (zeros without tokens)"
            torch.testing.assert_close(got[3][name], ref[3][name], rtol=RTOL, atol=ATOL, msg=name)


def test_unsupported_dtype_runs_the_loop_and_bf16_runs_grouped():
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        probs, routing_map = _routing()
        g = torch.Generator().manual_seed(7)
        tokens, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        sequential, grouped = _pair("gelu_bias", groups, torch.float64)
        ref = _run(sequential, tokens.double(), probs.double(), routing_map, dy.double())
        got = _run(grouped, tokens.double(), probs.double(), routing_map, dy.double())
        assert got[-1] == 0 and torch.equal(got[0], ref[0])
        sequential, grouped = _pair("swiglu", groups, torch.bfloat16)
        bf16 = [t.bfloat16() for t in (tokens, probs, dy)]
        ref = _run(sequential, bf16[0], bf16[1], routing_map, bf16[2])
        got = _run(grouped, bf16[0], bf16[1], routing_map, bf16[2])
        assert got[-1] > 0 and got[0].dtype == torch.bfloat16
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype, align, tol", [(torch.float32, 4, (RTOL, ATOL)), (torch.bfloat16, 8, (1e-2, 1e-2))])
def test_each_experts_rows_are_padded_to_16_bytes_and_padding_changes_nothing(dtype, align, tol, monkeypatch):
    """The kernel gets groups of a multiple of 16 bytes / element size rows, every operand's token
    dimension covering them; outputs and gradients equal the unpadded run's (up to the GEMMs'
    summation order: the zero rows change how the kernel blocks the sums)."""
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        probs, routing_map = _routing()
        counts = routing_map.sum(0).tolist()
        assert any(c % align for c in counts), counts  # something to pad
        g = torch.Generator().manual_seed(8)
        tokens, dy = (torch.randn(T, H, generator=g).to(dtype) for _ in range(2))
        _, grouped = _pair("gelu_bias", groups, dtype)
        got = _run(grouped, tokens, probs.to(dtype), routing_map, dy)
        padded = [-(-c // align) * align for c in counts]
        for sizes, a, b in _run.groups:
            assert sizes == padded, (sizes, counts)
            tokens_dim = a[1] if len(b) == 2 else a[0]  # dW: [out, M] x [M, in]; else [M, k] x [E, k, n]
            assert tokens_dim == sum(padded) and (len(b) == 2 or b[0] == E), (a, b)
        monkeypatch.setattr(experts, "group_alignment", lambda dtype: 1)
        ref = _run(grouped, tokens, probs.to(dtype), routing_map, dy)
        assert all(sizes == counts for sizes, _, _ in _run.groups)
        for a, b in zip(got[:3], ref[:3]):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1])
        for name in ref[3]:
            torch.testing.assert_close(got[3][name].float(), ref[3][name].float(), rtol=tol[0], atol=tol[1], msg=name)


def test_backward_keeps_the_expert_weights_not_a_stacked_copy():
    """What the grouped GEMMs save for backward: the parameters themselves, no ``[E, ...]`` stack."""
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        _, grouped = _pair("swiglu", groups)
        probs, routing_map = _routing()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            grouped(torch.randn(T, H, requires_grad=True), probs, routing_map)
        stacks = [tuple(t.shape) for t in saved if t.dim() == 3]
        assert not stacks, f"stacked expert weights kept for backward: {stacks}"
        storages = {t.untyped_storage().data_ptr() for t in saved}
        weights = [p for n, p in grouped.named_parameters() if n.endswith("weight")]
        assert all(w.untyped_storage().data_ptr() in storages for w in weights)
