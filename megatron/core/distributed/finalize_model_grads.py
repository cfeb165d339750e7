"""Gradient reductions at the end of a step: data parallel, sequence parallel, tied embeddings, tokens.

``finalize_model_grads(model, num_tokens=None, pg_collection=None)`` is what the pipeline
schedule calls (as ``config.finalize_model_grads_func``) after the last backward:

1. each DDP-wrapped chunk finishes its data-parallel reduction;
2. sequence-parallel replicated weights (norms, row-parallel biases) are summed over TP;
3. with pipeline parallelism and tied embeddings, the word-embedding grad of the first stage
   and the output-layer grad of the last stage are summed over the embedding group (and, with
   multi-token prediction, those of the last stage's embedding copy);
4. with ``num_tokens`` (``calculate_per_token_loss``) the token count is taken from the last
   pipeline stage, summed over DP, and every gradient is divided by it;
5. MoE routers end their step: with expert bias, their token counts are summed over data x
   context parallel (one all-reduce for all routers of the stage) and each bias is updated
   from the sum, so every replica keeps the same bias; ``global_aux_loss`` counts restart.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads
from megatron.core.utils import comm_device, unwrap_model


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    # The data-parallel wrapper accumulates into ``main_grad``; plain modules use ``grad``; FSDP2's
    # gradients are DTensors whose local shard is what this rank sums (every TP rank holds the same rows).
    grad = getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad
    return grad._local_tensor if isinstance(grad, DTensor) else grad


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
        _grad_of(p)
        for chunk in model_chunks
        for p in chunk.parameters()
        if p.requires_grad and getattr(p, "sequence_parallel", False) and _grad_of(p) is not None
    ]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def allreduce_embedding_grads(model_chunks: Sequence[torch.nn.Module], groups: ProcessGroupCollection) -> None:
    """Sum the grads of the embedding weights that the first and last pipeline stage both hold (a tied
    output layer, multi-token prediction's embedding) over the embedding group."""
    allreduce_tied_embedding_grads(model_chunks, groups)


def _reduce_num_tokens(num_tokens: torch.Tensor, groups: ProcessGroupCollection) -> torch.Tensor:
    """The global token count: broadcast from the last pipeline stage, summed over DP.

    The schedules keep the count on the parameters' device (the GPU for NCCL), so the moves below
    are no-ops there; a CPU count (gloo, or a caller's) goes to each group's communication device.
    """
    num_tokens = num_tokens.detach().clone().to(torch.float64)
    if groups.size_of("pp") > 1:
        num_tokens = num_tokens.to(comm_device(groups.pp))
        dist.broadcast(num_tokens, src=groups.ranks["pp"][-1], group=groups.pp)
    if groups.size_of("dp_cp") > 1:
        num_tokens = num_tokens.to(comm_device(groups.dp_cp))
        dist.all_reduce(num_tokens, group=groups.dp_cp)
    return num_tokens


def _routers(model_chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    """The MoE routers of ``model_chunks`` (modules with ``reset_global_aux_loss_tracker``), in module order."""
    return [m for chunk in model_chunks for m in chunk.modules() if hasattr(m, "reset_global_aux_loss_tracker")]


def finish_router_step(model_chunks: Sequence[torch.nn.Module], groups: ProcessGroupCollection) -> None:
    """Update every router's expert bias from the step's token counts summed over TP x DP x CP (each rank
    counts the tokens it routed: under SP its sequence shard, as Megatron); reset
    the ``global_aux_loss`` counts. Every rank of a stage holds the same routers in the same order."""
    routers = _routers(model_chunks)
    for router in routers:
        router.reset_global_aux_loss_tracker()
    biased = [r for r in routers if getattr(r, "expert_bias", None) is not None]
    if not biased:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in biased])  # [routers, E]
    if groups.size_of("tp_dp_cp") > 1:
        counts = counts.to(comm_device(groups.tp_dp_cp))
        dist.all_reduce(counts, group=groups.tp_dp_cp)
    for router, total in zip(biased, counts):
        router.update_expert_bias(total)


def _model_groups(model_chunks: Sequence[torch.nn.Module]) -> ProcessGroupCollection:
    """The process groups the (first) model chunk was built with, else those of ``initialize_model_parallel``."""
    groups = getattr(unwrap_model(model_chunks[0]), "pg_collection", None) if model_chunks else None
    return groups if groups is not None else ProcessGroupCollection.use_mpu_process_groups()


def finalize_model_grads(
    model: Sequence[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
) -> None:
    """All reductions a step needs after backward (see the module docstring), Megatron-core's signature.

    ``model`` is the list of model chunks. The training loop binds its groups
    (``functools.partial(finalize_model_grads, pg_collection=groups)``) to make
    ``config.finalize_model_grads_func``. None (Megatron-core's ``finalize_model_grads([model])``)
    means the groups the model was built with (``pg_collection`` of the unwrapped first chunk),
    else those of ``initialize_model_parallel``. ``force_all_reduce`` is handed to each chunk's
    ``finish_grad_sync``.

    Raises:
        ValueError: a chunk is not DDP-wrapped while data parallelism is > 1.
    """
    model_chunks = model
    groups = pg_collection if pg_collection is not None else _model_groups(model_chunks)
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
        elif groups.size_of("dp_cp") > 1:
            raise ValueError(
                "finalize_model_grads: data-parallel size "
                f"{groups.size_of('dp_cp')} needs DistributedDataParallel-wrapped model chunks"
            )
    allreduce_sequence_parallel_grads(model_chunks, groups.tp)
    allreduce_embedding_grads(model_chunks, groups)
    if num_tokens is not None:
        # A device tensor: no host read of the count (the division is the same float64 one).
        scale = _reduce_num_tokens(num_tokens, groups).reshape(()).clamp_min(1.0).reciprocal()
        for chunk in model_chunks:
            if hasattr(chunk, "scale_gradients"):
                chunk.scale_gradients(scale)
            else:
                for param in chunk.parameters():
                    if _grad_of(param) is not None:
                        _grad_of(param).mul_(scale)
    finish_router_step(model_chunks, groups)
