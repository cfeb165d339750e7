"""Send one batch from the first rank of each TP group to the others (Megatron's ``broadcast_data``)."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import comm_device

_MAX_DIMS = 8  # dimensions a broadcast tensor may have (Megatron's limit is the same)


def _shapes_from_source(
    keys: Sequence[str], data: Optional[Mapping[str, torch.Tensor]], datatype: torch.dtype, group: dist.ProcessGroup
) -> List[List[int]]:
    """Every key's shape as known on the group's first rank (zero-padded rows travel, then are cut).

    A last row carries the first rank's verdict on the dtypes, so that every rank raises together.
    """
    table = torch.zeros(len(keys) + 1, _MAX_DIMS, dtype=torch.long, device=comm_device(group))
    if dist.get_rank(group) == 0:
        for row, key in enumerate(keys):
            shape = data[key].shape
            if len(shape) >= _MAX_DIMS:
                raise ValueError(f"broadcast_data: {key!r} has {len(shape)} dimensions; at most {_MAX_DIMS - 1}")
            table[row, : len(shape)] = torch.tensor(shape, dtype=torch.long)
            table[-1, 0] += int(data[key].dtype != datatype)
    dist.broadcast(table, dist.get_global_rank(group, 0), group=group)
    rows = table.cpu().tolist()
    if rows[-1][0]:
        raise AssertionError(f"broadcast_data: {rows[-1][0]} of {list(keys)} do not have dtype {datatype}")
    return [[int(s) for s in row if s > 0] for row in rows[:-1]]


def broadcast_data(
    keys: Sequence[str],
    data: Optional[Mapping[str, torch.Tensor]],
    datatype: torch.dtype,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Dict[str, torch.Tensor]:
    """The tensors ``data[key]`` of the TP group's first rank, on every rank of the group.

    Args:
        keys: which entries to send, in this order.
        data: the batch; read on the group's first rank only (other ranks may pass anything).
        datatype: the dtype every sent tensor must have (checked on the first rank).
        tp_group: the group (None: the default TP group).

    Returns:
        key -> tensor, on the device the group communicates from (the GPU for NCCL, else the CPU).

    Raises:
        AssertionError: a tensor on the first rank does not have ``datatype`` (on every rank; Megatron
            raises on the first rank only).
    """
    group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group)
    shapes = _shapes_from_source(keys, data, datatype, group)
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    device = comm_device(group)
    if dist.get_rank(group) == 0:
        flat = torch.cat([data[key].to(device).contiguous().view(-1) for key in keys])
    else:
        flat = torch.empty(sum(sizes), dtype=datatype, device=device)
    dist.broadcast(flat, dist.get_global_rank(group, 0), group=group)
    pieces = torch.split(flat, sizes)
    return {key: piece.view(shape) for key, piece, shape in zip(keys, pieces, shapes)}
