"""Megatron-core's ``MambaStack``: a hybrid stack of Mamba, attention, MLP and MoE layers.

It is a ``TransformerBlock`` whose per-layer specs come from the hybrid pattern
(``mamba_hybrid_layer_allocation``): pipeline stages take their layers by the same layout rules, layer
``N`` is ``decoder.layers.{N-1}`` everywhere, and the final norm is Megatron-core's ``final_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented


@dataclass
class MambaStackSubmodules:
    """The spec of each layer type (Megatron-core's field names)."""

    mamba_layer: Union[ModuleSpec, type, None] = None
    attention_layer: Union[ModuleSpec, type, None] = None
    mlp_layer: Union[ModuleSpec, type, None] = None
    moe_layer: Union[ModuleSpec, type, None] = None

    def layer_specs(self, layer_types: List[str]) -> List[ModuleSpec]:
        """One spec per layer symbol; raises naming a symbol whose spec is missing."""
        by_symbol = {
            Symbols.MAMBA: self.mamba_layer,
            Symbols.ATTENTION: self.attention_layer,
            Symbols.MLP: self.mlp_layer,
            Symbols.MOE: self.moe_layer,
        }
        missing = sorted({t for t in layer_types if by_symbol[t] is None})
        if missing:
            raise ValueError(f"MambaStackSubmodules: no layer spec for the pattern's {missing} layers")
        return [by_symbol[t] for t in layer_types]


class MambaStack(TransformerBlock):
    """This pipeline stage's layers of the hybrid stack ``[s(/tp), b, h]`` -> same, then ``final_norm``."""

    final_norm_name = "final_norm"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaStackSubmodules,
        residual_in_fp32: bool = False,
        pre_process: bool = True,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: Optional[str] = None,
        post_layer_norm: bool = True,
        post_process: bool = True,
        device: Optional[object] = None,
        dtype: Optional[object] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        refuse_unimplemented(
            "MambaStack", residual_in_fp32=(residual_in_fp32, False), device=(device, None), dtype=(dtype, None)
        )
        self.layer_type_list = allocate_layers(
            config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern
        )
        block = TransformerBlockSubmodules(layer_specs=submodules.layer_specs(self.layer_type_list))
        super().__init__(
            config, block, post_layer_norm, pre_process, post_process, pg_collection, vp_stage, name="decoder"
        )
