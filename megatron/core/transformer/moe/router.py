"""Top-k router: a bias-free linear gate, softmax scores, and the load-balancing losses."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    LOAD_BALANCING_LOSS,
    Z_LOSS,
    AuxLossTracker,
    MoEAuxLossAutoScaler,
    get_aux_loss_tracker,
    router_z_loss,
    switch_load_balancing_loss,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def topk_softmax(
    logits: torch.Tensor, topk: int, pre_softmax: bool, scaling_factor: Optional[float]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing probabilities ``[T, E]`` (zero off the chosen experts) and the routing map ``[T, E]`` (bool).

    ``pre_softmax``: softmax over all experts, then keep the top k. Otherwise: top k of the
    logits, softmax over those k (= Mixtral's softmax, top-k, renormalise). Softmax in fp32.
    """
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)  # [T, E]
        top_probs, top_idx = torch.topk(scores, k=topk, dim=-1)  # [T, k]
    else:
        top_logits, top_idx = torch.topk(logits, k=topk, dim=-1)  # [T, k]
        top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    if scaling_factor is not None:
        top_probs = top_probs * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, top_idx, top_probs)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)  # [T, E]
    return probs, routing_map


class TopKRouter(MegatronModule):
    """``logits = tokens W^T`` with ``W`` ``[num_experts, h]`` replicated over TP; routes each token to k experts.

    Every TP rank routes the same tokens. Gradients inside the MoE layer are partial sums
    over TP (the experts are TP-sharded), so ``W`` enters through ``copy_to`` (its gradient is
    all-reduced) and the aux losses, equal on every rank, are back-propagated by TP rank 0 only.
    """

    def __init__(self, config: TransformerConfig, tp_group: dist.ProcessGroup) -> None:
        super().__init__(config)
        self.tp_group = tp_group
        self.topk = config.moe_router_topk
        self.weight = torch.nn.Parameter(
            torch.empty(config.num_moe_experts, config.hidden_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
        self.layer_number: Optional[int] = None
        self.aux_loss_tracker: AuxLossTracker = get_aux_loss_tracker()  # a run rebinds it (use_aux_loss_tracker)

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based layer number, under which the aux losses are tracked."""
        self.layer_number = layer_number

    def forward(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[T, h]`` -> (probs ``[T, E]``, routing map ``[T, E]``)."""
        weight = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        logits = F.linear(tokens, weight)  # [T, E]
        c = self.config
        probs, routing_map = topk_softmax(logits, self.topk, c.moe_router_pre_softmax, c.moe_router_topk_scaling_factor)
        if self.training and torch.is_grad_enabled():
            probs = self._attach_aux_losses(logits, probs, routing_map)
        return probs, routing_map

    def _attach_aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        c = self.config
        share = 1.0 if dist.get_rank(self.tp_group) == 0 else 0.0
        losses = []
        if c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff > 0:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
            aux = switch_load_balancing_loss(scores, routing_map.sum(dim=0), self.topk, c.moe_aux_loss_coeff)
            losses.append((LOAD_BALANCING_LOSS, aux, c.moe_aux_loss_coeff))
        if c.moe_z_loss_coeff:
            losses.append((Z_LOSS, router_z_loss(logits, c.moe_z_loss_coeff), c.moe_z_loss_coeff))
        for name, loss, coeff in losses:
            probs = MoEAuxLossAutoScaler.apply(probs, loss, share, self.aux_loss_tracker)
            if self.layer_number is not None:
                self.aux_loss_tracker.add(name, loss / coeff, self.layer_number, c.num_layers)
        return probs
