"""Training-step throughput of a Llama-style model: ours (fused / unfused) beside plain PyTorch (eager / compiled).

One process, one device. Columns, each stepping alternately with the others after warm-up:

* ``ours``: ``GPTModel`` with pretrain_gpt.py's default fusions (``megatron/core/fusions``, compiled by
  ``jit_fuser``), ``gradient_accumulation_fusion``, our ``DistributedDataParallel`` (fp32 gradient buffer)
  and optimizer (bf16 parameters, fp32 main weights, AdamW, clip 1.0): the step the training loop runs;
* ``ours-unfused``: the same with every ``--no-*-fusion`` flag;
* ``plain`` / ``plain-compiled``: a Llama written here in plain PyTorch (RMSNorm, SwiGLU, RoPE,
  grouped-query attention through ``F.scaled_dot_product_attention(is_causal=True)``, flash attention
  on a GPU) under bf16 autocast with fp32 weights and fused AdamW; ``-compiled`` wraps it in ``torch.compile``.

Reported per column: median step seconds, tokens/s, and MFU = model FLOPs per step / step time / peak
(``--peak-tflops``, default from the GPU's name: 989 for H100/H200 bf16 dense). Model FLOPs per token:
``6 * N`` for the weights (N without the embedding table, with the output layer) plus ``6 * L * s * h``
for causal attention (half of ``12 * L * s * h``). ``--json PATH`` writes the results.

``--dry-run``: the same code on the CPU with a tiny model (2 layers, hidden 64, seq 64), the fused
regions run eagerly and ``plain-compiled`` uncompiled (``TORCHDYNAMO_DISABLE=1``): it proves the script,
not a speed. CI runs it through ``scripts/gpu_bench.sh --dry-run``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_step_vs_plain import CLIP, FUSIONS, LR, WEIGHT_DECAY, training_step  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from tests.model_utils import build_gpt, llama_style  # noqa: E402

# ~1.1B: Llama-3.2-1B's shape with a 32k vocabulary
LLAMA_1B = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class PlainBlock(nn.Module):
    """Pre-norm Llama block: x + attn(rms(x)), x + swiglu(rms(x))."""

    def __init__(self, h: int, heads: int, groups: int, ffn: int):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.d, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.n1(x)).split([h, self.groups * self.d, self.groups * self.d], dim=-1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)  # (B, nh, T, d)
        k, v = (t.view(b, s, self.groups, self.d).transpose(1, 2) for t in (k, v))  # (B, ng, T, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, d)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.fc1(self.n2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


class PlainLlama(nn.Module):
    """Token embedding, blocks, final RMSNorm, untied output layer, mean cross entropy."""

    def __init__(self, num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size, vocab, seq):
        super().__init__()
        d = hidden_size // num_attention_heads
        self.emb = nn.Embedding(vocab, hidden_size)
        self.blocks = nn.ModuleList(
            PlainBlock(hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size) for _ in range(num_layers)
        )
        self.norm, self.out = nn.RMSNorm(hidden_size, eps=1e-5), nn.Linear(hidden_size, vocab, bias=False)
        angles = torch.outer(torch.arange(seq).float(), 10000.0 ** (-torch.arange(0, d, 2).float() / d))
        angles = torch.cat((angles, angles), dim=-1)  # (T, d)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.out(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plain_step(shape: Dict, vocab: int, seq: int, device, tokens, labels, compiled: bool) -> Callable[[], None]:
    torch.manual_seed(1234)
    model = PlainLlama(**shape, vocab=vocab, seq=seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    run = torch.compile(model) if compiled else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16):
            loss = run(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    return step


def ours_step(shape: Dict, vocab: int, seq: int, device, tokens, labels, fused: bool) -> Callable[[], None]:
    groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
    kw = llama_style(**shape, vocab_size=vocab, max_sequence_length=seq, params_dtype=torch.bfloat16, bf16=True)
    model = build_gpt(dict(kw, gradient_accumulation_fusion=True, **dict.fromkeys(FUSIONS, fused)), groups)
    return training_step(model.to(device), groups, {"params_dtype": torch.bfloat16, "bf16": True}, tokens, labels)


def model_flops_per_token(shape: Dict, vocab: int, seq: int) -> float:
    """``6 N`` (weights without the embedding table) + ``6 L s h`` (causal attention), per token."""
    h, layers, ffn = shape["hidden_size"], shape["num_layers"], shape["ffn_hidden_size"]
    d = h // shape["num_attention_heads"]
    per_layer = h * (h + 2 * shape["num_query_groups"] * d) + h * h + 3 * h * ffn
    return 6.0 * (layers * per_layer + h * vocab) + 6.0 * layers * seq * h


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(steps: Dict[str, Callable[[], None]], warmup: int, iters: int, device) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _peak(device, given: float) -> float:
    if given:
        return given
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


def run(args) -> Dict:
    dry = args.dry_run
    device = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    shape, vocab, seq, b = (TINY, 256, 64, 2) if dry else (LLAMA_1B, 32000, args.seq, args.micro_batch)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (b, seq + 1), generator=g)
    tokens, labels = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    makers = {
        "ours": lambda: ours_step(shape, vocab, seq, device, tokens, labels, True),
        "ours-unfused": lambda: ours_step(shape, vocab, seq, device, tokens, labels, False),
        "plain": lambda: plain_step(shape, vocab, seq, device, tokens, labels, False),
        "plain-compiled": lambda: plain_step(shape, vocab, seq, device, tokens, labels, True),
    }
    steps = {name: makers[name]() for name in args.columns.split(",")}
    times = measure(steps, args.warmup, args.iters, device)
    flops, peak = model_flops_per_token(shape, vocab, seq) * b * seq, _peak(device, args.peak_tflops)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dry_run": dry}
    result.update(model=dict(shape, vocab=vocab, seq=seq, micro_batch=b), peak_tflops=peak, columns={})
    for name, t in times.items():
        med = statistics.median(t)
        mfu = flops / med / (peak * 1e12) if not math.isnan(peak) else None
        result["columns"][name] = dict(step_s=med, steps_s=t, tokens_per_s=b * seq / med, mfu=mfu)
        print(
            f"{name:15s} {med * 1e3:9.1f} ms  {b * seq / med:10.0f} tok/s  MFU {mfu if mfu is None else f'{mfu:.3f}'}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no compilation (module doc)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--columns", default="ours,ours-unfused,plain,plain-compiled")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 dense peak (default: from the GPU name)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if torch.cuda.is_available() and not args.dry_run else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        result = run(args)
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
