"""T5's relative position bias: a learned scalar per head and distance bucket, added to attention scores.

A key at distance ``key - query`` falls into a bucket: small distances each get their own bucket,
larger ones share logarithmically wider buckets up to ``max_distance``, beyond which all distances
share the last bucket. Bidirectional attention (T5's encoder) spends half the buckets on keys after
the query; unidirectional attention (the decoder) buckets only keys at or before the query.
The table ``relative_attention_bias`` ``[num_buckets, heads]`` is Hugging Face's
``block.0.layer.0.SelfAttention.relative_attention_bias``: T5 computes the bias once per stack and
adds it in every layer.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index in ``[0, num_buckets)`` of each ``key - query`` distance (any shape, integer)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets  # keys after the query: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # keys after the query share bucket 0
    exact = num_buckets // 2
    # Distances from ``exact`` to ``max_distance`` spread log-uniformly over the remaining buckets.
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionEmbedding(torch.nn.Module):
    """The bias table of one stack; ``forward(sq, sk)`` -> bias ``[1, heads, sq, sk]`` (Megatron-core's API)."""

    def __init__(
        self,
        bidirectional: bool,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        num_attention_heads: int,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
    ) -> None:
        super().__init__()
        if relative_attention_num_buckets < (4 if bidirectional else 2):
            raise ValueError(f"relative_attention_num_buckets={relative_attention_num_buckets}: too few buckets")
        self.bidirectional = bidirectional
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.relative_attention_bias = torch.nn.Embedding(relative_attention_num_buckets, num_attention_heads)
        init_method(self.relative_attention_bias.weight)

    def forward(self, query_seq_length: int, key_seq_length: int) -> torch.Tensor:
        """``[1, heads, sq, sk]``: the bias every query-key pair gets, per head."""
        device = self.relative_attention_bias.weight.device
        queries = torch.arange(query_seq_length, device=device)  # [sq]
        keys = torch.arange(key_seq_length, device=device)  # [sk]
        buckets = relative_position_bucket(
            keys[None, :] - queries[:, None],
            self.bidirectional,
            self.relative_attention_num_buckets,
            self.relative_attention_max_distance,
        )  # [sq, sk]
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, sq, sk]
