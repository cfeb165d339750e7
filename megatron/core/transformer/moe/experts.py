"""Experts run one after another, each an ``MLP`` (``is_expert=True``) on the tokens routed to it."""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def sort_by_expert(probs: torch.Tensor, routing_map: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per expert: the ids of the tokens routed to it (ascending) and their routing probabilities.

    One stable sort of the ``[E, T]`` routing map puts the routed (token, expert) pairs first,
    expert by expert; one host read of the per-expert counts splits them (a ``nonzero`` per
    expert would read the host once per expert).
    """
    num_tokens = routing_map.shape[0]
    routed = routing_map.t().reshape(-1).bool()  # [E*T], expert-major
    counts = routed.view(-1, num_tokens).sum(dim=1).tolist()  # [E] the one host read
    order = torch.argsort((~routed).to(torch.uint8), stable=True)[: sum(counts)]  # [sum n_e]
    token_ids = order % num_tokens  # [sum n_e]
    sorted_probs = probs.t().reshape(-1)[order]  # [sum n_e]
    return list(token_ids.split(counts)), list(sorted_probs.split(counts))


class SequentialMLP(MegatronModule):
    """``local_experts.{i}``: one MLP per local expert, each split over the expert-TP group.

    Local expert ``i`` of EP rank ``r`` is global expert ``r * num_local_experts + i``. With
    ``use_cpu_initialization`` every rank draws all experts' weights in global order and keeps
    its own, so the initial model (and the default generator afterwards) does not depend on EP.

    ``forward`` returns this rank's partial sum over TP of ``sum_k p[t, e_k] * expert_{e_k}(x_t)``;
    the MoE layer reduces it. Every expert runs, also on zero tokens, so every parameter gets a
    gradient (zeros) each step.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Union[ModuleSpec, type, None] = None,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        groups = pg_collection
        self.tp_group = groups.expt_tp
        ep_size = groups.size_of("ep")
        first = groups.rank_in("ep") * num_local_experts
        built = num_local_experts * ep_size if config.use_cpu_initialization and ep_size > 1 else num_local_experts
        experts = [
            build_module(
                submodules or MLP,
                config,
                pg_collection=groups,
                ffn_hidden_size=config.moe_ffn_hidden_size,
                is_expert=True,
            )
            for _ in range(built)
        ]
        if built > num_local_experts:
            experts = experts[first : first + num_local_experts]
        self.local_experts = torch.nn.ModuleList(experts)

    def _bias_share(self, bias: torch.Tensor) -> torch.Tensor:
        """The replicated output bias as a partial sum over TP: whole on rank 0, zero elsewhere."""
        bias = copy_to_tensor_model_parallel_region(bias, self.tp_group)  # gradient summed over TP
        return bias if dist.get_rank(self.tp_group) == 0 else bias * 0.0

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[T, h]``, ``probs`` and ``routing_map`` ``[T, E]`` -> partial output ``[T, h]``."""
        output = torch.zeros_like(tokens)  # [T, h]
        indices, weights = sort_by_expert(probs, routing_map)
        for expert, index, prob in zip(self.local_experts, indices, weights):
            out, bias = expert(tokens[index])  # [n_e, h] partial over TP, [h] or None
            if bias is not None:
                out = out + self._bias_share(bias)
            weighted = out * prob.unsqueeze(-1).to(out.dtype)  # [n_e, h]
            output = output.index_add(0, index, weighted)
        return output
