"""Gradient reductions a step needs beyond data parallelism."""

from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    # The data-parallel wrapper accumulates into ``main_grad``; plain modules use ``grad``.
    return getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad


def allreduce_sequence_parallel_grads(model_chunks: Iterable[torch.nn.Module], tp_group: dist.ProcessGroup) -> None:
    """Sum over TP the grads of replicated weights that saw only this rank's sequence shard.

    With sequence parallelism, norm weights (and row-parallel biases, learned position
    embeddings) are replicated on every TP rank but each rank back-propagates through a
    different slice of the sequence, so each holds a partial gradient. One coalesced
    all-reduce makes them whole.
    """
    if dist.get_world_size(tp_group) == 1:
        return
    grads: List[torch.Tensor] = [
        _grad_of(p) for chunk in model_chunks for p in chunk.parameters()
        if p.requires_grad and getattr(p, "sequence_parallel", False) and _grad_of(p) is not None
    ]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
