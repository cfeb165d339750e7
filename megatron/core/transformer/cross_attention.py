"""Cross-attention (encoder-decoder attention): queries from the decoder, keys and values from the encoder.

The projections are Megatron-core's: ``linear_q`` (column parallel, ``h -> heads * d``),
``linear_kv`` (column parallel, ``h -> heads * 2d``) and ``linear_proj`` (row parallel). The key-value
weight is laid out per head, ``[k_0, v_0, k_1, v_1, ...]`` (``d`` rows each), so a column split over
TP hands every rank whole heads: its key and value heads come out of one matmul with no
communication until the output projection.

Under sequence parallelism both inputs arrive sequence-sharded (``[s/tp, b, h]``); the column-parallel
projections all-gather their input along the sequence, so each rank sees the whole encoder output.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import run_core_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented


class CrossAttention(MegatronModule):
    """Multi-head attention of the decoder's hidden states over the encoder output, heads split over TP.

    ``forward(hidden_states [sq(/tp), b, h], attention_mask, key_value_states [sk(/tp), b, h])``
    returns ``(output [sq(/tp), b, h], output bias or None)``. ``attention_mask`` is boolean, True
    where a query may NOT see a key, ``[b, 1, sq, sk]`` or ``[b, 1, 1, sk]``; None: every key.
    Grouped-query attention is refused (as in Megatron-core), and so is context parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(
                f"CrossAttention: grouped-query attention is not supported (num_query_groups="
                f"{config.num_query_groups}, num_attention_heads={config.num_attention_heads})"
            )
        refuse_unimplemented("CrossAttention", context_parallel_size=(pg_collection.size_of("cp"), 1))
        tp = pg_collection.size_of("tp")
        self.heads_per_rank = config.num_attention_heads // tp
        projection = config.kv_channels * config.num_attention_heads
        self.linear_q = self._column(projection, pg_collection)
        self.linear_kv = self._column(2 * projection, pg_collection)
        self.core_attention = DotProductAttention(config, layer_number, attn_mask_type)
        self.linear_proj = RowParallelLinear(
            projection,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=pg_collection.tp,
        )
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.layer_number = layer_number

    def _column(self, output_size: int, groups: ProcessGroupCollection) -> ColumnParallelLinear:
        return ColumnParallelLinear(
            self.config.hidden_size,
            output_size,
            config=self.config,
            init_method=self.config.init_method,
            bias=self.config.add_bias_linear,
            gather_output=False,
            tp_group=groups.tp,
        )

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query ``[sq, b, heads/tp, d]`` from the decoder, key and value ``[sk, b, heads/tp, d]`` from the encoder."""
        d = self.config.kv_channels
        mixed_kv, _ = self.linear_kv(key_value_states)  # [sk, b, heads/tp * 2d]
        mixed_kv = mixed_kv.view(*mixed_kv.shape[:2], self.heads_per_rank, 2 * d)  # [sk, b, heads/tp, 2d]
        key, value = torch.split(mixed_kv, [d, d], dim=-1)  # [sk, b, heads/tp, d] each
        query, _ = self.linear_q(hidden_states)  # [sq, b, heads/tp * d]
        query = query.view(*query.shape[:2], self.heads_per_rank, d)  # [sq, b, heads/tp, d]
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[sq(/tp with SP), b, h]`` attending over ``key_value_states`` -> (``[sq(/tp), b, h]``, bias or None).

        ``inference_context`` (generation): the encoder's keys and values are projected on this layer's first
        call and kept in the context (``cross_key_value_memory_dict``); later calls project only the query.
        """
        if key_value_states is None:
            raise ValueError("CrossAttention.forward needs key_value_states (the encoder output)")
        cache = None if inference_context is None else inference_context.cross_key_value_memory_dict
        if cache is not None and self.layer_number in cache:
            query, _ = self.linear_q(hidden_states)  # [sq, b, heads/tp * d]
            query = query.view(*query.shape[:2], self.heads_per_rank, self.config.kv_channels)
            key, value = cache[self.layer_number]  # [sk, b, heads/tp, d]
        else:
            query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
            if cache is not None:
                cache[self.layer_number] = (key, value)
        context = run_core_attention(self, query, key, value, attention_mask, None)  # [sq, b, heads/tp*d]
        return self.linear_proj(context)
