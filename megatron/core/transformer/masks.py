"""Attention masks: the one builder of causal and sliding-window masks.

Convention (Megatron's): a boolean mask is True where a query may NOT see a key. Queries are
identified by their global sequence positions, so the same builder serves a whole sequence
(positions ``0 .. s-1``) and a context-parallel rank, whose queries are two chunks of the sequence
(``megatron.core.context_parallel.cp_chunk_positions``) while its keys, all-gathered, are the whole
sequence.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def build_attention_mask(
    query_length: int,
    key_length: int,
    causal: bool = True,
    window: Optional[Tuple[int, int]] = None,
    query_positions: Optional[torch.Tensor] = None,
    device: Optional[torch.device] = None,
) -> Optional[torch.Tensor]:
    """``[sq, sk]`` boolean, True where a query may not see a key; None when nothing is blocked.

    Args:
        query_length: number of queries ``sq``.
        key_length: number of keys ``sk``, at positions ``0 .. sk-1``.
        causal: block keys after the query (key position > query position).
        window: ``(left, right)`` as Megatron's ``--window-size`` and flash attention: query ``i``
            sees keys ``i - left .. i + right``; -1 leaves that side unlimited.
        query_positions: ``[sq]`` global position of each query (context parallelism); by default
            ``0 .. sq-1``.
        device: where to build the mask when ``query_positions`` is not given.
    """
    if not causal and window is None:
        return None
    if query_positions is None:
        query_positions = torch.arange(query_length, device=device)  # [sq]
    elif query_positions.shape != (query_length,):
        raise ValueError(f"query_positions has shape {tuple(query_positions.shape)}, expected ({query_length},)")
    keys = torch.arange(key_length, device=query_positions.device)  # [sk]
    offset = keys[None, :] - query_positions[:, None]  # [sq, sk]: key position - query position
    blocked = offset > 0 if causal else torch.zeros_like(offset, dtype=torch.bool)
    if window is not None:
        left, right = window
        if left >= 0:
            blocked |= offset < -left
        if right >= 0:
            blocked |= offset > right
    return blocked
