"""Time the local experts' forward + backward: ``SequentialMLP`` (one MLP per expert),
``GroupedMLP`` (``torch._grouped_mm`` on per-expert parameters stacked at each forward, the layout
we keep so checkpoints stay interchangeable), and the same grouped GEMMs on weights stacked once
(what stacked ``[E, ...]`` parameters would cost). fp32, one thread, top-2 of random logits;
the median of ``--repeats`` timed steps after two warm-up steps.

Usage: python benchmarks/bench_moe_grouped_gemm.py [--repeats 20]

Measured (2-core CPU shared with other jobs, 2026-12-01, torch 2.13, one thread; ms per forward +
backward; three runs, so the spread shows the noise):
    E=8 h=64  f=128 T=256:  sequential 2.2 / 9.0 / 8.2, grouped (stack per forward) 2.1 / 4.7 / 7.5,
                            pre-stacked 1.5 / 3.6 / 5.6
    E=8 h=256 f=512 T=1024: sequential 71 / 138 / 155, grouped 77 / 136 / 154, pre-stacked 80 / 160 / 124
On a CPU the grouped GEMM saves per-call overhead: small experts gain (pre-stacked weights most: the
per-forward stack copies every expert weight), large ones are the same within the noise. We keep the
per-expert parameters (checkpoints interchangeable with SequentialMLP without any key mapping).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, permute_by_expert
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.gpu.fake_cuda import fake_world

SIZES = ((8, 64, 128, 256), (8, 256, 512, 1024))  # (experts, hidden, ffn, tokens)


def _median_ms(step: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(2):
        step().square().sum().backward()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step().square().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _prestacked(grouped: GroupedMLP, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """The grouped GEMMs on weights stacked once, outside the step."""
    w1 = torch.stack([e.linear_fc1.weight for e in grouped.local_experts]).detach().requires_grad_()
    w2 = torch.stack([e.linear_fc2.weight for e in grouped.local_experts]).detach().requires_grad_()

    def step() -> torch.Tensor:
        ids, weights, counts = permute_by_expert(probs, routing_map)
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[ids], w1.transpose(1, 2), offs=ends).chunk(2, dim=-1)  # [N, f] each
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)  # [N, h]
        return torch.zeros_like(x).index_add(0, ids, out * weights.unsqueeze(-1))

    return step


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    with fake_world(1):
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        for experts, hidden, ffn, tokens in SIZES:
            config = TransformerConfig(
                num_layers=1,
                hidden_size=hidden,
                num_attention_heads=2,
                num_moe_experts=experts,
                moe_ffn_hidden_size=ffn,
                gated_linear_unit=True,
                activation_func=F.silu,
                add_bias_linear=False,
                use_cpu_initialization=True,
            )
            sequential = SequentialMLP(experts, config, pg_collection=groups)
            grouped = GroupedMLP(experts, config, pg_collection=groups)
            x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
            probs = torch.softmax(logits, dim=-1)
            routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, logits.topk(2, dim=1).indices, True)
            steps = {
                "sequential": functools.partial(sequential, x, probs, routing_map),
                "grouped (stack per forward)": functools.partial(grouped, x, probs, routing_map),
                "grouped (pre-stacked)": _prestacked(grouped, x, probs, routing_map),
            }
            for name, step in steps.items():
                print(f"E={experts} h={hidden} f={ffn} T={tokens} {name}: {_median_ms(step, repeats):.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    main(parser.parse_args().repeats)
