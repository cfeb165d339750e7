"""Which transformer layers each pipeline stage and virtual chunk holds, computed as data."""

from __future__ import annotations

from typing import List, Optional


def stage_layer_counts(
    num_layers: int, pp_size: int, first: Optional[int] = None, last: Optional[int] = None
) -> List[int]:
    """Layers per pipeline rank; ``first``/``last`` override the end stages, the rest split evenly.

    Raises:
        ValueError: the layers cannot be split as asked.
    """
    if pp_size == 1:
        return [num_layers]
    fixed = {0: first, pp_size - 1: last}
    fixed = {rank: n for rank, n in fixed.items() if n is not None}
    middle_stages = pp_size - len(fixed)
    remaining = num_layers - sum(fixed.values())
    if remaining < 0 or (middle_stages and remaining % middle_stages) or (not middle_stages and remaining):
        raise ValueError(
            f"num_layers={num_layers} cannot be split over pipeline_model_parallel_size={pp_size} with "
            f"num_layers_in_first_pipeline_stage={first} and num_layers_in_last_pipeline_stage={last}: "
            "the remaining layers must divide evenly over the other stages"
        )
    even = remaining // middle_stages if middle_stages else 0
    return [fixed.get(rank, even) for rank in range(pp_size)]


def pipeline_layer_assignment(
    num_layers: int,
    pp_size: int,
    vp_size: Optional[int] = None,
    first: Optional[int] = None,
    last: Optional[int] = None,
) -> List[List[List[int]]]:
    """Global layer numbers (1-based) held by ``[pp_rank][chunk]``.

    The model runs chunk 0 of every stage in stage order, then chunk 1, and so on, so
    chunk ``v`` of rank ``r`` follows chunk ``v`` of rank ``r-1`` in the network.
    """
    vp = vp_size or 1
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    for rank, count in enumerate(counts):
        if count % vp:
            raise ValueError(
                f"pipeline stage {rank} holds {count} layers, not divisible by "
                f"{vp} virtual pipeline chunks (num_layers={num_layers}, pipeline_model_parallel_size={pp_size})"
            )
    layout: List[List[List[int]]] = [[[] for _ in range(vp)] for _ in range(pp_size)]
    next_layer = 1
    for chunk in range(vp):
        for rank in range(pp_size):
            per_chunk = counts[rank] // vp
            layout[rank][chunk] = list(range(next_layer, next_layer + per_chunk))
            next_layer += per_chunk
    return layout
