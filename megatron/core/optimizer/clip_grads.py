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

from typing import Dict, Iterable, List, Sequence, Tuple

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


def _reduce(value: torch.Tensor, groups: Sequence[dist.ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``value`` reduced over each group in turn, moved only where a group's backend needs another device.

    Statistics of device gradients stay on the device (NCCL) and the caller reads the result
    once; nothing travels through the host on the way.
    """
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            value = value.to(comm_device(group))
            dist.all_reduce(value, op=op, group=group)
    return value


def _home_device(grads: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> torch.device:
    """Where a statistic of ``grads`` starts: their device, else the first group's communication device."""
    if grads:
        return grads[0].device
    live = [g for g in groups if g is not None]
    return comm_device(live[0]) if live else torch.device("cpu")


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    """Tensors grouped as multi-tensor (``torch._foreach_*``) kernels take them."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


_NORM_CHUNK = 4096


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``tensor`` as a float64 scalar on its device (the CPU path).

    A float64 copy of every gradient is slow (the norm was ~0.6 s of a GPT-2-small step on
    2 cores); one fp32 CPU norm over millions of elements drifts (3e-4 relative at 10M). So
    each 4096-element chunk is reduced by torch's fp32 norm kernel and the chunk results are
    added in float64: within ~1e-6 relative of an all-float64 sum and ~25x faster.
    """
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    whole = flat.numel() // _NORM_CHUNK * _NORM_CHUNK
    chunks = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), dim=1).double()  # [n/4096]
    return chunks.pow(2).sum() + flat[whole:].double().pow(2).sum()


def _foreach_sum_of_squares(grads: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of same-device, same-dtype ``grads``: a float64 scalar on their device.

    On an accelerator one multi-tensor kernel takes every tensor's norm (fp32 accumulation,
    tree-reduced: ~1e-6 relative whatever the size) and the squares are added in float64.
    CPU norm kernels accumulate linearly, so the CPU keeps the chunked ``sum_of_squares``.
    """
    if grads[0].device.type == "cpu":
        return torch.stack([sum_of_squares(g) for g in grads]).sum()
    dtype = None if grads[0].dtype in (torch.float32, torch.float64) else torch.float32
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=dtype)  # fp32 each
    return torch.stack(norms).double().pow(2).sum()


def _squares_over(grads: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """Sum of squares of ``grads`` summed over ``groups``: a float64 tensor ``[1]``, not yet read."""
    total = torch.zeros(1, dtype=torch.float64, device=_home_device(grads, groups))
    for same in _by_device_and_dtype(grads).values():
        total = total + _foreach_sum_of_squares(same).to(total.device)
    return _reduce(total, groups)


def get_grad_norm_fp32(
    grads: Iterable[torch.Tensor],
    groups: Sequence[dist.ProcessGroup],
    expert_grads: Iterable[torch.Tensor] = (),
    expert_groups: Sequence[dist.ProcessGroup] = (),
) -> float:
    """L2 norm of all ``grads`` on all ranks of ``groups`` and ``expert_grads`` on all ranks of
    ``expert_groups`` (each rank passes only what it counts). One host read."""
    dense = _squares_over(list(grads), groups)
    total = dense + _squares_over(list(expert_grads), expert_groups).to(dense.device)
    return float(total.sqrt().item())


def clip_grad_by_total_norm_fp32(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (multi-tensor)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for same in _by_device_and_dtype(grads).values():
            torch._foreach_mul_(same, coeff)


def _zeros_over(grads: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """Exactly-zero elements of ``grads`` summed over ``groups``: a float64 tensor ``[1]``, not yet read."""
    total = torch.zeros(1, dtype=torch.float64, device=_home_device(grads, groups))
    numel = sum(g.numel() for g in grads)
    if grads:
        nonzero = torch.stack([torch.count_nonzero(g).to(total.device) for g in grads]).sum()
        total += numel - nonzero.double()
    return _reduce(total, groups)


def count_zeros_fp32(
    grads: Iterable[torch.Tensor],
    groups: Sequence[dist.ProcessGroup],
    expert_grads: Iterable[torch.Tensor] = (),
    expert_groups: Sequence[dist.ProcessGroup] = (),
) -> int:
    """Number of exactly-zero gradient elements over all ranks of ``groups`` (experts: ``expert_groups``)."""
    dense = _zeros_over(list(grads), groups)
    total = dense + _zeros_over(list(expert_grads), expert_groups).to(dense.device)
    return int(total.item())


def unscale_and_find_nonfinite(
    grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, groups: Sequence[dist.ProcessGroup]
) -> bool:
    """Multiply ``grads`` by ``inv_scale`` in place; whether any rank of ``groups`` holds an inf/NaN.

    Multi-tensor (``torch._amp_foreach_non_finite_check_and_unscale_``, on CPU and CUDA): the
    flag is set on the device from the scaled values, reduced with MAX, and read once.
    """
    found = torch.zeros(1, dtype=torch.float32, device=_home_device(grads, groups))
    for (device, _), same in _by_device_and_dtype(grads).items():
        flag = found if device == found.device else torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(same, flag, inv_scale.to(device))
        if flag is not found:
            found = torch.maximum(found, flag.to(found.device))
    found = _reduce(found, groups, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)


def nonempty(grads: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Drop missing gradients (parameters that took no part in the step)."""
    return [g for g in grads if g is not None]
