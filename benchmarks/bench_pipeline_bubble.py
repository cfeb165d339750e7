"""Measure the pipeline bubble of the 1F1B and interleaved schedules against (p-1)/(v*m).

A synthetic pipeline runs through the real executor and p2p layer on gloo processes:
each stage's forward sleeps ``t_f / v`` per chunk and its backward ``t_b / v``, so the
compute time is fixed and needs no core (the machine may have fewer cores than ranks).
Reported: bubble = (wall - busy) / busy, where busy = m * (t_f + t_b) per rank.
Each p2p batch costs about 1 ms on gloo over loopback; with 2*v*m batches per rank this
adds ~2*v*m ms over the theory, hence the default stage times of 100/200 ms; each case runs
twice and the faster run counts (other load only adds time).

Usage: python benchmarks/bench_pipeline_bubble.py [--t-forward-ms 100] [--t-backward-ms 200] [--repeats 2]

Measured (2-core CPU, 2026-11-30, defaults; 1.5 minutes), bubble beside (p-1)/(v*m):
    p=2: m=4 v=1 0.258/0.250, v=2 0.140/0.125; m=8 v=1 0.132/0.125, v=2 0.074/0.062;
         m=16 v=1 0.069/0.062, v=2 0.043/0.031
    p=4: m=4 v=1 0.762/0.750, v=2 0.396/0.375; m=8 v=1 0.384/0.375, v=2 0.205/0.188;
         m=16 v=1 0.195/0.188, v=2 0.112/0.094
    every case within +0.021 of the theory (the excess is the p2p latency).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.pipeline_parallel import get_forward_backward_func

SHAPE = (4, 1, 8)  # [s, b, h]: tiny, so communication is not what is measured


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t_forward: float, t_backward: float) -> torch.Tensor:
        ctx.t_backward = t_backward
        time.sleep(t_forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.t_backward)
        return grad, None, None


class SleepChunk(torch.nn.Module):
    """One model chunk whose forward and backward take fixed times."""

    def __init__(self, t_forward: float, t_backward: float, first: bool) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            pipeline_dtype=torch.float32,
            hidden_size=SHAPE[2],
            sequence_parallel=False,
            variable_seq_lengths=False,
            calculate_per_token_loss=False,
            no_sync_func=None,
            grad_scale_func=None,
            finalize_model_grads_func=None,
        )
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.t_forward, self.t_backward, self.first = t_forward, t_backward, first
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self) -> torch.Tensor:
        x = torch.ones(SHAPE) if self.first else self.input_tensor  # [s, b, h]
        return _Sleep.apply(x * self.weight, self.t_forward, self.t_backward)


def _step(data_iterator, model):
    return model(), lambda out: (out.mean(), {})


def _time_one(groups, p: int, m: int, v: int, t_f: float, t_b: float) -> float:
    rank = groups.rank_in("pp")
    chunks = [SleepChunk(t_f / v, t_b / v, first=rank == 0 and c == 0) for c in range(v)]
    func = get_forward_backward_func(p, v)
    dist.barrier(group=groups.pp)
    start = time.perf_counter()
    func(
        forward_step_func=_step,
        data_iterator=[None] * v,
        model=chunks,
        num_microbatches=m,
        seq_length=SHAPE[0],
        micro_batch_size=SHAPE[1],
        pg_collection=groups,
    )
    dist.barrier(group=groups.pp)
    return time.perf_counter() - start


def _worker(
    rank: int, world: int, store: str, cases: List[Tuple[int, int]], t_f: float, t_b: float, repeats: int, out: mp.Queue
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups = build_process_groups(ParallelLayout(world_size=world, pipeline_model_parallel_size=world))
    for v in (1, 2):  # warm-up: connections, first-call costs
        _time_one(groups, world, world, v, 0.001, 0.001)
    for m, v in cases:
        # Other load only ever adds time: the fastest of several runs is the schedule's own.
        wall = min(_time_one(groups, world, m, v, t_f, t_b) for _ in range(repeats))
        if rank == 0:
            out.put((world, m, v, wall))
    dist.destroy_process_group()


def measure(
    p: int, cases: List[Tuple[int, int]], t_f: float, t_b: float, repeats: int = 1
) -> Dict[Tuple[int, int, int], float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, p, store, cases, t_f, t_b, repeats, out)) for r in range(p)]
        for proc in procs:
            proc.start()
        results = {}
        for _ in cases:
            world, m, v, wall = out.get(timeout=300)
            results[(world, m, v)] = wall
        for proc in procs:
            proc.join(60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-forward-ms", type=float, default=100.0)
    parser.add_argument("--t-backward-ms", type=float, default=200.0)
    parser.add_argument("--repeats", type=int, default=2, help="time each case this often, keep the fastest")
    args = parser.parse_args()
    t_f, t_b = args.t_forward_ms / 1e3, args.t_backward_ms / 1e3
    cases = [(m, v) for m in (4, 8, 16) for v in (1, 2)]
    print(f"t_forward={args.t_forward_ms} ms, t_backward={args.t_backward_ms} ms per microbatch per stage")
    print(f"{'p':>2} {'m':>3} {'v':>2} {'wall s':>8} {'bubble':>8} {'(p-1)/(vm)':>11} {'diff':>7}")
    for p in (2, 4):
        for (_world, m, v), wall in sorted(measure(p, cases, t_f, t_b, args.repeats).items()):
            busy = m * (t_f + t_b)
            bubble, theory = (wall - busy) / busy, (p - 1) / (v * m)
            print(f"{p:>2} {m:>3} {v:>2} {wall:8.3f} {bubble:8.3f} {theory:11.3f} {bubble - theory:+7.3f}")


if __name__ == "__main__":
    main()
