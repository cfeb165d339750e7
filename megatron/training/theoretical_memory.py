"""Theoretical memory per rank, from the typed configs alone, before anything is built.

Three parts, each a pure function of the configs:

* **State** (exact, ``theoretical_memory_params``): the parameters a rank holds, listed from the
  config by the rules ``GPTModel`` follows, laid out in gradient buffers by the data-parallel
  wrapper's own ``plan_buckets`` (distributed-optimizer padding included); fp32 main copies and
  Adam moments for all of them, or for this DP rank's shard of every bucket.
* **Activations** per microbatch and chunk (``theoretical_activations``): what our modules save
  for backward, by layer kind, with sequence parallelism, selective/full recompute, MoE, CP, TP.
* **Pipelining**: the peak over this rank's op list from ``schedule_table.rank_schedule`` (the one
  the executor runs: 1F1B keeps up to p - i microbatches in flight on stage i, interleaving more)
  of the activations forwarded and not yet backwarded, plus the rise of a backward that rebuilds
  a recomputed group.

Not accounted: multi-latent attention (not implemented in this project), ``qk_layernorm``, the
z-loss, communication buffers and gradient temporaries of the backward pass. ``--attention-dropout``
under SDPA is counted as nothing (flash attention keeps its RNG state, not a mask).

``report_theoretical_memory(args)`` prints Megatron's ``Theoretical memory footprints: weight and
optimizer=... MB, activation=... MB, total=... MB`` line (``pretrain_gpt.py`` calls it on global
rank 0 before building the model; Megatron prints it after the first logging interval).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.theoretical_activations import ChunkActivations, chunk_activations, peak_in_flight
from megatron.training.theoretical_memory_params import (
    LanguageModelShape,
    RankPosition,
    StateBytes,
    chunk_parameters,
    state_bytes,
)
from megatron.training.training_config import TrainingConfig

__all__ = [
    "LanguageModelShape",
    "MemoryEstimate",
    "RankPosition",
    "StateBytes",
    "estimate_from_args",
    "estimate_memory",
    "report_theoretical_memory",
]

MB = 1024 * 1024


# --------------------------------------------------------------------------- report
@dataclass
class MemoryEstimate:
    """One rank's theoretical memory: state, activations per chunk, and their pipeline peak."""

    state: StateBytes
    chunks: List[ChunkActivations]
    activation_peak: int  # 0 when not estimated (Mamba or Gated DeltaNet layers: ``activations_estimated`` False)
    num_parameters: int
    activations_estimated: bool = True

    @property
    def total(self) -> int:
        return self.state.total + self.activation_peak


def estimate_memory(
    c: TransformerConfig,
    lm: LanguageModelShape,
    ddp: DistributedDataParallelConfig,
    opt: OptimizerConfig,
    pos: RankPosition,
    micro_batch_size: int,
    seq_length: int,
    num_microbatches: int,
    device_type: str = "cuda",
) -> MemoryEstimate:
    """Everything about one rank (``pos.pp_rank``, ``pos.dp_rank``) in one value. The state of a hybrid Mamba model
    or of one with Gated DeltaNet layers is exact; their activations are not estimated yet (``activations_estimated``
    False)."""
    count = sum(e.numel for v in range(pos.vp or 1) for e in chunk_parameters(c, lm, pos, v))
    state = state_bytes(c, lm, ddp, opt, pos)
    if lm.hybrid_layer_pattern is not None or c.experimental_attention_variant == "gated_delta_net":
        return MemoryEstimate(state, [], 0, count, activations_estimated=False)
    chunks = [chunk_activations(c, lm, pos, micro_batch_size, seq_length, v, device_type) for v in range(pos.vp or 1)]
    return MemoryEstimate(state, chunks, peak_in_flight(chunks, pos, num_microbatches), count)


def _from_args(args: argparse.Namespace) -> Tuple[TransformerConfig, LanguageModelShape, RankPosition]:
    from megatron.training.arguments import core_transformer_config_from_args, language_model_shape_from_args

    c, lm = core_transformer_config_from_args(args), language_model_shape_from_args(args)
    tp, pp, cp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.context_parallel_size
    pos = RankPosition(
        tp=tp,
        pp=pp,
        dp=args.world_size // (tp * pp * cp),
        cp=cp,
        ep=c.expert_model_parallel_size,
        vp=c.virtual_pipeline_model_parallel_size,
        etp=c.expert_tensor_parallel_size,
    )
    return c, lm, pos


def estimate_from_args(
    args: argparse.Namespace,
    num_microbatches: Optional[int] = None,
    device_type: str = "cuda",
    pp_ranks: Optional[Sequence[int]] = None,
) -> Dict[int, MemoryEstimate]:
    """``estimate_memory`` of DP rank 0 on the given pipeline ranks (all by default), from validated args."""
    from megatron.training.arguments import (
        data_parallel_config_from_args,
        optimizer_config_from_args,
        training_config_from_args,
    )

    c, lm, pos = _from_args(args)
    t = training_config_from_args(args)
    m = num_microbatches or _microbatches(t, pos)
    ddp, opt = data_parallel_config_from_args(args), optimizer_config_from_args(args)
    ranks = range(pos.pp) if pp_ranks is None else pp_ranks
    return {
        r: estimate_memory(c, lm, ddp, opt, _at_stage(pos, r), t.micro_batch_size, t.seq_length, m, device_type)
        for r in ranks
    }


def _microbatches(t: TrainingConfig, pos: RankPosition) -> int:
    """Microbatches per step at the full global batch."""
    return t.global_batch_size // (t.micro_batch_size * pos.dp)


def report_theoretical_memory(
    args: argparse.Namespace, num_microbatches: Optional[int] = None, verbose: bool = True, device_type: str = "cuda"
) -> Optional[MemoryEstimate]:
    """Print Megatron's ``Theoretical memory footprints`` line for the most loaded pipeline stage.

    Our line always includes the activations (Megatron's only under sequence parallelism with
    selective recompute): they follow from the same rules for every setting.
    """
    if getattr(args, "padded_vocab_size", None) is None:
        print("Theoretical memory footprints: not computed (no tokenizer yet: the vocabulary size is unknown)")
        return None
    estimates = estimate_from_args(args, num_microbatches, device_type)
    stage = max(estimates, key=lambda r: estimates[r].total)
    e = estimates[stage]
    if verbose:
        from megatron.training.arguments import training_config_from_args

        m = num_microbatches or _microbatches(training_config_from_args(args), _from_args(args)[2])
        _print_details(e, stage, m)
    activation = f"{e.activation_peak / MB:.2f} MB" if e.activations_estimated else "not estimated (Mamba / GDN layers)"
    print(
        f"Theoretical memory footprints: weight and optimizer={e.state.total / MB:.2f} MB, "
        f"activation={activation}, total={e.total / MB:.2f} MB",
        flush=True,
    )
    return e


def _at_stage(pos: RankPosition, pp_rank: int) -> RankPosition:
    return RankPosition(pos.tp, pos.pp, pos.dp, pos.cp, pos.ep, pos.vp, pp_rank, pos.dp_rank, pos.etp)


def _print_details(e: MemoryEstimate, stage: int, num_microbatches: int) -> None:
    s = e.state
    print(f"Number of parameters in most loaded shard in billions: {e.num_parameters / 1e9:.4f}")
    print(
        f"Theoretical memory of pipeline stage {stage} (MB): parameters {s.params / MB:.2f}, gradients "
        f"{s.grads / MB:.2f}, fp32 main parameters {s.main_params / MB:.2f}, optimizer states "
        f"{s.optimizer_states / MB:.2f}"
    )
    if not e.activations_estimated:
        return
    kinds: Dict[str, int] = {}
    for chunk in e.chunks:
        for kind, nbytes in chunk.saved.parts.items():
            kinds[kind] = kinds.get(kind, 0) + nbytes
    parts = ", ".join(f"{k} {v / MB:.2f}" for k, v in kinds.items())
    print(
        f"Theoretical activations per microbatch (MB, all chunks): {parts}; peak over the schedule "
        f"({num_microbatches} microbatches): {e.activation_peak / MB:.2f}",
        flush=True,
    )
