"""Model FLOPs of a GPT (or hybrid Mamba) training iteration: ``FlopsConfig`` (the shape that determines them) and
``num_floating_point_operations`` (re-exported by ``training_log``, where the logger uses them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from megatron.core.transformer.attention_variant_fields import linear_attention_layer


@dataclass(frozen=True)
class FlopsConfig:
    """The shape of a GPT that determines its matmul FLOPs."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    padded_vocab_size: int
    num_query_groups: Optional[int] = None  # None: one key/value head per query head
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    swiglu: bool = False
    num_moe_layers: int = 0  # of num_layers, whose MLP runs moe_router_topk experts of moe_ffn_hidden_size
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_shared_expert_intermediate_size: Optional[int] = None  # MoE layers also run this MLP on every token
    attention_output_gate: bool = False  # the query projection also produces a gate as wide as the queries
    multi_latent_attention: bool = False  # the attention term is then ``mla_attention_flops``
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    mtp_num_layers: int = 0  # each: eh_proj (2h -> h), one layer like the last, its own logits
    experimental_attention_variant: Optional[str] = None  # 'dsa': every MLA layer adds ``dsa_indexer_flops``
    dsa_indexer_n_heads: int = 0
    dsa_indexer_head_dim: int = 0
    # experimental_attention_variant 'gated_delta_net': these layers are Gated DeltaNet (``gdn_layer_flops``)
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # A hybrid Mamba model (``pretrain_mamba.py``): one symbol per layer (``M`` Mamba, ``*`` attention,
    # ``-`` MLP, ``E`` MoE; ``allocate_layers``); None for a GPT. Its FLOPs are ``hybrid_flops``.
    hybrid_layer_pattern: Optional[str] = None
    mamba_state_dim: int = 0
    mamba_head_dim: int = 0
    mamba_num_groups: int = 0
    mamba_num_heads: Optional[int] = None  # None: 2 * hidden_size / mamba_head_dim
    # DeepSeek-V4: one attention type per layer (``compressed_attention_flops``; CSA keeps ``dsa_indexer_topk``
    # entries), the sliding window ``(W - 1, 0)``, and ``hyper_connection_streams`` residual streams.
    compressed_attention_layer_types: Optional[Sequence[str]] = None
    window_size: Optional[Tuple[int, int]] = None
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    attention_output_groups: Optional[int] = None
    attention_output_lora_rank: Optional[int] = None
    dsa_indexer_topk: Optional[int] = None
    hyper_connection_streams: int = 1


def mla_attention_flops(cfg: FlopsConfig) -> float:
    """Forward FLOPs per token of one multi-latent attention layer (matmuls, 2 per multiply-add).

    With n heads, dq = qk_head_dim + qk_pos_emb_head_dim, dv = v_head_dim: the query path
    ``h -> q_lora_rank -> n*dq`` (or ``h -> n*dq``), the key/value down projection
    ``h -> kv_lora_rank + qk_pos_emb_head_dim``, its up projection ``kv_lora_rank -> n*(qk_head_dim + dv)``,
    the output ``n*dv -> h``, and the full s x s scores (``n*dq``) and weighted values (``n*dv``).
    """
    h, s, n = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads
    dq, dv = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    query = h * n * dq if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + n * dq)
    key_value = h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + cfg.kv_lora_rank * n * (cfg.qk_head_dim + dv)
    return 2 * (query + key_value + n * dv * h) + 2 * s * n * (dq + dv)


def dsa_indexer_flops(cfg: FlopsConfig) -> float:
    """Forward FLOPs per token of one DSA lightning indexer (0 without DSA): its query ``q_lora_rank -> hi*di``,
    key ``h -> di`` and head weights ``h -> hi``, the s scores per head (``di``) and their weighted sum over heads.
    The attention itself is still counted whole (this implementation masks the s x s scores)."""
    if cfg.experimental_attention_variant != "dsa":
        return 0.0
    h, s, heads, d = cfg.hidden_size, cfg.seq_length, cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
    return 2 * ((cfg.q_lora_rank or 0) * heads * d + h * d + h * heads) + 2 * s * heads * (d + 1)


def compressed_attention_flops(cfg: FlopsConfig, layer_type: str) -> Tuple[float, float]:
    """Forward FLOPs per token of one DeepSeek-V4 attention layer of ``layer_type``: (trained, no-backward).

    With n heads of d channels, query rank ql, g output groups of rank r, window W = ``window_size[0] + 1``
    (at most s): projections ``h -> ql -> n d``, the shared key/value ``h -> d``, the grouped output
    ``n d -> g r`` (each group ``n d / g -> r``) and ``g r -> h``; the window's scores and weighted values
    (``4 n d W``). HCA adds its compressor (key/value and gate ``h -> d`` on the ``(s // m) m`` pooled tokens)
    and attention over all ``s // m`` entries (future ones masked, counted as computed). CSA's compressor is
    twice as wide (overlapping windows) and attention covers ``min(k, s // m)`` chosen entries; its
    ``CompressedIndexer`` (no gradient: the second term) has an overlapping compressor at ``di``, queries
    ``ql -> hi di``, head weights ``h -> hi`` and ``hi (di + 1)`` per scored entry, as DSA's.
    """
    h, s, n = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads
    d = cfg.kv_channels or h // n
    ql, groups, rank = cfg.q_lora_rank, cfg.attention_output_groups, cfg.attention_output_lora_rank
    trained = 2 * (h * ql + ql * n * d + h * d + n * d * rank + groups * rank * h)
    trained += 4 * n * d * min(cfg.window_size[0] + 1, s)
    if layer_type == "sliding_attention":
        return trained, 0.0
    rate = cfg.csa_compress_rate if layer_type == "compressed_sparse_attention" else cfg.hca_compress_rate
    entries, pooled = s // rate, (s // rate) * rate / s  # compressed entries; share of tokens pooled
    if layer_type == "heavily_compressed_attention":
        return trained + 4 * h * d * pooled + 4 * n * d * entries, 0.0
    trained += 8 * h * d * pooled + 4 * n * d * min(cfg.dsa_indexer_topk, entries)
    heads, di = cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
    indexer = 8 * h * di * pooled + 2 * (ql * heads * di + h * heads) + 2 * entries * heads * (di + 1)
    return trained, indexer


def hyper_connection_flops(cfg: FlopsConfig) -> Tuple[float, float]:
    """Forward FLOPs per token of hyper-connections over n streams (0 when n = 1): (per layer, per head).

    Each of a layer's two ``HyperConnectionModule``s projects the n h flattened streams to ``(2 + n) n`` mixing
    weights and mixes the streams (``comb^T streams``: ``n^2 h``); a ``HyperHead`` projects them to n weights.
    The Sinkhorn iterations, the weighted collapses and the merge's ``post * output`` are elementwise."""
    n, h = cfg.hyper_connection_streams, cfg.hidden_size
    if n <= 1:
        return 0.0, 0.0
    return 2 * 2 * (n * h * (2 + n) * n + n * n * h), 2 * n * h * n


def gdn_layer_flops(cfg: FlopsConfig) -> float:
    """Forward FLOPs per token of one Gated DeltaNet layer, counted as Megatron counts them: ``in_proj``
    (``h -> 2 qk + 2 v + 2 Hv``: q, k, v, z, beta, alpha), the depthwise convolution over q, k, v (``K`` taps),
    the delta rule (``4 Hv dv^2``: K K^T, V K^T, the state update and the read-out) and ``out_proj`` (``v -> h``),
    with qk = key heads x key head dim, v = value heads x value head dim."""
    h, heads, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qk, v = cfg.linear_num_key_heads * cfg.linear_key_head_dim, heads * dv
    conv = cfg.linear_conv_kernel_dim * (2 * qk + v)
    return 2 * (h * (2 * qk + 2 * v + 2 * heads) + conv + 4 * heads * dv * dv + h * v)


def _linear_attention_layers(cfg: FlopsConfig) -> int:
    """How many decoder layers are Gated DeltaNet layers (0 without that variant)."""
    if cfg.experimental_attention_variant != "gated_delta_net":
        return 0
    return sum(linear_attention_layer(cfg.linear_attention_freq, n) for n in range(1, cfg.num_layers + 1))


def mamba_layer_flops(cfg: FlopsConfig) -> float:
    """Forward FLOPs per token of one Mamba-2 mixer, counted as Megatron counts them.

    With d = heads * head_dim inner channels, G groups, N state size: ``in_proj`` (``h -> 2d + 2GN + heads``:
    z, x, B, C, dt), Megatron's estimate of the selective scan (``7 d N``) and ``out_proj`` (``d -> h``). The
    convolution, gates and norm are not counted. Megatron takes d = 2h whatever ``mamba_num_heads`` is; here d is
    the mixer's own width (the same unless ``mamba_num_heads * mamba_head_dim != 2h``).
    """
    h = cfg.hidden_size
    heads = cfg.mamba_num_heads or 2 * h // cfg.mamba_head_dim
    d = heads * cfg.mamba_head_dim
    n = cfg.mamba_state_dim
    return 2 * h * (2 * d + 2 * cfg.mamba_num_groups * n + heads) + 7 * d * n + 2 * d * h


def hybrid_flops(cfg: FlopsConfig, batch_size: int) -> float:
    """Model FLOPs of one training iteration of a hybrid Mamba model, by Megatron's rules for hybrids.

    Per token and forward pass, summed over the pattern's layers: Mamba ``mamba_layer_flops``; attention
    ``4hq + 4hk`` projections (``+ 2hq`` with the output gate) and ``2sq`` for the scores and weighted values
    (the causal half of the square, as Megatron's hybrid count takes it; the GPT count takes the whole square);
    MLP ``4hf`` (x 3/2 with SwiGLU); MoE its routed and shared experts as in the GPT count; logits ``2hV`` per
    output (the model's and each MTP module's). Backward costs twice the forward: 3x in all.
    """
    h, s, pattern = cfg.hidden_size, cfg.seq_length, cfg.hybrid_layer_pattern or ""
    d = cfg.kv_channels or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * d
    k = (cfg.num_query_groups or cfg.num_attention_heads) * d
    gated = 1.5 if cfg.swiglu else 1.0
    attention = 4 * h * q + 4 * h * k + (2 * h * q if cfg.attention_output_gate else 0) + 2 * s * q
    moe_ffn = cfg.moe_router_topk * cfg.moe_ffn_hidden_size + (cfg.moe_shared_expert_intermediate_size or 0)
    per_layer = {
        "M": mamba_layer_flops(cfg),
        "*": attention,
        "-": 4 * h * cfg.ffn_hidden_size * gated,
        "E": 4 * h * moe_ffn * gated,
    }
    logits = 2 * h * cfg.padded_vocab_size * (1 + cfg.mtp_num_layers)
    return 3.0 * batch_size * s * (sum(per_layer[symbol] for symbol in pattern) + logits)


def num_floating_point_operations(cfg: FlopsConfig, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) over ``batch_size`` sequences.

    Only matrix multiplications are counted, at 2 FLOPs per multiply-add. With
    T = batch_size * s tokens, h hidden, L layers, q = heads * kv_channels (query
    width), k = groups * kv_channels (key/value width), f the FFN width, V the
    padded vocabulary, the forward pass costs per token:

    * attention projections: Q (h x q), K and V (h x k each), output (q x h):
      2 * (2*h*q + 2*h*k) = 4*h*q*(1 + k/q);
    * with ``attention_output_gate`` the query projection is twice as wide (queries and gate): + 2*h*q;
    * attention scores Q K^T and the weighted sum of V: 2 * 2*s*q = 4*s*q
      (the full s x s square: the causal mask's skipped half is counted too);
    * MLP: h -> f and f -> h: 4*h*f; with SwiGLU the first projection is
      h -> 2f (gate and up): 6*h*f;
    * logits (once, not per layer): 2*h*V.
    * MoE layers: the MLP term with f = topk * moe_ffn_hidden_size, plus the shared experts'
      width (each token runs k experts and the shared ones; the router's 2*h*E is not counted).
    * multi-latent attention replaces the attention terms by ``mla_attention_flops``.
    * each multi-token prediction module: ``eh_proj`` (2h -> h: 4h^2), one layer of the last
      layer's kind (MoE when there are MoE layers) and its own logits.

    The backward pass costs twice the forward (a gradient for the input and one
    for the weight of every matmul), so the iteration costs 3x the forward:

        3 * T * [ L * (4hq(1 + k/q) + 4sq + 4hf * g) + 2hV ],   g = 3/2 with SwiGLU else 1,

    which is Megatron's ``12 * T * L * h^2 * (...)`` expression written out. DSA's indexer
    (``dsa_indexer_flops``, in each layer and MTP layer) has no backward: it adds its forward once. Not counted:
    norms, softmax, activations, embeddings lookup, loss, optimizer, and the extra
    forward of activation recomputation (model FLOPs, not hardware FLOPs). Gated DeltaNet layers
    (``experimental_attention_variant='gated_delta_net'``) count ``gdn_layer_flops`` instead of attention;
    a hybrid Mamba model (``hybrid_layer_pattern``) is counted by ``hybrid_flops``. DeepSeek-V4
    (``compressed_attention_layer_types``) counts ``compressed_attention_flops`` per layer (its CSA indexer, like
    DSA's, once) and, with hyper-connections, ``hyper_connection_flops`` per layer and per output (the model's and
    each MTP module's hyper head). A hash-routed MoE layer runs its experts as a learned one does (the hash
    replaces only the choice of experts; its gate is uncounted like the router's).
    """
    if cfg.hybrid_layer_pattern is not None:
        return hybrid_flops(cfg, batch_size)
    h, s = cfg.hidden_size, cfg.seq_length
    gated = 1.5 if cfg.swiglu else 1.0
    decoder_attention, mtp_attention, forward_only = _attention_terms(cfg)
    dense_ffn = (cfg.num_layers - cfg.num_moe_layers) * cfg.ffn_hidden_size
    per_moe_layer = cfg.moe_router_topk * cfg.moe_ffn_hidden_size + (cfg.moe_shared_expert_intermediate_size or 0)
    moe_ffn = cfg.num_moe_layers * per_moe_layer
    last_ffn = per_moe_layer if cfg.num_moe_layers else cfg.ffn_hidden_size  # an MTP layer repeats the last kind
    per_layer_streams, head_streams = hyper_connection_flops(cfg)
    logits = 2 * h * cfg.padded_vocab_size + head_streams  # each output: its hyper head, its logits
    mtp = cfg.mtp_num_layers * (4 * h * h + mtp_attention + 4 * h * last_ffn * gated + per_layer_streams + logits)
    forward_per_token = (
        decoder_attention + 4 * h * (dense_ffn + moe_ffn) * gated + cfg.num_layers * per_layer_streams + logits + mtp
    )
    return batch_size * s * (3.0 * forward_per_token + forward_only)


def _attention_terms(cfg: FlopsConfig) -> Tuple[float, float, float]:
    """Forward FLOPs per token of attention: (all decoder layers', one MTP layer's, the no-backward part of
    the decoder and MTP layers: DSA's or CSA's indexer)."""
    if cfg.compressed_attention_layer_types is not None:
        types = list(cfg.compressed_attention_layer_types)
        terms = {t: compressed_attention_flops(cfg, t) for t in set(types)}
        last = terms[types[-1]]  # an MTP layer has the last layer's attention type
        decoder = sum(terms[t][0] for t in types)
        return decoder, last[0], sum(terms[t][1] for t in types) + cfg.mtp_num_layers * last[1]
    h, s = cfg.hidden_size, cfg.seq_length
    d = cfg.kv_channels or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * d
    k = (cfg.num_query_groups or cfg.num_attention_heads) * d
    gate = 2 * h * q if cfg.attention_output_gate else 0
    attention = mla_attention_flops(cfg) if cfg.multi_latent_attention else 4 * h * q * (1 + k / q) + gate + 4 * s * q
    linear = _linear_attention_layers(cfg)  # their attention term is the Gated DeltaNet's
    decoder = (cfg.num_layers - linear) * attention + linear * gdn_layer_flops(cfg)
    return decoder, attention, (cfg.num_layers + cfg.mtp_num_layers) * dsa_indexer_flops(cfg)
