"""Long-context attention memory per CP rank: the ring (p2p) and Ulysses (a2a) schemes against all_gather.

One causal attention layer (``DotProductAttention``, grouped-query heads) runs forward and backward
on CPU gloo ranks at sequence length ``--seq`` for each ``--cp`` and scheme. ``tests.tensor_meter``
records, per rank, the peak of live bytes the step allocates (the inputs q, k, v not counted), the
largest tensor any op creates and the largest autograd saves. Printed beside the formulas:

* p2p / a2a: ``s/cp * b * 4 B * (A*h*d + B*g*d)`` (outputs, log-sum-exp, ring buffers, gradients:
  linear in s/cp) plus the tile workspace ``~ 6 * tile * b * h * 4 B`` (constant), so the peak per
  rank falls as 1/cp, and no tensor is s x s;
* all_gather: ``s/cp * s * (8 + 1 + 4) B`` (the int64 position offsets, the boolean mask, SDPA's
  float mask of this rank's queries against every key) plus the gathered keys and values
  ``2 * s * b * g * d * 4 B``: quadratic in s. Measured only up to ``--all-gather-max-seq`` (it needs
  ~13 GB per rank at s = 32k, cp = 2); above that the formula alone is printed.

Usage: ``python benchmarks/bench_long_context.py --seq 8192 --cp 2 4`` (~20 min on 2 busy CPU cores; the
time grows as s^2: ``--seq 32768`` is a few hours there). ``a2a`` needs ``--heads`` divisible by each cp.

Measured (2026-12-02, 2 CPU cores shared with other jobs; heads 2, groups 1, head dim 16, tile 32768, s = 16384):
p2p peak 10.9 MiB/rank at cp=2, 6.6 at cp=4 (formula 13.8, 7.6); a2a 16.0 MiB at cp=2; the largest tensor
created or saved was q-sized ``[1, 2, s/cp, 16]`` (p2p) or a 512 Ki-element score tile (a2a), against s*s = 268 M.
At s = 8192 (4 heads, 2 groups) see the README table; at s = 32768, 4 heads, 2 groups, cp=4: p2p 23.8 MiB/rank
(formula 27.5), largest tensor ``[1, 4, 8192, 16]``, 378 s.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict

import torch

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer import tiled_attention
from megatron.core.transformer.attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.tensor_meter import TensorMeter

MIB = 1 << 20


def _step(rank: int, world: int, scheme: str, shape: Dict[str, int]) -> Dict[str, object]:
    """One fwd+bwd on this rank's ``[s/cp, 1, heads, d]``; what the meter saw and the time."""
    torch.set_num_threads(1)
    tiled_attention.TILE_ELEMENTS = shape["tile"]
    cp = build_process_groups(ParallelLayout(world_size=world, context_parallel_size=world)).cp if world > 1 else None
    h, g, d, s = shape["heads"], shape["groups"], shape["dim"], shape["seq"]
    config = TransformerConfig(
        num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g, attention_dropout=0.0,
        cp_comm_type=scheme,
    )  # fmt: skip
    attention = DotProductAttention(config, 1, cp_group=cp)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(s // world, 1, n, d, generator=gen, requires_grad=True) for n in (h, g, g))
    grad = torch.randn(s // world, 1, h * d, generator=gen)
    start = time.perf_counter()
    with TensorMeter() as meter:
        attention(q, k, v, None).backward(grad)
    return dict(peak=meter.peak_bytes, created=meter.largest_created, saved=meter.largest_saved,
                seconds=time.perf_counter() - start)  # fmt: skip


def linear_formula(seq: int, cp: int, shape: Dict[str, int]) -> int:
    """p2p / a2a bytes per rank: terms linear in s/cp (b = 1, fp32) plus the constant tile workspace."""
    h, g, d = shape["heads"], shape["groups"], shape["dim"]
    return seq // cp * 4 * (6 * h * d + 12 * g * d + 4 * h) + 6 * shape["tile"] * h * 4


def all_gather_formula(seq: int, cp: int, shape: Dict[str, int]) -> int:
    """all_gather bytes per rank: the [s/cp, s] offsets (int64), mask (bool) and SDPA float mask, gathered K/V."""
    return seq // cp * seq * (8 + 1 + 4) + 2 * seq * shape["groups"] * shape["dim"] * 4


def _report(scheme: str, seq: int, cp: int, shape: Dict[str, int]) -> None:
    results = run_distributed(_step, cp, scheme, dict(shape, seq=seq), timeout=3600)
    peak = max(r["peak"] for r in results)
    formula = (all_gather_formula if scheme == "all_gather" else linear_formula)(seq, cp, shape)
    r = results[0]
    print(
        f"{scheme:10s} s={seq:6d} cp={cp}: peak {peak / MIB:9.1f} MiB/rank (formula {formula / MIB:9.1f}); "
        f"largest created {r['created'][1]}, saved {r['saved'][1]} (s*s = {seq * seq}); {r['seconds']:.1f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schemes", nargs="+", default=["p2p", "a2a", "all_gather"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--tile", type=int, default=1 << 16, help="scores per query tile and head")
    parser.add_argument("--all-gather-max-seq", type=int, default=4096)
    args = parser.parse_args()
    shape = dict(heads=args.heads, groups=args.groups, dim=args.dim, tile=args.tile)
    for scheme in args.schemes:
        for cp in args.cp:
            seq = min(args.seq, args.all_gather_max_seq) if scheme == "all_gather" else args.seq
            _report(scheme, seq, cp, shape)
            if seq < args.seq:
                formula = all_gather_formula(args.seq, cp, shape)
                print(f"{'':10s} s={args.seq:6d} cp={cp}: formula {formula / MIB:9.1f} MiB/rank", flush=True)


if __name__ == "__main__":
    main()
