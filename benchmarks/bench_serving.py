"""Serving N concurrent requests: the dynamic engine beside the static engine and ``transformers`` ``generate``.

N greedy requests with varied prompt lengths and varied numbers of tokens to generate all arrive at once, on a
random GPT-2-shaped model (no download, one process, fp32, the same weights for all three):

- dynamic: ``DynamicInferenceEngine`` batches every request in flight (continuous batching, paged KV cache);
- static: ``InferenceEngine.generate`` one request at a time, as the server ran it before (a lock around each);
- transformers: ``generate`` one request at a time.

Prints throughput (generated tokens per second of wall time), time to first token (from the common arrival)
and time per output token after the first (mean and p90 over requests), and whether the three produced the
same tokens. The machine may be shared: numbers vary from run to run.

Usage: python benchmarks/bench_serving.py [--requests 32] [--layers 4] [--hidden 256] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch

if __package__ in (None, ""):  # run as a script: make the repository (tools/, benchmarks/) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_generation import build_models  # noqa: E402
from megatron.core.inference.dynamic_context import DynamicInferenceContext  # noqa: E402
from megatron.core.inference.dynamic_engine import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.engine import InferenceEngine  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from tools.checkpoint.convert import single_process_group  # noqa: E402

Timings = Dict[str, List[float]]  # "ttft" and "tpot" per request, "wall" once


def workload(args: argparse.Namespace, vocab: int) -> List[Tuple[List[int], int]]:
    """``args.requests`` (prompt, tokens to generate) pairs with lengths drawn from the given ranges."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.requests):
        length = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        new = int(torch.randint(args.new_min, args.new_max + 1, (1,), generator=g))
        out.append((torch.randint(0, vocab, (length,), generator=g).tolist(), new))
    return out


def run_dynamic(model, groups, work, args) -> Tuple[Timings, List[List[int]]]:
    c = model.config
    longest = args.prompt_max + args.new_max
    context = DynamicInferenceContext(
        c.params_dtype,
        c.num_layers,
        c.kv_channels,
        c.num_query_groups or c.num_attention_heads,
        longest,
        args.buffer_gb,
        max_requests=args.requests,
        max_tokens=args.max_tokens,
        block_size_tokens=args.block_size,
    )
    engine = DynamicInferenceEngine(model, context, pg_collection=groups)
    start = time.monotonic()
    requests = [
        engine.add_request(None, prompt, SamplingParams(temperature=0.0, num_tokens_to_generate=new))
        for prompt, new in work
    ]
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.monotonic() - start
    timings = {"wall": [wall], "ttft": [], "tpot": []}
    for r in requests:
        timings["ttft"].append(r.first_token_time - start)
        timings["tpot"].append((r.finish_time - r.first_token_time) / max(1, len(r.generated_tokens) - 1))
    print(f"  dynamic: {engine.step_count} steps, {context.allocator.reused_blocks} prefix blocks reused")
    return timings, [r.generated_tokens for r in requests]


def run_static(model, groups, work) -> Tuple[Timings, List[List[int]]]:
    engine = InferenceEngine(model, groups, max_sequence_length=model.max_sequence_length)
    first: List[float] = []
    forward = engine._forward

    def timed_forward(chunk, context):  # records when each request's first token's logits exist
        out = forward(chunk, context)
        if not context.is_decode_only():
            first.append(time.monotonic())
        return out

    engine._forward = timed_forward
    return sequential(lambda prompt, new: engine.generate([prompt], greedy(new))[0].generated_tokens, work, first)


def run_hf(hf, work) -> Tuple[Timings, List[List[int]]]:
    first: List[float] = []

    class FirstToken:  # a ``generate`` streamer: the second put is the first new token
        def __init__(self):
            self.puts = 0

        def put(self, _):
            self.puts += 1
            if self.puts == 2:
                first.append(time.monotonic())

        def end(self):
            pass

    def one(prompt: List[int], new: int) -> List[int]:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            streamer=FirstToken(),
        )
        return out[0, len(prompt) :].tolist()

    return sequential(one, work, first)


def greedy(new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=new)


def sequential(generate, work, first: List[float]) -> Tuple[Timings, List[List[int]]]:
    """One request after the other, all having arrived at the start; ``first`` collects first-token times."""
    start = time.monotonic()
    timings: Timings = {"ttft": [], "tpot": []}
    outputs = []
    for prompt, new in work:
        tokens = generate(prompt, new)
        end = time.monotonic()
        timings["ttft"].append(first[-1] - start)
        timings["tpot"].append((end - first[-1]) / max(1, len(tokens) - 1))
        outputs.append(tokens)
    timings["wall"] = [time.monotonic() - start]
    return timings, outputs


def report(name: str, timings: Timings, total_tokens: int, baseline: float) -> float:
    throughput = total_tokens / timings["wall"][0]
    ttft, tpot = sorted(timings["ttft"]), sorted(timings["tpot"])
    p90 = lambda xs: xs[min(len(xs) - 1, int(0.9 * len(xs)))]  # noqa: E731
    print(
        f"{name:13s} {throughput:9.1f} tok/s ({throughput / baseline if baseline else 1:5.2f}x static) | "
        f"TTFT mean {statistics.mean(ttft):7.3f} s p90 {p90(ttft):7.3f} s | "
        f"per token mean {1000 * statistics.mean(tpot):7.1f} ms p90 {1000 * p90(tpot):7.1f} ms"
    )
    return throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt-min", type=int, default=8)
    parser.add_argument("--prompt-max", type=int, default=64)
    parser.add_argument("--new-min", type=int, default=16)
    parser.add_argument("--new-max", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512, help="dynamic engine: tokens per step")
    parser.add_argument("--buffer-gb", type=float, default=0.25)
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers (the slowest)")
    args = parser.parse_args()
    args.prompt, args.new_tokens = args.prompt_max, args.new_max  # bench_generation's model sizing
    torch.set_grad_enabled(False)
    with single_process_group() as groups:
        hf, ours = build_models(args, groups)
        work = workload(args, hf.config.vocab_size)
        total = sum(new for _, new in work)
        print(
            f"{args.requests} concurrent requests on a GPT-2 shape ({args.layers} layers, hidden {args.hidden}): "
            f"prompts {args.prompt_min}-{args.prompt_max}, {args.new_min}-{args.new_max} new tokens, {total} in all"
        )
        static, static_out = run_static(ours, groups, work)
        dynamic, dynamic_out = run_dynamic(ours, groups, work, args)
        base = report("static", static, total, 0.0)
        report("dynamic", dynamic, total, base)
        same = dynamic_out == static_out
        if not args.skip_hf:
            hf_timings, hf_out = run_hf(hf, work)
            report("transformers", hf_timings, total, base)
            same = same and hf_out == static_out
        print(f"same tokens: {same}")


if __name__ == "__main__":
    main()
