"""Layer specs for GPT: which classes make up a decoder layer."""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _norm(config, hidden_size, eps):
    return build_norm(config, hidden_size, eps)


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False, **unused: object
) -> ModuleSpec:
    """Pure-PyTorch decoder layer; with ``num_experts`` its MLP is a ``MoELayer``.

    ``qk_layernorm`` is read from the config; ``moe_grouped_gemm`` only picks a GPU kernel
    in Megatron, so the experts compute the same either way.
    """
    mlp = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=MLP)) if num_experts else MLP
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}),
            pre_mlp_layernorm=_norm,
            mlp=mlp,
        ),
    )


def get_gpt_decoder_block_spec(
    config: TransformerConfig, use_transformer_engine: bool = False, **unused: object
) -> TransformerBlockSubmodules:
    """One layer spec per layer: MoE where ``config.moe_layer_freq`` says so, dense elsewhere."""
    dense, moe = get_gpt_layer_local_spec(), get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    return TransformerBlockSubmodules(
        layer_specs=[moe if config.is_moe_layer(n) else dense for n in range(1, config.num_layers + 1)]
    )


def get_gpt_layer_with_transformer_engine_spec(*args: object, **kwargs: object) -> ModuleSpec:
    """Transformer-Engine layers are an optional accelerator; the PyTorch layers compute the same."""
    return get_gpt_layer_local_spec(*args, **kwargs)
