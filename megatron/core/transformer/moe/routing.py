"""Routing as pure functions of the router logits: scores, top-k choice, and the balance losses' inputs.

Everything here maps ``logits`` ``[T, E]`` (T tokens, E experts) to tensors; the router module
(``router.py``) owns the parameters, buffers and communication. Megatron's semantics:

* ``softmax``: with ``pre_softmax`` the softmax over all E experts, then the top k of those
  probabilities; without it the top k logits, then a softmax over those k.
* ``sigmoid``: per-expert sigmoid scores; the top k are renormalised to sum to 1 (k > 1). An
  ``expert_bias`` ``[E]`` is added to the scores only to choose the experts (aux-loss-free
  balancing); the weights stay the unbiased scores.
* ``sqrtsoftplus`` (DeepSeek-V4's router, ``transformers``' ``DeepseekV4TopKRouter``): per-expert
  scores ``sqrt(softplus(logits))``, otherwise as ``sigmoid`` (expert bias, renormalised top k).
* group-limited: the E experts form ``num_groups`` equal groups; each token first keeps the
  ``group_topk`` groups with the largest sum of their ``topk / group_topk`` best scores, then
  picks its k experts inside them.
* ``scaling_factor`` multiplies the chosen weights.
* capacity (``moe_expert_capacity_factor``): applied to the routed probs and map, after all of
  the above and before the balance losses (which see the logits, not the kept pairs). Each
  expert keeps at most ``ceil(T * k / E * factor)`` of the ``T`` tokens one rank routes: those
  with the largest probs (``probs``; ties: the earlier token) or the earliest (``position``).
  With padding the map marks exactly that many tokens per expert (``min(capacity, T)``): the
  kept ones, then unrouted tokens (earliest first) with weight 0.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megatron.core.transformer.moe_choices import DROP_POLICIES, SCORE_FUNCTIONS


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top ``topk`` of ``scores`` ``[T, E]`` within each token's ``group_topk`` best groups -> ``[T, k]`` each."""
    tokens, experts = scores.shape
    per_group = experts // num_groups
    grouped = scores.view(tokens, num_groups, per_group)  # [T, G, E/G]
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_scores.topk(group_topk, dim=-1).indices  # [T, group_topk]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)  # [T, G]
    allowed = allowed.repeat_interleave(per_group, dim=1)  # [T, E]
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def _select(
    scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]
) -> Tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=-1)


PER_EXPERT_SCORES = ("sigmoid", "sqrtsoftplus")  # each expert scored alone (no softmax over experts)


def per_expert_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """``sigmoid(logits)`` or ``sqrt(softplus(logits))`` ``[T, E]``, computed in fp32, in ``logits``' dtype."""
    x = logits.float()
    scores = torch.sigmoid(x) if score_function == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
    return scores.type_as(logits)


def route(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, E]`` (zero off the chosen experts) and bool routing map ``[T, E]`` of ``logits``."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)  # [T, E]
            weights, chosen = _select(scores, topk, num_groups, group_topk)  # [T, k]
        else:
            top_logits, chosen = _select(logits, topk, num_groups, group_topk)  # [T, k]
            weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function in PER_EXPERT_SCORES:
        scores = per_expert_scores(logits, score_function)  # [T, E]
        if expert_bias is not None:
            _, chosen = _select(scores + expert_bias, topk, num_groups, group_topk)  # the bias only picks
            weights = scores.gather(1, chosen)  # [T, k]
        else:
            weights, chosen = _select(scores, topk, num_groups, group_topk)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function={score_function!r}: must be one of {SCORE_FUNCTIONS}")
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)  # [T, E]
    return probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the balance losses see: scores ``[T, E]`` over all experts (softmax, or the per-expert scores
    normalised per token) and the top-k map ``[T, E]`` of those scores (no groups, no expert bias), in fp32."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    else:
        scores = per_expert_scores(logits.float(), score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(scores, k=topk, dim=-1).indices  # [T, k]
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def sequence_load_balancing_loss(
    scores: torch.Tensor, per_seq_counts: torch.Tensor, batch_size: int, topk: int, coeff: float, seq_length: int
) -> torch.Tensor:
    """DeepSeek's sequence-wise balance loss: the Switch loss of each sequence alone, averaged over sequences.

    ``scores`` ``[s'*b, E]`` in the MoE layer's ``[s, b]`` token order: ``s'`` positions of each of the
    ``b`` sequences (a rank's shard); ``per_seq_counts`` ``[b, E]``: each sequence's top-k counts over
    all its ``seq_length`` positions. Per sequence: ``coeff * E / (k * s^2) * sum_e (sum_t p[t, e]) *
    count[e]``, the sum over ``t`` taken over the shard: the shards' losses add up to the sequence's.
    """
    tokens, experts = scores.shape
    per_seq_scores = scores.view(tokens // batch_size, batch_size, experts).sum(dim=0)  # [b, E]
    total = (per_seq_scores * per_seq_counts.to(scores.dtype)).sum()
    return total * (coeff * experts / (topk * seq_length * seq_length)) / batch_size


def random_logits_straight_through(logits: torch.Tensor) -> torch.Tensor:
    """``--moe-router-force-load-balancing``: standard-normal logits in forward (the default generator);
    the gradient passes to ``logits`` unchanged."""
    with torch.no_grad():
        noise = torch.randn_like(logits)  # [T, E]
    return logits + (noise - logits).detach()


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's capacity of each expert for ``num_tokens`` routed tokens: ``ceil(T * k / E * factor)``."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def _rank_in_expert(probs: torch.Tensor, routing_map: torch.Tensor, policy: str) -> torch.Tensor:
    """Each token's place in its expert's queue ``[..., T, E]`` (0 = kept first): the routed tokens
    first, by prob descending (``probs``) or token order (``position``), then the others by token order."""
    if policy == "probs":
        key = probs.detach().float().masked_fill(~routing_map, float("-inf"))  # [..., T, E]
    elif policy == "position":
        key = routing_map.to(torch.uint8)
    else:
        raise ValueError(f"moe_token_drop_policy={policy!r}: must be one of {DROP_POLICIES}")
    order = torch.sort(key, dim=-2, descending=True, stable=True).indices  # [..., T, E] token ids by place
    places = torch.arange(key.shape[-2], device=key.device).view(-1, 1).expand_as(order)  # [..., T, E]
    return torch.empty_like(order).scatter_(-2, order, places)


def drop_to_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    policy: str = "probs",
    pad: bool = False,
    groups: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Probs and map ``[T, E]`` with each expert's routed tokens cut to its capacity (see the module docstring).

    ``groups``: the ``T`` tokens are that many equal consecutive blocks, each one rank's own tokens
    in Megatron (e.g. its sequence shard); capacity and dropping are per block.
    """
    num_tokens, num_experts = probs.shape
    if num_tokens % groups:
        raise ValueError(f"{num_tokens} tokens do not split into {groups} capacity groups")
    per_group = num_tokens // groups
    capacity = expert_capacity(per_group, topk, num_experts, capacity_factor)
    if capacity >= per_group:  # nothing to drop; padding gives every expert every token
        keep = torch.ones_like(routing_map)
    else:
        shape = (groups, per_group, num_experts)
        places = _rank_in_expert(probs.view(shape), routing_map.view(shape), policy)  # [G, T/G, E]
        keep = (places < capacity).view(num_tokens, num_experts)  # [T, E]
    new_map = keep if pad else routing_map & keep  # [T, E]
    return probs * new_map, new_map


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]`` (Megatron-core's ``moe_utils.sinkhorn``).

    Row scales ``r`` and column scales ``c`` are alternated until ``c`` moves by less than ``tol``
    (mean absolute change) so that ``c_j * exp(cost_ij) * r_i`` has rows summing to ``1/T`` and
    columns to ``1/E``: every expert receives the same share of the tokens. Returns that matrix.
    """
    kernel = torch.exp(cost)  # [T, E]
    tokens, experts = kernel.shape
    eps = 1e-8
    col = torch.ones(experts, device=cost.device, dtype=cost.dtype)
    while True:
        row = 1.0 / (tokens * ((kernel * col).sum(dim=1) + eps))  # [T]
        new_col = 1.0 / (experts * ((row.unsqueeze(1) * kernel).sum(dim=0) + eps))  # [E]
        change = (new_col - col).abs().mean()
        col = new_col
        if not change > tol:  # NaN (an overflowed exp) stops too, as upstream's ``while error > tol``
            return col * kernel * row.unsqueeze(1)


def sinkhorn_route(logits: torch.Tensor, topk: int, training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``moe_router_load_balancing_type='sinkhorn'``: probs and routing map ``[T, E]`` (Megatron-core's rule).

    Training picks each token's ``topk`` experts on the Sinkhorn-balanced logits (fp32, no gradient);
    evaluation on the activated logits. The probabilities are the activated logits (sigmoid for
    ``topk == 1``, else softmax) on the chosen experts, zero elsewhere; no auxiliary loss.
    """
    activated = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32)
    activated = activated.type_as(logits)
    with torch.no_grad():
        ranked = sinkhorn(logits.detach().float()) if training else activated
        chosen = torch.topk(ranked, k=topk, dim=1).indices  # [T, k]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)  # [T, E]
    return activated * routing_map, routing_map
