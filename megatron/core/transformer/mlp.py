"""The feed-forward block: h -> ffn (column parallel) -> activation -> h (row parallel)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class MLP(MegatronModule):
    """``act(x W1 + b1) W2 + b2``, or with ``gated_linear_unit`` ``(act(x Wg) * x Wu) W2`` (SwiGLU).

    For gated units the first projection holds the gate and the up projection stacked;
    it is split over TP with stride 2 so every rank gets matching halves of both.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection,
        ffn_hidden_size: Optional[int] = None,
        is_expert: bool = False,
    ) -> None:
        super().__init__(config)
        tp_group = pg_collection.expt_tp if is_expert else pg_collection.tp
        ffn = ffn_hidden_size or config.ffn_hidden_size
        gated = config.gated_linear_unit
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn if gated else ffn,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
            skip_bias_add=True,
            stride=2 if gated else 1,
            is_expert=is_expert,
            tp_group=tp_group,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s, b, h]`` -> (``[s, b, h]``, bias of the last projection or None)."""
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, ffn/tp] (x2 when gated)
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(intermediate, 2, dim=-1)  # [s, b, ffn/tp] each
            intermediate = self.config.activation_func(gate) * up
        else:
            intermediate = self.config.activation_func(intermediate)
        return self.linear_fc2(intermediate)
