"""Mixture-of-experts MLP (Mixtral style): route each token to k experts and mix their outputs.

Dropless (every routed token is processed) unless ``moe_expert_capacity_factor`` is set: then
the router cuts each expert's pairs to capacity, per rank's own tokens (see routing.py). EP rank r
holds the ``E / ep`` experts ``r * E / ep + i``, each split over the expert-TP group
(``expert_tensor_parallel_size``, which may differ from TP: the experts live on the expert grid
``ETP x EP x expert-DP``). Each rank routes only its own tokens, as Megatron's ``MoELayer`` does:

* under sequence parallelism the layer enters with this TP rank's shard ``[s/tp, b, h]``; the
  router, capacity and the aux losses see those ``s/tp * b`` tokens (the balance losses sum their
  token counts over TP x CP, so the ranks' losses add up to those of the whole sequence, see
  ``router.py``);
* dispatch / experts / combine: ``token_dispatcher.py`` (``allgather`` or ``alltoall``) moves them
  over the expert grid and returns their summed output ``[s/tp * b, h]``: the layer's output
  ``[s/tp, b, h]``, with no gather of the sequence before routing and no reduce-scatter after;
* without sequence parallelism and TP > 1 the input is the whole sequence on every TP rank;
  Megatron refuses this in training (``MoELayer.forward``), and so does this layer. In evaluation
  every TP rank routes and dispatches all the tokens (as Megatron), each getting the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import build_dispatcher
from megatron.core.transformer.moe_fields import check_moe_training_layout
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """The router, the expert MLP class (or spec) and the shared experts.

    ``router`` is built as ``router(config, tp_group, tp_cp_group=, tp_dp_cp_group=)`` and called as
    ``router(tokens [T, h], batch_size=)`` on this rank's tokens -> (probs ``[T, E]``, routing map ``[T, E]``),
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
        self.router = build_module(
            submodules.router, config, self.tp_group, tp_cp_group=groups.tp_cp, tp_dp_cp_group=groups.tp_dp_cp
        )
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

    def _local_token_ids(self, token_ids: torch.Tensor, seq: int) -> torch.Tensor:
        """``token_ids`` ``[b, s]`` of the TP group's sequence -> the ids of this rank's tokens ``[seq*b]``."""
        ids = token_ids.t()  # [s, b]
        if self.sequence_parallel:
            ids = ids[self.tp_rank * seq : (self.tp_rank + 1) * seq]  # [s/tp, b]: this rank's shard
        return ids.reshape(-1)  # [seq*b], [s, b] order

    def forward(
        self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, None]:
        """This rank's tokens ``[s/tp, b, h]`` (SP; else ``[s, b, h]``) -> (same shape, None): no bias left to add.

        ``token_ids`` ``[b, s]`` (the TP group's whole sequence, as the model's ``input_ids``): the ids of
        the tokens, for a router that routes by them (``HashRouter``); any other router refuses them."""
        if self.training:
            check_moe_training_layout(self.config.num_moe_experts, self.tp_size, self.sequence_parallel)
        seq, b, h = hidden_states.shape
        tokens = hidden_states.reshape(-1, h)  # [T, h], T = seq*b: this rank's tokens
        by_id = {} if token_ids is None else {"token_ids": self._local_token_ids(token_ids, seq)}  # [T]
        probs, routing_map = self.router(tokens, batch_size=b, **by_id)  # [T, E]
        probs = probs.to(tokens.dtype)  # routed in moe_router_dtype, mixed in the model's
        dispatched = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(
            dispatched.tokens, dispatched.probs, dispatched.routing_map, dispatched.tokens_per_expert
        )  # [R, h]
        output = self.token_dispatcher.combine(expert_output, dispatched).view(seq, b, h)  # summed over top-k
        if self.shared_experts is not None:
            shared, _ = self.shared_experts(hidden_states)  # [s(/tp), b, h], reduced over TP itself
            output = output + shared
        return output, None
