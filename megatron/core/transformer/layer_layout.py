"""Which transformer layers each pipeline stage and virtual chunk holds, computed as data."""

from __future__ import annotations

from typing import Any, List, Optional


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


def _counts_with_end_slots(num_layers: int, pp_size: int, vp: int, embedding: bool, loss: bool) -> List[List[int]]:
    """``[pp_rank][chunk]`` layer counts when the embedding and/or the loss count as one layer each.

    Megatron-core's ``account_for_{embedding,loss}_in_pipeline_split``: the ``num_layers`` (+1, +1)
    slots split evenly over every stage; the model's first stage gives one slot to the embedding,
    its last stage one to the loss.
    """
    slots, stages = num_layers + int(embedding) + int(loss), pp_size * vp
    if slots % stages:
        raise ValueError(
            f"num_layers={num_layers} with account_for_embedding_in_pipeline_split={embedding} and "
            f"account_for_loss_in_pipeline_split={loss} makes {slots} slots: must be divisible by "
            f"pipeline_model_parallel_size={pp_size} x {vp} virtual chunk(s) = {stages}"
        )
    counts = [[slots // stages] * vp for _ in range(pp_size)]
    counts[0][0] -= int(embedding)
    counts[-1][-1] -= int(loss)
    return counts


def _even_chunk_counts(
    num_layers: int, pp_size: int, vp: int, first: Optional[int], last: Optional[int]
) -> List[List[int]]:
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    for rank, count in enumerate(counts):
        if count % vp:
            raise ValueError(
                f"pipeline stage {rank} holds {count} layers, not divisible by "
                f"{vp} virtual pipeline chunks (num_layers={num_layers}, pipeline_model_parallel_size={pp_size})"
            )
    return [[count // vp] * vp for count in counts]


def pipeline_layer_assignment(
    num_layers: int,
    pp_size: int,
    vp_size: Optional[int] = None,
    first: Optional[int] = None,
    last: Optional[int] = None,
    *,
    embedding_slot: bool = False,
    loss_slot: bool = False,
    decoder_counts: Optional[List[List[int]]] = None,
) -> List[List[List[int]]]:
    """Global layer numbers (1-based) held by ``[pp_rank][chunk]``.

    The counts come from ``decoder_counts`` (``[pp_rank][chunk]``, e.g. a custom layout's), or the
    embedding/loss slots (see ``_counts_with_end_slots``), or an even split with ``first``/``last``
    overriding the end stages. The model runs chunk 0 of every stage in stage order, then chunk 1,
    and so on, so chunk ``v`` of rank ``r`` follows chunk ``v`` of rank ``r-1`` in the network.
    """
    vp = vp_size or 1
    if decoder_counts is not None:
        counts = decoder_counts
    elif embedding_slot or loss_slot:
        counts = _counts_with_end_slots(num_layers, pp_size, vp, embedding_slot, loss_slot)
    else:
        counts = _even_chunk_counts(num_layers, pp_size, vp, first, last)
    layout: List[List[List[int]]] = [[[] for _ in range(vp)] for _ in range(pp_size)]
    next_layer = 1
    for chunk in range(vp):
        for rank in range(pp_size):
            layout[rank][chunk] = list(range(next_layer, next_layer + counts[rank][chunk]))
            next_layer += counts[rank][chunk]
    return layout


def config_layer_assignment(
    config: Any, pp_size: Optional[int] = None, vp_size: Optional[int] = None
) -> List[List[List[int]]]:
    """``pipeline_layer_assignment`` for a TransformerConfig (sizes default to the config's)."""
    pp = config.pipeline_model_parallel_size if pp_size is None else pp_size
    vp = config.virtual_pipeline_model_parallel_size if vp_size is None else vp_size
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    counts = None
    if layout is not None:  # a PipelineParallelLayerLayout (the config converted it)
        counts = [[stage.count(layout.decoder_type) for stage in row] for row in layout.layout]
    return pipeline_layer_assignment(
        config.num_layers,
        pp,
        vp,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        embedding_slot=getattr(config, "account_for_embedding_in_pipeline_split", False),
        loss_slot=getattr(config, "account_for_loss_in_pipeline_split", False),
        decoder_counts=counts,
    )
