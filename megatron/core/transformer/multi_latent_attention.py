"""Multi-latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank latents.

Per token, with ``n`` heads, ``dn = qk_head_dim``, ``dr = qk_pos_emb_head_dim``, ``dv = v_head_dim``:

* query: ``x -> [q_lora_rank] -> norm -> [n, dn + dr]`` (or ``x -> [n, dn + dr]`` without ``q_lora_rank``);
* key/value: ``x -> [kv_lora_rank + dr]``; the latent part is normalized and expanded to
  ``[n, dn + dv]`` (each head's key without position and its value); the ``dr`` part is one
  rotated key shared by every head;
* the ``dr`` channels of queries and keys are rotated (RoPE or YaRN), after de-interleaving them
  (DeepSeek's checkpoints hold them as interleaved pairs); attention over ``dn + dr`` channels
  with the softmax scale ``yarn_mscale(s, mscale_all_dim)^2 / sqrt(dn + dr)``; output ``[n * dv]``.

Tensor parallelism splits the heads: the up projections are column parallel and the output
projection row parallel, while the down projections (``linear_q_down_proj``, ``linear_kv_down_proj``)
are replicated on every TP rank, as in Megatron. Each rank's heads give a partial gradient of the
latents and of the shared rotated key; the up projections' input communication and the explicit
one of the shared key (an all-reduce, or under sequence parallelism the reduce-scatter of the
sequence all-gather) sum them. Under sequence parallelism the down projections run on this rank's
``s/tp`` tokens, so their weights and the latent norms carry ``sequence_parallel`` and
``finalize_model_grads`` sums their gradients over TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.layers import _home_device
from megatron.core.tensor_parallel.linear_function import COMM_NONE, parallel_linear
from megatron.core.transformer.attention import cp_groups_of, run_core_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb, deinterleave, yarn_concentration, yarn_mscale
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


class ReplicatedLinear(MegatronModule):
    """``y = x W^T`` with the whole ``W`` ``[out, in]`` on every TP rank (no bias, no communication).

    Initialized with ``config.init_method`` from the default generator, which every TP rank seeds
    alike. Under sequence parallelism each rank sees its own tokens, so the weight is marked
    ``sequence_parallel`` and its gradient is summed over TP like a norm's. Under FP8 the GEMMs are
    quantized (``quantizer``, set by ``fp8_utils.attach_quantizers``), as Megatron's ``TELinear``
    runs them inside the layer's FP8 autocast.
    """

    def __init__(self, config: TransformerConfig, input_size: int, output_size: int) -> None:
        super().__init__(config)
        weight = torch.empty(output_size, input_size, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = torch.nn.Parameter(weight.to(device=_home_device(), dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.quantizer = None  # a quantization.recipes.LinearQuantizer under FP8/FP4

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """``[s, b, in]`` -> (``[s, b, out]``, None), like the parallel linears."""
        if self.quantizer is None:
            return F.linear(x, self.weight), None
        return parallel_linear(x, self.weight, None, None, COMM_NONE, False, self.quantizer), None  # [s, b, out]


@dataclass
class MLASelfAttentionSubmodules:
    """The replaceable part of ``MLASelfAttention`` (Megatron-core's field name): its core attention.

    A ``DotProductAttention`` by default; DeepSeek-V3.2's ``DSAttention``
    (``experimental_attention_variant/dsa.py``) adds a lightning indexer, and ``MLASelfAttention``
    then hands it the hidden states and query latent to build its sparse mask from. The projections
    are always the ones described in the module docstring.
    """

    core_attention: Any = DotProductAttention


class MLASelfAttention(MegatronModule):
    """Multi-latent self-attention split over TP ranks by head (see the module docstring).

    Parameters (Megatron-core's names): ``linear_q_proj`` or ``linear_q_down_proj`` +
    ``q_layernorm`` + ``linear_q_up_proj``; ``linear_kv_down_proj``, ``kv_layernorm``,
    ``linear_kv_up_proj``; ``linear_proj``. The latent norms exist with ``config.qk_layernorm``
    (Megatron's spec builds identities otherwise). ``forward`` takes the RoPE angles ``[s, 1, 1, dr]``
    from the model (``GPTModel`` computes them for ``qk_pos_emb_head_dim`` channels, YaRN's with
    ``rope_type='yarn'``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        submodules: Optional[MLASelfAttentionSubmodules] = None,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        if not config.multi_latent_attention:
            raise ValueError("MLASelfAttention needs TransformerConfig.multi_latent_attention=True")
        groups = pg_collection
        self.tp_group = groups.tp
        self.tp_size = groups.size_of("tp")
        self.heads_per_rank = config.num_attention_heads // self.tp_size
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self._build_projections(config, groups)
        yarn = config.rope_type == "yarn"
        self.rotary_mscale = (
            yarn_concentration(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) if yarn else 1.0
        )
        temperature = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        self.core_attention = build_module(
            (submodules or MLASelfAttentionSubmodules()).core_attention,
            config,
            layer_number,
            attn_mask_type,
            **cp_groups_of(groups),
            softmax_scale=temperature * temperature / math.sqrt(self.q_head_dim),
        )
        self.sparse = hasattr(self.core_attention, "sparse_attention_mask")  # DSAttention
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.layer_number = layer_number

    def _build_projections(self, config: TransformerConfig, groups: ProcessGroupCollection) -> None:
        n, h = config.num_attention_heads, config.hidden_size

        def column(in_size: int, out_size: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                in_size, out_size, config=config, init_method=config.init_method, bias=False, tp_group=groups.tp
            )

        if config.q_lora_rank is None:
            self.linear_q_proj = column(h, n * self.q_head_dim)
        else:
            self.linear_q_down_proj = ReplicatedLinear(config, h, config.q_lora_rank)
            self.q_layernorm = build_norm(config, config.q_lora_rank) if config.qk_layernorm else None
            self.linear_q_up_proj = column(config.q_lora_rank, n * self.q_head_dim)
        self.linear_kv_down_proj = ReplicatedLinear(config, h, config.kv_lora_rank + config.qk_pos_emb_head_dim)
        self.kv_layernorm = build_norm(config, config.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = column(config.kv_lora_rank, n * (config.qk_head_dim + config.v_head_dim))
        self.linear_proj = RowParallelLinear(
            n * config.v_head_dim,
            h,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=groups.tp,
        )

    def _query(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp), b, h]`` -> (queries ``[s, b, n/tp, dn + dr]`` not yet rotated, the normalised
        query latent ``[s(/tp), b, q_lora_rank]`` or None without query compression)."""
        latent = None
        if self.config.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)  # [s, b, n/tp * (dn + dr)]
        else:
            latent, _ = self.linear_q_down_proj(hidden_states)  # [s(/tp), b, q_lora_rank]
            if self.q_layernorm is not None:
                latent = self.q_layernorm(latent)
            q, _ = self.linear_q_up_proj(latent)  # [s, b, n/tp * (dn + dr)]
        return q.view(*q.shape[:2], self.heads_per_rank, self.q_head_dim), latent

    def _key_value(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s(/tp), b, h]`` -> (keys without position ``[s, b, n/tp, dn]``, values ``[s, b, n/tp, dv]``,
        the shared positional key ``[s, b, 1, dr]``, not yet rotated)."""
        c = self.config
        combined, _ = self.linear_kv_down_proj(hidden_states)  # [s(/tp), b, kv_lora_rank + dr]
        latent, k_pos = torch.split(combined, [c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv, _ = self.linear_kv_up_proj(latent)  # [s, b, n/tp * (dn + dv)]
        kv = kv.view(*kv.shape[:2], self.heads_per_rank, c.qk_head_dim + c.v_head_dim)
        k_nope, value = torch.split(kv, [c.qk_head_dim, c.v_head_dim], dim=-1)
        if c.sequence_parallel and self.tp_size > 1:
            k_pos = gather_from_sequence_parallel_region(k_pos, True, self.tp_group)  # [s, b, dr]
        elif self.tp_size > 1:
            k_pos = copy_to_tensor_model_parallel_region(k_pos, self.tp_group)  # backward sums the heads' parts
        return k_nope, value, k_pos.unsqueeze(2)

    def _rotate(self, t: torch.Tensor, rotary_pos_emb: Optional[torch.Tensor]) -> torch.Tensor:
        """The positional channels ``[s, b, m, dr]`` rotated (de-interleaved first), scaled by YaRN's factor."""
        if rotary_pos_emb is None:
            raise ValueError("MLASelfAttention needs rotary_pos_emb (GPTModel computes it under MLA)")
        return apply_rotary_pos_emb(deinterleave(t), rotary_pos_emb, mscale=self.rotary_mscale)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp with SP), b, h]`` -> (output ``[s(/tp), b, h]``, output bias or None)."""
        if inference_context is not None or attention_bias is not None:
            raise NotImplementedError("MLASelfAttention: inference_context and attention_bias are not supported yet")
        c = self.config
        q, latent = self._query(hidden_states)  # [s, b, n/tp, dn + dr]
        q_nope, q_pos = torch.split(q, [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        k_nope, value, k_pos = self._key_value(hidden_states)
        query = torch.cat([q_nope, self._rotate(q_pos, rotary_pos_emb)], dim=-1)  # [s, b, n/tp, dn + dr]
        k_pos = self._rotate(k_pos, rotary_pos_emb).expand(-1, -1, self.heads_per_rank, -1)  # [s, b, n/tp, dr]
        key = torch.cat([k_nope, k_pos], dim=-1)  # [s, b, n/tp, dn + dr]
        if self.sparse:
            attention_mask = self._sparse_mask(hidden_states, latent, rotary_pos_emb, attention_mask)
        context = run_core_attention(self, query, key, value, attention_mask, None)  # [s, b, n/tp * dv]
        return self.linear_proj(context)

    def _sparse_mask(
        self,
        hidden_states: torch.Tensor,
        latent: torch.Tensor,
        rotary_pos_emb: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """DSAttention's ``[b, 1, s, s]`` mask from the whole sequence's hidden states and query latent
        (all-gathered under sequence parallelism, without gradient: the selection has none)."""
        inputs = (hidden_states.detach(), latent.detach())
        if self.config.sequence_parallel and self.tp_size > 1:
            inputs = tuple(gather_from_sequence_parallel_region(t, False, self.tp_group) for t in inputs)
        return self.core_attention.sparse_attention_mask(*inputs, rotary_pos_emb, attention_mask, self.rotary_mscale)
