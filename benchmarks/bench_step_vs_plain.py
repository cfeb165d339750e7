"""Our GPT training step against a plain PyTorch loop on the same shapes, same run (issue 16 item 4).

Plain: a nanoGPT-style model written here (``nn.Embedding`` tokens + positions, pre-LN blocks with
one fused qkv ``nn.Linear``, ``F.scaled_dot_product_attention(is_causal=True)``, GeLU MLP, final
LayerNorm, output tied to the token embedding, ``F.cross_entropy``), N(0, 0.02) init with the
output projections scaled by 1/sqrt(2 * layers) as ours, ``torch.nn.utils.clip_grad_norm_(1.0)`` and
fused ``torch.optim.AdamW`` (weight decay 0.01, as ours); ``plain-compiled`` is the same loop with the model
under ``torch.compile`` (forward and backward compiled, the first steps compile).

Columns (``--columns``): ``ours``, ``ours-unfused`` (every ``--no-*-fusion`` flag), ``plain``,
``plain-compiled`` and ``gemm-floor``: the step's GEMMs alone (``gemm_shapes``: the linears' forward, input- and
weight-gradient GEMMs, the output layer's, and attention's batched products at the causal half), contiguous, in
the step's dtype; the ratios ours / each column are printed.

Ours: ``GPTModel`` with ``gradient_accumulation_fusion`` and the fusions (on by default in ``pretrain_gpt.py``,
as in Megatron), plus ``--cross-entropy-loss-fusion`` (off by default, as in Megatron: a user after speed turns it
on; ``OURS_FLAGS`` is printed), wrapped in our ``DistributedDataParallel`` (one gloo rank, contiguous fp32 gradient
buffer) and ``get_megatron_optimizer`` (AdamW, clip_grad 1.0), the step the training loop runs: zero
the buffer, forward, mean loss, backward, ``finish_grad_sync``, ``optimizer.step()``.

Precision: fp32 is fp32 for both. bf16 differs by design: ours follows ``--bf16`` (bf16 parameters
and activations, fp32 main weights in the optimizer, fp32 gradient accumulation and reduction,
Megatron's defaults); plain keeps fp32 weights and runs its forward under
``torch.autocast("cpu", torch.bfloat16)`` (bf16 matmuls, fp32 weights, grads and AdamW).

Host memory: ours calls ``retain_freed_host_memory()`` as ``initialize_run`` does on CPU (glibc keeps
freed blocks for reuse, so large tensors stop faulting in fresh pages every step). It is process-wide:
in one process the plain loop gets it too; with ``--isolated`` only with ``--plain-allocator``.

Two modes. By default both live in one process and step alternately (ours, plain, ours, ...), so
that load from other jobs hits both alike. ``--isolated RUNS`` runs each in its own process, as a
training job does, RUNS processes per side, alternating ours, plain, ours, ...; each process drops
its warm-up steps. The medians and the ratio ours / plain are printed.

Usage: python benchmarks/bench_step_vs_plain.py [--config tiny|gpt2-small] [--dtype fp32|bf16|both]
       [--iters N] [--warmup N] [--columns ours,plain,...] [--isolated RUNS [--plain-allocator]]

Measured 2026-12-01, before the fusions and the compiled / GEMM-floor columns, on the 2-core machine
(lscpu "AMD EPYC", 2 threads), quiet (load 0.5-1.7),
gpt2-small, after 1 warm-up step:
    before this session's changes (reference AdamW loop for fp32, fc1 bias as a separate pass, no
    gradient_accumulation_fusion in this benchmark), one process, median of 5:
                                      fp32 ours 10.04 s plain 9.46 s ratio 1.061; bf16 0.597
    + fused AdamW for fp32 too, fc1 bias in its GEMM, the training loop's gradient_accumulation_fusion,
      one process, median of 7:       fp32 ours 9.55 s plain 9.36 s ratio 1.020; bf16 3.51 / 4.96 s 0.708
      same, median of 9:              fp32 ours 9.62 s plain 9.31 s ratio 1.033
      --isolated 3 (median of 9):     fp32 ours 8.44 s plain 8.40 s ratio 1.005
    + the host allocator setting:
      --isolated 3 (median of 9):     fp32 ours 8.19 s plain 8.48 s ratio 0.965; bf16 2.74 / 3.58 s 0.766
      one process (plain gets it too), median of 5:
                                      fp32 ours 8.13 s plain 8.10 s ratio 1.004; bf16 2.86 / 2.93 s 0.977
      --isolated 3 --plain-allocator (median of 9): fp32 ours 8.05 s plain 8.06 s ratio 0.998
The allocator alone, one process per implementation, 3 steps after 1 warm-up (page faults, wall):
ours 0.25-0.7M faults, 8.4-8.65 s -> 0-0.26M, 7.93-8.04 s; plain 0.64-0.82M, 8.81-8.87 s -> 0-0.2M,
8.18-8.41 s. Step-to-step noise on this machine is about 3-5%, so fp32 is at parity when both loops
get the allocator setting, and about 3.5% faster as each runs by default.
Profile (torch.profiler, 2 layers) before the earlier cross-entropy work: the bf16 blockwise CE
backward alone was 2.1 s of a 6.8 s step; plain's fused log_softmax + backward was ~0.4 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_memory_and_step import GPT2_SMALL  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.training.host_allocator import retain_freed_host_memory  # noqa: E402
from tests.model_utils import batch, build_gpt, gpt2_style  # noqa: E402

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, max_sequence_length=64)
CONFIGS = {"tiny": (TINY, 2, 64), "gpt2-small": (GPT2_SMALL, 4, 512)}  # model kwargs, micro batch, seq
LR, WEIGHT_DECAY, CLIP, STD = 1e-4, 0.01, 1.0, 0.02
# pretrain_gpt.py's defaults (Megatron's): each --no-*-fusion flag turns one off; plus the cross-entropy
# fusion, off by default in Megatron, that a user after speed passes (--cross-entropy-loss-fusion)
FUSIONS = (
    "bias_dropout_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
)
# the pretrain_gpt.py command line "ours" stands for (the fusions above are its defaults, but the cross entropy's)
OURS_FLAGS = (
    "--cross-entropy-loss-fusion --gradient-accumulation-fusion (default) --attention-backend auto (SDPA) "
    "--hidden-dropout 0 --attention-dropout 0 --clip-grad 1.0 --weight-decay 0.01 [--bf16], "
    "fusions on (Megatron's defaults: bias-dropout, bias-gelu, masked-softmax, rope, persist-layer-norm)"
)
COLUMNS = ("ours", "ours-unfused", "plain", "plain-compiled", "gemm-floor")


class PlainBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))  # (B, T, C)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))  # (B, T, C)


class PlainGPT(nn.Module):
    """nanoGPT-shaped GPT-2: learned positions, tied output, mean cross entropy."""

    def __init__(
        self, num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int, max_sequence_length: int
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.wpe = nn.Embedding(max_sequence_length, hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(hidden_size, num_attention_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, std=STD / math.sqrt(2 * num_layers) if scaled else STD)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(s, device=tokens.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plain_step_fn(
    kwargs: Dict, bf16: bool, tokens: torch.Tensor, labels: torch.Tensor, compiled: bool = False
) -> Callable[[], None]:
    """One plain step: forward (autocast for bf16), backward, clip, fused AdamW; ``compiled``: the
    model under ``torch.compile`` (forward and backward compiled; the first steps compile)."""
    torch.manual_seed(1234)
    plain = PlainGPT(**kwargs)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model = torch.compile(plain) if compiled else plain

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        opt.step()

    return step


def ours_step_fn(
    kwargs: Dict, bf16: bool, tokens: torch.Tensor, labels: torch.Tensor, fused: bool = True
) -> Callable[[], None]:
    """One step of ours: DDP (1 gloo rank, fp32 grad buffer) + our optimizer, as the training loop runs it;
    ``fused``: pretrain_gpt.py's default fusions (Megatron's), else the unfused references."""
    retain_freed_host_memory()  # as initialize_run does on CPU; process-wide, so in one process plain gets it too
    groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
    kw = {"params_dtype": torch.bfloat16, "bf16": True} if bf16 else {}
    # pretrain_gpt.py's default (Megatron's): weight gradients accumulate straight into main_grad.
    fusions = dict.fromkeys(FUSIONS, fused)
    model = build_gpt(gpt2_style(**kwargs, **kw, **fusions, gradient_accumulation_fusion=True), groups)
    return training_step(model, groups, kw, tokens, labels)


def training_step(model, groups, precision: Dict, tokens: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    """The training loop's step for ``model``: our DDP (fp32 grad buffer) and optimizer (AdamW, clip 1.0);
    ``precision``: the bf16 config fields, or empty for fp32."""
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, pg_collection=groups
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, **precision), [ddp], pg_collection=groups
    )

    def step() -> None:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens, None, None, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        opt.step()

    return step


def gemm_shapes(kwargs: Dict, b: int, s: int) -> List[Tuple[int, int, int, int]]:
    """(batch, m, k, n) of the matrix products of one training step of the GPT-2-shaped model.

    Per layer the four linears (qkv h->3h, proj h->h, fc1 h->4h, fc2 4h->h) and the output layer
    (h->V), each three GEMMs over t = b*s tokens: forward ``X W^T``, input gradient ``dY W``, weight
    gradient ``dY^T X``; and attention's six batched products per layer (``Q K^T``, ``P V`` forward,
    four in backward) over b*heads of ``[s, d] x [d, s]`` shapes.
    """
    h, layers, vocab, heads = (kwargs[k] for k in ("hidden_size", "num_layers", "vocab_size", "num_attention_heads"))
    t, d = b * s, h // heads
    shapes = []
    for i, o in [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * layers + [(h, vocab)]:
        shapes += [(1, t, i, o), (1, t, o, i), (1, o, t, i)]
    shapes += [(b * heads, s, d, s), (b * heads, s, s, d)] * 3 * layers
    return shapes


def gemm_floor_fn(kwargs: Dict, bf16: bool, b: int, s: int) -> Callable[[], None]:
    """The step's GEMMs alone (``gemm_shapes``), contiguous operands in the step's dtype: a lower bound for
    any implementation of the step. Attention's products run over half the (batch x head) pairs: the
    work a causal kernel does, which skips the masked half."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    by_shape = {}  # one operand pair per distinct shape (the layers repeat theirs): GBs less host memory
    for bt, m, k, n in set(gemm_shapes(kwargs, b, s)):
        batch_dims = (max(bt // 2, 1),) if bt > 1 else ()
        by_shape[bt, m, k, n] = (
            torch.randn(*batch_dims, m, k, dtype=dtype),
            torch.randn(*batch_dims, k, n, dtype=dtype),
        )
    operands = [by_shape[shape] for shape in gemm_shapes(kwargs, b, s)]

    def step() -> None:
        for a, w in operands:
            torch.matmul(a, w)

    return step


def _timed_steps(steps: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, List[float]]:
    """Seconds of each step function over ``rounds`` rounds, stepping them alternately."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def _step_fns(config: str, bf16: bool, names: List[str]) -> Dict[str, Callable[[], None]]:
    kwargs, b, s = CONFIGS[config]
    tokens, labels = batch(b=b, s=s, vocab=kwargs["vocab_size"])
    makers = {
        "ours": ours_step_fn,
        "ours-unfused": lambda *a: ours_step_fn(*a, fused=False),
        "plain": plain_step_fn,
        "plain-compiled": lambda *a: plain_step_fn(*a, compiled=True),
        "gemm-floor": lambda kw, bf, *_: gemm_floor_fn(kw, bf, b, s),
    }
    return {name: makers[name](kwargs, bf16, tokens, labels) for name in names}


def compare(config: str, bf16: bool, iters: int, warmup: int, columns: List[str] = ("ours", "plain")) -> Dict:
    """Median step seconds of each column in one process, stepping alternately; warm-up steps dropped."""
    times = _timed_steps(_step_fns(config, bf16, list(columns)), warmup + iters)
    return {name: statistics.median(t[warmup:]) for name, t in times.items()}


def compare_isolated(
    config: str, dtype: str, iters: int, warmup: int, runs: int, plain_allocator: bool, columns: List[str]
) -> Dict[str, float]:
    """Median step seconds of ours and plain, each in its own process (as a training job runs),
    ``runs`` processes each, alternating ours, plain, ours, ...; each run's warm-up steps dropped."""
    times: Dict[str, List[float]] = {name: [] for name in columns}
    for _ in range(runs):
        for name in times:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--config", config]
            cmd += ["--dtype", dtype, "--iters", str(iters), "--warmup", str(warmup)]
            cmd += ["--plain-allocator"] if plain_allocator else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            times[name] += json.loads(out.strip().splitlines()[-1])
    return {name: statistics.median(t) for name, t in times.items()}


def _worker(name: str, config: str, bf16: bool, iters: int, warmup: int, plain_allocator: bool) -> None:
    """One implementation alone in this process: print its step seconds after warm-up as JSON."""
    if name.startswith("plain") and plain_allocator:
        retain_freed_host_memory()
    print(json.dumps(_timed_steps(_step_fns(config, bf16, [name]), warmup + iters)[name][warmup:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gpt2-small")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--isolated",
        type=int,
        default=0,
        metavar="RUNS",
        help="each implementation in its own process, RUNS processes each, alternating",
    )
    parser.add_argument(
        "--plain-allocator",
        action="store_true",
        help="with --isolated: the plain loop's process gets our host allocator setting too (one process: always)",
    )
    parser.add_argument(
        "--columns",
        default="ours,plain,plain-compiled,gemm-floor",
        help=f"comma-separated, of {','.join(COLUMNS)} (ours-unfused: ours with every --no-*-fusion flag)",
    )
    parser.add_argument("--worker", choices=COLUMNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtypes = ("fp32", "bf16") if args.dtype == "both" else (args.dtype,)
    columns = args.columns.split(",")
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        parser.error(f"--columns {args.columns}: unknown {unknown}; choose from {','.join(COLUMNS)}")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        if args.worker:
            _worker(args.worker, args.config, args.dtype == "bf16", args.iters, args.warmup, args.plain_allocator)
            dist.destroy_process_group()
            return
        how = f"{args.isolated} alternating runs per side, one process each" if args.isolated else "one process"
        how += ", plain with our host allocator setting" if args.plain_allocator or not args.isolated else ""
        print(
            f"{args.config}: median of {args.iters} steps after {args.warmup} warm-up, alternating, {how}, "
            f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
        )
        print(f"ours: {OURS_FLAGS}; ours-unfused: every --no-*-fusion, no --cross-entropy-loss-fusion")
        print("plain: fused torch.optim.AdamW, clip_grad_norm_ 1.0, same shapes and batch; bf16 = autocast")
        for dtype in dtypes:
            if args.isolated:
                t = compare_isolated(
                    args.config, dtype, args.iters, args.warmup, args.isolated, args.plain_allocator, columns
                )
            else:
                t = compare(args.config, dtype == "bf16", args.iters, args.warmup, columns)
            cells = [f"{name} {t[name] * 1e3:9.1f} ms" for name in columns]
            ratios = [f"ours/{name} {t['ours'] / t[name]:.3f}" for name in columns if name != "ours" and "ours" in t]
            load = f"  (load {os.getloadavg()[0]:.2f})"
            print(f"{dtype}: " + "  ".join(cells) + ("  |  " + "  ".join(ratios) if ratios else "") + load, flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
