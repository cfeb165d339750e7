"""The LM loss alone: the fused cross entropy (``--cross-entropy-loss-fusion``) beside the reference and torch.

Forward + backward of the per-token loss of ``[s, b, V]`` logits (one rank, the whole vocabulary), the three
stepped alternately in one process so that load from other jobs hits them alike; the first round (the fused
regions compile) is dropped, the medians printed with the bytes each saves for backward beyond its inputs:

* ``reference``: ``tensor_parallel.vocab_parallel_cross_entropy`` (pretrain_gpt.py's default);
* ``fused``: ``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`` (compiled regions);
* ``torch``: ``F.cross_entropy`` on the logits upcast to fp32, as the plain loop of bench_step_vs_plain.py.

Usage: python benchmarks/bench_cross_entropy.py [--seq 512] [--batch 4] [--vocab 50304] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402


def _losses(target: torch.Tensor) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    group = dist.group.WORLD
    return {
        "reference": lambda x: vocab_parallel_cross_entropy(x, target, tp_group=group),
        "fused": lambda x: fused_vocab_parallel_cross_entropy(x, target, tp_group=group),
        "torch": lambda x: F.cross_entropy(x.flatten(0, 1).float(), target.flatten(), reduction="none"),
    }


def _saved_bytes(fn: Callable, logits: torch.Tensor) -> int:
    """Bytes ``fn`` saves for backward in tensors that do not share the logits' storage."""
    leaf = logits.clone().requires_grad_(True)
    mine, sizes = leaf.untyped_storage().data_ptr(), []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != mine:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(leaf)
    return sum(sizes)


def measure(logits: torch.Tensor, target: torch.Tensor, rounds: int) -> Dict[str, float]:
    """Median seconds of forward + backward of each loss, alternating, the first round dropped."""
    times: Dict[str, list] = {name: [] for name in _losses(target)}
    for _ in range(rounds):
        for name, fn in _losses(target).items():
            leaf = logits.clone().requires_grad_(True)
            start = time.perf_counter()
            fn(leaf).mean().backward()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds; the first is dropped")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        print(f"[{args.seq}, {args.batch}, {args.vocab}] logits, {torch.get_num_threads()} threads")
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            logits = torch.randn(args.seq, args.batch, args.vocab, generator=gen).to(dtype)
            target = torch.randint(0, args.vocab, (args.seq, args.batch), generator=gen)
            seconds = measure(logits, target, max(args.rounds, 2))
            cells = [
                f"{name} {seconds[name] * 1e3:8.1f} ms, saves {_saved_bytes(fn, logits) / 2**20:7.1f} MiB"
                for name, fn in _losses(target).items()
            ]
            print(
                f"{str(dtype).removeprefix('torch.')} (load {os.getloadavg()[0]:.1f}): " + "; ".join(cells), flush=True
            )
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
