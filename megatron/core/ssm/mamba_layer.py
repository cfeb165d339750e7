"""Megatron-core's ``MambaLayer``: ``x + mixer(norm(x))``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MambaLayerSubmodules:
    """The pre-norm and the mixer (Megatron-core's field names; its bias-dropout-add is built in here)."""

    norm: Union[ModuleSpec, type] = Norm
    mixer: Union[ModuleSpec, type] = field(default_factory=lambda: ModuleSpec(module=MambaMixer))


class MambaLayer(MegatronModule):
    """A residual Mamba block ``[s(/tp), b, h]`` -> same; ``layer_number`` is global and 1-based.

    Takes ``TransformerBlock``'s layer arguments (``add_layer_offset``: the block passes global numbers),
    so a hybrid stack is a ``TransformerBlock`` whose layer specs mix ``MambaLayer`` and transformer layers.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaLayerSubmodules,
        layer_number: int = 1,
        residual_in_fp32: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
        pp_layer_offset: int = 0,
        add_layer_offset: bool = True,
    ) -> None:
        super().__init__(config)
        config.require_width("MambaLayer")
        self.layer_number = layer_number + (pp_layer_offset if add_layer_offset else 0)
        self.residual_in_fp32 = residual_in_fp32
        self.norm = build_module(submodules.norm, config, config.hidden_size, config.layernorm_epsilon)
        self.mixer = build_module(
            submodules.mixer, config, d_model=config.hidden_size, layer_number=self.layer_number,
            pg_collection=pg_collection,
        )  # fmt: skip

    @property
    def checkpoint_layer_index(self) -> int:
        """The 0-based global index that names this layer in checkpoints."""
        return self.layer_number - 1

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[Any] = None,
        **unused_attention_inputs: Any,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp), b, h]`` -> (same, None). ``attention_mask`` and ``rotary_pos_emb`` are attention's
        inputs, which a Mamba layer does not read (Megatron-core's signature); cross-attention inputs raise."""
        if any(v is not None for v in unused_attention_inputs.values()):
            raise NotImplementedError(f"MambaLayer: {sorted(unused_attention_inputs)} (cross-attention inputs)")
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        out, bias = self.mixer(self.norm(hidden_states), inference_context, packed_seq_params=packed_seq_params)
        if bias is not None:
            out = out + bias
        out = F.dropout(out, p=self.config.hidden_dropout, training=self.training)
        return (residual + out).to(hidden_states.dtype), None
