"""The speed-flag invariance suite's data and runner (used by ``test_speed_flag_invariance.py``).

Every flag whose record has ``speed_only`` is one factor (or a level of one, e.g. the recomputation
modes). For a layout, :func:`rows` is a strength-2 covering array over the factors that apply to it:
each pair of levels of two factors appears in some row. Each row is a real ``pretrain()`` run of
``pretrain_gpt.py`` (in-process, many runs per spawned rank group); its per-iteration losses and
grad norms must equal those of row 0 (every speed flag left out), bit for bit when all the row's
flags are ``bitwise``, else within :data:`RTOL`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron.training.flags.record import BITWISE
from megatron.training.flags.registry import RECORDS
from tests.covering_array import all_pairs

RTOL = 1e-5  # fp32 sums in another order, after 3 Adam steps of a tiny model: measured differences ~1e-7
ITERS = 3


@dataclass(frozen=True)
class Level:
    """One setting of a factor: the flags it adds, and what the layout must have for it ('tp', 'moe', 'cp')."""

    argv: Tuple[str, ...]
    needs: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Factor:
    """Speed-only flags ``dests`` varied together; level 0 is the run without them."""

    name: str
    dests: Tuple[str, ...]
    levels: Tuple[Level, ...]


def _switch(name: str, flag: str, dest: str, needs: Tuple[str, ...] = ()) -> Factor:
    return Factor(name, (dest,), (Level(()), Level((flag,), needs)))


_FULL = ("--recompute-granularity", "full", "--recompute-num-layers", "1", "--recompute-method")
FACTORS: Tuple[Factor, ...] = (
    _switch("overlap_grad_reduce", "--overlap-grad-reduce", "overlap_grad_reduce"),
    _switch("overlap_param_gather", "--overlap-param-gather", "overlap_param_gather"),
    _switch("distributed_optimizer", "--use-distributed-optimizer", "use_distributed_optimizer"),
    Factor(  # HybridDeviceOptimizer: half of each rank's main parameters stepped through host copies
        "optimizer_cpu_offload",
        ("optimizer_cpu_offload", "optimizer_offload_fraction"),
        (Level(()), Level(("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"))),
    ),
    Factor("bucket_size", ("ddp_bucket_size",), (Level(()), Level(("--ddp-bucket-size", "2000")))),
    _switch("average_in_collective", "--ddp-average-in-collective", "ddp_average_in_collective"),
    _switch("grad_accumulation_fusion", "--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    Factor(
        "recompute",
        ("recompute_activations", "recompute_granularity", "recompute_method", "recompute_num_layers")
        + ("distribute_saved_activations",),
        (
            Level(()),
            Level(("--recompute-activations",)),
            Level(_FULL + ("uniform",)),
            Level(_FULL + ("block",)),
            Level(_FULL + ("uniform", "--distribute-saved-activations"), ("tp",)),
        ),
    ),
    _switch("masked_softmax_fusion", "--no-masked-softmax-fusion", "masked_softmax_fusion", ("explicit_scores",)),
    _switch("bias_gelu_fusion", "--no-bias-gelu-fusion", "bias_gelu_fusion"),
    _switch("bias_swiglu_fusion", "--no-bias-swiglu-fusion", "bias_swiglu_fusion", ("swiglu",)),
    _switch("persist_layer_norm", "--no-persist-layer-norm", "no_persist_layer_norm", ("rmsnorm",)),
    _switch("bias_dropout_fusion", "--no-bias-dropout-fusion", "bias_dropout_fusion"),
    _switch("rope_fusion", "--no-rope-fusion", "apply_rope_fusion"),
    _switch("cross_entropy_fusion", "--cross-entropy-loss-fusion", "cross_entropy_loss_fusion"),
    _switch("tp_comm_overlap", "--tp-comm-overlap", "tp_comm_overlap", ("sp",)),
    _switch("overlap_p2p_comm", "--no-overlap-p2p-communication", "overlap_p2p_comm"),
    _switch("grouped_gemm", "--moe-grouped-gemm", "moe_grouped_gemm", ("moe",)),
    _switch("permute_fusion", "--moe-permute-fusion", "moe_permute_fusion", ("moe",)),
    Factor(
        "dispatcher",
        ("moe_token_dispatcher_type",),
        (Level(()), Level(("--moe-token-dispatcher-type", "alltoall"), ("moe",))),
    ),
    Factor(
        "cp_comm_type",
        ("cp_comm_type",),
        (Level(()), Level(("--cp-comm-type", "a2a"), ("cp",)), Level(("--cp-comm-type", "all_gather"), ("cp",))),
    ),
    # The suite's runs do not save, so here these only parse and build the run; the proof that they change
    # nothing is tests/fault/test_async_save_faults.py (the losses and checkpoint tensor bytes of a sync run).
    Factor(
        "async_save",
        ("async_save", "use_persistent_ckpt_worker"),
        (Level(()), Level(("--async-save", "--use-persistent-ckpt-worker"))),
    ),
)

_MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01")


@dataclass(frozen=True)
class Layout:
    """A tiny model on 2 ranks: its extra flags and what it has ('tp': TP > 1 without SP, 'sp': TP > 1 with SP,
    'moe', 'cp', 'swiglu', 'rmsnorm', 'explicit_scores': attention through explicit scores, not SDPA)."""

    argv: Tuple[str, ...]
    has: Tuple[str, ...] = ()


LAYOUTS: Dict[str, Layout] = {
    "dense-dp2": Layout(()),
    # Llama-style (SwiGLU, RMSNorm, RoPE): the fused forms of those run under TP + SP and recomputation, and the
    # attention takes the explicit-score path, whose masked softmax is the one fused outside SDPA.
    "dense-tp2-sp": Layout(
        ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu", "--normalization", "RMSNorm")
        + ("--position-embedding-type", "rope", "--attention-backend", "unfused"),
        ("sp", "swiglu", "rmsnorm", "explicit_scores"),
    ),
    "dense-tp2": Layout(("--tensor-model-parallel-size", "2"), ("tp",)),  # TP without SP: distributed saves
    "dense-pp2-vpp2": Layout(
        ("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1")
    ),
    "dense-cp2": Layout(("--context-parallel-size", "2", "--position-embedding-type", "rope"), ("cp",)),
    "moe-expert-dp2": Layout(_MOE, ("moe",)),  # DP 2, EP 1: every expert replicated over 2 expert-DP ranks
    "moe-ep2-tp": Layout(_MOE + ("--expert-model-parallel-size", "2"), ("moe",)),
}


def speed_only_dests() -> List[str]:
    """Every flag whose record says it changes only speed or memory."""
    return sorted(dest for dest, record in RECORDS.items() if record.speed_only is not None)


def factors_for(layout: Layout) -> List[Tuple[Factor, List[Level]]]:
    """The factors with more than one level this layout can run, each with those levels."""
    chosen = []
    for factor in FACTORS:
        levels = [lv for lv in factor.levels if set(lv.needs) <= set(layout.has)]
        if len(levels) > 1:
            chosen.append((factor, levels))
    return chosen


def _allowed(names: List[str]):
    gather, dist_opt = names.index("overlap_param_gather"), names.index("distributed_optimizer")

    def allowed(partial: Dict[int, int]) -> bool:  # the matrix refuses the param gather without the optimizer
        return not (partial.get(gather) == 1 and partial.get(dist_opt) == 0)

    return allowed


@dataclass(frozen=True)
class Row:
    """One run: the chosen level index per factor name, its flags, and its tolerance."""

    levels: Dict[str, int]
    argv: Tuple[str, ...]
    tolerance: str

    def has(self, *factor_names: str) -> bool:
        return all(self.levels.get(name, 0) for name in factor_names)


def _row(chosen: List[Tuple[Factor, List[Level]]], indices: Sequence[int]) -> Row:
    argv: Tuple[str, ...] = ()
    tolerance = BITWISE
    for (factor, levels), index in zip(chosen, indices):
        argv += levels[index].argv
        if index and any(RECORDS[d].speed_only.tolerance != BITWISE for d in factor.dests):
            tolerance = "rtol"
    return Row({factor.name: index for (factor, _), index in zip(chosen, indices)}, argv, tolerance)


def rows(layout: Layout) -> List[Row]:
    """The all-pairs rows of ``layout``; row 0 is the reference (no speed flag)."""
    chosen = factors_for(layout)
    names = [factor.name for factor, _ in chosen]
    return [_row(chosen, r) for r in all_pairs([len(levels) for _, levels in chosen], _allowed(names))]


def each_level_once(all_rows: List[Row]) -> List[Row]:
    """A fast subset of ``all_rows``: row 0, then rows until every level of every factor ran once."""
    seen, subset = set(), []
    for row in all_rows:
        new = {(name, index) for name, index in row.levels.items()} - seen
        if not subset or new:
            subset.append(row)
            seen |= new
    return subset


def base_flags(layout: Layout) -> List[str]:
    from tests.functional_tests.gpt_runs import mock_flags, tiny_gpt_flags, with_flags

    flags = with_flags(tiny_gpt_flags(ITERS) + mock_flags(), {"--eval-iters": "0", "--distributed-backend": "gloo"})
    argv, i = list(layout.argv), 0
    while i < len(argv):  # a layout's "--flag value" replaces the base's
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags = with_flags(flags, {argv[i]: argv[i + 1]})
            i += 2
        else:
            flags.append(argv[i])
            i += 1
    return flags


def run_rows(rank: int, world_size: int, flags: List[str], row_argvs: List[Tuple[str, ...]]) -> List[List[Tuple]]:
    """Rank body: one in-process ``pretrain()`` per row; each run's per-iteration (losses, grad norm)."""
    import pretrain_gpt
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.transformer.enums import ModelType
    from megatron.training import training

    step, results, start = training.train_step, [], time.perf_counter()
    for argv in row_argvs:
        record: List[Tuple] = []

        def recording(loop, record=record):
            out = step(loop)
            record.append((out[0], out[2]))  # (reduced losses, grad norm)
            return out

        training.train_step = recording
        destroy_num_microbatches_calculator()  # pretrain() sets the process-wide one, once per run
        try:
            training.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                argv=flags + list(argv),
            )
        finally:
            training.train_step = step
        results.append(record)
        if rank == 0:
            print(
                f"speed-invariance run {len(results)}/{len(row_argvs)}: {time.perf_counter() - start:.1f}s", flush=True
            )
    return results
