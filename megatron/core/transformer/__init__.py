"""Transformer building blocks: config, attention, MLP, norms, layer and block."""

from megatron.core.transformer.enums import AttnBackend, AttnMaskType, ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "AttnBackend",
    "AttnMaskType",
    "MegatronModule",
    "ModelType",
    "ModuleSpec",
    "MLATransformerConfig",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "build_module",
]
