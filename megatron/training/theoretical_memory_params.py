"""Model state part of the theoretical memory (see ``theoretical_memory``): exact, from the configs.

The parameters a rank holds are listed from the config by the same rules ``GPTModel`` follows
(``chunk_parameters``, checked name by name against built models in the tests); the data-parallel
wrapper's own ``plan_buckets`` lays them out in gradient buffers (padding under the distributed
optimizer included); the optimizer's fp32 main copies and Adam moments cover all of them, or this
DP rank's shard of every bucket. Megatron-FSDP's strategies keep only that shard of the gradient
buffer (``optim_grads``) and of the parameters too (``optim_grads_params``, whose buckets start at
every transformer layer, ``unit_starts``). FSDP2 (``TorchFullyShardedDataParallelConfig``) keeps 1/d of
every parameter (rounded up; dim-0 row padding ignored) as fp32 shards, which are also the optimizer's
main weights, fp32 gradient shards and the moments: 16/d bytes per parameter whatever the precision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import default_bucket_size
from megatron.core.distributed.param_and_grad_buffer import plan_buckets
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
from megatron.core.ssm.mamba_mixer import mamba_dims
from megatron.core.transformer.layer_layout import config_layer_assignment
from megatron.core.transformer.transformer_config import TransformerConfig

INDEX_BYTES = 8  # int64 token ids, positions, routing indices
MAMBA_CONV_WIDTH = 4  # the mixer's d_conv (megatron-core's default; not a flag)
FP32 = 4


@dataclass(frozen=True)
class LanguageModelShape:
    """What ``GPTModel`` takes besides its ``TransformerConfig``."""

    vocab_size: int  # padded (``args.padded_vocab_size``)
    max_sequence_length: int
    position_embedding_type: str = "learned_absolute"
    share_embeddings_and_output_weights: bool = True
    rotary_percent: float = 1.0
    hybrid_layer_pattern: Optional[str] = None  # a hybrid ``MambaModel``: one symbol per layer (``M * - E``)


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of a model chunk, in registration order."""

    name: str
    numel: int
    is_expert: bool = False
    fp32: bool = False  # kept in fp32 whatever the parameters' dtype (a Mamba mixer's A_log and D)


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


def _latent_attention(c: TransformerConfig, p: str, tp: int) -> List[ParamEntry]:
    """``MLASelfAttention``: query (down, norm, up, or one projection), key/value (down, norm, up), output."""
    h, n = c.hidden_size, c.num_attention_heads
    q_out = n * (c.qk_head_dim + c.qk_pos_emb_head_dim) // tp
    if c.q_lora_rank is None:
        entries = _linear(f"{p}.linear_q_proj", q_out, h, None)
    else:
        entries = _linear(f"{p}.linear_q_down_proj", c.q_lora_rank, h, None)
        entries += _norm(c, f"{p}.q_layernorm", c.q_lora_rank) if c.qk_layernorm else []
        entries += _linear(f"{p}.linear_q_up_proj", q_out, c.q_lora_rank, None)
    entries += _linear(f"{p}.linear_kv_down_proj", c.kv_lora_rank + c.qk_pos_emb_head_dim, h, None)
    entries += _norm(c, f"{p}.kv_layernorm", c.kv_lora_rank) if c.qk_layernorm else []
    entries += _linear(f"{p}.linear_kv_up_proj", n * (c.qk_head_dim + c.v_head_dim) // tp, c.kv_lora_rank, None)
    entries += _linear(f"{p}.linear_proj", h, n * c.v_head_dim // tp, h if c.add_bias_linear else None)
    return entries + (
        _sparse_attention_indexer(c, f"{p}.core_attention.indexer") if c.experimental_attention_variant else []
    )


def _sparse_attention_indexer(c: TransformerConfig, p: str) -> List[ParamEntry]:
    """DSA's ``DSAIndexer`` (replicated over TP): query, key, key LayerNorm (weight and bias), head weights."""
    heads, d = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    entries = _linear(f"{p}.linear_wq_b", heads * d, c.q_lora_rank, None) + _linear(
        f"{p}.linear_wk", d, c.hidden_size, None
    )
    entries += [ParamEntry(f"{p}.k_norm.weight", d), ParamEntry(f"{p}.k_norm.bias", d)]
    return entries + _linear(f"{p}.linear_weights_proj", heads, c.hidden_size, None)


def _kv_compressor(c: TransformerConfig, p: str, dim: int, rate: int, overlap: bool) -> List[ParamEntry]:
    """DeepSeek-V4's ``KVCompressor``: per-slot ``position_bias``, key/value and gate projections (two series
    when ``overlap``), the pooled entries' norm."""
    width = (2 if overlap else 1) * dim
    entries = [ParamEntry(f"{p}.position_bias", rate * width)]
    entries += _linear(f"{p}.linear_kv", width, c.hidden_size, None) + _linear(
        f"{p}.linear_gate", width, c.hidden_size, None
    )
    return entries + _norm(c, f"{p}.kv_layernorm", dim)


def _compressed_attention(c: TransformerConfig, p: str, layer_type: str) -> List[ParamEntry]:
    """DeepSeek-V4's ``CompressedAttention`` (replicated over TP): sink logits, query (down, norm, up), the shared
    key/value and its norm, the grouped low-rank output; HCA/CSA a compressor, CSA also its indexer."""
    h, n, d, ql = c.hidden_size, c.num_attention_heads, c.kv_channels, c.q_lora_rank
    g, rank = c.attention_output_groups, c.attention_output_lora_rank
    entries = [ParamEntry(f"{p}.attention_sinks", n)] + _linear(f"{p}.linear_q_down_proj", ql, h, None)
    entries += _norm(c, f"{p}.q_layernorm", ql) + _linear(f"{p}.linear_q_up_proj", n * d, ql, None)
    entries += _linear(f"{p}.linear_kv_proj", d, h, None) + _norm(c, f"{p}.kv_layernorm", d)
    entries += _linear(f"{p}.linear_o_group_proj", g * rank, n * d // g, None) + _linear(
        f"{p}.linear_proj", h, g * rank, None
    )
    if layer_type == "heavily_compressed_attention":
        return entries + _kv_compressor(c, f"{p}.compressor", d, c.hca_compress_rate, overlap=False)
    if layer_type == "compressed_sparse_attention":
        heads, di = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        entries += _kv_compressor(c, f"{p}.compressor", d, c.csa_compress_rate, overlap=True)
        entries += _kv_compressor(c, f"{p}.indexer.compressor", di, c.csa_compress_rate, overlap=True)
        entries += _linear(f"{p}.indexer.linear_wq_b", heads * di, ql, None)
        entries += _linear(f"{p}.indexer.linear_weights_proj", heads, h, None)
    return entries


def _hyper_connection(c: TransformerConfig, p: str, mixes: int) -> List[ParamEntry]:
    """A ``HyperConnectionModule`` (``mixes = (2 + n) n``, 3 scales) or ``HyperHead`` (``mixes = n``, 1 scale) over
    n streams: fp32 whatever the parameters' dtype (built so), replicated over TP."""
    n, h = c.hyper_connection_streams, c.hidden_size
    scales = 1 if mixes == n else 3
    return [
        ParamEntry(f"{p}.mapping_proj", mixes * n * h, fp32=True),
        ParamEntry(f"{p}.mapping_bias", mixes, fp32=True),
        ParamEntry(f"{p}.mapping_scale", scales, fp32=True),
    ]


def _hyper_head(c: TransformerConfig, p: str) -> List[ParamEntry]:
    """The ``HyperHead`` collapsing the streams before a final norm (none without hyper-connections)."""
    return _hyper_connection(c, p, c.hyper_connection_streams) if c.hyper_connection_streams > 1 else []


def attention_type(c: TransformerConfig, layer_number: int) -> Optional[str]:
    """DeepSeek-V4's attention type of global layer ``layer_number`` (1-based; an MTP layer: ``num_layers``), or
    None for other models."""
    types = c.compressed_attention_layer_types
    return None if types is None else types[layer_number - 1]


def _attention(c: TransformerConfig, p: str, tp: int) -> List[ParamEntry]:
    """``SelfAttention`` (fused QKV, output, query/key norms) or multi-latent attention."""
    if c.multi_latent_attention:
        return _latent_attention(c, p, tp)
    h, d = c.hidden_size, c.kv_channels
    gated = 2 if c.attention_output_gate else 1  # the gate is as wide as the queries
    qkv = d * (gated * c.num_attention_heads + 2 * c.num_query_groups) // tp
    entries = _linear(f"{p}.linear_qkv", qkv, h, qkv if c.add_bias_linear or c.add_qkv_bias else None)
    entries += _linear(f"{p}.linear_proj", h, d * c.num_attention_heads // tp, h if c.add_bias_linear else None)
    if c.qk_layernorm:
        entries += _norm(c, f"{p}.q_layernorm", d) + _norm(c, f"{p}.k_layernorm", d)
    return entries


def _gated_delta_net(c: TransformerConfig, p: str, tp: int) -> List[ParamEntry]:
    """``GatedDeltaNet``: input and output projections, convolution, per-head norm, ``dt_bias``, ``A_log``."""
    qk, v, heads = (
        c.linear_num_key_heads * c.linear_key_head_dim,
        c.linear_num_value_heads * c.linear_value_head_dim,
        c.linear_num_value_heads,
    )
    entries = [ParamEntry(f"{p}.dt_bias", heads // tp), ParamEntry(f"{p}.A_log", heads // tp)]  # its own: first
    entries += _linear(f"{p}.in_proj", (2 * qk + 2 * v + 2 * heads) // tp, c.hidden_size, None)
    entries += _linear(f"{p}.out_proj", c.hidden_size, v // tp, None)
    entries += [ParamEntry(f"{p}.conv1d.weight", (2 * qk + v) // tp * c.linear_conv_kernel_dim)]
    return entries + _norm(c, f"{p}.out_norm", c.linear_value_head_dim)


def _moe_mlp(c: TransformerConfig, p: str, pos: RankPosition) -> List[ParamEntry]:
    """``MoELayer``: router, this rank's experts, then the shared experts (gate, fc1, fc2)."""
    entries = [ParamEntry(f"{p}.router.weight", c.num_moe_experts * c.hidden_size)]
    for j in range(c.num_moe_experts // pos.ep):
        entries += _mlp(c, f"{p}.experts.local_experts.{j}", c.moe_ffn_hidden_size, pos.expert_tp, expert=True)
    if c.moe_shared_expert_intermediate_size is not None:
        if c.moe_shared_expert_gate:  # the module's own parameter: listed before its linears'
            entries.append(ParamEntry(f"{p}.shared_experts.gate_weight", c.hidden_size))
        entries += _mlp(c, f"{p}.shared_experts", c.moe_shared_expert_intermediate_size, pos.tp, expert=False)
    return entries


def _layer(
    c: TransformerConfig, p: str, moe: bool, pos: RankPosition, gdn: bool = False, v4_type: Optional[str] = None
) -> List[ParamEntry]:
    """``TransformerLayer`` under prefix ``p`` (local spec; ``moe``: its MLP is a ``MoELayer``; ``gdn``: a
    ``GatedDeltaNet`` in place of self-attention; ``v4_type``: DeepSeek-V4's attention of that type). With
    hyper-connections its two ``HyperConnectionModule``s follow the MLP."""
    h = c.hidden_size
    if v4_type is not None:
        mixer = _compressed_attention(c, f"{p}.self_attention", v4_type)
    else:
        mixer = (_gated_delta_net if gdn else _attention)(c, f"{p}.self_attention", pos.tp)
    entries = _norm(c, f"{p}.input_layernorm", h) + mixer + _norm(c, f"{p}.pre_mlp_layernorm", h)
    if moe:
        entries += _moe_mlp(c, f"{p}.mlp", pos)
    else:
        entries += _mlp(c, f"{p}.mlp", c.ffn_hidden_size, pos.tp, expert=False)
    if c.hyper_connection_streams > 1:
        n = c.hyper_connection_streams
        for part in ("attention", "mlp"):
            entries += _hyper_connection(c, f"{p}.{part}_hyper_connection", (2 + n) * n)
    return entries


def _mamba_layer(c: TransformerConfig, p: str, tp: int) -> List[ParamEntry]:
    """``MambaLayer``: its norm, then the mixer's own ``dt_bias``, ``A_log``, ``D`` (per local head; the last two
    fp32), ``in_proj`` (``[z, x, B, C, dt]`` rows), ``out_proj``, the depthwise ``conv1d`` over ``[x, B, C]`` and the
    gated norm's weight."""
    d = mamba_dims(c)
    heads, conv = d.nheads // tp, sum(d.conv_sections(tp))
    entries = _norm(c, f"{p}.norm", c.hidden_size)
    entries += [ParamEntry(f"{p}.mixer.dt_bias", heads), ParamEntry(f"{p}.mixer.A_log", heads, fp32=True)]
    entries.append(ParamEntry(f"{p}.mixer.D", heads, fp32=True))
    entries += _linear(f"{p}.mixer.in_proj", sum(d.in_proj_sections(tp)), c.hidden_size, None)
    entries += _linear(f"{p}.mixer.out_proj", c.hidden_size, d.d_inner // tp, None)
    entries += _linear(f"{p}.mixer.conv1d", conv, MAMBA_CONV_WIDTH, conv)
    return entries + [ParamEntry(f"{p}.mixer.norm.weight", d.d_inner // tp)]


def _hybrid_layer(c: TransformerConfig, p: str, symbol: str, pos: RankPosition) -> List[ParamEntry]:
    """One layer of a hybrid stack: Mamba, attention alone, MLP alone or MoE alone (``mamba_stack_spec``)."""
    if symbol == Symbols.MAMBA:
        return _mamba_layer(c, p, pos.tp)
    if symbol == Symbols.ATTENTION:
        return _norm(c, f"{p}.input_layernorm", c.hidden_size) + _attention(c, f"{p}.self_attention", pos.tp)
    entries = _norm(c, f"{p}.pre_mlp_layernorm", c.hidden_size)
    if symbol == Symbols.MOE:
        return entries + _moe_mlp(c, f"{p}.mlp", pos)
    return entries + _mlp(c, f"{p}.mlp", c.ffn_hidden_size, pos.tp, expert=False)


def _mtp(c: TransformerConfig, pos: RankPosition) -> List[ParamEntry]:
    """``MultiTokenPredictionBlock``: per module two norms, ``eh_proj`` (2h -> h), a layer of the last
    decoder layer's kind, a final norm."""
    h, entries = c.hidden_size, []
    for k in range(c.mtp_num_layers or 0):
        p = f"mtp.layers.{k}"
        entries += _norm(c, f"{p}.enorm", h) + _norm(c, f"{p}.hnorm", h)
        entries += _linear(f"{p}.eh_proj", h // pos.tp, 2 * h, None)
        last = c.num_layers  # the module's layer repeats the last layer's kind
        entries += _layer(c, f"{p}.transformer_layer", is_moe_layer(c, last), pos, v4_type=attention_type(c, last))
        entries += _hyper_head(c, f"{p}.hyper_head") + _norm(c, f"{p}.final_layernorm", h)
    return entries


def chunk_layers(c: TransformerConfig, pos: RankPosition, vp_stage: int) -> List[int]:
    """Global 1-based numbers of the layers of chunk ``vp_stage`` on pipeline rank ``pos.pp_rank``."""
    layout = config_layer_assignment(c, pos.pp, pos.vp)
    return layout[pos.pp_rank][vp_stage]


def chunk_ends(pos: RankPosition, vp_stage: int) -> Tuple[bool, bool]:
    """(pre_process, post_process) of a chunk, as ``model_setup.build_model_chunks`` decides."""
    chunks = pos.vp or 1
    return pos.pp_rank == 0 and vp_stage == 0, pos.pp_rank == pos.pp - 1 and vp_stage == chunks - 1


def chunk_parameters(c: TransformerConfig, lm: LanguageModelShape, pos: RankPosition, vp_stage: int = 0):
    """The parameters of one model chunk (``GPTModel``, or ``MambaModel`` with ``lm.hybrid_layer_pattern``) on this
    rank, in registration order. With multi-token prediction the last chunk holds the MTP block and an embedding
    of its own."""
    pre, post = chunk_ends(pos, vp_stage)
    mtp = bool(c.mtp_num_layers) and post
    h, entries = c.hidden_size, []
    if pre or mtp:
        entries.append(ParamEntry("embedding.word_embeddings.weight", lm.vocab_size // pos.tp * h))
        if lm.position_embedding_type == "learned_absolute":
            entries.append(ParamEntry("embedding.position_embeddings.weight", lm.max_sequence_length * h))
    pattern = lm.hybrid_layer_pattern
    for local, number in enumerate(chunk_layers(c, pos, vp_stage)):
        p = f"decoder.layers.{local}"
        if pattern:
            entries += _hybrid_layer(c, p, pattern[number - 1], pos)
        else:
            moe, gdn = is_moe_layer(c, number), c.is_linear_attention_layer(number)
            entries += _layer(c, p, moe, pos, gdn, attention_type(c, number))
    if post:
        entries += [] if pattern else _hyper_head(c, "decoder.hyper_head")
        entries += _norm(c, "decoder.final_norm" if pattern else "decoder.final_layernorm", h)
        if not (lm.share_embeddings_and_output_weights and (pre or mtp)):
            entries.append(ParamEntry("output_layer.weight", lm.vocab_size // pos.tp * h))
        entries += _mtp(c, pos) if mtp else []
    return entries


def cross_stage_names(c: TransformerConfig, lm: LanguageModelShape, pos: RankPosition, vp_stage: int) -> List[str]:
    """Names of the chunk's weights with a copy on another stage (``LanguageModule.cross_stage_embedding_weights``):
    alone in their bucket under the distributed optimizer."""
    pre, post = chunk_ends(pos, vp_stage)
    mtp_elsewhere = bool(c.mtp_num_layers) and pre != post
    tied = lm.share_embeddings_and_output_weights and pre != post
    if not (tied or mtp_elsewhere):
        return []
    names = ["embedding.word_embeddings.weight" if pre or mtp_elsewhere else "output_layer.weight"]
    if mtp_elsewhere and lm.position_embedding_type == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    return names


# --------------------------------------------------------------------------- state
# A transformer layer (Megatron-FSDP's unit): "decoder.layers.3." or an MTP layer's "...transformer_layer.".
_UNIT = re.compile(r"^(.*?\.layers\.\d+\.transformer_layer\.|.*?decoder\.layers\.\d+\.)")


def unit_starts(entries: Sequence[ParamEntry]) -> FrozenSet[int]:
    """Indices (layout order) where the transformer layer changes: ``optim_grads_params`` opens a bucket there."""
    units = [(m.group(1) if (m := _UNIT.match(e.name)) else None) for e in entries]
    return frozenset(i for i in range(1, len(units)) if units[i] != units[i - 1])


def _buffer_state(
    entries: Sequence[ParamEntry],
    bucket_size: Optional[int],
    dp: int,
    dp_rank: int,
    distributed: bool,
    own_bucket: frozenset,
    starts: FrozenSet[int] = frozenset(),
) -> Tuple[int, int]:
    """(buffer elements, elements of this DP rank's optimizer state) for one gradient buffer."""
    numels = [e.numel for e in entries]
    ranges, plans = plan_buckets(numels, bucket_size, dp if distributed else 1, own_bucket, starts)
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
    """Parameter, gradient-buffer and optimizer bytes on one rank (every chunk, DDP- or FSDP2-wrapped); with
    several distributed-optimizer instances the shards are 1/(dp / N)."""
    if isinstance(ddp, TorchFullyShardedDataParallelConfig):
        return _fsdp2_state_bytes(c, lm, opt, pos)
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
        alone = cross_stage_names(c, lm, pos, vp_stage) if distributed and pos.pp > 1 else []
        # One buffer per (expert or not, parameter dtype): fp32-only parameters have their own in half precision.
        for expert, own_fp32 in ((False, False), (False, True), (True, False), (True, True)):
            group = [e for e in reversed(entries) if e.is_expert == expert and (e.fp32 and p_size != FP32) == own_fp32]
            if not group:
                continue
            held_size = FP32 if own_fp32 else p_size
            names = [e.name for e in group]
            own = frozenset(names.index(name) for name in alone if name in names)
            # Sharded within one distributed-optimizer instance (dp / N consecutive DP ranks).
            dp = (pos.expt_dp if expert else pos.dp * pos.cp) // ddp.num_distributed_optimizer_instances
            rank = pos.dp_rank % dp
            starts = unit_starts(group) if ddp.shard_params else frozenset()
            numel, owned = _buffer_state(group, bucket_size, dp, rank, distributed, own, starts)
            held_params = numel // dp if ddp.shard_params else numel if distributed else sum(e.numel for e in group)
            out.params += held_params * held_size
            out.grads += (numel // dp if ddp.shard_grads else numel) * (FP32 if own_fp32 else g_size)
            out.main_params += owned * FP32 if held_size != FP32 else 0
            out.optimizer_states += owned * FP32 * _optimizer_states_per_param(opt)
    return out


def _fsdp2_state_bytes(
    c: TransformerConfig, lm: LanguageModelShape, opt: OptimizerConfig, pos: RankPosition
) -> StateBytes:
    """FSDP2: each parameter's 1/d shard in fp32 (the main weight), its fp32 gradient shard and moments;
    experts sharded over expert-DP, the rest over DP x CP (FSDP2 runs without pipeline stages)."""
    out = StateBytes()
    for vp_stage in range(pos.vp or 1):
        for e in chunk_parameters(c, lm, pos, vp_stage):
            dp = pos.expt_dp if e.is_expert else pos.dp * pos.cp
            held = -(-e.numel // dp)
            out.params += held * FP32
            out.grads += held * FP32
            out.optimizer_states += held * FP32 * _optimizer_states_per_param(opt)
    return out
