"""Model state part of the theoretical memory (see ``theoretical_memory``): exact, from the configs.

The parameters a rank holds are listed from the config by the same rules ``GPTModel`` follows
(``chunk_parameters``, checked name by name against built models in the tests); the data-parallel
wrapper's own ``plan_buckets`` lays them out in gradient buffers (padding under the distributed
optimizer included); the optimizer's fp32 main copies and Adam moments cover all of them, or this
DP rank's shard of every bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import default_bucket_size
from megatron.core.distributed.param_and_grad_buffer import plan_buckets
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel.layer_layout import pipeline_layer_assignment
from megatron.core.transformer.transformer_config import TransformerConfig

INDEX_BYTES = 8  # int64 token ids, positions, routing indices
FP32 = 4


@dataclass(frozen=True)
class LanguageModelShape:
    """What ``GPTModel`` takes besides its ``TransformerConfig``."""

    vocab_size: int  # padded (``args.padded_vocab_size``)
    max_sequence_length: int
    position_embedding_type: str = "learned_absolute"
    share_embeddings_and_output_weights: bool = True
    rotary_percent: float = 1.0


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of a model chunk, in registration order."""

    name: str
    numel: int
    is_expert: bool = False


@dataclass
class StateBytes:
    """Bytes of model state on one rank."""

    params: int = 0
    grads: int = 0
    main_params: int = 0  # fp32 copies of half-precision parameters
    optimizer_states: int = 0  # Adam moments (or SGD momentum)

    @property
    def optimizer(self) -> int:
        return self.main_params + self.optimizer_states

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class RankPosition:
    """Where a rank sits: its sizes and the ranks it has along pipeline and data parallelism."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vp: Optional[int] = None
    pp_rank: int = 0
    dp_rank: int = 0
    etp: Optional[int] = None  # expert-TP size; None: TP's

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expt_dp(self) -> int:
        """Expert data-parallel size: ``tp*cp*dp / (etp*ep)``."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- parameters
def _linear(name: str, rows: int, cols: int, bias: Optional[int], expert: bool = False) -> List[ParamEntry]:
    """A linear's weight ``[rows, cols]`` then its bias (``bias`` elements, or none)."""
    entries = [ParamEntry(f"{name}.weight", rows * cols, expert)]
    return entries + ([ParamEntry(f"{name}.bias", bias, expert)] if bias else [])


def _norm(c: TransformerConfig, name: str, size: int) -> List[ParamEntry]:
    entries = [ParamEntry(f"{name}.weight", size)]
    return entries + ([ParamEntry(f"{name}.bias", size)] if c.normalization == "LayerNorm" else [])


def _mlp(c: TransformerConfig, name: str, ffn: int, tp: int, expert: bool) -> List[ParamEntry]:
    """``MLP``: column-parallel fc1 (gate and up stacked when gated), row-parallel fc2 (whole bias)."""
    fc1_out = (2 if c.gated_linear_unit else 1) * ffn // tp
    bias = c.add_bias_linear
    return _linear(f"{name}.linear_fc1", fc1_out, c.hidden_size, fc1_out if bias else None, expert) + _linear(
        f"{name}.linear_fc2", c.hidden_size, ffn // tp, c.hidden_size if bias else None, expert
    )


def is_moe_layer(c: TransformerConfig, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) has a ``MoELayer`` (``moe_layer_freq``)."""
    if c.num_moe_experts is None:
        return False
    freq = c.moe_layer_freq
    if isinstance(freq, int):
        return (layer_number - 1) % freq == 0
    return bool(freq[layer_number - 1])


def _layer(c: TransformerConfig, local: int, number: int, pos: RankPosition) -> List[ParamEntry]:
    """``TransformerLayer`` ``number`` (global, 1-based; ``local``: its index in the chunk), local spec."""
    p, tp, h, d = f"decoder.layers.{local}", pos.tp, c.hidden_size, c.kv_channels
    qkv = d * (c.num_attention_heads + 2 * c.num_query_groups) // tp
    entries = _norm(c, f"{p}.input_layernorm", h)
    entries += _linear(f"{p}.self_attention.linear_qkv", qkv, h, qkv if c.add_bias_linear or c.add_qkv_bias else None)
    proj_bias = h if c.add_bias_linear else None
    entries += _linear(f"{p}.self_attention.linear_proj", h, d * c.num_attention_heads // tp, proj_bias)
    if c.qk_layernorm:
        entries += _norm(c, f"{p}.self_attention.q_layernorm", d) + _norm(c, f"{p}.self_attention.k_layernorm", d)
    entries += _norm(c, f"{p}.pre_mlp_layernorm", h)
    if not is_moe_layer(c, number):
        return entries + _mlp(c, f"{p}.mlp", c.ffn_hidden_size, tp, expert=False)
    entries.append(ParamEntry(f"{p}.mlp.router.weight", c.num_moe_experts * h))
    for j in range(c.num_moe_experts // pos.ep):
        entries += _mlp(c, f"{p}.mlp.experts.local_experts.{j}", c.moe_ffn_hidden_size, pos.expert_tp, expert=True)
    return entries


def chunk_layers(c: TransformerConfig, pos: RankPosition, vp_stage: int) -> List[int]:
    """Global 1-based numbers of the layers of chunk ``vp_stage`` on pipeline rank ``pos.pp_rank``."""
    layout = pipeline_layer_assignment(
        c.num_layers, pos.pp, pos.vp, c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage
    )
    return layout[pos.pp_rank][vp_stage]


def chunk_ends(pos: RankPosition, vp_stage: int) -> Tuple[bool, bool]:
    """(pre_process, post_process) of a chunk, as ``model_setup.build_model_chunks`` decides."""
    chunks = pos.vp or 1
    return pos.pp_rank == 0 and vp_stage == 0, pos.pp_rank == pos.pp - 1 and vp_stage == chunks - 1


def chunk_parameters(c: TransformerConfig, lm: LanguageModelShape, pos: RankPosition, vp_stage: int = 0):
    """The parameters of one model chunk (``GPTModel``) on this rank, in registration order."""
    pre, post = chunk_ends(pos, vp_stage)
    h, entries = c.hidden_size, []
    if pre:
        entries.append(ParamEntry("embedding.word_embeddings.weight", lm.vocab_size // pos.tp * h))
        if lm.position_embedding_type == "learned_absolute":
            entries.append(ParamEntry("embedding.position_embeddings.weight", lm.max_sequence_length * h))
    for local, number in enumerate(chunk_layers(c, pos, vp_stage)):
        entries += _layer(c, local, number, pos)
    if post:
        entries += _norm(c, "decoder.final_layernorm", h)
        if not (lm.share_embeddings_and_output_weights and pre):
            entries.append(ParamEntry("output_layer.weight", lm.vocab_size // pos.tp * h))
    return entries


# --------------------------------------------------------------------------- state
def _buffer_state(
    entries: Sequence[ParamEntry],
    bucket_size: Optional[int],
    dp: int,
    dp_rank: int,
    distributed: bool,
    own_bucket: frozenset,
) -> Tuple[int, int]:
    """(buffer elements, elements of this DP rank's optimizer state) for one gradient buffer."""
    ranges, plans = plan_buckets([e.numel for e in entries], bucket_size, dp if distributed else 1, own_bucket)
    numel = plans[-1].end if plans else 0
    if not distributed:
        return numel, sum(e.numel for e in entries)
    owned = 0
    for plan in plans:
        size = (plan.end - plan.start) // dp
        lo = plan.start + dp_rank * size
        for i in plan.param_indices:
            start, end = ranges[i]
            owned += max(0, min(end, lo + size) - max(start, lo))
    return numel, owned


def _optimizer_states_per_param(opt: OptimizerConfig) -> int:
    if opt.optimizer == "adam":
        return 2  # exp_avg, exp_avg_sq
    return 1 if getattr(opt, "sgd_momentum", 0) else 0


def state_bytes(
    c: TransformerConfig,
    lm: LanguageModelShape,
    ddp: DistributedDataParallelConfig,
    opt: OptimizerConfig,
    pos: RankPosition,
) -> StateBytes:
    """Parameter, gradient-buffer and optimizer bytes on one rank (every chunk, DDP-wrapped)."""
    p_size = dtype_bytes(c.params_dtype)
    g_size = FP32 if ddp.grad_reduce_in_fp32 else p_size
    distributed = ddp.use_distributed_optimizer
    out = StateBytes()
    for vp_stage in range(pos.vp or 1):
        entries = chunk_parameters(c, lm, pos, vp_stage)
        # model_setup: only the first chunk is bucketed, and DDP buckets only on the first pipeline
        # stage (one bucket elsewhere, as Megatron-core); parameters are laid out in reverse order.
        bucketed = vp_stage == 0 and pos.pp_rank == 0
        bucket_size = default_bucket_size(ddp, pos.dp * pos.cp) if bucketed else None
        pre, post = chunk_ends(pos, vp_stage)
        tied_alone = distributed and pos.pp > 1 and lm.share_embeddings_and_output_weights and (pre or post)
        for expert in (False, True):
            group = [e for e in reversed(entries) if e.is_expert == expert]
            if not group:
                continue
            names = [e.name for e in group]
            tied = "embedding.word_embeddings.weight" if pre else "output_layer.weight"
            own = frozenset({names.index(tied)} if tied_alone and tied in names else ())
            dp = pos.expt_dp if expert else pos.dp * pos.cp
            rank = pos.dp_rank % dp
            numel, owned = _buffer_state(group, bucket_size, dp, rank, distributed, own)
            out.params += (numel if distributed else sum(e.numel for e in group)) * p_size
            out.grads += numel * g_size
            out.main_params += owned * FP32 if p_size != FP32 else 0
            out.optimizer_states += owned * FP32 * _optimizer_states_per_param(opt)
    return out
