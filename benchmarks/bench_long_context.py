"""Long-context attention memory per CP rank: ring (p2p), Ulysses (a2a) and hierarchical (a2a+p2p) against all_gather.

One causal attention layer (``DotProductAttention``) runs forward and backward on CPU gloo ranks at
sequence length ``--seq`` for each ``--cp`` and scheme (``a2a+p2p`` where cp = 4: 2 x 2).
``tests.tensor_meter`` (an allocation hook, ``TorchDispatchMode``, seeing every op's outputs, and a
saved-tensor hook) records per rank the peak of live bytes the step allocates (the inputs q, k, v
not counted), the largest tensor any op creates and the largest autograd saves; the largest is
printed beside s*s. Printed beside the formulas (``n = s/cp`` tokens per rank, fp32, b = 1):

* p2p / a2a / a2a+p2p: ``n * 4 B * (6*h*d + 12*g'*d + 4*h + 3*TILE_ROWS*h/A)``: outputs, log-sum-exp,
  ring buffers and gradients, and the score tiles (``TILE_ROWS`` queries against a block's ``n/2`` keys;
  after an all-to-all over ``A`` ranks, ``TILE_ROWS/A`` queries against ``A*n/2`` keys on ``h/A`` heads;
  about six tile-sized tensors live at once). ``g'``: the
  key/value groups a rank holds per local token, ``g`` (p2p), ``lcm(g, a2a size)`` (a2a repeats groups
  up to a multiple of its size). Every term is linear in s/cp (a2a's tiles: in s/cp^2): the peak at
  least halves from cp = 2 to cp = 4 (the summary line prints the measured ratio; with ``g < cp`` a2a's
  repeated groups do not shrink);
* all_gather: ``n * s * (8 + 1 + 4) B`` (the int64 position offsets, the boolean mask, SDPA's float
  mask of this rank's queries against every key) plus the gathered keys and values ``2*s*g*d*4 B``:
  quadratic in s. Run only up to ``--all-gather-max-seq``; above that the formula alone is printed.

Usage: ``python benchmarks/bench_long_context.py --seq 8192 --cp 2 4`` (minutes on 2 busy CPU cores; the
time grows as s^2). ``a2a`` needs ``--heads`` divisible by lcm(groups, cp). Measured numbers: README.md,
"Long context".
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Dict, List, Optional

import torch

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer import tiled_attention
from megatron.core.transformer.attention import DotProductAttention, cp_groups_of
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.tensor_meter import TensorMeter

MIB = 1 << 20
HALVING_TOLERANCE = 0.1  # the measured cp=2 / cp=4 peak ratio must be at least 2 * (1 - this)


def _nested(scheme: str, cp: int) -> Optional[List[int]]:
    """hierarchical_context_parallel_sizes of ``scheme`` at ``cp`` ranks: [2, cp/2] for a2a+p2p."""
    return [2, cp // 2] if scheme == "a2a+p2p" else None


def _step(rank: int, world: int, scheme: str, shape: Dict[str, int]) -> Dict[str, object]:
    """One fwd+bwd on this rank's ``[s/cp, 1, heads, d]``; what the meter saw and the time."""
    torch.set_num_threads(1)
    tiled_attention.TILE_ROWS = shape["tile_rows"]
    layout = ParallelLayout(
        world, context_parallel_size=world, hierarchical_context_parallel_sizes=_nested(scheme, world)
    )
    groups = build_process_groups(layout)
    h, g, d, s = shape["heads"], shape["groups"], shape["dim"], shape["seq"]
    config = TransformerConfig(
        num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g, attention_dropout=0.0,
        cp_comm_type=scheme,
    )  # fmt: skip
    attention = DotProductAttention(config, 1, **cp_groups_of(groups))
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(s // world, 1, n, d, generator=gen, requires_grad=True) for n in (h, g, g))
    grad = torch.randn(s // world, 1, h * d, generator=gen)
    start = time.perf_counter()
    with TensorMeter() as meter:
        attention(q, k, v, None).backward(grad)
    return dict(peak=meter.peak_bytes, created=meter.largest_created, saved=meter.largest_saved,
                seconds=time.perf_counter() - start)  # fmt: skip


def linear_formula(scheme: str, seq: int, cp: int, shape: Dict[str, int]) -> int:
    """p2p / a2a / a2a+p2p bytes per rank (b = 1, fp32): every term linear in s/cp (module docstring)."""
    h, g, d, n = shape["heads"], shape["groups"], shape["dim"], seq // cp
    a2a = {"p2p": 1, "a2a": cp, "a2a+p2p": 2}[scheme]
    held = g * a2a // math.gcd(g, a2a)  # key/value groups per local token after a2a's repetition
    return n * 4 * (6 * h * d + 12 * held * d + 4 * h + 3 * shape["tile_rows"] * h // a2a)


def all_gather_formula(seq: int, cp: int, shape: Dict[str, int]) -> int:
    """all_gather bytes per rank: the [s/cp, s] offsets (int64), mask (bool) and SDPA float mask, gathered K/V."""
    return seq // cp * seq * (8 + 1 + 4) + 2 * seq * shape["groups"] * shape["dim"] * 4


def _fits(scheme: str, cp: int, shape: Dict[str, int]) -> bool:
    """Whether the a2a exchange of ``scheme`` can split the heads (p2p and all_gather always can)."""
    a2a = {"a2a": cp, "a2a+p2p": 2}.get(scheme, 1)
    return shape["heads"] % (shape["groups"] * a2a // math.gcd(shape["groups"], a2a)) == 0


def _report(scheme: str, seq: int, cp: int, shape: Dict[str, int]) -> int:
    """Run one case, print its line, return the peak bytes per rank."""
    results = run_distributed(_step, cp, scheme, dict(shape, seq=seq), timeout=7200)
    peak = max(r["peak"] for r in results)
    formula = all_gather_formula(seq, cp, shape) if scheme == "all_gather" else linear_formula(scheme, seq, cp, shape)
    created = max(r["created"] for r in results)
    saved = max(r["saved"] for r in results)
    print(
        f"{scheme:10s} s={seq:6d} cp={cp}: peak {peak / MIB:9.1f} MiB/rank (formula {formula / MIB:9.1f}); "
        f"largest created {created[1]} = {created[0]}, saved {saved[1]} = {saved[0]} elements "
        f"(s*s = {seq * seq}); {max(r['seconds'] for r in results):.1f} s",
        flush=True,
    )
    return peak


def _halving(scheme: str, seq: int, peaks: Dict[int, int]) -> None:
    """The summary of one scheme: measured peak per rank at cp=2 over cp=4 against 1/cp's 2."""
    if 2 in peaks and 4 in peaks:
        ratio = peaks[2] / peaks[4]
        holds = ratio >= 2 * (1 - HALVING_TOLERANCE)
        print(
            f"{scheme:10s} s={seq:6d}: peak cp=2 / cp=4 = {ratio:.2f} (falls at least as 1/cp: >= "
            f"{2 * (1 - HALVING_TOLERANCE):.2f}: {'holds' if holds else 'DOES NOT HOLD'})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schemes", nargs="+", default=["p2p", "a2a", "a2a+p2p", "all_gather"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--tile-rows", type=int, default=tiled_attention.TILE_ROWS, help="queries per score tile")
    parser.add_argument("--all-gather-max-seq", type=int, default=4096)
    args = parser.parse_args()
    shape = dict(heads=args.heads, groups=args.groups, dim=args.dim, tile_rows=args.tile_rows)
    for scheme in args.schemes:
        seq = min(args.seq, args.all_gather_max_seq) if scheme == "all_gather" else args.seq
        peaks = {}
        for cp in args.cp:
            if scheme == "a2a+p2p" and cp != 4:
                continue  # [2, 2]: the smallest hierarchy with both levels
            if not _fits(scheme, cp, shape):
                print(f"{scheme:10s} cp={cp}: skipped, --heads {args.heads} not divisible by lcm(groups, a2a size)")
                continue
            if seq > 0:
                peaks[cp] = _report(scheme, seq, cp, shape)
            if seq < args.seq:
                formula = all_gather_formula(args.seq, cp, shape)
                print(
                    f"{scheme:10s} s={args.seq:6d} cp={cp}: formula {formula / MIB:9.1f} MiB/rank (not run)", flush=True
                )
        _halving(scheme, seq, peaks)


if __name__ == "__main__":
    main()
