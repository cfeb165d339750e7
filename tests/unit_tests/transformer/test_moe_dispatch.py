"""The experts find their tokens with one sort of the routing map and one host read of the counts,
not a ``nonzero`` (host sync) per expert; tokens, probabilities and outputs are the same."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.experts import SequentialMLP, sort_by_expert
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.gpu.fake_cuda import fake_world

T, E, H = 11, 4, 8


def _routing(dtype: torch.dtype = torch.bool):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, logits.topk(2, dim=1).indices, True)
    routing_map[:, 2] = False  # an expert without tokens
    return torch.softmax(logits, dim=-1), routing_map.to(dtype)  # [T, E] each


class _CountNonzero(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.nonzero.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_sort_by_expert_equals_nonzero_per_expert(dtype):
    probs, routing_map = _routing(dtype)
    indices, weights = sort_by_expert(probs, routing_map)
    for e in range(E):
        expected = routing_map[:, e].nonzero(as_tuple=True)[0]
        assert torch.equal(indices[e], expected) and torch.equal(weights[e], probs[expected, e]), e


def test_experts_forward_without_nonzero_equals_the_per_expert_loop():
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        config = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=2,
            num_moe_experts=E,
            moe_ffn_hidden_size=16,
            use_cpu_initialization=True,
        )
        torch.manual_seed(0)
        experts = SequentialMLP(E, config, pg_collection=groups)
        device = next(experts.parameters()).device  # the GPU where there is one
        tokens = torch.randn(T, H, device=device)
        probs, routing_map = (t.to(device) for t in _routing())
        expected = torch.zeros_like(tokens)
        for e, expert in enumerate(experts.local_experts):  # the former loop
            index = routing_map[:, e].nonzero(as_tuple=True)[0]
            out, bias = expert(tokens[index])
            out = out + bias if bias is not None else out
            expected = expected.index_add(0, index, out * probs[index, e].unsqueeze(-1))
        with _CountNonzero() as counter:
            got = experts(tokens, probs, routing_map)
        assert counter.calls == 0
        assert torch.equal(got, expected)
