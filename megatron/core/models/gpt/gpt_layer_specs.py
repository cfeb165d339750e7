"""Layer specs for GPT: which classes make up a decoder layer."""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _norm(config, hidden_size, eps):
    return build_norm(config, hidden_size, eps)


def get_gpt_layer_local_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, **unused: object) -> ModuleSpec:
    """Pure-PyTorch decoder layer. ``qk_layernorm`` is read from the config; MoE is not supported yet."""
    if num_experts:
        raise ValueError("num_experts is not supported yet (mixture of experts)")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}),
            pre_mlp_layernorm=_norm,
            mlp=MLP,
        ),
    )


def get_gpt_layer_with_transformer_engine_spec(*args: object, **kwargs: object) -> ModuleSpec:
    """Transformer-Engine layers are an optional accelerator; the PyTorch layers compute the same."""
    return get_gpt_layer_local_spec(*args, **kwargs)
