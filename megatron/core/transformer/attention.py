"""Self-attention: fused QKV projection (column parallel), core attention, output projection (row parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core.extensions.transformer_engine import is_te_linear
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.core.transformer.dot_product_attention import (  # noqa: F401 - re-exported: the names' old home
    FLASH_HEAD_DIM_MAX,
    DotProductAttention,
    flash_blockers,
    layer_cp_comm_type,
    repeat_kv,
    warn_flash_unavailable,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.masks import build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import LayerNorm, Norm, RMSNorm, build_norm
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import CP_COMM_TYPES, TransformerConfig


def cp_groups_of(groups: ProcessGroupCollection) -> Dict[str, object]:
    """``DotProductAttention``'s context-parallel keyword arguments from a collection: ``cp_group`` (None
    without CP) and ``hcp_groups`` (the hierarchical sub-groups, None unless built)."""
    return dict(cp_group=groups.cp if groups.size_of("cp") > 1 else None, hcp_groups=groups.hcp)


def run_core_attention(
    attention: MegatronModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    packed_seq_params: Optional[PackedSeqParams] = None,
) -> torch.Tensor:
    """``attention.core_attention`` on ``[s, b, heads, d]`` inputs, recomputed in backward under selective
    recomputation (the bias, which carries a gradient, goes in as a checkpointed input)."""
    packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
    if not (attention.recompute_core_attention and attention.training):
        return attention.core_attention(query, key, value, mask, bias, **packed)
    if bias is None:
        return checkpoint(lambda q, k, v: attention.core_attention(q, k, v, mask, **packed), False, query, key, value)
    return checkpoint(
        lambda q, k, v, t: attention.core_attention(q, k, v, mask, t, **packed), False, query, key, value, bias
    )


@dataclass
class SelfAttentionSubmodules:
    """Megatron-core's parts of self-attention; the defaults are the layers this module builds.

    Only these layers exist here (Transformer-Engine specs fall back to them), so another class in
    a field raises ``NotImplementedError`` naming it. A ``q_layernorm`` / ``k_layernorm`` entry
    (a norm class such as ``transformer.norms.Norm``) builds the query/key norms.
    """

    linear_qkv: Any = ColumnParallelLinear
    core_attention: Any = None  # DotProductAttention (dot_product_attention.py; None means it)
    linear_proj: Any = RowParallelLinear
    q_layernorm: Any = None
    k_layernorm: Any = None

    def check(self, config: TransformerConfig) -> bool:
        """Raise unless every part is one this module builds; whether query/key norms are asked for."""
        expected = {"linear_qkv": ColumnParallelLinear, "core_attention": DotProductAttention}
        expected["linear_proj"] = RowParallelLinear
        te_modes = {"linear_qkv": "column", "linear_proj": "row"}
        for name, cls in expected.items():
            value = getattr(self, name)
            if value not in (cls, None) and not is_te_linear(value, te_modes.get(name, "")):
                raise NotImplementedError(
                    f"SelfAttentionSubmodules.{name}={value!r}: only {cls.__name__}"
                    + (f" or the Transformer Engine {te_modes[name]}-parallel linear" if name in te_modes else "")
                )
        allowed = (None, Norm, LayerNorm if config.normalization == "LayerNorm" else RMSNorm)
        norms = (self.q_layernorm, self.k_layernorm)
        if any(n not in allowed for n in norms) or (norms[0] is None) != (norms[1] is None):
            raise NotImplementedError(
                f"q_layernorm={self.q_layernorm!r}, k_layernorm={self.k_layernorm!r}: both None or both the norm "
                f"config.normalization={config.normalization!r} names (or Norm)"
            )
        return norms[0] is not None


class SelfAttention(MegatronModule):
    """Multi-head / grouped-query self-attention split over tensor-parallel ranks by query group.

    The fused QKV weight is laid out per query group: for each group, its query heads,
    then one key head, then one value head. A column split therefore hands each TP rank
    whole groups, and no communication is needed until the output projection.

    Megatron-core's signature: ``submodules`` (``SelfAttentionSubmodules``, checked), ``cp_comm_type``
    (this layer's context-parallel scheme; None: ``config.cp_comm_type``),
    and ``pg_collection`` (None: ``parallel_state``'s groups, for library
    callers; the models always pass theirs). ``qk_layernorm`` (from our layer spec) builds query/key
    norms (True) or none (False); None follows the submodules, else ``config.qk_layernorm``. The spec
    may not drop norms the config asks for.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[SelfAttentionSubmodules] = None,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        qk_layernorm: Optional[bool] = None,
    ) -> None:
        super().__init__(config)
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r}: must be one of {CP_COMM_TYPES}")
        self.cp_comm_type = cp_comm_type
        spec_norms = (submodules or SelfAttentionSubmodules()).check(config)
        if qk_layernorm is None and submodules is not None:
            qk_layernorm = spec_norms or None
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self._build(config, layer_number, attn_mask_type, groups, qk_layernorm, submodules or SelfAttentionSubmodules())

    def _build(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        groups: ProcessGroupCollection,
        qk_layernorm: Optional[bool],
        submodules: SelfAttentionSubmodules,
    ) -> None:
        tp = groups.size_of("tp")
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        d = config.kv_channels
        gated = 2 if config.attention_output_gate else 1  # each group's queries, then as many gate columns
        qkv_size = d * (gated * config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = (submodules.linear_qkv or ColumnParallelLinear)(
            config.hidden_size,
            qkv_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False,
            tp_group=groups.tp,
        )
        self.core_attention = DotProductAttention(
            config,
            layer_number,
            attn_mask_type,
            cp_comm_type=self.cp_comm_type,
            **cp_groups_of(groups),
        )
        self.linear_proj = (submodules.linear_proj or RowParallelLinear)(
            d * config.num_attention_heads,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=groups.tp,
        )
        if qk_layernorm is False and config.qk_layernorm:
            raise ValueError("the layer spec says qk_layernorm=False but TransformerConfig.qk_layernorm=True")
        with_qk_norm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
        self.q_layernorm = build_norm(config, d) if with_qk_norm else None
        self.k_layernorm = build_norm(config, d) if with_qk_norm else None
        for norm in (self.q_layernorm, self.k_layernorm) if with_qk_norm and tp > 1 else ():
            for param in norm.parameters():  # per-head weights: each rank's gradient covers its heads only,
                param.sequence_parallel = True  # summed over TP by finalize_model_grads (as Megatron does)
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.layer_number = layer_number  # global: names this layer's KV cache

    def split_qkv(self, mixed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, groups/tp * (q_per_group + 2) * d]`` -> q ``[s, b, heads/tp, d]``, k, v ``[s, b, groups/tp, d]``."""
        query, _, key, value = self.split_qkv_gate(mixed)
        return query, key, value

    def split_qkv_gate(
        self, mixed: torch.Tensor
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Split the QKV projection into q ``[s, b, heads/tp, d]``, the output gate (``[s, b, heads/tp * d]``,
        None unless ``attention_output_gate``), k and v ``[s, b, groups/tp, d]``.

        Each query group's columns are its queries, then (gated) as many gate columns, then its key and value.
        """
        s, b, _ = mixed.shape
        d = self.config.kv_channels
        q_cols = self.heads_per_rank // self.groups_per_rank * d
        g_cols = q_cols if self.config.attention_output_gate else 0
        mixed = mixed.view(s, b, self.groups_per_rank, q_cols + g_cols + 2 * d)
        q, gate, k, v = torch.split(mixed, [q_cols, g_cols, d, d], dim=-1)
        gate = gate.reshape(s, b, self.heads_per_rank * d) if g_cols else None
        return q.reshape(s, b, self.heads_per_rank, d), gate, k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp with SP), b, h]`` -> (output ``[s(/tp), b, h]``, output bias or None).

        ``packed_seq_params``: the rows are packed sequences (``megatron.core.packed_seq_params``),
        each attending to itself only; the rotary angles already follow each sequence's positions.

        ``attention_bias`` ``[1|b, heads/tp, s, s]`` is added to the scores (T5's relative position bias).
        ``inference_context`` (a ``megatron.core.inference.StaticInferenceContext``): this call's tokens
        are the positions from its ``sequence_len_offset`` on; their keys and values (rotated) join its
        cache, and the queries attend over every cached position up to their own.
        """
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, qkv/tp]
        query, gate, key, value = self.split_qkv_gate(mixed)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None:
            interleaved = self.config.rotary_interleaved
            fused = self.config.apply_rope_fusion
            query = apply_rotary_pos_emb(query, rotary_pos_emb, interleaved, fused=fused)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, interleaved, fused=fused)
        if inference_context is not None and not inference_context.is_static_batching():
            return self.linear_proj(self._paged(inference_context, query, key, value, attention_mask, attention_bias))
        if inference_context is not None:
            key, value, attention_mask = self._with_kv_cache(inference_context, key, value, attention_mask)
        context = run_core_attention(
            self, query, key, value, attention_mask, attention_bias, packed_seq_params
        )  # [s, b, heads/tp*d]
        if gate is not None:  # in fp32, back to the activation dtype
            context = (context * torch.sigmoid(gate.float())).to(context.dtype)
        return self.linear_proj(context)

    def _paged(
        self,
        inference_context: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Attention of a dynamic-batching step (``DynamicInferenceContext``): the flat ``[T, 1, ., d]`` tokens of
        several requests, each over its own cached positions -> ``[T, 1, heads/tp*d]``."""
        self._refuse_in_inference()
        if mask is not None or bias is not None:
            raise NotImplementedError(
                "SelfAttention: a dynamic inference step takes no attention_mask or attention_bias"
            )
        query, key, value, blocked = inference_context.paged_attention_inputs(self.layer_number, query, key, value)
        context = run_core_attention(self, query, key, value, blocked, None)  # [maxq, B, heads/tp*d]
        return inference_context.unpad_attention_output(context)

    def _with_kv_cache(
        self, inference_context: Any, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append ``key``/``value`` ``[s, b, groups/tp, d]`` to the cache; return every cached position's
        ``[offset + s, b, groups/tp, d]`` and the causal mask ``[s, offset + s]`` of this call's queries
        (True = blocked), or-ed with ``mask``."""
        self._refuse_in_inference()
        s = key.shape[0]
        positions = inference_context.query_positions(s, key.device)  # [s]
        key, value = inference_context.append_key_value(self.layer_number, key, value)  # [offset + s, b, g, d]
        blocked = build_attention_mask(s, key.shape[0], query_positions=positions)  # [s, offset + s]
        return key, value, blocked if mask is None else mask | blocked

    def _refuse_in_inference(self) -> None:
        c = self.config
        if self.core_attention.cp_size > 1 or c.sequence_parallel:
            raise NotImplementedError(
                "SelfAttention with inference_context: not supported yet with context parallelism or "
                f"sequence_parallel (cp={self.core_attention.cp_size}, sequence_parallel={c.sequence_parallel})"
            )
