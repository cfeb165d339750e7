"""A greedy strength-2 covering array ("all pairs"): rows in which every pair of levels of two factors appears.

``all_pairs([2, 3, 2])`` returns rows of level indices, one per factor, such that for any two factors
``i < j`` and any levels ``a`` of ``i`` and ``b`` of ``j`` some row has ``row[i] == a and row[j] == b``;
``allowed(partial)`` (a dict factor -> level) rules out combinations, and pairs it forbids are not
required. Greedy (in the spirit of AETG / IPO): each new row starts from an uncovered pair and fills
the other factors with the level covering most uncovered pairs; the first row is all zeros (the base).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Set, Tuple

Pair = Tuple[int, int, int, int]  # factor i, level a, factor j, level b (i < j)
Allowed = Callable[[Dict[int, int]], bool]


def _required(levels: List[int], allowed: Allowed) -> Set[Pair]:
    return {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(levels)), 2)
        for a in range(levels[i])
        for b in range(levels[j])
        if allowed({i: a, j: b})
    }


def pairs_of(row: List[int]) -> Set[Pair]:
    """The pairs one full row covers."""
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def _gain(partial: Dict[int, int], factor: int, level: int, uncovered: Set[Pair]) -> int:
    gain = 0
    for other, chosen in partial.items():
        i, a, j, b = (other, chosen, factor, level) if other < factor else (factor, level, other, chosen)
        gain += (i, a, j, b) in uncovered
    return gain


def _complete(seed: Dict[int, int], levels: List[int], uncovered: Set[Pair], allowed: Allowed) -> Optional[List[int]]:
    partial = dict(seed)
    for factor in range(len(levels)):
        if factor in partial:
            continue
        options = [lv for lv in range(levels[factor]) if allowed({**partial, factor: lv})]
        if not options:
            return None
        partial[factor] = max(options, key=lambda lv: (_gain(partial, factor, lv, uncovered), -lv))
    return [partial[f] for f in range(len(levels))]


def all_pairs(levels: List[int], allowed: Allowed = lambda partial: True) -> List[List[int]]:
    """Rows (level indices) covering every allowed pair of levels; the first row is all zeros."""
    uncovered = _required(levels, allowed)
    rows = [[0] * len(levels)]
    uncovered -= pairs_of(rows[0])
    while uncovered:
        i, a, j, b = min(uncovered)
        row = _complete({i: a, j: b}, levels, uncovered, allowed)
        if row is None:  # no allowed row holds this pair: it cannot be required
            uncovered.discard((i, a, j, b))
            continue
        rows.append(row)
        uncovered -= pairs_of(row)
    return rows
