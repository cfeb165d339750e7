"""The grid of layouts and features the dry run checks (tests and ``scripts/gpu_smoke.sh`` run it).

Tiny models (4 layers, hidden 64, 4 heads, sequence 32, vocabulary 128, mock data) so the
whole grid runs in a couple of minutes on two cores. Every case trains, saves, resumes
and trains again, as its first, a middle and its last rank.

Host-sync bound: ``DENSE_SYNC_BOUND`` = 6 per steady-state iteration, the most any dense case
needs. With ``--log-interval 1`` the loop reads the reported losses (one copy), the grad norm and
the loss scale, checks each gradient bucket for NaN, reads the fp16 overflow flag where it
applies, and copies the timers' gathered times back: 4 to 6 per iteration in this grid (the
per-token count and its scale stay on the device). A per-parameter ``.item()`` loop (dozens),
a copy per microbatch (4 here) or one more per-iteration read on the busiest rank exceeds it.
MoE cases add at most one host read per MoE layer and microbatch (``moe_bound``): with the
``allgather`` dispatcher the experts read the per-expert token counts to split the sorted tokens (as
Megatron's ``SequentialMLP`` does); with ``alltoall`` the dispatcher's one read of every split size
(counted and exchanged on the device) serves the experts too, and a recomputed layer reuses it.
``GroupedMLP`` (grouped GEMM) computes its groups' ends from the counts on the device, uploading
nothing. The FP8/FP4 cases
(2 layers) hold the dense bound: a quantizer that uploaded a constant per call (dozens per
iteration) or read the host would exceed it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from tools.dry_run.scheduler import Job

DENSE_SYNC_BOUND = 6

TINY_GPT = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "1",
    "--weight-decay",
    "0.01",
    "--clip-grad",
    "1.0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--num-workers",
    "0",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
    "--seed",
    "1234",
]


@dataclass
class Case:
    """A layout and feature set, played on a world of ``world_size`` ranks."""

    name: str
    world_size: int
    flags: List[str]
    max_syncs: int = DENSE_SYNC_BOUND
    covers: List[str] = field(default_factory=list)
    python_path: List[str] = field(default_factory=list)  # e.g. the fake Transformer Engine's folder
    entry_point: str = "gpt"  # "mamba": pretrain_mamba.py (a hybrid model)
    sdpa: bool = True  # its attention calls SDPA (DeepSeek-V4's compressed attention does not: batched matmuls)


def moe_bound(moe_layers: int, microbatches: int) -> int:
    """The dense bound plus one host read (the token counts / split sizes) per MoE layer and microbatch."""
    return DENSE_SYNC_BOUND + moe_layers * microbatches


GRID: List[Case] = [
    Case(
        "tp2-sp-pp2-dp2-distopt-bf16",
        8,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
            "--global-batch-size",
            "16",
            "--bf16",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--recompute-granularity",
            "selective",
            "--calculate-per-token-loss",
            "--tp-comm-overlap",
        ],
        covers=[
            "TP",
            "SP",
            "TP comm overlap (ring all-gather / reduce-scatter under chunk GEMMs)",
            "PP 1F1B",
            "DP",
            "distributed optimizer",
            "overlap grad reduce",
            "overlap param gather",
            "bf16",
            "recompute selective",
            "per-token loss",
            "torch_dist checkpoint",
        ],
    ),
    Case(
        "pp2-vpp2-dp2-distopt-fp16",
        4,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "16",
            "--fp16",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        covers=[
            "PP interleaved (p2p overlap: batches in flight, waited where consumed)",
            "DP",
            "distributed optimizer",
            "fp16 loss scaling",
            "recompute full",
        ],
    ),
    Case(
        "cp2-tp2-dp2-bf16",
        8,
        [
            "--num-layers",  # 2 of TINY_GPT's 4: CP's ring attention makes many small ops, slow under fake tensors
            "2",
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--global-batch-size",
            "8",
            "--bf16",
            "--calculate-per-token-loss",
        ],
        covers=["CP", "TP", "DP", "bf16", "per-token loss"],
    ),
    Case(
        "ep2-moe-tp2-dp4-distopt-bf16",
        8,
        [
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--global-batch-size",
            "16",
            "--bf16",
            "--use-distributed-optimizer",
            "--moe-aux-loss-coeff",
            "0.01",
        ],
        max_syncs=moe_bound(moe_layers=4, microbatches=2),
        covers=["EP", "MoE", "TP", "SP", "DP", "distributed optimizer", "bf16"],
    ),
    Case(
        "moe-alltoall-grouped-gemm-tp2-sp-ep2-distopt-overlap-recompute-bf16",
        4,
        [
            *"--num-layers 2 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --global-batch-size 8".split(),
            *"--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1".split(),
            *"--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01".split(),
            *"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
            *"--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather".split(),
        ],
        # The all-to-all dispatcher's one read of its split sizes per MoE layer and microbatch; the full
        # recompute of each layer in backward reuses it (no second read).
        max_syncs=moe_bound(moe_layers=2, microbatches=2),
        covers=[
            "MoE all-to-all dispatcher",
            "MoE grouped GEMM",
            "MoE routing of the SP shard",
            "TP",
            "SP",
            "EP",
            "recompute full (MoE sizes replayed)",
            "distributed optimizer",
            "overlap param gather",
            "bf16",
        ],
    ),
    Case(
        "dp2-fsdp-optim-grads-params-bf16",
        2,
        [
            *"--global-batch-size 8 --bf16 --use-distributed-optimizer --overlap-grad-reduce".split(),
            *"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params".split(),
        ],
        # A bucket per layer and two for the root (final norm; embeddings) instead of one: the loop's NaN check
        # of each bucket before its reduction (check_for_nan_in_grad) reads the host 5 more times.
        max_syncs=DENSE_SYNC_BOUND + 5,
        covers=["DP", "Megatron-FSDP (sharded parameters and gradients)", "distributed optimizer", "bf16"],
    ),
    Case(
        "dp4-fsdp-optim-grads-2-instances-bf16",
        4,
        [
            *"--global-batch-size 8 --bf16 --use-distributed-optimizer --overlap-grad-reduce".split(),
            *"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads".split(),
            *"--num-distributed-optimizer-instances 2".split(),
        ],
        covers=["DP", "hybrid sharding (2 distributed-optimizer instances)", "Megatron-FSDP (sharded gradients)"],
    ),
    Case(
        "tp2-sp-dp2-fp8-delayed",
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--global-batch-size",
            "8",
            *"--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4".split(),
        ],
        covers=["TP", "SP", "DP", "bf16", "FP8 (torch._scaled_mm under CUDA's checks, delayed scaling state)"],
    ),
    Case(
        "tp2-dp2-gqa-bf16-legacy-ckpt",
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--global-batch-size",
            "16",
            "--bf16",
            "--ckpt-format",
            "torch",
            "--overlap-grad-reduce",
            "--group-query-attention",
            "--num-query-groups",
            "2",
        ],
        covers=["TP", "DP", "grouped-query attention", "bf16 (fused Adam)", "legacy torch checkpoint"],
    ),
    Case(
        "dp2-fp32-legacy-ckpt",
        2,
        ["--global-batch-size", "8", "--ckpt-format", "torch", "--log-num-zeros-in-grad"],
        covers=["DP", "fp32 (foreach Adam)", "legacy torch checkpoint", "zero counting"],
    ),
    Case(
        "tp2-pp4-dp8-distopt-bf16",
        64,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "4",
            "--global-batch-size",
            "64",
            "--bf16",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
        covers=["64 ranks", "TP", "PP 1F1B (4 stages)", "DP 8", "distributed optimizer", "bf16"],
    ),
]


# A hybrid Mamba model through pretrain_mamba.py (Mamba, attention and MoE layers, an attention layer on each stage;
# its mixers' scans and convolutions under CUDA's rules), with TP+SP, PP and the distributed optimizer.
GRID.append(
    Case(
        "hybrid-mamba-tp2-sp-pp2-distopt-bf16",
        4,
        [
            *"--hybrid-override-pattern M*E* --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2".split(),
            *"--num-experts 4 --moe-router-topk 2 --position-embedding-type none --normalization RMSNorm".split(),
            *"--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2".split(),
            *"--global-batch-size 8 --bf16 --use-distributed-optimizer --overlap-grad-reduce".split(),
        ],
        # The last stage reads the host 7 times outside MoE (the loop's NaN check once per gradient bucket: three
        # buckets there) and once per microbatch for its MoE layer's token counts (allgather dispatcher).
        max_syncs=moe_bound(moe_layers=1, microbatches=4) + 1,
        covers=["hybrid Mamba (pretrain_mamba.py)", "MoE in a hybrid stack", "TP", "SP", "PP", "bf16"],
        entry_point="mamba",
    )
)

# DeepSeek-V4 (the compressed attention's gathers, top-k and Sinkhorn-mixed streams under CUDA's rules): a CSA and an
# HCA layer, two hyper-connection streams (2 Sinkhorn iterations: each is a handful of small ops, slow under fake
# tensors), a hash-routed then a learned MoE layer with a shared expert, the clamped SwiGLU; TP+SP (the attention
# replicated, its input gathered) and EP over the same two ranks. MTP under TP+SP and EP: test_deepseek_v4_parallel.
GRID.append(
    Case(
        "deepseek-v4-tp2-sp-ep2-bf16",
        2,
        [
            *"--num-layers 2 --compressed-attention-layer-types compressed_sparse_attention".split(),
            *"heavily_compressed_attention --kv-channels 16 --q-lora-rank 16 --window-size 7,0".split(),
            *"--csa-compress-rate 4 --hca-compress-rate 8 --attention-output-groups 2".split(),
            *"--attention-output-lora-rank 8 --dsa-indexer-n-heads 2 --dsa-indexer-head-dim 8".split(),
            *"--dsa-indexer-topk 4 --hyper-connection-streams 2 --hyper-connection-sinkhorn-iterations 2".split(),
            *"--position-embedding-type rope --rotary-interleaved --rotary-percent 0.5 --normalization RMSNorm".split(),
            *"--swiglu --activation-func-clamp-value 10 --disable-bias-linear".split(),
            *"--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2".split(),
            *"--moe-ffn-hidden-size 32 --moe-num-hash-layers 1".split(),
            *"--moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid".split(),
            *"--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2".split(),
            *"--expert-tensor-parallel-size 1 --global-batch-size 4 --bf16 --use-distributed-optimizer".split(),
        ],
        # One more NaN check than a dense case: the hyper-connections' fp32 parameters have their own gradient buffer.
        max_syncs=moe_bound(moe_layers=2, microbatches=2) + 1,
        covers=["DeepSeek-V4 (CSA, HCA, hyper-connections, hash and learned MoE)", "TP", "SP", "EP", "bf16"],
        sdpa=False,
    )
)

# The repository's fake Transformer Engine (plain torch behind TE's API), for a source checkout's grid:
# --transformer-impl transformer_engine then builds the adapter's TE linears through pretrain_gpt.py's specs.
FAKE_TE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fakes")
GRID.append(
    Case(
        "tp2-sp-te-spec-fake-te-bf16",
        2,
        [
            *"--num-layers 2 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 4".split(),
            *"--bf16 --transformer-impl transformer_engine".split(),
        ],
        covers=["TE layer spec (fake TE)", "TP", "SP", "bf16"],
        python_path=[os.path.normpath(FAKE_TE_PATH)],
    )
)


def quantized_case(name: str, precision: str, layout: str, covers: str) -> Case:
    """A bf16 case with FP8/FP4 ``precision`` flags on a 2-rank ``layout`` (``QUANTIZED_LAYOUTS``): 2
    layers (the quantizers' many small ops are slow under fake tensors), the dense bound."""
    layout_flags, layout_covers = QUANTIZED_LAYOUTS[layout]
    flags = layout_flags + ["--num-layers", "2", "--global-batch-size", "4", "--bf16"] + precision.split()
    return Case(name, 2, flags, covers=[covers] + layout_covers + ["bf16"])


QUANTIZED_LAYOUTS = {
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["TP", "SP"]),
}
# Every other FP8/FP4 recipe (delayed scaling: tp2-sp-dp2-fp8-delayed above); hidden 64 and 32 tokens
# per rank allow each block size (ragged 128-blocks included). They run under TP+SP, where the block
# recipes all-gather their quantized pieces.
GRID += [
    quantized_case(f"{layout}-{name}", precision, layout, covers)
    for name, precision, layout, covers in (
        ("fp8-tensorwise", "--fp8-format hybrid --fp8-recipe tensorwise", "tp2-sp", "FP8 tensorwise"),
        ("fp8-blockwise", "--fp8-format e4m3 --fp8-recipe blockwise", "tp2-sp", "FP8 blockwise"),
        ("fp8-mxfp8", "--fp8-format hybrid --fp8-recipe mxfp8", "tp2-sp", "MXFP8"),
        ("fp4-nvfp4", "--fp4-format e2m1 --fp4-recipe nvfp4", "tp2-sp", "NVFP4 (stochastic rounding, RHT)"),
    )
]


def pick_ranks(spec: str, world_size: int) -> List[int]:
    """Ranks from ``first,middle,last``, ``all`` or integers (comma separated)."""
    named: Dict[str, int] = {"first": 0, "middle": (world_size - 1) // 2, "last": world_size - 1}
    if spec == "all":
        return list(range(world_size))
    ranks: List[int] = []
    for item in spec.split(","):
        rank = named[item] if item in named else int(item)
        if not 0 <= rank < world_size:
            raise ValueError(f"--dry-run-rank {item}: outside world size {world_size}")
        if rank not in ranks:
            ranks.append(rank)
    return ranks


def grid_jobs(
    cases: Sequence[Case],
    ranks: str,
    workdir: str,
    iters: int = 3,
    resume_iters: int = 2,
    case_ranks: Optional[Mapping[str, str]] = None,
) -> List[Job]:
    """One job per case and rank (``ranks``, or the case's own entry in ``case_ranks``), each with its own
    directory under ``workdir``."""
    case_ranks = case_ranks or {}
    return [
        Job(
            name=case.name,
            flags=TINY_GPT + case.flags,
            rank=rank,
            world_size=case.world_size,
            workdir=os.path.join(workdir, f"{case.name}-rank{rank}"),
            iters=iters,
            resume_iters=resume_iters,
            max_syncs=case.max_syncs,
            python_path=case.python_path,
            entry_point=case.entry_point,
        )
        for case in cases
        for rank in pick_ranks(case_ranks.get(case.name, ranks), case.world_size)
    ]


def select_cases(names: str) -> List[Case]:
    """``all`` or comma-separated case names (or unique prefixes), each optionally ``NAME:RANKS`` (``case_ranks``)."""
    if names in ("", "all"):
        return list(GRID)
    chosen = []
    for name in (item.partition(":")[0] for item in names.split(",")):
        matches = [c for c in GRID if c.name == name] or [c for c in GRID if c.name.startswith(name)]
        if len(matches) != 1:
            raise ValueError(
                f"--dry-run-grid {name}: matches {[c.name for c in matches] or 'no case'}; "
                f"cases: {', '.join(c.name for c in GRID)}"
            )
        chosen.append(matches[0])
    return chosen


def case_ranks(names: str) -> Dict[str, str]:
    """The ranks given to single cases in ``names`` (``NAME:first``, ranks joined by ``+``: ``NAME:first+last``),
    by case name; the other cases play the ranks of ``--dry-run-rank``."""
    if names in ("", "all"):
        return {}
    given = [item.partition(":") for item in names.split(",")]
    cases = select_cases(names)
    return {case.name: ranks.replace("+", ",") for case, (_, colon, ranks) in zip(cases, given) if colon}
