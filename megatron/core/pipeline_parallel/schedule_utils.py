"""Megatron-core's schedule helpers that are plain arithmetic or bookkeeping.

``schedules`` re-exports them where Megatron-core users import them from. Our own schedules
do not call them: their plan is ``schedule_table`` (per-rank op lists tested without
processes); these give the same numbers in Megatron-core's form for code written against it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from megatron.core import parallel_state
from megatron.core.context_parallel import local_sequence_length
from megatron.core.pipeline_parallel.p2p_communication import stage_hidden_size
from megatron.core.utils import unwrap_model

Shape = Union[List[int], torch.Size]


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """``cond``, and during validation (``forward_only``) also ``first_val_step`` when given."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def set_current_microbatch(model: Any, microbatch_id: int) -> None:
    """Record ``microbatch_id`` as ``current_microbatch`` on every layer of the model's decoder.

    ``model`` may be wrapped (DDP, ``Float16Module``); a model without a ``decoder`` is left alone.
    """
    inner = unwrap_model(model[0] if isinstance(model, list) else model)
    decoder = getattr(inner, "decoder", None)
    if decoder is None:
        return
    for layer in decoder.layers:
        layer.current_microbatch = microbatch_id


def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int],
    config: Any,
    tp_group: torch.distributed.ProcessGroup,
    cp_group: torch.distributed.ProcessGroup,
) -> List[Tuple[int, int, int]]:
    """The one activation shape sent between stages: ``[(s / cp (/ tp under SP), b, h (* n streams))]``
    (``p2p_communication.stage_hidden_size``: DeepSeek-V4's hyper-connection streams travel packed).

    ``decoder_seq_length`` replaces ``seq_length`` when given. Unlike upstream, a length that does
    not divide evenly raises ``ValueError`` (``context_parallel.local_sequence_length``).
    """
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    local = local_sequence_length(seq, cp_group.size(), tp_group.size(), bool(config.sequence_parallel))
    return [(local, micro_batch_size, stage_hidden_size(config))]


def _pipeline_sizes(p2p_communicator: Any) -> Tuple[int, int, Optional[int]]:
    """(pp size, pp rank, virtual size) from an upstream-style communicator or the default groups."""
    if p2p_communicator is not None:
        group = p2p_communicator.pp_group
        return group.size(), group.rank(), p2p_communicator.virtual_pipeline_model_parallel_size
    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )


def get_pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int,
    forward_only: bool = False,
    overlap_moe_expert_parallel_comm: bool = False,
    p2p_communicator: Any = None,
) -> Tuple[int, bool, int, int]:
    """Forward steps of this pipeline rank: (total, all in warm-up, warm-up, remaining).

    Warm-up is ``p - rank - 1`` forwards for 1F1B; interleaved, twice that plus
    ``(chunks - 1) x group size`` (one more with ``overlap_moe_expert_parallel_comm``); all of
    them when ``forward_only``; capped at the total. Sizes come from ``p2p_communicator``
    (``pp_group``, ``virtual_pipeline_model_parallel_size``) or the default groups.
    """
    pp_size, pp_rank, vp_size = _pipeline_sizes(p2p_communicator)
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp_size == 1:
        warmup = 0
    elif vp_size is None:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        warmup += int(overlap_moe_expert_parallel_comm)
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> List[Tuple[int, int]]:
    """The order of (microbatch, chunk) forwards of the interleaved schedule on every rank.

    Microbatches go in groups of ``microbatch_group_size_per_vp_stage``; each group runs
    through chunk 0, then chunk 1, ...; the last group takes whatever microbatches remain.
    """
    table: List[Tuple[int, int]] = []
    group = microbatch_group_size_per_vp_stage
    for start in range(0, num_microbatches, group):
        stop = min(start + group, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(start, stop))
    return table


def _defers_embedding_wgrad(config: Any) -> bool:
    """Whether ``config`` asks for the deferred embedding weight gradient (not implemented here)."""
    return bool(getattr(config, "defer_embedding_wgrad_compute", False))


def clear_embedding_activation_buffer(config: Any, model: Any, is_last_stage: bool) -> None:
    """Upstream empties the buffer of the deferred output-layer weight gradient; there is none here.

    Returns None (as upstream does when the deferral is off); the deferral itself is refused.
    """
    if is_last_stage and _defers_embedding_wgrad(config):
        raise NotImplementedError("defer_embedding_wgrad_compute is not supported yet (a GPU overlap option)")
    return None


def finish_embedding_wgrad_compute(
    config: Any, embedding_module: Any, is_last_stage: bool, tp_group: Optional[torch.distributed.ProcessGroup]
) -> None:
    """Upstream computes the deferred output-layer weight gradient; there is none here (see above)."""
    if is_last_stage and _defers_embedding_wgrad(config):
        raise NotImplementedError("defer_embedding_wgrad_compute is not supported yet (a GPU overlap option)")
