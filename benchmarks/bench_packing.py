"""Sequence packing for fine-tuning: padding waste and training tokens/s with and without packing.

    python benchmarks/bench_packing.py [--conversations 256] [--seq-length 512] [--steps 3]

A skewed-length conversation set (log-normal lengths: most short, a few near ``--seq-length``) is
laid out three ways, the way ``SFTDataset`` does (``pack_rows``):

* ``padded``: one conversation per row, padded to the row (plain causal attention);
* ``packed``: conversations end to end (``PackedSeqParams``: per-sequence attention, no ``[s, s]`` mask);
* ``packed+mask``: the same rows with a dense ``[1, 1, s, s]`` block-diagonal mask (``--reset-attention-mask``'s way).

Prints, per layout, the rows, the padding waste (padding / row tokens) and the real (conversation)
tokens per second of forward + backward of a small Llama-style GPT on one CPU process, fp32.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.datasets.sft_dataset import pack_rows  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import packed_seq_params_from_lengths  # noqa: E402
from megatron.core.parallel_state import ParallelLayout, build_process_groups  # noqa: E402
from tests.model_utils import llama_style  # noqa: E402

VOCAB = 512


def skewed_lengths(count: int, seq_length: int, seed: int = 0) -> List[int]:
    """Log-normal lengths (median about seq_length / 10), clipped to [8, seq_length]."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(seq_length / 10), 0.9, count)
    return [int(n) for n in np.clip(lengths, 8, seq_length)]


def model(seq_length: int, groups) -> GPTModel:
    """The tests' Llama shape (RMSNorm, SwiGLU, RoPE, 8 heads / 4 groups), 2 x 128."""
    torch.manual_seed(0)
    kw = llama_style(hidden_size=128, ffn_hidden_size=256, vocab_size=VOCAB, max_sequence_length=seq_length)
    return GPTModel(pg_collection=groups, **kw)


def block_diagonal_mask(lengths: List[int], s: int) -> torch.Tensor:
    """``[1, 1, s, s]`` True = blocked: causal within each sequence, nothing across."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [s]
    blocked = (doc[:, None] != doc[None, :]) | torch.ones(s, s, dtype=torch.bool).triu(1)
    return blocked[None, None]


def run_rows(gpt: GPTModel, rows: List[List[int]], lengths: List[int], s: int, layout: str) -> float:
    """Seconds for forward + backward of every row (each row a micro batch of 1)."""
    start = time.perf_counter()
    for row in rows:
        seqs = [lengths[i] for i in row]
        tokens = torch.randint(0, VOCAB, (1, s))
        kw = {}
        if layout == "packed":
            kw["packed_seq_params"] = packed_seq_params_from_lengths(seqs + ([s - sum(seqs)] if sum(seqs) < s else []))
        elif layout == "packed+mask":
            kw["attention_mask"] = block_diagonal_mask(seqs + ([s - sum(seqs)] if sum(seqs) < s else []), s)
        gpt(tokens, None, labels=tokens, **kw).sum().backward()
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> List[Tuple[str, int, float, float]]:
    lengths = skewed_lengths(args.conversations, args.seq_length)
    real = sum(lengths)
    groups = build_process_groups(ParallelLayout(world_size=1))
    gpt = model(args.seq_length, groups)
    results = []
    for layout in ("padded", "packed", "packed+mask"):
        rows = pack_rows(lengths, args.seq_length, layout != "padded", 1)
        waste = 1 - real / (len(rows) * args.seq_length)
        times = [run_rows(gpt, rows, lengths, args.seq_length, layout) for _ in range(args.steps)]
        results.append((layout, len(rows), waste, real / min(times)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="passes over the set; the fastest counts")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            results = measure(args)
        finally:
            dist.destroy_process_group()
    lengths = skewed_lengths(args.conversations, args.seq_length)
    print(
        f"{args.conversations} conversations, lengths min {min(lengths)} median {int(np.median(lengths))} "
        f"max {max(lengths)}, rows of {args.seq_length} tokens"
    )
    print(f"{'layout':<12} {'rows':>5} {'padding waste':>14} {'real tokens/s':>14}")
    for layout, rows, waste, rate in results:
        print(f"{layout:<12} {rows:>5} {waste:>13.1%} {rate:>14.0f}")
    padded, packed = results[0][3], results[1][3]
    print(f"packed / padded tokens/s: {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
