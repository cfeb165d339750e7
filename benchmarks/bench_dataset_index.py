"""Time the GPT dataset index builders on synthetic document lengths (no data files).

Usage: python benchmarks/bench_dataset_index.py [--tokens 1e9] [--seq-length 2048] [--blend-samples 1e6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron.core.datasets import helpers


def _timed(label: str, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    print(f"{label:<28s} {time.perf_counter() - start:8.3f} s")
    return out


def bench_gpt_indices(num_tokens: int, seq_length: int, mean_doc_len: int, seed: int) -> float:
    """Build the document, sample and shuffle indices for ``num_tokens`` tokens; return seconds."""
    rng = np.random.RandomState(seed)
    num_docs = max(1, num_tokens // mean_doc_len)
    # Skewed lengths like real text: many short documents, a few long ones.
    lengths = np.maximum(1, rng.exponential(mean_doc_len, size=num_docs)).astype(np.int32)
    tokens = int(lengths.astype(np.int64).sum())
    num_samples = (tokens - 1) // seq_length  # exactly one epoch
    print(f"{num_docs:,} documents, {tokens:,} tokens, {num_samples:,} samples of {seq_length}")
    start = time.perf_counter()
    shuffle_rng = np.random.RandomState(seed)
    docs = np.arange(num_docs)
    doc_index = _timed("document index", helpers.build_document_index, docs, 1, shuffle_rng, False)
    sample_index = _timed("sample index", helpers.build_sample_index, lengths, doc_index, seq_length)
    _timed(
        "shuffle index", helpers.build_shuffle_index, sample_index.shape[0] - 1, sample_index.shape[0] - 1, shuffle_rng
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--mean-doc-length", type=int, default=500)
    parser.add_argument("--blend-samples", type=float, default=1e6)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    total = bench_gpt_indices(int(args.tokens), args.seq_length, args.mean_doc_length, args.seed)
    print(f"{'GPT indices total':<28s} {total:8.3f} s")
    if args.blend_samples > 0:
        _timed(
            f"blend {int(args.blend_samples):,} x 2 datasets",
            helpers.build_blending_indices,
            [0.3, 0.7],
            int(args.blend_samples),
        )


if __name__ == "__main__":
    main()
