"""Mixture-of-experts MLP (Mixtral style): route each token to k experts and mix their outputs.

Dropless (every routed token is processed) unless ``moe_expert_capacity_factor`` is set: then
the router cuts each expert's pairs to capacity, per rank's own tokens (see routing.py). The
experts are split over the TP group (expert_tensor_parallel_size = TP) and, with expert
parallelism, over the EP group: EP rank r holds the ``E / ep`` experts ``r * E / ep + i``.
Communication, per layer:

* enter: the tokens of all TP ranks are gathered, so every rank routes the same ``T = s*b``
  tokens (sequence parallelism: all-gather along the sequence, whose backward reduce-scatters;
  without it the input is already replicated and only the backward all-reduces);
* route: on those ``T`` tokens, so routing and aux losses are those of a data-parallel replica;
* dispatch (EP > 1): tokens ``[T, h]``, probs and routing map ``[T, E]`` are all-gathered over
  EP (``[ep*T, ...]``); the all-gather's backward reduce-scatters, so each rank gets the
  gradient of its own tokens from every rank's experts;
* combine (EP > 1): each rank's output of its local experts is reduce-scattered back over EP;
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
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """The expert MLP class (or spec); ``config.moe_grouped_gemm`` picks the kernel (``GroupedMLP``), not the result.
    ``shared_experts`` is built when ``config.moe_shared_expert_intermediate_size`` is set."""

    experts: Union[ModuleSpec, type, None] = MLP
    shared_experts: Union[ModuleSpec, type, None] = SharedExpertMLP


class MoELayer(MegatronModule):
    """``router`` (``mlp.router.weight``) and ``experts`` (``mlp.experts.local_experts.{i}...``, local index;
    checkpoints name experts by their global index), and optionally ``shared_experts`` (a dense TP
    MLP on every token, added to the routed experts' output)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        *,
        pg_collection: ProcessGroupCollection,
        layer_number: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        groups = pg_collection
        ep_size = groups.size_of("ep")
        if config.num_moe_experts % ep_size:
            raise ValueError(
                f"num_moe_experts={config.num_moe_experts} must be divisible by expert_model_parallel_size={ep_size}"
            )
        self.tp_group, self.ep_group = groups.expt_tp, groups.ep
        self.sequence_parallel = config.sequence_parallel
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_start = groups.rank_in("ep") * self.num_local_experts
        self.router = TopKRouter(config, self.tp_group, dp_group=groups.dp_cp)
        submodules = submodules or MoESubmodules()
        experts_class = GroupedMLP if config.moe_grouped_gemm else SequentialMLP  # same parameters
        self.experts = experts_class(self.num_local_experts, config, submodules.experts, pg_collection=groups)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(submodules.shared_experts, config, pg_collection=groups)
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
        # Capacity is per rank's own tokens, as in Megatron: under SP each TP rank's sequence shard.
        shards = dist.get_world_size(self.tp_group) if self.sequence_parallel else 1
        probs, routing_map = self.router(tokens, batch_size=full.shape[1], capacity_groups=shards)  # [T, E] each
        probs = probs.to(tokens.dtype)  # routed in moe_router_dtype, mixed in the model's
        partial = self._run_experts(tokens, probs, routing_map)  # [T, h]
        output = self._reduce_output(partial.view_as(full))  # [s(/tp), b, h]
        if self.shared_experts is not None:
            shared, _ = self.shared_experts(hidden_states)  # [s(/tp), b, h], reduced over TP itself
            output = output + shared
        return output, None

    def _run_experts(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the EP group's tokens -> partial output ``[T, h]`` (partial over TP)."""
        if dist.get_world_size(self.ep_group) == 1:
            return self.experts(tokens, probs, routing_map)  # [T, h]
        tokens = gather_from_sequence_parallel_region(tokens, True, self.ep_group)  # [ep*T, h]
        probs = gather_from_sequence_parallel_region(probs, True, self.ep_group)  # [ep*T, E]
        with torch.no_grad():
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), False, self.ep_group
            ).bool()  # [ep*T, E]
        local = slice(self.local_expert_start, self.local_expert_start + self.num_local_experts)
        partial = self.experts(tokens, probs[:, local], routing_map[:, local])  # [ep*T, h]
        return reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)  # [T, h]
