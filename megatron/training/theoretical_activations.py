"""Activation part of the theoretical memory (see ``theoretical_memory``): saved-for-backward bytes.

What each of our modules saves, as they are written: SDPA attention keeps q/k/v, its output and the
fp32 log-sum-exp, never an ``s x s`` score matrix (the unfused backend does); dropout keeps masks
only when dropout > 0 (bool on CUDA, the activations' dtype on a CPU); sequence parallelism divides
norm and linear inputs by TP; selective recompute drops what core attention keeps inside; full
recompute keeps one ``[s(/tp), b, h]`` input per checkpointed group and rebuilds a group during its
backward. Dropless MoE: every token goes to ``top-k`` experts, so a rank's experts see ``s*b*k``
routed tokens in expectation (exactly so without expert parallelism). With a capacity factor each
expert keeps at most its capacity per rank's tokens (balanced routing assumed), and exactly
``min(capacity, tokens)`` with ``moe_pad_expert_input_to_capacity``.
Shared experts are a dense MLP beside them; multi-latent attention keeps its latents, their norms and
the up projections' outputs; multi-token prediction adds per module an embedding, a layer, a head
and a loss on the last stage. DeepSeek-V4's compressed attention is replicated over TP and keeps what it saves for
the whole (gathered) sequence; its hyper-connections keep their fp32 mixes and Sinkhorn divisions for this rank's
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from megatron.core.pipeline_parallel.schedule_table import FORWARD, rank_schedule
from megatron.core.transformer.moe.routing import expert_capacity
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.theoretical_memory_params import (
    FP32,
    INDEX_BYTES,
    LanguageModelShape,
    RankPosition,
    attention_type,
    chunk_ends,
    chunk_layers,
    dtype_bytes,
    is_moe_layer,
)


@dataclass
class ActivationBytes:
    """Saved-for-backward bytes of one microbatch through one chunk, by layer kind."""

    parts: Dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float) -> None:
        self.parts[kind] = self.parts.get(kind, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


# --------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class _Tokens:
    """Token counts of one microbatch on one rank."""

    b: int  # micro batch size
    s: int  # sequence length on this CP rank
    sp: int  # divisor of norm / linear inputs: TP under sequence parallelism, else 1
    e: int  # bytes per activation element (the parameters' dtype)
    mask: int  # bytes per dropout-mask element

    @property
    def t(self) -> int:
        """Tokens of the TP group (``s/cp * b``)."""
        return self.s * self.b

    @property
    def local(self) -> float:
        """Tokens in this rank's ``[s/cp(/tp under SP), b, h]`` activation."""
        return self.t / self.sp


def _norm_activations(c: TransformerConfig, tokens: float, e: int, size: int = 0) -> float:
    """LayerNorm: input, fp32 mean and rstd. Our RMSNorm: fp32 input, fp32 1/rms, normalised input.
    ``size``: the normalised width (default: the hidden size)."""
    h = size or c.hidden_size
    if c.normalization == "LayerNorm":
        return tokens * h * e + 2 * tokens * FP32
    return tokens * h * FP32 + tokens * FP32 + tokens * h * e


def _core_attention(c: TransformerConfig, n: _Tokens, pos: RankPosition) -> float:
    """What core attention keeps inside (dropped by selective recompute)."""
    heads, groups, d = c.num_attention_heads // pos.tp, c.num_query_groups // pos.tp, c.kv_channels
    backend = getattr(c.attention_backend, "name", c.attention_backend)
    if backend in ("unfused", "local") or c.apply_query_key_layer_scaling:
        sk = n.s * pos.cp
        probs = FP32 + n.e if c.attention_softmax_in_fp32 and n.e != FP32 else n.e  # fp32 softmax + its cast
        return n.b * heads * n.s * sk * probs
    gathered = 2 * n.s * pos.cp * n.b * groups * d * n.e if pos.cp > 1 else 0  # keys, values over CP
    return n.b * heads * n.s * FP32 + gathered  # SDPA's log-sum-exp (fp32)


def _latent_attention(c: TransformerConfig, n: _Tokens, pos: RankPosition) -> float:
    """Multi-latent attention: the down projections' input and outputs, the latent norms and the up
    projections' (gathered) inputs, the up projections' outputs, query and key with their rotated
    channels, RoPE tables, core, output."""
    heads, h, dr = c.num_attention_heads // pos.tp, c.hidden_size, c.qk_pos_emb_head_dim
    qk, dv, kv = c.qk_head_dim + dr, c.v_head_dim, c.kv_lora_rank
    total = n.local * h * n.e + n.local * (kv + dr) * n.e  # down projections' input, kv latent + positional key
    total += _norm_activations(c, n.local, n.e, kv) if c.qk_layernorm else 0
    total += n.t * kv * n.e + n.t * heads * (qk - dr + dv) * n.e  # kv_up input and output (keys, values)
    if c.q_lora_rank is not None:
        q = c.q_lora_rank
        total += n.local * q * n.e + (_norm_activations(c, n.local, n.e, q) if c.qk_layernorm else 0)
        total += n.t * q * n.e  # q_up input
    total += n.t * heads * qk * n.e * 3  # query projection, query and key (with their rotated channels)
    total += n.t * (heads + 1) * dr * n.e + 4 * n.s * dr * n.e  # rotated channels, cos/sin tables
    if c.recompute_granularity != "selective":
        total += _core_attention(c, n, pos)
    return total + n.t * heads * dv * n.e  # context: linear_proj's input


def _attention(c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, pos: RankPosition) -> float:
    """Self-attention: QKV input, the fused q/k/v, rotated copies, RoPE tables, core, output."""
    if c.multi_latent_attention:
        return _latent_attention(c, n, pos)
    heads, groups, d, h = c.num_attention_heads // pos.tp, c.num_query_groups // pos.tp, c.kv_channels, c.hidden_size
    rope = lm.position_embedding_type == "rope"
    total = n.local * h * n.e + n.t * (heads + 2 * groups) * d * n.e  # linear_qkv input, q/k/v storage
    if rope or (groups > 1 and heads > groups):  # rotated or regrouped queries are new tensors
        total += n.t * heads * d * n.e
    if rope:
        total += n.t * groups * d * n.e + 4 * n.s * int(d * lm.rotary_percent) * n.e  # keys, cos/sin x (q, k)
    if c.recompute_granularity != "selective":
        total += _core_attention(c, n, pos)
    if c.attention_output_gate:  # the gate's columns of the fused projection, its fp32 sigmoid
        total += n.t * heads * d * (n.e + 4)
    return total + n.t * heads * d * n.e  # context: linear_proj's input


def _kv_compressor(
    c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, dim: int, rate: int, overlap: bool
) -> float:
    """DeepSeek-V4's ``KVCompressor`` over ``s // rate`` entries of ``rate`` (``2 rate`` with ``overlap``) slots: the
    slots' values, their fp32 softmax weights (and the weights' cast), RoPE tables at the entries, the entries' norm."""
    entries = n.s // rate
    slots = entries * n.b * (2 if overlap else 1) * rate * dim
    total = slots * n.e + slots * FP32 + (slots * n.e if n.e != FP32 else 0)
    return total + 2 * entries * _rotary_dim(c, lm) * FP32 + _norm_activations(c, entries * n.b, n.e, dim)


def _rotary_dim(c: TransformerConfig, lm: LanguageModelShape) -> int:
    return int(c.kv_channels * lm.rotary_percent)


def _compressed_attention(c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, layer_type: str) -> float:
    """DeepSeek-V4's ``CompressedAttention`` on the whole sequence of every TP rank (replicated; gathered under SP).

    The projections' input, the query latent's norm and the up projection's input, the key/value norm, the per-head
    unweighted norm of the queries (its input, 1/rms; in half precision also their fp32 copy and its cast), the cos
    and sin of three rotations (queries, key/value, output), the rotated queries and the heads' output (copied for
    the window's and the grouped projection's batched matmuls), the window's gathered keys, the padded keys and the
    window's validity, the softmax's max indices and probabilities over window, compressed entries and sink, the
    window's probabilities (copied), the low-rank output. HCA: the entries, the queries again, the future mask and
    the entries' probabilities; CSA: per batched matmul the gathered chosen entries and their indices, the queries
    again, the unchosen mask and the chosen entries' probabilities; each with its ``_kv_compressor`` (the indexer
    keeps nothing: no gradient).
    """
    t, e, heads, d, h = n.t, n.e, c.num_attention_heads, c.kv_channels, c.hidden_size
    ql, window = c.q_lora_rank, min(c.window_size[0] + 1, n.s)
    q = t * heads * d
    total = t * h * e + _norm_activations(c, t, e, ql) + t * ql * e + _norm_activations(c, t, e, d)
    total += q * e + t * heads * FP32 + (q * FP32 + t * heads * e if e != FP32 else 0)
    total += 6 * n.s * _rotary_dim(c, lm) * FP32 + 2 * q * e
    total += t * d * window * e + (n.s + window - 1) * n.b * d * e + n.s * window
    compressed = 0
    if layer_type == "heavily_compressed_attention":
        compressed = n.s // c.hca_compress_rate
        total += n.b * compressed * d * e + q * e + n.s * compressed
        total += _kv_compressor(c, lm, n, d, c.hca_compress_rate, overlap=False)
    elif layer_type == "compressed_sparse_attention":
        compressed = min(c.dsa_indexer_topk, n.s // c.csa_compress_rate)
        total += 2 * (n.b * INDEX_BYTES + t * compressed * (INDEX_BYTES + d * e)) + q * e + t * compressed
        total += _kv_compressor(c, lm, n, d, c.csa_compress_rate, overlap=True)
    total += t * heads * compressed * e  # the compressed entries' probabilities (copied)
    total += t * heads * INDEX_BYTES + t * heads * (window + compressed + 1) * e + t * heads * window * e
    return total + t * c.attention_output_groups * c.attention_output_lora_rank * e


def _stream_mix(c: TransformerConfig, n: _Tokens, mixes: int) -> float:
    """What a hyper-connection module or head keeps of its input streams (this rank's tokens): the streams
    (and their fp32 copy in half precision), 1/rms, the fp32 normalised streams and the ``mixes`` projections."""
    streams = n.local * c.hyper_connection_streams * c.hidden_size
    total = streams * n.e + (streams * FP32 if n.e != FP32 else 0)
    return total + n.local * FP32 + streams * FP32 + n.local * mixes * FP32


def _hyper_connections(c: TransformerConfig, n: _Tokens) -> float:
    """A layer's two ``HyperConnectionModule``s and merges: the stream mix of ``(2 + n) n`` weights, the fp32 sigmoids
    of pre and post and the pre weights (+eps), the softmax and the Sinkhorn iterations' ``2 I - 1`` divisions (each
    keeps its matrix and its sums); the merge keeps the mixing matrix and post (cast to the activations' dtype)
    and the sub-block's output."""
    k, iters, tokens = c.hyper_connection_streams, c.hyper_connection_sinkhorn_iterations, n.local
    module = _stream_mix(c, n, (2 + k) * k) + 3 * tokens * k * FP32
    module += 2 * iters * tokens * k * k * FP32 + (2 * iters - 1) * tokens * k * FP32
    merge = tokens * (k * k + k) * n.e + tokens * c.hidden_size * n.e
    return 2 * (module + merge)


def _hyper_head(c: TransformerConfig, n: _Tokens) -> float:
    """A ``HyperHead``: its stream mix of n weights, the fp32 sigmoid and the pre weights (0 without streams)."""
    k = c.hyper_connection_streams
    return _stream_mix(c, n, k) + 2 * n.local * k * FP32 if k > 1 else 0


def _mlp_intermediates(c: TransformerConfig, tokens: float, ffn_local: int, e: int) -> float:
    """fc1 output (gate and up) and the activation's output (gated: also act(gate); clamped, DeepSeek-V4's SwiGLU:
    also the clamped gate and up)."""
    if not c.gated_linear_unit:
        return tokens * ffn_local * e * 2
    return tokens * ffn_local * e * (4 if c.activation_func_clamp_value is None else 6)


def _routed_pairs(c: TransformerConfig, n: _Tokens, pos: RankPosition) -> float:
    """(token, expert) pairs this rank's experts run: ``t*k`` dropless (expected under EP, exact
    without); with a capacity factor, per local expert and per routing block (each EP rank's tokens,
    each TP rank's shard under SP) at most the capacity, exactly ``min(capacity, block)`` padded."""
    k, experts, factor = c.moe_router_topk, c.num_moe_experts, c.moe_expert_capacity_factor
    if factor is None:
        return n.t * k
    block = n.t / n.sp  # tokens one rank routes
    capacity = expert_capacity(int(block), k, experts, factor)
    per_expert = min(capacity, block) if c.moe_pad_expert_input_to_capacity else min(capacity, block * k / experts)
    return n.sp * pos.ep * (experts // pos.ep) * per_expert


def _moe(c: TransformerConfig, n: _Tokens, pos: RankPosition) -> float:
    """MoE on the TP group's tokens: router, routing bookkeeping, experts on the routed pairs."""
    h, k, experts = c.hidden_size, c.moe_router_topk, c.num_moe_experts
    local_experts = experts // pos.ep
    routed = _routed_pairs(c, n, pos)  # sum over local experts of their tokens
    total = n.t * h * n.e  # router input
    total += n.t * experts * FP32 if c.moe_router_pre_softmax else n.t * k * FP32  # softmax output
    total += n.t * k * INDEX_BYTES  # top-k indices
    if c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff > 0:
        total += n.t * experts * FP32 + experts * FP32 + FP32  # softmax scores, counts, loss
    total += n.t * pos.ep * local_experts * INDEX_BYTES + routed * (INDEX_BYTES + FP32)  # sort, indices, weights
    ffn = c.moe_ffn_hidden_size // pos.tp
    total += routed * 3 * h * n.e + _mlp_intermediates(c, routed, ffn, n.e)  # input, output, weighted
    if n.e != FP32:
        total += routed * n.e  # routing weights cast to the activations' dtype
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None:  # a dense MLP on the layer's input (the router's), its output; the gate
        total += _mlp_intermediates(c, n.t, shared // pos.tp, n.e) + n.local * h * n.e
        total += n.local * h * n.e + 2 * n.local * n.e if c.moe_shared_expert_gate else 0
    return total


def layer_activations(
    c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, pos: RankPosition, number: int, moe: bool = None
) -> ActivationBytes:
    """One layer (``number``: global, 1-based; ``moe``: whether it is MoE, default from ``number``)
    without full recompute, by kind."""
    out = ActivationBytes()
    out.add("norms", 2 * _norm_activations(c, n.local, n.e))
    v4_type = attention_type(c, number)
    out.add("attention", _attention(c, lm, n, pos) if v4_type is None else _compressed_attention(c, lm, n, v4_type))
    if c.hyper_connection_streams > 1:
        out.add("hyper_connections", _hyper_connections(c, n))
    if is_moe_layer(c, number) if moe is None else moe:
        out.add("moe", _moe(c, n, pos))
    else:
        mlp = n.local * c.hidden_size * n.e + _mlp_intermediates(c, n.t, c.ffn_hidden_size // pos.tp, n.e)
        out.add("mlp", mlp)
    if c.hidden_dropout > 0:
        out.add("dropout", 2 * n.local * c.hidden_size * n.mask)  # masks of the two residual dropouts
    return out


def _checkpoint_groups(c: TransformerConfig, count: int) -> List[Tuple[int, int, bool]]:
    """``(start, end, recomputed)`` over a chunk's ``count`` layers, as ``TransformerBlock.forward`` runs them."""
    full = c.recompute_granularity == "full"
    step = c.recompute_num_layers if full and c.recompute_method == "uniform" else 1
    groups, start = [], 0
    while start < count:
        end = min(start + step, count)
        recomputed = full and (c.recompute_method == "uniform" or start < c.recompute_num_layers)
        groups.append((start, end, recomputed))
        start = end
    return groups


def _ids(lm: LanguageModelShape, n: _Tokens) -> float:
    """Token ids and (learned positions) position ids an embedding keeps."""
    return (2 if lm.position_embedding_type == "learned_absolute" else 1) * n.t * INDEX_BYTES


def _cross_entropy(lm: LanguageModelShape, n: _Tokens, pos: RankPosition) -> float:
    """The vocab-parallel cross entropy of one head."""
    vocab = lm.vocab_size // pos.tp
    if n.e == FP32:  # fp32 softmax, not-mine mask, targets
        return n.t * vocab * FP32 + n.t + n.t * INDEX_BYTES
    # logits, not-mine mask, targets, fp32 max and log-sum-exp; softmax recomputed in backward
    return n.t * vocab * n.e + n.t + n.t * INDEX_BYTES + 2 * n.t * FP32


def _mtp(c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, pos: RankPosition) -> float:
    """Multi-token prediction modules: shifted ids and labels, embedding, two norms, ``eh_proj``'s
    ``[s, b, 2h]`` input, a layer of the last decoder layer's kind, its own head and masked loss."""
    h, moe = c.hidden_size, is_moe_layer(c, c.num_layers)
    per_module = _ids(lm, n) + n.t * INDEX_BYTES + 2 * n.t * FP32  # ids, labels, shifted mask and the masked loss
    per_module += 2 * _norm_activations(c, n.local, n.e) + 2 * n.local * h * n.e
    per_module += layer_activations(c, lm, n, pos, c.num_layers, moe).total
    per_module += _norm_activations(c, n.local, n.e) + n.local * h * n.e + _cross_entropy(lm, n, pos)  # head
    per_module += _hyper_head(c, n)
    return (c.mtp_num_layers or 0) * per_module


def _embedding_and_head(
    c: TransformerConfig, lm: LanguageModelShape, n: _Tokens, pos: RankPosition, pre: bool, post: bool
) -> ActivationBytes:
    out = ActivationBytes()
    if pre:
        mask = n.local * c.hidden_size * n.mask if c.hidden_dropout > 0 else 0
        out.add("embedding", _ids(lm, n) + mask)
    if post:
        out.add("norms", _norm_activations(c, n.local, n.e))
        if c.hyper_connection_streams > 1:
            out.add("hyper_connections", _hyper_head(c, n))
        out.add("output_layer", n.local * c.hidden_size * n.e)
        out.add("loss", _cross_entropy(lm, n, pos) + n.t * FP32 + FP32)  # masked_token_loss: fp32 mask; 1/tokens
        if c.mtp_num_layers:
            out.add("mtp", _mtp(c, lm, n, pos))
    return out


@dataclass
class ChunkActivations:
    """One microbatch through one chunk: bytes saved in forward by kind, and how far its backward
    rises above that (full recompute rebuilds a group's activations while earlier ones are kept)."""

    saved: ActivationBytes
    backward_rise: int = 0

    @property
    def total(self) -> int:
        return self.saved.total


def _backward_rise(segments: List[Tuple[int, int]]) -> int:
    """Walk backward over ``(saved, rebuilt)`` segments in forward order: each frees its saved bytes
    after rebuilding ``rebuilt`` (its recomputation); the highest point above the start."""
    current = rise = 0
    for saved, rebuilt in reversed(segments):
        rise = max(rise, current + rebuilt)
        current -= saved
    return rise


def chunk_activations(
    c: TransformerConfig,
    lm: LanguageModelShape,
    pos: RankPosition,
    micro_batch_size: int,
    seq_length: int,
    vp_stage: int = 0,
    device_type: str = "cuda",
) -> ChunkActivations:
    """Saved-for-backward bytes of one microbatch through chunk ``vp_stage`` of this rank.

    ``device_type``: CUDA's dropout keeps a bool mask, the CPU's a mask in the activations' dtype.
    """
    sp = pos.tp if c.sequence_parallel else 1
    e = dtype_bytes(c.params_dtype)
    n = _Tokens(micro_batch_size, seq_length // pos.cp, sp, e, 1 if device_type == "cuda" else e)
    pre, post = chunk_ends(pos, vp_stage)
    out = ActivationBytes()
    head = _embedding_and_head(c, lm, n, pos, pre, post)
    segments = [(head.parts.get("embedding", 0), 0)]
    numbers = chunk_layers(c, pos, vp_stage)
    for start, end, recomputed in _checkpoint_groups(c, len(numbers)):
        layers = [layer_activations(c, lm, n, pos, number) for number in numbers[start:end]]
        if recomputed:  # only the group's input is kept (split over TP with distribute_saved_activations)
            split = pos.tp if c.distribute_saved_activations else 1
            kept = int(n.local * c.hidden_size * n.e / split)
            out.add("recompute_inputs", kept)
            segments.append((kept, sum(a.total for a in layers)))
            continue
        for layer in layers:
            for kind, nbytes in layer.parts.items():
                out.add(kind, nbytes)
            rebuilt = int(_core_attention(c, n, pos)) if c.recompute_granularity == "selective" else 0
            segments.append((layer.total, rebuilt))
    for kind, nbytes in head.parts.items():
        out.add(kind, nbytes)
    segments.append((head.total - head.parts.get("embedding", 0), 0))
    return ChunkActivations(out, _backward_rise(segments))


def peak_in_flight(chunks: Sequence[ChunkActivations], pos: RankPosition, num_microbatches: int) -> int:
    """Peak of the activations alive on this rank over its pipeline schedule.

    Walks the rank's op list from ``schedule_table`` (the one the executor runs): a forward of
    (microbatch, chunk) adds that chunk's bytes, its backward rises by the chunk's recomputation
    and then frees them.
    """
    live = peak = 0
    for op in rank_schedule(pos.pp_rank, pos.pp, num_microbatches, pos.vp or 1):
        chunk = chunks[op.chunk]
        if op.kind == FORWARD:
            live += chunk.total
        else:
            peak = max(peak, live + chunk.backward_rise)
            live -= chunk.total
        peak = max(peak, live)
    return peak
