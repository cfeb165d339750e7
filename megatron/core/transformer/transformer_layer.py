"""A transformer layer: pre-LN ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (GPT, Megatron's BERT).

A decoder layer of an encoder-decoder model (T5) also has ``pre_cross_attn_layernorm`` and
``cross_attention`` between the two: ``x + cross_attn(norm(x), context)``, the keys and values
coming from ``context``, the encoder output.

The optional ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` submodules normalize the sum
after each residual add; with the pre-norms set to ``IdentityOp`` the layer is the original
post-LN transformer (``norm(x + attn(x))``, then ``norm(x + mlp(x))``) of BERT and Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import fused_bias_dropout_add
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.layer_layout import config_layer_assignment
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def config_stage(config: TransformerConfig, vp_stage: Optional[int], pp_rank: Optional[int]) -> tuple:
    """(layout, pp_rank, chunk) for Megatron-core's config-based helpers; pp_rank from parallel_state if None."""
    pp_size = config.pipeline_model_parallel_size
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else 0
    layout = config_layer_assignment(config, pp_size)
    return layout, pp_rank, vp_stage or 0


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Megatron-core's helper: the global 0-based index of the first layer of ``(pp_rank, vp_stage)``,
    i.e. the number of layers the model runs before it."""
    layout, pp_rank, chunk = config_stage(config, vp_stage, pp_rank)
    before = [layout[r][v] for v in range(len(layout[0])) for r in range(len(layout))]
    return sum(len(layers) for layers in before[: chunk * len(layout) + pp_rank])


@dataclass
class TransformerLayerSubmodules:
    """Classes (or specs) for each part of a layer."""

    input_layernorm: Union[ModuleSpec, type, None] = None
    self_attention: Union[ModuleSpec, type, None] = None
    pre_mlp_layernorm: Union[ModuleSpec, type, None] = None
    mlp: Union[ModuleSpec, type, None] = None
    post_self_attn_layernorm: Union[ModuleSpec, type, None] = None  # None: not built (pre-LN)
    post_mlp_layernorm: Union[ModuleSpec, type, None] = None  # None: not built (pre-LN)
    pre_cross_attn_layernorm: Union[ModuleSpec, type, None] = None  # None: not built (no cross-attention)
    cross_attention: Union[ModuleSpec, type, None] = None  # None: not built (GPT, BERT, T5's encoder)


class TransformerLayer(MegatronModule):
    """One decoder layer; ``self.layer_number`` is global and 1-based.

    Megatron-core's signature: ``layer_number`` counts within this pipeline stage and chunk, and
    ``add_layer_offset`` adds the layers before it (``pp_layer_offset``, or
    ``get_transformer_layer_offset(config, vp_stage)`` for this rank); ``TransformerBlock`` passes
    global numbers with ``add_layer_offset=False``. ``hidden_dropout`` overrides
    ``config.hidden_dropout`` for this layer. ``pg_collection`` None: ``parallel_state``'s groups (for
    library callers; the models always pass theirs). ``is_mtp_layer`` must stay False (no multi-token
    prediction yet).
    """

    is_fsdp_unit = True  # Megatron-FSDP gathers and frees sharded parameters layer by layer

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        is_mtp_layer: bool = False,
        add_layer_offset: bool = True,
        pp_layer_offset: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        config.require_width("TransformerLayer")
        if is_mtp_layer:
            raise NotImplementedError("TransformerLayer: is_mtp_layer=True not supported yet")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        if add_layer_offset:
            if pp_layer_offset is None:
                pp_layer_offset = get_transformer_layer_offset(config, vp_stage, pg_collection.rank_in("pp"))
            layer_number += pp_layer_offset
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self._build(config, submodules, layer_number, pg_collection)

    def _build(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        self.layer_number = layer_number
        self.pg_collection = pg_collection
        # A hybrid stack's attention-only and MLP-only layers (megatron/core/ssm) leave the other half None.
        attention, mlp = submodules.self_attention is not None, submodules.mlp is not None
        self.input_layernorm = self._optional_norm(submodules.input_layernorm) if attention else None
        self.self_attention = None
        if attention:
            self.self_attention = build_module(
                submodules.self_attention, config, layer_number=layer_number, pg_collection=pg_collection
            )
        self.pre_mlp_layernorm = self._optional_norm(submodules.pre_mlp_layernorm) if mlp else None
        self.mlp = build_module(submodules.mlp, config, pg_collection=pg_collection) if mlp else None
        self.post_self_attn_layernorm = self._optional_norm(submodules.post_self_attn_layernorm)
        self.post_mlp_layernorm = self._optional_norm(submodules.post_mlp_layernorm)
        self.pre_cross_attn_layernorm = self._optional_norm(submodules.pre_cross_attn_layernorm)
        self.cross_attention = None
        if submodules.cross_attention is not None:
            self.cross_attention = build_module(
                submodules.cross_attention, config, layer_number=layer_number, pg_collection=pg_collection
            )
        if hasattr(self.mlp, "set_layer_number"):  # MoE: aux losses are tracked per layer
            self.mlp.set_layer_number(layer_number)

    @property
    def checkpoint_layer_index(self) -> int:
        """The 0-based global index that names this layer in checkpoints (any pipeline layout)."""
        return self.layer_number - 1

    def _optional_norm(self, spec: Union[ModuleSpec, type, None]) -> Optional[torch.nn.Module]:
        if spec is None:
            return None
        return build_module(spec, self.config, self.config.hidden_size, self.config.layernorm_epsilon)

    def _bias_dropout_add(
        self, out: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor
    ) -> torch.Tensor:
        """``residual + dropout(out + bias)``, fused with ``config.bias_dropout_fusion``."""
        if self.config.bias_dropout_fusion:
            return fused_bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training)
        if bias is not None:
            out = out + bias
        return residual + F.dropout(out, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[Any] = None,
        token_ids: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp with SP), b, h]`` -> (same shape, ``context``).

        ``token_ids`` ``[b, s]``: the input ids, handed to an MLP that routes by them (a hash-routed
        ``MoELayer``); other MLPs do not take them.

        ``packed_seq_params`` (``megatron.core.packed_seq_params``): the rows are packed sequences.

        ``context`` (the encoder output ``[sk(/tp), b, h]``) and ``context_mask`` (True = blocked) feed
        the cross-attention of layers that have one; ``attention_bias`` is added to the self-attention
        scores (T5's relative position bias); ``inference_context`` holds the self-attention's KV cache (and the
        cross-attention's encoder keys and values).
        """
        if self.self_attention is not None:
            given = _given(
                attention_bias=attention_bias, inference_context=inference_context, packed_seq_params=packed_seq_params
            )
            hidden_states = self._attention(hidden_states, attention_mask, rotary_pos_emb, given)
        if self.cross_attention is not None:
            hidden_states = self._cross_attention(hidden_states, context, context_mask, inference_context)
        if self.mlp is not None:
            normed = self.pre_mlp_layernorm(hidden_states)
            mlp_out, mlp_bias = self.mlp(normed, **self._token_ids_for_mlp(token_ids))
            post_ln_residual = self.config.apply_residual_connection_post_layernorm
            hidden_states = self._bias_dropout_add(mlp_out, mlp_bias, normed if post_ln_residual else hidden_states)
            if self.post_mlp_layernorm is not None:
                hidden_states = self.post_mlp_layernorm(hidden_states)
        return hidden_states, context

    def _token_ids_for_mlp(self, token_ids: Optional[torch.Tensor]) -> dict:
        """``{"token_ids": ...}`` for an MLP routing by token id (which then must have them), else ``{}``."""
        if not getattr(self.mlp, "routes_by_token_id", False):
            return {}
        if token_ids is None:
            raise ValueError(f"layer {self.layer_number}: its hash-routed MoE layer needs token_ids (the input ids)")
        return {"token_ids": token_ids}

    def _attention(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rotary_pos_emb: Optional[torch.Tensor],
        given: dict,
    ) -> torch.Tensor:
        """``x + attn(norm(x))`` (or the post-LN variants): ``[s(/tp), b, h]`` -> same shape."""
        normed = self.input_layernorm(hidden_states)
        attn_out, attn_bias = self.self_attention(
            normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, **given
        )
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        hidden_states = self._bias_dropout_add(attn_out, attn_bias, residual)
        if self.post_self_attn_layernorm is not None:
            hidden_states = self.post_self_attn_layernorm(hidden_states)
        return hidden_states

    def _cross_attention(
        self,
        hidden_states: torch.Tensor,
        context: Optional[torch.Tensor],
        context_mask: Optional[torch.Tensor],
        inference_context: Optional[Any] = None,
    ) -> torch.Tensor:
        """``x + cross_attn(norm(x), context)``: ``[s(/tp), b, h]`` -> same shape (``inference_context``: the
        encoder's keys and values cached)."""
        normed = (
            hidden_states if self.pre_cross_attn_layernorm is None else self.pre_cross_attn_layernorm(hidden_states)
        )
        extra = {} if inference_context is None else {"inference_context": inference_context}
        out, bias = self.cross_attention(normed, context_mask, key_value_states=context, **extra)
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        return self._bias_dropout_add(out, bias, residual)


def _given(**kwargs: Any) -> dict:
    """The keyword arguments that are not None: self-attention modules without them keep working."""
    return {k: v for k, v in kwargs.items() if v is not None}
