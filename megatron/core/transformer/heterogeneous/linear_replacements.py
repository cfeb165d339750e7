"""``ColumnParallelLinearGathered``: the hidden-to-hidden linear that replaces an attention or MLP
(``replace_with_linear`` in a heterogeneous block config)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["ColumnParallelLinearGathered"]


class ColumnParallelLinearGathered(ColumnParallelLinear):
    """``y = x W^T + b`` with ``W`` ``[h, h]`` split by output rows over TP, the output gathered back.

    Megatron-core's constructor: the sizes, bias (``config.add_bias_linear``, added here) and
    ``config.init_method`` come from the config; the other arguments a layer spec passes
    (``layer_number``, ``tp_comm_buffer_name``) are accepted; ``pg_collection`` gives the TP group
    (None: parallel_state's). Input ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); output the
    same shape, and None for the bias. Extra forward arguments (an attention's mask, rotary embeddings)
    are accepted and unused.
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        pg_collection = kwargs.get("pg_collection")
        super().__init__(
            input_size=config.hidden_size,
            output_size=config.hidden_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_group=None if pg_collection is None else pg_collection.tp,
        )
        self.config = config

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, None]:
        """``[s(/tp), b, h]`` -> the same shape (the TP shards of the output columns put together)."""
        if runtime_gather_output or self.gather_output:
            raise ValueError("ColumnParallelLinearGathered: runtime_gather_output is not supported (it gathers itself)")
        out, _ = super().forward(input_, weight, runtime_gather_output)  # [s, b, h/tp]
        tp = dist.get_world_size(self.tp_group)
        if tp == 1:
            return out, None
        if not self.sequence_parallel:
            return gather_from_tensor_model_parallel_region(out, self.tp_group), None  # [s, b, h]
        # Sequence parallel: this rank's columns in place in a zero [s, b, h], summed and split along s.
        width = out.shape[-1]
        before = dist.get_rank(self.tp_group) * width
        padded = F.pad(out, (before, self.config.hidden_size - before - width))  # [s, b, h]
        return reduce_scatter_to_sequence_parallel_region(padded, self.tp_group), None  # [s/tp, b, h]
