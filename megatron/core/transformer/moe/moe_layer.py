"""Mixture-of-experts MLP (Mixtral style): route each token to k experts and mix their outputs.

Dropless (every routed token is processed), one expert-parallel rank; the experts are split
over the TP group (expert_tensor_parallel_size = TP). Communication, per layer:

* enter: the tokens of all TP ranks are gathered, so every rank routes the same ``T = s*b``
  tokens (sequence parallelism: all-gather along the sequence, whose backward reduce-scatters;
  without it the input is already replicated and only the backward all-reduces);
* leave: each rank's output is a partial sum over TP (its shards of every expert), reduced with
  a reduce-scatter to sequence shards (SP) or an all-reduce.

Inside, every gradient is a partial sum over TP, which the enter step sums; replicated
parameters (router weight, expert output biases) enter through ``copy_to`` so theirs are
summed too. 'allgather' and 'alltoall' dispatchers are the same computation here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from megatron.core.parallel_state import ProcessGroupCollection, resolve_process_groups
from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """The expert MLP class (or spec); ``moe_grouped_gemm`` would pick a kernel, not a different result."""

    experts: Union[ModuleSpec, type, None] = MLP


class MoELayer(MegatronModule):
    """``router`` (``mlp.router.weight``) and ``experts`` (``mlp.experts.local_experts.{i}...``)."""

    def __init__(self, config: TransformerConfig, submodules: Optional[MoESubmodules] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, layer_number: Optional[int] = None) -> None:
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        groups = resolve_process_groups(pg_collection)
        if groups.size_of("ep") != 1:
            raise ValueError(f"expert_model_parallel_size={groups.size_of('ep')}: not supported yet (only 1)")
        self.tp_group = groups.expt_tp
        self.sequence_parallel = config.sequence_parallel
        self.router = TopKRouter(config, self.tp_group)
        self.experts = SequentialMLP(config.num_moe_experts, config, (submodules or MoESubmodules()).experts,
                                     groups)
        if layer_number is not None:
            self.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based number of the layer holding this MLP (the aux-loss tracker's index)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def _gather_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> the TP group's tokens ``[s, b, h]``; backward sums partial gradients."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, True, self.tp_group)  # [s, b, h]
        return copy_to_tensor_model_parallel_region(hidden_states, self.tp_group)  # [s, b, h]

    def _reduce_output(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial sums ``[s, b, h]`` -> the sum, as this rank's sequence shard under SP."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, h]
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)  # [s, b, h]

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """``[s(/tp with SP), b, h]`` -> (same shape, None): no bias left to add."""
        full = self._gather_tokens(hidden_states)  # [s, b, h]
        tokens = full.reshape(-1, full.shape[-1])  # [T, h]
        probs, routing_map = self.router(tokens)  # [T, E] each
        partial = self.experts(tokens, probs, routing_map)  # [T, h]
        return self._reduce_output(partial.view_as(full)), None
