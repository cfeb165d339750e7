"""Hash routing (DeepSeek-V4's ``hash_moe`` layers): a frozen token-id -> experts table picks the experts.

Only the choice is static: the learned gate still scores every expert (``tokens W^T``, the score
function of ``moe_router_score_function``), and the chosen experts' scores, renormalised to sum to
1 and times ``moe_router_topk_scaling_factor``, weight their outputs (as ``transformers``'
``DeepseekV4HashRouter``). The table ``tid2eid`` ``[V, k]`` (``V = moe_hash_router_vocab_size``) is a
checkpointed integer buffer, the same on every rank; a fresh one holds k distinct experts per token
drawn from a fixed seed, a converted one the checkpoint's. No balance losses and no expert bias
(the table fixes the load); capacity, if set, cuts the routed pairs as for ``TopKRouter``.

Token ids enter per call: ``MoELayer.forward(hidden_states, token_ids=[b, s])`` hands the router
the ids of its ``[s, b]``-ordered tokens (``[T]``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.routing import per_expert_scores
from megatron.core.transformer.transformer_config import TransformerConfig

TABLE_SEED = 0  # the same table on every rank and every run


def fresh_hash_table(vocab_size: int, num_experts: int, topk: int) -> torch.Tensor:
    """``[V, k]`` int64: k distinct experts per token id, from a fixed-seed generator."""
    generator = torch.Generator().manual_seed(TABLE_SEED)
    return torch.rand(vocab_size, num_experts, generator=generator).argsort(dim=-1)[:, :topk]


def hash_route(
    logits: torch.Tensor, chosen: torch.Tensor, score_function: str, scaling_factor: Optional[float]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Probs ``[T, E]`` (zero off ``chosen`` ``[T, k]``) and bool map ``[T, E]``: the chosen experts'
    scores over all E (softmax, sigmoid or sqrtsoftplus of ``logits`` ``[T, E]``), renormalised, times the factor."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)  # [T, E]
    else:
        scores = per_expert_scores(logits, score_function)  # [T, E]
    weights = scores.gather(1, chosen)  # [T, k]
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)  # [T, E]
    return probs, routing_map


class HashRouter(TopKRouter):
    """``TopKRouter``'s gate (``weight`` ``[E, h]``, replicated over TP) with the experts taken from
    ``tid2eid[token_ids]``; a router for ``MoESubmodules.router`` in hash-routed layers."""

    needs_token_ids = True  # MoELayer.routes_by_token_id: the layer asks for the input ids

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: dist.ProcessGroup,
        tp_cp_group: Optional[dist.ProcessGroup] = None,
        tp_dp_cp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(config, tp_group, tp_cp_group, tp_dp_cp_group)
        vocab = config.moe_hash_router_vocab_size
        if vocab is None:
            raise ValueError("HashRouter needs moe_hash_router_vocab_size (the token ids its table covers)")
        self.expert_bias = None  # the table balances; the learned layers keep theirs
        self.local_tokens_per_expert = None
        self.register_buffer("tid2eid", fresh_hash_table(vocab, config.num_moe_experts, self.topk))

    def forward(
        self,
        tokens: torch.Tensor,
        batch_size: int = 1,
        token_ids: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[T, h]`` and their ids ``token_ids`` ``[T]`` -> (probs ``[T, E]``, routing map ``[T, E]``)."""
        if token_ids is None:
            raise ValueError("HashRouter needs token_ids: call MoELayer.forward(hidden_states, token_ids=[b, s])")
        if token_ids.shape != tokens.shape[:1]:
            raise ValueError(
                f"HashRouter: token_ids {tuple(token_ids.shape)} do not match tokens {tuple(tokens.shape)}"
            )
        c = self.config
        logits = self.gating(self.jitter(tokens))  # [T, E]
        chosen = self.tid2eid[token_ids.long()]  # [T, k]
        probs, routing_map = hash_route(logits, chosen, c.moe_router_score_function, c.moe_router_topk_scaling_factor)
        probs, routing_map = self.cut_to_capacity(probs, routing_map)
        return probs, routing_map
