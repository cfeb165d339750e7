"""``get_gpt_heterogeneous_layer_spec``: one local layer spec per block config of a heterogeneous model."""

from __future__ import annotations

from typing import Optional

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.gpt.gpt_layer_specs import _with_te_linears, get_gpt_layer_local_spec
from megatron.core.transformer.heterogeneous.heterogeneous_config import (
    HeterogeneousTransformerConfig,
    TransformerBlockConfig,
)
from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

__all__ = ["get_gpt_heterogeneous_layer_spec"]


def _layer_spec(block: TransformerBlockConfig, config: HeterogeneousTransformerConfig, use_te: bool) -> ModuleSpec:
    """The local GPT layer, its attention / MLP replaced by a gathered linear or left out as ``block`` says.

    A left-out part (``no_op``) has no module and no norm in our ``TransformerLayer`` (its slots are None):
    the layer passes its input on, as upstream's ``IdentityOp`` / ``IdentityFuncOp`` do.
    """
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    if use_te and te_ext.is_te_available():
        spec = _with_te_linears(spec)
    parts = spec.submodules
    if block.attention.no_op:
        parts.input_layernorm, parts.self_attention = None, None
    elif block.attention.replace_with_linear:
        parts.input_layernorm = Norm
        parts.self_attention = ModuleSpec(ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_attn"})
    if block.mlp.no_op:
        parts.pre_mlp_layernorm, parts.mlp = None, None
    elif block.mlp.replace_with_linear:
        parts.mlp = ModuleSpec(ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_mlp"})
    return spec


def get_gpt_heterogeneous_layer_spec(
    config: HeterogeneousTransformerConfig,
    use_te: bool = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """One layer spec per ``config.per_block_parameters`` entry (Megatron-core's signature).

    ``use_te``: Transformer Engine's linears in the built attentions and MLPs where TE imports. Megatron
    returns only the layers of ``(pp_rank, vp_stage)``; ``TransformerBlock`` here picks its stage's layers
    from the full list itself (as with ``get_gpt_decoder_block_spec``), so the list covers every layer and
    both arguments are accepted. Each layer is built with ``config.get_config_for_layer(n)``.
    """
    del vp_stage, pp_rank  # the block picks its stage's layers (docstring)
    if not getattr(config, "heterogeneous_block_specs", False):
        raise ValueError("get_gpt_heterogeneous_layer_spec needs a HeterogeneousTransformerConfig")
    if config.num_moe_experts or config.multi_latent_attention:
        raise NotImplementedError(
            f"get_gpt_heterogeneous_layer_spec: num_moe_experts={config.num_moe_experts}, multi_latent_attention="
            f"{config.multi_latent_attention}: heterogeneous blocks are dense layers with standard attention"
        )
    specs = [_layer_spec(block, config, use_te) for block in config.per_block_parameters]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=Norm)
