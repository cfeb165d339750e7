"""DeepSeek Sparse Attention (DeepSeek-V3.2): multi-latent attention over the keys a lightning indexer picks.

Per token, with indexer heads ``hi`` of ``di`` channels and ``dr = qk_pos_emb_head_dim``:

* indexer queries ``[hi, di]`` from MLA's normalised query latent (``linear_wq_b``), one indexer key
  ``[di]`` per token from the hidden state (``linear_wk`` then a LayerNorm ``k_norm``, eps 1e-6), and a
  weight per head (``linear_weights_proj``, scaled by ``hi^-1/2``);
* the first ``dr`` channels of queries and keys are rotated with the model's RoPE angles, in halves
  (not MLA's interleaved pairs);
* score(query i, key j) = sum over heads of weight * relu(q . k / sqrt(di)); over the keys a query may
  see (causal, and the given mask), the ``dsa_indexer_topk`` best are kept;
* MLA's attention then runs with every other key masked (``DSAttention``, a ``DotProductAttention``).

The selection has no gradient: the main loss does not train the indexer (``transformers`` runs it
under ``no_grad`` too); Megatron trains it with a separate KL loss (``--dsa-indexer-loss-coeff``),
not implemented here, so its weights only change through weight decay.

Tensor parallelism: the indexer is replicated on every TP rank (as ``transformers``' TP plan leaves
it, and Megatron's duplicated linears): it scores whole tokens, not heads, and the top-k must be the
same for every head. Each rank runs it on the whole sequence (``MLASelfAttention`` all-gathers its
inputs under sequence parallelism) with identical weights and inputs, so every rank selects the same
keys without communication. Context parallelism is refused (``TransformerConfig``): a query's
candidates are all earlier keys, which CP splits over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.masks import build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules, ReplicatedLinear
from megatron.core.transformer.norms import LayerNorm
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

INDEXER_KEY_NORM_EPS = 1e-6  # DeepSeek-V3.2's (and transformers') fixed LayerNorm epsilon


@dataclass
class DSAIndexerSubmodules:
    """Megatron-core's parts of the indexer (replicated linears and the key LayerNorm)."""

    linear_wq_b: Any = ReplicatedLinear
    linear_wk: Any = ReplicatedLinear
    k_norm: Any = LayerNorm
    linear_weights_proj: Any = ReplicatedLinear


@dataclass
class DSAttentionSubmodules:
    """Megatron-core's parts of ``DSAttention``: the indexer."""

    indexer: Any = None


def lightning_index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's score ``sum_h w_h hi^-1/2 relu(q_h . k / sqrt(di))`` ``[b, sq, sk]`` (fp32)
    from queries ``[sq, b, hi, di]``, keys ``[sk, b, di]`` (one per token, or one per compressed
    window in DeepSeek-V4) and head weights ``[sq, b, hi]``."""
    n_heads, head_dim = q.shape[-2:]
    q = q.permute(1, 0, 2, 3).float()  # [b, sq, hi, di]
    k = k.permute(1, 2, 0).float()  # [b, di, sk]
    per_head = F.relu(torch.matmul(q, k.unsqueeze(1)) * head_dim**-0.5)  # [b, sq, hi, sk]
    weights = weights.float().transpose(0, 1) * n_heads**-0.5  # [b, sq, hi]
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # [b, sq, sk]


class DSAIndexer(MegatronModule):
    """The lightning indexer: top-k key indices per query (see the module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: Optional[DSAIndexerSubmodules] = None) -> None:
        super().__init__(config)
        sub = submodules or DSAIndexerSubmodules()
        self.n_heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk = config.dsa_indexer_topk
        self.linear_wq_b = build_module(sub.linear_wq_b, config, config.q_lora_rank, self.n_heads * self.head_dim)
        self.linear_wk = build_module(sub.linear_wk, config, config.hidden_size, self.head_dim)
        self.k_norm = build_module(sub.k_norm, config, self.head_dim, eps=INDEXER_KEY_NORM_EPS)
        self.linear_weights_proj = build_module(sub.linear_weights_proj, config, config.hidden_size, self.n_heads)

    def scores(
        self, hidden_states: torch.Tensor, q_latent: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float
    ) -> torch.Tensor:
        """Index scores ``[b, sq, sk]`` (fp32) from ``hidden_states`` ``[s, b, h]`` and the query latent
        ``[s, b, q_lora_rank]``; ``rotary_pos_emb`` ``[s, 1, 1, dr]``, ``mscale`` YaRN's cos/sin factor."""
        s, b, _ = hidden_states.shape
        q, _ = self.linear_wq_b(q_latent)  # [s, b, hi * di]
        q = apply_rotary_pos_emb(q.view(s, b, self.n_heads, self.head_dim), rotary_pos_emb, mscale=mscale)
        k, _ = self.linear_wk(hidden_states)  # [s, b, di]
        k = apply_rotary_pos_emb(self.k_norm(k).unsqueeze(2), rotary_pos_emb, mscale=mscale)  # [s, b, 1, di]
        weights, _ = self.linear_weights_proj(hidden_states)  # [s, b, hi]
        return lightning_index_scores(q, k.squeeze(2), weights)  # [b, sq, sk]

    def forward(
        self,
        hidden_states: torch.Tensor,
        q_latent: torch.Tensor,
        rotary_pos_emb: torch.Tensor,
        blocked: torch.Tensor,
        mscale: float = 1.0,
    ) -> torch.Tensor:
        """Top-k key indices ``[b, sq, min(topk, sk)]`` among the keys not ``blocked`` (``[b|1, sq, sk]``,
        True = not visible); rows with fewer visible keys fill up with blocked ones."""
        scores = self.scores(hidden_states, q_latent, rotary_pos_emb, mscale).masked_fill(blocked, float("-inf"))
        return scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices  # [b, sq, k]


class DSAttention(DotProductAttention):
    """MLA's core attention restricted to the indexer's top-k keys (a ``[b, 1, sq, sk]`` mask).

    ``MLASelfAttention`` calls ``sparse_attention_mask`` with the whole sequence's hidden states and
    query latent, then runs this module as its ``DotProductAttention`` with the returned mask.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
        softmax_scale: Optional[float] = None,
        submodules: Optional[DSAttentionSubmodules] = None,
        hcp_groups: Optional[List[torch.distributed.ProcessGroup]] = None,
    ) -> None:
        super().__init__(config, layer_number, attn_mask_type, cp_group, softmax_scale, hcp_groups=hcp_groups)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"DSAttention: attn_mask_type={attn_mask_type.name} (needs causal)")
        indexer = (submodules or DSAttentionSubmodules()).indexer or DSAIndexer
        self.indexer = build_module(indexer, config)

    @torch.no_grad()
    def sparse_attention_mask(
        self,
        hidden_states: torch.Tensor,
        q_latent: torch.Tensor,
        rotary_pos_emb: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        mscale: float = 1.0,
    ) -> torch.Tensor:
        """``[b, 1, sq, sk]`` boolean, True where a query may not see a key: causal, ``attention_mask``
        (``[b|1, 1, sq, sk]`` or None) and every key outside the query's top-k."""
        s = hidden_states.shape[0]
        blocked = build_attention_mask(s, s, device=hidden_states.device).unsqueeze(0)  # [1, sq, sk]
        if attention_mask is not None:
            blocked = blocked | attention_mask.squeeze(1)  # [b|1, sq, sk]
        top = self.indexer(hidden_states, q_latent, rotary_pos_emb, blocked, mscale)  # [b, sq, k]
        outside = torch.ones(top.shape[0], s, s, dtype=torch.bool, device=top.device).scatter(-1, top, False)
        return (blocked | outside).unsqueeze(1)  # [b, 1, sq, sk]


def get_dsa_module_spec(mla_spec: ModuleSpec) -> ModuleSpec:
    """``mla_spec`` (an ``MLASelfAttention`` spec) with ``DSAttention`` and its indexer as core attention."""
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=DSAIndexer))
    submodules = replace(mla_spec.submodules or MLASelfAttentionSubmodules(), core_attention=core)
    return ModuleSpec(module=mla_spec.module, params=dict(mla_spec.params), submodules=submodules)
