"""Sequence-parallel communication hidden behind the GEMMs (``tp_comm_overlap``).

Under sequence parallelism a column-parallel linear all-gathers its ``[s/tp, b, h]`` input before
its GEMM, and a row-parallel linear reduce-scatters its ``[s, b, o]`` partial output after its
GEMM. With ``tp_comm_overlap`` both are decomposed into ``tp`` chunks passed around the TP ring
(as torchtitan's async TP and Megatron's userbuffer ring exchange do), so each chunk's GEMM runs
while the next chunk travels:

* ``ring_all_gather_linear``: at step ``k`` rank ``r`` holds the piece of rank ``r - k``; it posts
  the send of that piece to ``r + 1`` and the receive of the piece of ``r - k - 1`` from ``r - 1``
  (one ``batch_isend_irecv``), runs the GEMM of the piece it holds, then waits. The output rows
  are placed by their origin, so the result is ``[s, b, o/tp]`` as after a blocking all-gather.
* ``ring_linear_reduce_scatter``: at step ``k`` rank ``r`` runs the GEMM of input chunk
  ``c = r + k + 1`` (mod ``tp``), adds the partial sum of ``c`` received from ``r + 1`` (posted
  after the previous step's GEMM), and posts it on to ``r - 1``; at the last step ``c = r`` and
  the sum is complete: this rank's ``[s/tp, b, o]`` output shard. The send of step ``k`` travels
  during the GEMM of step ``k + 1``.

Backward is the blocking path's (``linear_function``: the column linear re-gathers its input under
the input-gradient GEMM; the row linear all-gathers its output gradient, then runs its GEMMs).
Sums run in ring order, so results equal the blocking path's up to fp rounding. On a GPU the
ring's kernels and the GEMMs start in issue order under ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(``megatron.training.cuda_env``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.utils import divide


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """One chunk's GEMM ``[rows, b, h] -> [rows, b, o]`` (its own function: tests record the order)."""
    return F.linear(x, weight, bias)


def _ring_step(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup) -> List[dist.Work]:
    """Post ``send`` to global rank ``dst`` and the receive into ``recv`` from ``src`` as one batch."""
    ops = [dist.P2POp(dist.isend, send, dst, group=group), dist.P2POp(dist.irecv, recv, src, group=group)]
    return dist.batch_isend_irecv(ops)


def _wait(works: List[dist.Work]) -> None:
    for work in works:
        work.wait()


def _ring(group: dist.ProcessGroup) -> Tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the next, of the previous)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    return rank, size, nxt, prev


def ring_all_gather_linear(
    piece: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """``F.linear(all_gather(piece), weight, bias)``: ``[s/tp, b, h] -> [s, b, o/tp]``, each piece's
    GEMM overlapping the transfer of the next piece (module doc)."""
    rank, size, nxt, prev = _ring(group)
    outputs: List[Optional[torch.Tensor]] = [None] * size
    current = piece.contiguous()  # [s/tp, b, h]: the piece of rank (rank - k) at step k
    for k in range(size):
        works, incoming = [], None
        if k < size - 1:
            incoming = torch.empty_like(current)
            works = _ring_step(current, nxt, incoming, prev, group)  # the next piece travels ...
        outputs[(rank - k) % size] = _gemm(current, weight, bias)  # ... during this GEMM: [s/tp, b, o/tp]
        _wait(works)
        current = incoming if incoming is not None else current
    return torch.cat(outputs, dim=0)  # [s, b, o/tp]


def ring_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight))`` along dim 0: ``[s, b, h/tp] -> [s/tp, b, o]``, each
    chunk's GEMM overlapping the transfer of the previous chunk's partial sum (module doc)."""
    rank, size, nxt, prev = _ring(group)
    chunks = x.split(divide(x.size(0), size), dim=0)  # tp x [s/tp, b, h/tp]
    works: List[dist.Work] = []
    incoming: Optional[torch.Tensor] = None
    total = None
    for k in range(size):
        partial = _gemm(chunks[(rank + k + 1) % size], weight, None)  # [s/tp, b, o], while step k-1's sum travels
        _wait(works)
        total = partial if incoming is None else partial + incoming  # the sum of ranks r+1 .. r+k+1's share
        if k < size - 1:
            incoming = torch.empty_like(total)
            works = _ring_step(total, prev, incoming, nxt, group)
    return total  # [s/tp, b, o]


__all__ = ["ring_all_gather_linear", "ring_linear_reduce_scatter"]
