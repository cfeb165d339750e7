"""Small arithmetic and tensor-splitting helpers shared by the tensor-parallel layers."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import all_gather_into_tensor


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator`` (both are named).
    """
    if denominator == 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Tuple[torch.Tensor, ...]:
    """Cut ``tensor`` into ``num_partitions`` equal pieces along its last dimension.

    Args:
        tensor: any tensor whose last dimension is divisible by ``num_partitions``.
        num_partitions: number of pieces.
        contiguous_split_chunks: return contiguous copies instead of views.
    """
    last = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """This rank's equal slice of ``tensor`` flattened (numel must divide by the group size).

    Args:
        tensor: the tensor to cut.
        new_buffer: return a copy in its own storage (so the full tensor can be freed);
            otherwise a view into ``tensor``.
        tp_group: the group whose ranks share the pieces (None: the default TP group).
    """
    group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = divide(tensor.numel(), world)
    piece = tensor.reshape(-1)[rank * per_rank : (rank + 1) * per_rank]
    return piece.clone() if new_buffer else piece


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Inverse of ``split_tensor_into_1d_equal_chunks``: the flat tensor of all ranks' slices.

    ``tensor`` may have any shape; each rank's piece enters in row-major order.
    """
    group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group)
    world = dist.get_world_size(group)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)  # [world * numel]
    all_gather_into_tensor(out, tensor.reshape(-1).contiguous(), group=group)  # gloo needs matching 1-D shapes
    return out


class VocabUtility:
    """Which contiguous slice ``[first, last)`` of the vocabulary a TP rank owns."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Tuple[int, int]:
        """Range of rank ``rank`` when every rank holds ``per_partition_vocab_size`` entries."""
        del world_size  # every partition has the same size; kept for Megatron's signature
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        """Range of rank ``rank`` when ``global_vocab_size`` is split over ``world_size`` ranks."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
