"""Mixture-of-experts MLP (Mixtral style): route each token to k experts and mix their outputs.

Dropless (every routed token is processed) unless ``moe_expert_capacity_factor`` is set: then
the router cuts each expert's pairs to capacity, per rank's own tokens (see routing.py). EP rank r
holds the ``E / ep`` experts ``r * E / ep + i``, each split over the expert-TP group
(``expert_tensor_parallel_size``, which may differ from TP: the experts live on the expert grid
``ETP x EP x expert-DP``). Per layer:

* enter: the tokens of the attention-TP group are gathered, so every TP rank routes the same
  ``T = s*b`` tokens and routing, aux losses and expert-bias counts are those of a data-parallel
  replica (SP: all-gather along the sequence, whose backward reduce-scatters; without SP the input
  is replicated and the backward all-reduces);
* own tokens: TP rank i keeps rows ``[i*T/tp, (i+1)*T/tp)`` of the routed tokens (under SP exactly
  its sequence shard), so no two ranks of the expert grid dispatch the same token;
* dispatch / experts / combine: ``token_dispatcher.py`` (``allgather`` or ``alltoall``), which
  returns the summed output of the own tokens ``[T/tp, h]``;
* leave: under SP that is this rank's output shard ``[s/tp, b, h]``; without SP the shards are
  placed in a zero ``[T, h]`` and all-reduced over TP (backward: identity).

Gradients reaching the gathered tokens are partial sums over TP (each rank's own rows, plus the
router's share), which the enter step sums; the router weight enters through ``copy_to`` and the
aux losses, equal on all TP ranks, are back-propagated by TP rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import build_dispatcher, own_rows
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """The router, the expert MLP class (or spec) and the shared experts.

    ``router`` is built as ``router(config, tp_group, dp_group=...)`` and called as
    ``router(tokens [T, h], batch_size=, capacity_groups=)`` -> (probs ``[T, E]``, routing map ``[T, E]``),
    plus ``token_ids=[T]`` when the layer is given them (``HashRouter``: DeepSeek-V4's hash routing),
    with ``set_layer_number``; a new routing rule is a ``TopKRouter`` subclass (or spec) here.
    ``config.moe_grouped_gemm`` picks the experts' kernel (``GroupedMLP``), not the result.
    ``shared_experts`` is built when ``config.moe_shared_expert_intermediate_size`` is set."""

    router: Union[ModuleSpec, type] = TopKRouter
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
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        # Upstream's boundary: our layers pass their groups; a library caller may rely on the defaults.
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        ep_size = groups.size_of("ep")
        if config.num_moe_experts % ep_size:
            raise ValueError(
                f"num_moe_experts={config.num_moe_experts} must be divisible by expert_model_parallel_size={ep_size}"
            )
        self.tp_group = groups.tp  # the attention layout the tokens come in
        self.tp_rank, self.tp_size = groups.rank_in("tp"), groups.size_of("tp")
        self.sequence_parallel = config.sequence_parallel
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_start = groups.rank_in("ep") * self.num_local_experts
        submodules = submodules or MoESubmodules()
        self.router = build_module(submodules.router, config, self.tp_group, dp_group=groups.dp_cp)
        self.token_dispatcher = build_dispatcher(
            config.moe_token_dispatcher_type, config.num_moe_experts, self.num_local_experts, groups
        )
        experts_class = GroupedMLP if config.moe_grouped_gemm else SequentialMLP  # same parameters
        self.experts = experts_class(self.num_local_experts, config, submodules.experts, pg_collection=groups)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(submodules.shared_experts, config, pg_collection=groups)
        if layer_number is not None:
            self.set_layer_number(layer_number)

    @property
    def routes_by_token_id(self) -> bool:
        """Whether the router picks experts by token id (``HashRouter``): the layer then needs ``token_ids``."""
        return getattr(self.router, "needs_token_ids", False)

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based number of the layer holding this MLP (the aux-loss tracker's index)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def _gather_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> the TP group's tokens ``[s, b, h]``; backward sums partial gradients."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, True, self.tp_group)  # [s, b, h]
        return copy_to_tensor_model_parallel_region(hidden_states, self.tp_group)  # [s, b, h]

    def _own_output(self, own: torch.Tensor, full_shape: torch.Size) -> torch.Tensor:
        """This rank's output rows ``[T/tp, h]`` -> ``[s/tp, b, h]`` (SP) or the TP group's ``[s, b, h]``."""
        s, b, h = full_shape
        if self.sequence_parallel:
            return own.view(s // self.tp_size, b, h)  # [s/tp, b, h]
        if self.tp_size == 1:
            return own.view(s, b, h)
        start, end = own_rows(s * b, self.tp_rank, self.tp_size)
        placed = F.pad(own, (0, 0, start, s * b - end))  # [T, h], zero off the own rows
        return reduce_from_tensor_model_parallel_region(placed, self.tp_group).view(s, b, h)

    def forward(
        self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, None]:
        """``[s(/tp with SP), b, h]`` -> (same shape, None): no bias left to add.

        ``token_ids`` ``[b, s]`` (the TP group's whole sequence, as the model's ``input_ids``): the ids of
        the tokens, for a router that routes by them (``HashRouter``); any other router refuses them."""
        full = self._gather_tokens(hidden_states)  # [s, b, h]
        tokens = full.reshape(-1, full.shape[-1])  # [T, h]
        # Capacity is per rank's own tokens, as in Megatron: under SP each TP rank's sequence shard.
        shards = self.tp_size if self.sequence_parallel else 1
        by_id = {} if token_ids is None else {"token_ids": token_ids.t().reshape(-1)}  # [T], [s, b] order
        probs, routing_map = self.router(tokens, batch_size=full.shape[1], capacity_groups=shards, **by_id)  # [T, E]
        probs = probs.to(tokens.dtype)  # routed in moe_router_dtype, mixed in the model's
        start, end = own_rows(tokens.shape[0], self.tp_rank, self.tp_size)
        mine = slice(start, end)
        dispatched = self.token_dispatcher.dispatch(tokens[mine], probs[mine], routing_map[mine], tokens.shape[0])
        expert_output = self.experts(
            dispatched.tokens, dispatched.probs, dispatched.routing_map, dispatched.tokens_per_expert
        )  # [R, h]
        own = self.token_dispatcher.combine(expert_output, dispatched)  # [T/tp, h], summed
        output = self._own_output(own, full.shape)  # [s(/tp), b, h]
        if self.shared_experts is not None:
            shared, _ = self.shared_experts(hidden_states)  # [s(/tp), b, h], reduced over TP itself
            output = output + shared
        return output, None
