"""Greedy generation speed: our InferenceEngine (KV cache) beside ``transformers``' ``generate`` on the same weights.

A random GPT-2-shaped model (no download), one process, fp32, the same prompts; prints generated tokens per second
for batch 1 and batch 8, the ratio, and whether both produced the same tokens.

Usage: python benchmarks/bench_generation.py [--layers 6] [--hidden 512] [--prompt 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Tuple

import torch
import transformers

if __package__ in (None, ""):  # run as a script: make the repository (tools/) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.inference.engine import InferenceEngine  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.hf_state_dict import from_hf_gpt2, resize_vocab  # noqa: E402
from tools.checkpoint.convert import single_process_group  # noqa: E402
from tools.checkpoint.hf_config import gpt_model_kwargs, megatron_args_from_hf  # noqa: E402


def build_models(args: argparse.Namespace, groups) -> Tuple[transformers.GPT2LMHeadModel, GPTModel]:
    """A random HF GPT-2 and our GPTModel holding its weights, both in eval mode."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=args.hidden // 64,
        n_positions=args.prompt + args.new_tokens,
        architectures=["GPT2LMHeadModel"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    _, flags = megatron_args_from_hf(hf.config.to_dict(), "benchmark model", tp=1, divisible_by=128)
    ours = GPTModel(**gpt_model_kwargs(flags), pg_collection=groups)
    state = resize_vocab(from_hf_gpt2(hf.state_dict(), ours.config), flags["padded_vocab_size"])
    ours.load_state_dict(state, strict=True)
    return hf, ours.eval()


def timed(fn: Callable[[], List[List[int]]], repeats: int) -> Tuple[float, List[List[int]]]:
    """Best wall time of ``repeats`` calls (after one warm-up) and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def compare(batch: int, engine: InferenceEngine, hf, params: SamplingParams, args: argparse.Namespace) -> None:
    """Time both generators on ``batch`` random prompts and print one line."""
    seeded = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, hf.config.vocab_size, (batch, args.prompt), generator=seeded)  # [b, prompt]

    def run_ours() -> List[List[int]]:
        return [r.generated_tokens for r in engine.generate(prompts.tolist(), params)]

    def run_hf() -> List[List[int]]:
        out = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, args.prompt :].tolist()

    t_ours, tok_ours = timed(run_ours, args.repeats)
    t_hf, tok_hf = timed(run_hf, args.repeats)
    n = batch * args.new_tokens
    print(
        f"batch {batch}: ours {n / t_ours:8.1f} tok/s | transformers {n / t_hf:8.1f} tok/s | "
        f"ours/transformers {t_hf / t_ours:5.2f}x | same tokens: {tok_ours == tok_hf}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    with single_process_group() as groups:
        hf, ours = build_models(args, groups)
        engine = InferenceEngine(ours, groups)
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=args.new_tokens)
        print(f"GPT-2 shape: {args.layers} layers, hidden {args.hidden}, prompt {args.prompt}, {args.new_tokens} new")
        for batch in (1, 8):
            compare(batch, engine, hf, params, args)


if __name__ == "__main__":
    main()
