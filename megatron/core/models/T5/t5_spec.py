"""Layer and block specs for T5: a bidirectional encoder and a causal decoder with cross-attention.

Megatron-core's specs (same function names): pre-LN layers, ``x + attn(norm(x))``, in the decoder
then ``x + cross_attn(norm(x), encoder output)``, then ``x + mlp(norm(x))``; the norm is the one the
config names (``config.normalization``) and each stack ends with a final norm. The
``_with_transformer_engine_`` variants return the same layers (Transformer Engine is an optional
accelerator here; the PyTorch layers compute the same).

Ours for Hugging Face's T5 v1.1 (``get_t5_v11_encoder_block_spec`` / ``get_t5_v11_decoder_block_spec``):
the same layout with RMSNorm (no bias) in every slot. The rest of v1.1 is numerics the config holds;
``t5_v11_config`` fills them in: RMSNorm, no bias anywhere, gated GeLU with the tanh approximation
(Hugging Face's ``gelu_new``), no ``1/sqrt(d)`` score scaling (``softmax_scale=1.0``). The model then
takes ``position_embedding_type="relative"`` and an untied LM head
(``share_embeddings_and_output_weights=False``, Hugging Face's ``tie_word_embeddings=False``).
"""

from __future__ import annotations

from typing import Any, Union

from megatron.core.activations import gelu_tanh
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.cross_attention import CrossAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import Norm, RMSNorm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

NormSpec = Union[type, Any]


def _encoder_layer(norm: NormSpec) -> ModuleSpec:
    """Bidirectional self-attention taking the encoder mask, then the MLP (fresh specs on each call)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.arbitrary}),
            pre_mlp_layernorm=norm,
            mlp=MLP,
        ),
    )


def _decoder_layer(norm: NormSpec) -> ModuleSpec:
    """Causal self-attention, cross-attention over the encoder output, then the MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}),
            pre_cross_attn_layernorm=norm,
            cross_attention=ModuleSpec(module=CrossAttention, params={"attn_mask_type": AttnMaskType.arbitrary}),
            pre_mlp_layernorm=norm,
            mlp=MLP,
        ),
    )


def encoder_model_with_local_spec() -> ModuleSpec:
    """Megatron-core's T5 encoder layer."""
    return _encoder_layer(Norm)


def decoder_model_with_local_spec() -> ModuleSpec:
    """Megatron-core's T5 decoder layer."""
    return _decoder_layer(Norm)


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Megatron-core's TE encoder layer: here the same as ``encoder_model_with_local_spec``."""
    return encoder_model_with_local_spec()


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Megatron-core's TE decoder layer: here the same as ``decoder_model_with_local_spec``."""
    return decoder_model_with_local_spec()


def _block(layer: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers)


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Megatron-core T5 encoder layers."""
    return _block(encoder_model_with_local_spec(), num_layers)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Megatron-core T5 decoder layers."""
    return _block(decoder_model_with_local_spec(), num_layers)


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Megatron-core's TE encoder block: here the same layers as the local one."""
    return get_t5_encoder_with_local_block_spec(num_layers)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Megatron-core's TE decoder block: here the same layers as the local one."""
    return get_t5_decoder_with_local_block_spec(num_layers)


def get_t5_v11_encoder_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Hugging Face T5 v1.1 encoder layers (RMSNorm); use with ``t5_v11_config``."""
    return _block(_encoder_layer(RMSNorm), num_layers)


def get_t5_v11_decoder_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Hugging Face T5 v1.1 decoder layers (RMSNorm); use with ``t5_v11_config``."""
    return _block(_decoder_layer(RMSNorm), num_layers)


def t5_v11_config(**kwargs: Any) -> TransformerConfig:
    """A TransformerConfig with T5 v1.1's numerics; ``kwargs`` give the shape and may override the rest.

    Hugging Face's ``T5Config`` names: ``d_model`` = ``hidden_size``, ``d_kv`` = ``kv_channels``,
    ``d_ff`` = ``ffn_hidden_size``, ``num_heads`` = ``num_attention_heads``,
    ``layer_norm_epsilon`` = ``layernorm_epsilon``, ``dropout_rate`` = the two dropouts.
    """
    settings = dict(
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=gelu_tanh,
        softmax_scale=1.0,
    )
    settings.update(kwargs)
    return TransformerConfig(**settings)
