"""Choose a parallel layout before launch: memory per rank and estimated step time of every valid one.

Given a model (``pretrain_gpt.py`` flags after ``--``, or a Hugging Face ``config.json`` with
``--hf-config``) and a cluster (GPUs per node, nodes, memory per GPU, and achieved GEMM and
collective rates), it enumerates TP / PP / virtual PP / CP / EP / DP, micro batch, recompute and
distributed optimizer, keeps the layouts our own flag validation accepts (``validate_args``) and
whose theoretical memory (``megatron/training/theoretical_memory.py``, the most loaded pipeline
stage) fits, and prints them ranked by estimated step time, each with its exact flags.

Step-time model (per rank, seconds):

* compute: model FLOPs of the global batch (``training_log.num_floating_point_operations``) over
  the world size, times 4/3 under full recompute (one more forward), at ``--gemm-tflops``;
  elementwise work (norms, softmax, activations, optimizer) from the bytes it moves at
  ``--memory-gbps``: three passes over the saved activations per microbatch, and ~36 bytes per
  parameter of this rank for the Adam step;
* communication from message sizes and a fixed cost per call (``--collective-latency-us``): per
  layer and microbatch two TP all-reduces (all-gather + reduce-scatter under SP, whose backward
  also re-gathers the saved input shards) of ``s*b*h`` forward and two backward (the forward's
  again under full recompute), CP all-gathers of keys and values, EP token all-gathers, pipeline sends, and the
  gradient all-reduce (reduce-scatter + all-gather with the distributed optimizer) over DP; a ring
  collective moves ``2(n-1)/n`` of the message at ``--allreduce-gbps`` inside a node or
  ``--inter-node-gbps`` across nodes;
* pipeline: ``(m + (p-1)/v)`` microbatch times, i.e. a bubble of ``(p-1)/(v*m)``.

``--calibrate`` measures the GEMM rate, the memory rate and the all-reduce bandwidth on this
machine with ``--calibrate-ranks`` processes running at once (gloo), so that the estimate can be
checked against real steps here (``benchmarks/bench_plan_parallelism.py``).

    python tools/plan_parallelism.py --gpus-per-node 8 --num-nodes 8 --gpu-memory-gb 80 \\
        --hf-config examples/configs/llama3_70b/config.json --seq-length 4096 --global-batch-size 512 --top 10
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training import arguments as A  # noqa: E402
from megatron.training.theoretical_memory import estimate_from_args  # noqa: E402
from megatron.training.training_log import (
    FlopsConfig,  # noqa: E402
    num_floating_point_operations,  # noqa: E402
)
from megatron.training.validation import ArgumentsError, vocab_size_with_padding  # noqa: E402

GB = 1e9
ADAM_BYTES_PER_PARAM = 36  # fp32 main, two moments, grad read + written, param written


@dataclass(frozen=True)
class Cluster:
    """The machines: sizes and achieved rates (per GPU / per rank)."""

    gpus_per_node: int
    num_nodes: int
    gpu_memory_gb: float
    gemm_tflops: float = 400.0  # achieved dense GEMM rate in the training dtype
    memory_gbps: float = 2000.0  # achieved device-memory bandwidth, for elementwise work
    allreduce_gbps: float = 150.0  # ring bus bandwidth inside a node (NVLink)
    inter_node_gbps: float = 40.0  # ring bus bandwidth across nodes (InfiniBand per GPU)
    collective_latency_us: float = 20.0  # fixed cost of one collective call
    device_type: str = "cuda"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    micro_batch_size: int = 1
    recompute: Optional[str] = None  # None, "selective", "full"
    dist_opt: bool = True
    fsdp2: bool = False  # PyTorch FSDP2 (--use-torch-fsdp2; then dist_opt is False)

    def flags(self) -> List[str]:
        """The ``pretrain_gpt.py`` flags of this layout."""
        out = [
            "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp),
            "--context-parallel-size", str(self.cp),
            "--micro-batch-size", str(self.micro_batch_size),
        ]  # fmt: skip
        if self.vp:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.tp > 1:
            out.append("--sequence-parallel")
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        if self.dist_opt:
            out.append("--use-distributed-optimizer")
        if self.fsdp2:
            out += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
        return out


@dataclass
class Plan:
    layout: Layout
    flags: List[str]
    memory_gb: float
    step_s: float
    parts: Dict[str, float]


# ---------------------------------------------------------------- the model from a Hugging Face config
def hf_config_flags(path: str) -> List[str]:
    """``pretrain_gpt.py`` model flags for a Hugging Face Llama / Mistral / Mixtral / Qwen2 / GPT-2 config."""
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") == "gpt2":
        return [
            "--num-layers", str(hf["n_layer"]), "--hidden-size", str(hf["n_embd"]),
            "--num-attention-heads", str(hf["n_head"]), "--max-position-embeddings", str(hf["n_positions"]),
            "--vocab-size", str(hf["vocab_size"]),
        ]  # fmt: skip
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    flags = [
        "--num-layers", str(hf["num_hidden_layers"]), "--hidden-size", str(hf["hidden_size"]),
        "--num-attention-heads", str(heads), "--ffn-hidden-size", str(hf["intermediate_size"]),
        "--max-position-embeddings", str(hf.get("max_position_embeddings", 4096)),
        "--vocab-size", str(hf["vocab_size"]), "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--disable-bias-linear",
    ]  # fmt: skip
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not hf.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    if hf.get("num_local_experts"):
        flags += ["--num-experts", str(hf["num_local_experts"]), "--moe-router-topk", str(hf["num_experts_per_tok"])]
    return flags


# ---------------------------------------------------------------- layouts
def _divisors(n: int, limit: Optional[int] = None) -> List[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidate_layouts(base: argparse.Namespace, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every combination worth validating: TP within a node, PP dividing the layers, VP, CP, EP."""
    layers, experts = base.num_layers, base.num_experts or 0
    for tp, pp in itertools.product(_divisors(gpus_per_node), _divisors(layers)):
        for cp in (1, 2, 4):
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            vps = [None] + [v for v in (2, 4) if pp > 1 and layers % (pp * v) == 0]
            eps = [e for e in _divisors(experts) if (dp * cp) % e == 0] if experts else [1]
            # data parallelism: the distributed optimizer, plain DDP, or FSDP2 (no pipeline stages)
            modes = [(True, False), (False, False)] + ([(False, True)] if pp == 1 else [])
            for vp, ep, mb, recompute, (dist_opt, fsdp2) in itertools.product(
                vps, eps, (1, 2, 4, 8), (None, "selective", "full"), modes
            ):
                if base.global_batch_size % (mb * dp) == 0 and not (dp * cp == 1 and (dist_opt or fsdp2)):
                    yield Layout(tp, pp, vp, cp, ep, mb, recompute, dist_opt, fsdp2)


def validated_args(base: argparse.Namespace, layout: Layout, world: int) -> Optional[argparse.Namespace]:
    """The flags of ``base`` with ``layout`` applied, through our own validation; None if it refuses.

    The layout's fields are set as the parser would set them from ``layout.flags()`` (a test parses
    those flags and compares), which saves building the parser for every candidate.
    """
    args = copy.deepcopy(base)
    full = layout.recompute == "full"
    values = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        micro_batch_size=layout.micro_batch_size,
        num_virtual_stages_per_pipeline_rank=layout.vp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=layout.tp > 1,
        recompute_granularity=layout.recompute,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        use_distributed_optimizer=layout.dist_opt,
        use_torch_fsdp2=layout.fsdp2,
    )
    if layout.fsdp2:
        values["gradient_accumulation_fusion"] = False
    for dest, value in values.items():
        setattr(args, dest, value)
    try:
        args = A.validate_args(args, world)
    except (ArgumentsError, ValueError):
        return None
    args.padded_vocab_size = vocab_size_with_padding(
        args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    return args


# ---------------------------------------------------------------- step time
def _ring(nbytes: float, n: int, gbps: float) -> float:
    """Seconds of a ring all-reduce (or all-gather + reduce-scatter) of ``nbytes`` over ``n`` ranks."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (gbps * GB)


def _bandwidth(span: int, cluster: Cluster) -> float:
    """A group whose ranks lie within ``span`` consecutive ranks stays inside a node when span <= node."""
    return cluster.allreduce_gbps if span <= cluster.gpus_per_node else cluster.inter_node_gbps


def _per_microbatch(args: argparse.Namespace, cluster: Cluster, m: int) -> Dict[str, float]:
    """Seconds of one microbatch through one pipeline stage, by part."""
    tp, pp, cp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.context_parallel_size, args.expert_model_parallel_size)  # fmt: skip
    e = 2 if args.bf16 or args.fp16 else 4
    s, b, h, layers = args.seq_length // cp, args.micro_batch_size, args.hidden_size, args.num_layers // pp
    flops = num_floating_point_operations(FlopsConfig(**_flops_fields(args)), args.global_batch_size)
    full = args.recompute_granularity == "full"
    flops *= 4 / 3 if full else 1.0  # one more forward
    if args.recompute_granularity == "selective":  # the attention core's forward again: 4*s*q per token
        q = args.num_attention_heads * args.kv_channels
        flops += args.global_batch_size * args.seq_length * args.num_layers * 4 * args.seq_length * q
    compute = flops / cluster.world_size / (cluster.gemm_tflops * 1e12) / m
    # Elementwise work: three passes (write, read, gradient) over what a layer writes, 34sbh (Korthikanti).
    written = layers * 34 * s * b * h * e / tp + s * b * args.padded_vocab_size / tp * 4 / pp
    elementwise = (4 if full else 3) * written / (cluster.memory_gbps * GB)
    act = s * b * h * e
    # Per layer: 2 all-reduces forward, 2 backward (under SP each is an all-gather + a reduce-scatter,
    # and backward re-gathers the saved input shards: 8 calls); full recompute repeats the forward's.
    calls = (8 + 4 * full) if args.sequence_parallel else (4 + 2 * full)
    latency = cluster.collective_latency_us * 1e-6
    tp_time = layers * ((4 + 2 * full) * _ring(act, tp, _bandwidth(tp, cluster)) + calls * latency)
    parts = {"compute": compute, "elementwise": elementwise, "tp": tp_time if tp > 1 else 0.0}
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    kv = 2 * args.seq_length * b * groups // tp * args.kv_channels * e
    parts["cp"] = layers * 2 * ((cp - 1) / cp * kv / (_bandwidth(tp * cp, cluster) * GB) + latency) if cp > 1 else 0.0
    moe_layers = layers if args.num_experts else 0
    parts["ep"] = moe_layers * 4 * ((ep - 1) * act / (_bandwidth(tp * cp * ep, cluster) * GB) + latency)
    sent = act / (tp if args.sequence_parallel else 1)
    parts["p2p"] = 2 * (sent / (_bandwidth(cluster.world_size, cluster) * GB) + latency) if pp > 1 else 0.0
    return parts


def _flops_fields(args: argparse.Namespace) -> Dict:
    from megatron.training.arguments import flops_config_from_args

    return flops_config_from_args(args).__dict__


def estimate_step(args: argparse.Namespace, cluster: Cluster, state_grads: int, owned_params: int) -> Dict[str, float]:
    """Seconds of one training step by part (``total`` included), for validated ``args``."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = cluster.world_size // (tp * pp * cp)
    vp = args.virtual_pipeline_model_parallel_size or 1
    m = args.global_batch_size // (args.micro_batch_size * dp)
    mb = _per_microbatch(args, cluster, m)
    per_mb = sum(mb.values())
    parts = {k: v * m for k, v in mb.items()}
    parts["bubble"] = per_mb * (pp - 1) / vp
    span = _bandwidth(cluster.world_size // pp, cluster)
    if getattr(args, "use_torch_fsdp2", False):  # fp32 gradient shards: reduce-scatter + two parameter gathers
        full = state_grads * dp * cp
        e = 2 if args.bf16 else 4
        parts["dp"] = _ring(full, dp * cp, span) / 2 + _ring(full * e / 4, dp * cp, span)
    else:
        parts["dp"] = _ring(state_grads, dp * cp, span)
    parts["optimizer"] = owned_params * ADAM_BYTES_PER_PARAM / (cluster.memory_gbps * GB)
    parts["total"] = sum(parts.values())
    return parts


def plan(base: argparse.Namespace, cluster: Cluster, fit_fraction: float = 0.9) -> List[Plan]:
    """Every valid layout that fits, fastest first."""
    plans = []
    budget = cluster.gpu_memory_gb * GB * fit_fraction
    for layout in candidate_layouts(base, cluster.world_size, cluster.gpus_per_node):
        args = validated_args(base, layout, cluster.world_size)
        if args is None:
            continue
        pp = args.pipeline_model_parallel_size
        estimates = estimate_from_args(args, device_type=cluster.device_type, pp_ranks=sorted({0, pp - 1}))
        worst = max(estimates.values(), key=lambda est: est.total)
        if worst.total > budget:
            continue
        state = estimates[0].state
        owned = state.optimizer_states // 8 if args.optimizer == "adam" else state.params // 2
        times = estimate_step(args, cluster, state.grads, owned)
        plans.append(Plan(layout, layout.flags(), worst.total / GB, times["total"], times))
    return sorted(plans, key=lambda p: (p.step_s, p.memory_gb))


def format_plans(plans: Sequence[Plan], top: int) -> str:
    lines = [f"{'rank':>4} {'step s':>9} {'mem GB':>7} {'bubble':>7}  layout -> pretrain_gpt.py flags"]
    for i, p in enumerate(plans[:top]):
        lay = p.layout
        desc = f"TP{lay.tp} PP{lay.pp} VP{lay.vp or 1} CP{lay.cp} EP{lay.ep} mb{lay.micro_batch_size}"
        desc += f" rc={lay.recompute or 'none'} distopt={int(lay.dist_opt)} fsdp2={int(lay.fsdp2)}"
        bubble = p.parts["bubble"] / p.step_s
        lines.append(f"{i + 1:>4} {p.step_s:9.3f} {p.memory_gb:7.1f} {bubble:7.1%}  {desc}")
        lines.append(f"{'':31s}{' '.join(p.flags)}")
    return "\n".join(lines)


# ---------------------------------------------------------------- calibration
def _median_seconds(fn, repeats: int = 5) -> float:
    import time

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibration_body(rank: int, world_size: int, shape: Sequence[int], bf16: bool) -> Dict[str, float]:
    """On every rank at once: GEMM TFLOP/s, copy GB/s and ring all-reduce bus GB/s (gloo).

    The GEMM rate is that of a linear layer's three products for ``shape`` = (tokens, in, out):
    forward ``X W``, input gradient ``dY W^T`` and weight gradient ``X^T dY``.
    """
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if bf16 else torch.float32
    m, k, n = shape
    x, w, dy = (torch.randn(*s, dtype=dtype) for s in ((m, k), (k, n), (m, n)))
    seconds = _median_seconds(lambda: (torch.mm(x, w), torch.mm(dy, w.t()), torch.mm(x.t(), dy)))
    out = {"gemm_tflops": 3 * 2 * m * k * n / seconds / 1e12}
    a = torch.randn(16 * 1024 * 1024 // 4)  # 16 MiB fp32
    b = torch.empty_like(a)
    out["memory_gbps"] = 3 * a.numel() * 4 / _median_seconds(lambda: torch.add(a, 1.0, out=b)) / GB
    out["allreduce_gbps"], out["collective_latency_us"] = float("inf"), 0.0
    if world_size > 1:
        msg = torch.randn(1024 * 1024)  # 4 MiB
        dist.barrier()
        seconds = _median_seconds(lambda: dist.all_reduce(msg))
        out["allreduce_gbps"] = 2 * (world_size - 1) / world_size * msg.numel() * 4 / seconds / GB
        tiny = torch.randn(256)  # 1 KiB: the fixed cost of a call
        out["collective_latency_us"] = _median_seconds(lambda: dist.all_reduce(tiny), repeats=21) * 1e6
    return out


def calibrate(ranks: int, bf16: bool, shape: Sequence[int] = (2048, 1024, 4096)) -> Dict[str, float]:
    """Rates measured with ``ranks`` processes running at once (the median over ranks)."""
    from tests.dist_harness import run_distributed

    results = run_distributed(calibration_body, ranks, tuple(shape), bf16, timeout=600)
    return {k: sorted(r[k] for r in results)[len(results) // 2] for k in results[0]}


def gemm_shape(args: argparse.Namespace) -> Tuple[int, int, int]:
    """The MLP's first linear for one micro batch of one sequence: (tokens, hidden, ffn)."""
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    return args.seq_length * (args.micro_batch_size or 1), args.hidden_size, ffn


# ---------------------------------------------------------------- command line
def base_args(model_flags: Sequence[str]) -> argparse.Namespace:
    """Parsed (not yet validated) model flags, with what the planner does not need filled in."""
    flags = list(model_flags)
    for flag, value in (("--lr", "1e-4"), ("--train-iters", "1"), ("--tokenizer-type", "NullTokenizer")):
        if flag not in flags:
            flags += [flag, value]
    return A.parse_args(flags, entry_point="gpt")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [options] [-- model flags]")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--gpu-memory-gb", type=float, required=True)
    p.add_argument("--gemm-tflops", type=float, default=Cluster.gemm_tflops, help="achieved GEMM TFLOP/s per GPU")
    p.add_argument("--memory-gbps", type=float, default=Cluster.memory_gbps, help="achieved memory GB/s per GPU")
    p.add_argument("--allreduce-gbps", type=float, default=Cluster.allreduce_gbps, help="bus GB/s inside a node")
    p.add_argument("--inter-node-gbps", type=float, default=Cluster.inter_node_gbps, help="bus GB/s across nodes")
    p.add_argument("--collective-latency-us", type=float, default=Cluster.collective_latency_us)
    p.add_argument("--device-type", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--hf-config", help="a Hugging Face config.json instead of model flags")
    p.add_argument("--seq-length", type=int, help="with --hf-config")
    p.add_argument("--global-batch-size", type=int, help="with --hf-config")
    p.add_argument("--calibrate", action="store_true", help="measure the rates on this machine first")
    p.add_argument("--calibrate-ranks", type=int, default=2)
    p.add_argument("--fit-fraction", type=float, default=0.9, help="usable share of --gpu-memory-gb")
    p.add_argument("--top", type=int, default=10)
    return p


def _hf_flags_or_exit(opts: argparse.Namespace) -> List[str]:
    """``hf_config_flags``, or one line naming the flag and what is wrong (no traceback)."""
    missing = [f"--{n.replace('_', '-')}" for n in ("seq_length", "global_batch_size") if getattr(opts, n) is None]
    if missing:
        raise SystemExit(f"error: --hf-config needs {' and '.join(missing)}")
    try:
        return hf_config_flags(opts.hf_config)
    except OSError as e:
        raise SystemExit(f"error: --hf-config {opts.hf_config}: {e.strerror or e}") from None
    except (ValueError, KeyError) as e:
        raise SystemExit(f"error: --hf-config {opts.hf_config} is not a Hugging Face model config: {e!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> List[Plan]:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    opts, model_flags = _parser().parse_args(argv[:split]), argv[split + 1 :]
    if opts.hf_config:
        model_flags = _hf_flags_or_exit(opts) + model_flags
        model_flags += ["--seq-length", str(opts.seq_length), "--global-batch-size", str(opts.global_batch_size)]
        model_flags += ["--bf16"] if "--fp16" not in model_flags and "--bf16" not in model_flags else []
    cluster = Cluster(
        opts.gpus_per_node, opts.num_nodes, opts.gpu_memory_gb, opts.gemm_tflops, opts.memory_gbps,
        opts.allreduce_gbps, opts.inter_node_gbps, opts.collective_latency_us, opts.device_type,
    )  # fmt: skip
    base = base_args(model_flags)
    if opts.calibrate:
        rates = calibrate(opts.calibrate_ranks, bool(base.bf16), gemm_shape(base))
        print("calibrated: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items()))
        ring = rates["allreduce_gbps"]
        cluster = replace(cluster, gemm_tflops=rates["gemm_tflops"], memory_gbps=rates["memory_gbps"])
        cluster = replace(cluster, allreduce_gbps=min(ring, 1e6), inter_node_gbps=min(ring, 1e6))
        cluster = replace(cluster, collective_latency_us=rates["collective_latency_us"])
    plans = plan(base, cluster, opts.fit_fraction)
    print(f"{len(plans)} layouts fit in {cluster.gpu_memory_gb} GB x {cluster.world_size} ranks")
    print(format_plans(plans, opts.top))
    return plans


if __name__ == "__main__":
    main()
