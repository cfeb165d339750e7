"""Global gradient norm, clipping and zero counting over model-parallel (and DP-shard) ranks.

Every rank holds a piece of the model: TP shards, a pipeline stage, and with the
distributed optimizer a 1/d slice of the flattened gradients. The global L2 norm is
the square root of the sum of squares over the distinct pieces, so a tensor that is
replicated must be counted exactly once:

* replicated across TP (``tensor_model_parallel`` False: norms, biases of row-parallel
  layers, position embeddings): only TP rank 0 contributes;
* the output-layer copy of tied embeddings on the last pipeline stage (``shared`` or
  ``shared_embedding`` set on it): never counted, the first stage's copy is.

The per-rank sums are then all-reduced over each group in ``groups`` in turn (sums of
sums, so the order is irrelevant): the model-parallel group, and also the data-parallel
group when each DP rank holds different shards.

Expert parameters (``allreduce = False``) differ across expert-parallel ranks, where dense
parameters are replicated, so their sum is reduced over other groups (``expert_groups``:
``tp_ep_pp``, plus ``expt_dp`` for shards) and added to the dense one. Replicated expert
tensors (biases over expert-TP = TP) count on TP rank 0 only, like dense ones.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import comm_device


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the last stage's copy of a tied embedding (it is counted on the first stage)."""
    return not (getattr(param, "shared", False) or getattr(param, "shared_embedding", False))


def counts_for_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` contributes to global gradient statistics."""
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_rank)


def _all_reduce(value: torch.Tensor, groups: Sequence[dist.ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a CPU scalar over each group in turn (through the device NCCL needs); returns it on the CPU."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            moved = value.to(comm_device(group))
            dist.all_reduce(moved, op=op, group=group)
            value = moved.cpu()
    return value


_NORM_CHUNK = 4096


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``tensor`` as a float64 scalar on its device.

    A float64 copy of every gradient is slow (the norm was ~0.6 s of a GPT-2-small step on
    2 cores); one fp32 sum over millions of elements drifts. So each 4096-element chunk is
    reduced by torch's fp32 norm kernel and the chunk results are added in float64: within
    ~1e-6 relative of an all-float64 sum (the accuracy of fp32 norm kernels, which Megatron
    uses too) and ~25x faster.
    """
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    whole = flat.numel() // _NORM_CHUNK * _NORM_CHUNK
    chunks = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), dim=1).double()  # [n/4096]
    return chunks.pow(2).sum() + flat[whole:].double().pow(2).sum()


def _squares_over(grads: Iterable[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """Sum of squares of ``grads`` summed over ``groups``, a float64 CPU tensor ``[1]``."""
    total = torch.zeros(1, dtype=torch.float64)
    for grad in grads:
        # The partial sum lives on the gradients' device; one copy to the host at the end.
        total = total.to(grad.device) + sum_of_squares(grad)
    return _all_reduce(total.cpu(), groups)


def get_grad_norm_fp32(grads: Iterable[torch.Tensor], groups: Sequence[dist.ProcessGroup],
                       expert_grads: Iterable[torch.Tensor] = (),
                       expert_groups: Sequence[dist.ProcessGroup] = ()) -> float:
    """L2 norm of all ``grads`` on all ranks of ``groups`` and ``expert_grads`` on all ranks of
    ``expert_groups`` (each rank passes only what it counts)."""
    total = _squares_over(grads, groups) + _squares_over(expert_grads, expert_groups)
    return float(total.sqrt().item())


def clip_grad_by_total_norm_fp32(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for grad in grads:
            grad.mul_(coeff)


def _zeros_over(grads: Iterable[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float64)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad).item()
    return _all_reduce(total, groups)


def count_zeros_fp32(grads: Iterable[torch.Tensor], groups: Sequence[dist.ProcessGroup],
                     expert_grads: Iterable[torch.Tensor] = (),
                     expert_groups: Sequence[dist.ProcessGroup] = ()) -> int:
    """Number of exactly-zero gradient elements over all ranks of ``groups`` (experts: ``expert_groups``)."""
    total = _zeros_over(grads, groups) + _zeros_over(expert_grads, expert_groups)
    return int(total.item())


def any_nonfinite(grads: Iterable[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> bool:
    """Whether any rank of ``groups`` holds an inf or NaN in ``grads``."""
    found = torch.zeros(1, dtype=torch.float32)
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
            break
    found = _all_reduce(found, groups, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)


def nonempty(grads: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Drop missing gradients (parameters that took no part in the step)."""
    return [g for g in grads if g is not None]
