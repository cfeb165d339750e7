"""Top-k router: a bias-free linear gate, the routing variants of ``routing.py``, balance losses and expert bias."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    BALANCE_LOSS_NAMES,
    Z_LOSS,
    AuxLossTracker,
    MoEAuxLossAutoScaler,
    get_aux_loss_tracker,
    router_z_loss,
    switch_load_balancing_loss,
)
from megatron.core.transformer.moe.routing import (
    drop_to_capacity,
    random_logits_straight_through,
    route,
    scores_for_aux_loss,
    sequence_load_balancing_loss,
    sinkhorn_route,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import apply_keeping_fp32

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def topk_softmax(
    logits: torch.Tensor, topk: int, pre_softmax: bool, scaling_factor: Optional[float]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (``routing.route`` with ``score_function='softmax'``): probs and map ``[T, E]``."""
    return route(logits, topk, "softmax", pre_softmax, scaling_factor=scaling_factor)


_FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "global_microbatches")


class TopKRouter(MegatronModule):
    """``logits = tokens W^T`` with ``W`` ``[num_experts, h]`` replicated over TP; routes each token to k experts.

    Each rank routes its own tokens, as in Megatron: under sequence parallelism its ``[s/tp, b]``
    shard, under context parallelism its CP chunk. ``W`` enters through ``copy_to`` over
    ``tp_group``, so its gradient (a partial sum over the shards) is summed over TP. The balance
    losses are Megatron's: this rank's scores against the per-expert counts summed over
    ``tp_cp_group`` (the ranks sharing one data-parallel replica's tokens), divided by the
    replica's token count, so the losses of the ranks add up to the loss of the whole sequence;
    the z-loss is each rank's token mean divided by the ``tp_cp_group`` size. Every rank
    back-propagates its own share, times the CP size (``_cp_weight``). Random draws (input jitter,
    forced balancing) use the default generator.

    With ``moe_router_enable_expert_bias`` the router holds ``expert_bias`` ``[E]`` (fp32, a
    checkpointed buffer) and counts the tokens it sends each expert while gradients are on
    (``local_tokens_per_expert``); ``finalize_model_grads`` all-reduces the counts over TP x DP x CP
    after each step's backward and calls ``update_expert_bias``, so every replica keeps the same
    bias. ``tp_dp_cp_group`` is the group over which ``global_aux_loss`` sums the token counts.
    Both groups default to ``tp_group`` (a router used alone).
    """

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: dist.ProcessGroup,
        tp_cp_group: Optional[dist.ProcessGroup] = None,
        tp_dp_cp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(config)
        self.tp_group = tp_group
        self.tp_cp_group = tp_cp_group if tp_cp_group is not None else tp_group
        self.tp_dp_cp_group = tp_dp_cp_group if tp_dp_cp_group is not None else tp_group
        self.topk = config.moe_router_topk
        experts = config.num_moe_experts
        self.weight = torch.nn.Parameter(torch.empty(experts, config.hidden_size, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
        bias = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(experts) if bias else None)  # fp32, checkpointed
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts) if bias else None, persistent=False)
        # global_aux_loss: running sum over this step's microbatches of the TP x DP x CP-summed counts, and how many.
        is_global = config.moe_router_load_balancing_type == "global_aux_loss"
        self.register_buffer("global_tokens_per_expert", torch.zeros(experts) if is_global else None, persistent=False)
        self.register_buffer("global_microbatches", torch.zeros(()) if is_global else None, persistent=False)
        self.layer_number: Optional[int] = None
        self.aux_loss_tracker: AuxLossTracker = get_aux_loss_tracker()  # a run rebinds it (use_aux_loss_tracker)

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the model; a bf16/fp16 cast leaves the expert bias and token counts fp32 (as Megatron)."""
        return apply_keeping_fp32(self, fn, recurse, _FP32_BUFFERS)

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based layer number, under which the aux losses are tracked."""
        self.layer_number = layer_number

    def jitter(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` times noise uniform in ``[1 - eps, 1 + eps]`` (``moe_input_jitter_eps``), else unchanged."""
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return tokens
        return tokens * torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)

    def gating(self, tokens: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]`` of ``tokens`` ``[T, h]``, in ``moe_router_dtype`` when set."""
        weight = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype)
        if dtype is not None:
            tokens, weight = tokens.to(dtype), weight.to(dtype)
        return F.linear(tokens, weight)  # [T, E]

    def forward(self, tokens: torch.Tensor, batch_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``tokens`` ``[T, h]`` (``[s, b]`` order, ``batch_size`` = b) -> (probs, routing map ``[T, E]``).

        Probabilities are in the router dtype (``moe_router_dtype``, else the tokens'). With
        ``moe_expert_capacity_factor`` the routed pairs are cut to the capacity of these ``T`` tokens
        after routing (before the balance losses, as Megatron). The expert-bias counts are those of
        the map returned (with padding: the padded map, as Megatron).
        """
        c = self.config
        logits = self.gating(self.jitter(tokens))  # [T, E]
        if c.moe_router_force_load_balancing:
            logits = random_logits_straight_through(logits)
        if c.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_route(logits, self.topk, self.training)
        else:
            probs, routing_map = route(
                logits,
                self.topk,
                c.moe_router_score_function,
                c.moe_router_pre_softmax,
                c.moe_router_num_groups,
                c.moe_router_group_topk,
                c.moe_router_topk_scaling_factor,
                self.expert_bias,
            )
        probs, routing_map = self.cut_to_capacity(probs, routing_map)
        if self.training and torch.is_grad_enabled():
            probs = self._attach_aux_losses(logits, probs, batch_size)
        if self.local_tokens_per_expert is not None and torch.is_grad_enabled():
            self.local_tokens_per_expert += routing_map.sum(dim=0)  # not in eval or a no-grad pass
        return probs, routing_map

    def cut_to_capacity(self, probs: torch.Tensor, routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Routed probs and map ``[T, E]`` cut to ``moe_expert_capacity_factor`` (unchanged when unset)."""
        c = self.config
        if c.moe_expert_capacity_factor is None:
            return probs, routing_map
        return drop_to_capacity(
            probs,
            routing_map,
            self.topk,
            c.moe_expert_capacity_factor,
            c.moe_token_drop_policy,
            c.moe_pad_expert_input_to_capacity,
        )

    @staticmethod
    def _summed(counts: torch.Tensor, group: dist.ProcessGroup) -> Tuple[torch.Tensor, int]:
        """Token counts summed over ``group`` (Megatron's reduce group of the balance losses), and its size."""
        size = dist.get_world_size(group)
        if size > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
        return counts, size

    def _balance_loss(self, logits: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The ``moe_router_load_balancing_type`` loss (its coefficient included): this rank's share."""
        c = self.config
        scores, aux_map = scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)  # [T, E] each
        kind, coeff = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
        if kind == "seq_aux_loss":
            seq = scores.shape[0] // batch_size  # this rank's part of each sequence
            per_seq = aux_map.view(seq, batch_size, -1).sum(dim=0).float()  # [b, E]
            per_seq, shards = self._summed(per_seq, self.tp_cp_group)  # over the whole sequences
            return sequence_load_balancing_loss(scores, per_seq, batch_size, self.topk, coeff, seq * shards)
        counts = aux_map.sum(dim=0).float()  # [E]
        if kind == "aux_loss":
            counts, shards = self._summed(counts, self.tp_cp_group)
            return switch_load_balancing_loss(scores, counts, self.topk, coeff, scores.shape[0] * shards)
        return self._global_balance_loss(scores, counts, coeff)

    def _global_balance_loss(self, scores: torch.Tensor, counts: torch.Tensor, coeff: float) -> torch.Tensor:
        """``global_aux_loss``: local scores against the counts of the whole batch (TP x DP x CP), averaged
        over this step's microbatches so far (reset by ``reset_global_aux_loss_tracker``)."""
        counts, shards = self._summed(counts, self.tp_dp_cp_group)
        self.global_tokens_per_expert += counts
        self.global_microbatches += 1
        mean_counts = self.global_tokens_per_expert / self.global_microbatches  # [E]
        return switch_load_balancing_loss(scores, mean_counts, self.topk, coeff, scores.shape[0] * shards)

    def _cp_weight(self) -> float:
        """The CP size (1 for per-token losses), as Megatron's ``forward_step`` scales the aux losses: the
        data-parallel wrapper averages gradients over DP x CP, and each CP rank's loss is only its share."""
        if self.config.calculate_per_token_loss:
            return 1.0
        return float(dist.get_world_size(self.tp_cp_group) // dist.get_world_size(self.tp_group))

    def _attach_aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Attach this rank's share of each aux loss to ``probs``; track the coefficient-free share."""
        c = self.config
        losses = []
        if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0:
            name = BALANCE_LOSS_NAMES[c.moe_router_load_balancing_type]
            losses.append((name, self._balance_loss(logits, batch_size), c.moe_aux_loss_coeff))
        if c.moe_z_loss_coeff:
            share = c.moe_z_loss_coeff / dist.get_world_size(self.tp_cp_group)  # the shards' means add up
            losses.append((Z_LOSS, router_z_loss(logits, share), c.moe_z_loss_coeff))
        for name, loss, coeff in losses:
            probs = MoEAuxLossAutoScaler.apply(probs, loss, self._cp_weight(), self.aux_loss_tracker)
            if self.layer_number is not None:
                self.aux_loss_tracker.add(name, loss / coeff, self.layer_number, c.num_layers + (c.mtp_num_layers or 0))
        return probs

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of experts below the mean count by the update rate,
        lower those above it; then clear the local counts. ``tokens_per_expert`` ``[E]``: all replicas' counts."""
        gap = tokens_per_expert.mean() - tokens_per_expert.to(self.expert_bias.device)  # [E]
        self.expert_bias += torch.sign(gap) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new step's ``global_aux_loss`` counts (``finalize_model_grads`` calls it)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.global_microbatches.zero_()
