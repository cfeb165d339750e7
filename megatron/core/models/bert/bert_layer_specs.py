"""Layer specs for BERT: bidirectional self-attention that takes a padding mask.

Two layer layouts:

* ``bert_layer_local_spec`` (Megatron-core's name and layout): pre-LN, ``x + attn(norm(x))`` then
  ``x + mlp(norm(x))``; ``BertModel`` then adds a final LayerNorm after the last layer.
  ``get_bert_layer_with_transformer_engine_spec()`` returns the same layers (Transformer Engine is
  an optional accelerator here; the PyTorch layers compute the same).
* ``bert_layer_post_ln_spec`` (ours): the original BERT / Hugging Face ``BertForPreTraining``
  layer, ``norm(x + attn(x))`` then ``norm(x + mlp(x))``: the pre-norm slots hold ``IdentityOp``
  and the layer's ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` are built. A model built
  from a spec with ``post_mlp_layernorm`` (see ``is_post_ln_spec``) normalizes the embedding sum
  (Hugging Face's ``embeddings.LayerNorm``) and builds no final LayerNorm.
"""

from __future__ import annotations

from typing import Union

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _padding_attention() -> ModuleSpec:
    """Bidirectional self-attention taking a padding mask (a fresh spec: callers may edit its params)."""
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.padding})


bert_layer_local_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=Norm,
        self_attention=_padding_attention(),
        pre_mlp_layernorm=Norm,
        mlp=MLP,
    ),
)

bert_layer_post_ln_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp,
        self_attention=_padding_attention(),
        pre_mlp_layernorm=IdentityOp,
        mlp=MLP,
        post_self_attn_layernorm=Norm,
        post_mlp_layernorm=Norm,
    ),
)


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Megatron-core's TE spec: here the same layers as ``bert_layer_local_spec``."""
    return bert_layer_local_spec


def is_post_ln_spec(spec: Union[ModuleSpec, TransformerBlockSubmodules]) -> bool:
    """Whether the layers normalize after the residual add (then: embedding norm, no final norm).

    A block spec must not mix post-LN and pre-LN layers.
    """
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    kinds = {getattr(layer.submodules, "post_mlp_layernorm", None) is not None for layer in layers}
    if len(kinds) > 1:
        raise ValueError("the layer specs mix post-LN and pre-LN layers")
    return kinds == {True}
