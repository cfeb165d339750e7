"""Shared experts (DeepSeek, Qwen2-MoE): a dense MLP every token goes through beside the routed experts.

All shared experts form one MLP of width ``moe_shared_expert_intermediate_size``, split over TP like
any dense MLP (it takes the MoE layer's input, ``[s/tp, b, h]`` under sequence parallelism, and
reduces its own output). With ``moe_shared_expert_gate`` its output is scaled per token by
``sigmoid(x . w)``, ``w`` a replicated ``[1, h]`` weight. ``moe_shared_expert_overlap`` overlaps it
with the token dispatch on GPU streams in Megatron; it computes the same, and runs after the
routed experts here.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import _home_device
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """``MLP`` of width ``config.moe_shared_expert_intermediate_size``, with the optional sigmoid gate
    ``gate_weight`` ``[1, h]`` (Megatron-core's names)."""

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection) -> None:
        super().__init__(
            config, ffn_hidden_size=config.moe_shared_expert_intermediate_size, pg_collection=pg_collection
        )
        self.gate_weight: Optional[torch.nn.Parameter] = None
        if config.moe_shared_expert_gate:
            weight = torch.empty(1, config.hidden_size, dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(weight)
            self.gate_weight = torch.nn.Parameter(weight.to(device=_home_device(), dtype=config.params_dtype))
            self.gate_weight.sequence_parallel = config.sequence_parallel  # each rank sees its tokens under SP

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp), b, h]`` -> (``[s(/tp), b, h]``, None): the bias, if any, already added."""
        out, bias = super().forward(hidden_states)  # [s(/tp), b, h]
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden_states, self.gate_weight))  # [s(/tp), b, 1] gate
        return out, None
