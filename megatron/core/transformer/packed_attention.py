"""Variable-length (block-diagonal) causal attention over a packed row, one sequence at a time.

No ``[t, t]`` mask is built. The queries a rank holds are cut into *segments*: contiguous runs of
one sequence (with a sliding window, runs of at most ``max(left + 1, WINDOW_BLOCK)`` queries).
Each segment attends to the keys of its own sequence that it may see: from the sequence start (or
the window's left edge) up to its last query. A segment whose queries are exactly its keys runs as
plain causal attention (``is_causal``: flash-eligible, grouped-query heads not expanded); the others
(a context-parallel rank's later chunk, windowed blocks) carry a small ``[queries, keys]`` mask.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron.core.transformer.masks import build_attention_mask

WINDOW_BLOCK = 32  # queries per windowed segment at least (fewer, larger kernel calls)


@dataclass
class Segment:
    """Queries ``q_start:q_end`` (rows of this rank's queries) attending to keys ``k_start:k_end``
    (rows of the packed row's keys); ``mask`` ``[q, k]`` True = blocked, None = aligned causal."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    mask: Optional[torch.Tensor]


def _runs(query_positions: List[int], cu_seqlens: List[int]) -> List[Tuple[int, int, int]]:
    """``(first row, row after last, sequence start)`` of each run of consecutive positions in one sequence."""
    runs, row = [], 0
    while row < len(query_positions):
        seq = bisect.bisect_right(cu_seqlens, query_positions[row]) - 1
        end = row + 1
        while (
            end < len(query_positions)
            and query_positions[end] == query_positions[end - 1] + 1
            and query_positions[end] < cu_seqlens[seq + 1]
        ):
            end += 1
        runs.append((row, end, cu_seqlens[seq]))
        row = end
    return runs


def packed_segments(
    query_positions: torch.Tensor, cu_seqlens: torch.Tensor, window: Optional[Tuple[int, int]] = None
) -> List[Segment]:
    """The segments, in query order, covering queries at packed-row ``query_positions`` ``[t_q]``.

    ``cu_seqlens`` ``[n + 1]`` bound the sequences of the packed row; ``window`` is Megatron's
    ``(left, right)`` (``right`` is moot under the causal mask; -1: unlimited).
    """
    positions = query_positions.tolist()
    cu = cu_seqlens.tolist()
    if positions and (min(positions) < 0 or max(positions) >= cu[-1]):
        raise ValueError(f"packed queries reach position {max(positions)} beyond cu_seqlens[-1]={cu[-1]}")
    left = window[0] if window is not None and window[0] >= 0 else None
    block = max(left + 1, WINDOW_BLOCK) if left is not None else None
    segments = []
    for row, end, seq_start in _runs(positions, cu):
        for first in range(row, end, block or end - row):
            last = min(end, first + (block or end - row))
            q0, q1 = positions[first], positions[last - 1] + 1  # packed positions [q0, q1)
            k0 = seq_start if left is None else max(seq_start, q0 - left)
            mask = None
            if k0 != q0 or left is not None:
                local = query_positions[first:last] - k0  # [q] positions relative to the first key
                mask = build_attention_mask(last - first, q1 - k0, True, window, query_positions=local)
            segments.append(Segment(first, last, k0, q1, mask))
    return segments
