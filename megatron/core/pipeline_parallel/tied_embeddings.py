"""Tied input embedding / output layer when they live on different pipeline stages.

The first stage holds the word embedding, the last stage a copy used as output weight.
``sync_tied_embeddings`` makes the copy equal to the embedding once after the model is
built; ``allreduce_tied_embedding_grads`` sums the two gradients every step (a piece of
``finalize_model_grads``), so both copies take the same optimizer step.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.utils import unwrap_model


def _tied_weight(model_chunks: Iterable[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    """This rank's copy of a tied embedding weight, or None."""
    for chunk in model_chunks:
        inner = unwrap_model(chunk)
        if getattr(inner, "share_embeddings_and_output_weights", False):
            weight = inner.shared_embedding_or_output_weight()
            if weight is not None:
                return weight
    return None


def _embedding_group(groups: ProcessGroupCollection) -> Optional[dist.ProcessGroup]:
    """The embedding group when this rank is in one with another rank, else None."""
    if groups.embd is None or dist.get_rank() not in groups.ranks.get("embd", []):
        return None
    return groups.embd if groups.size_of("embd") > 1 else None


def sync_tied_embeddings(model_chunks: Iterable[torch.nn.Module], pg_collection: ProcessGroupCollection) -> None:
    """Copy the first stage's word embedding into the last stage's output weight.

    Call once after building the model, on every rank (ranks outside the embedding group
    return at once). The last stage zeroes its copy and the group sums, as Megatron does.
    """
    group = _embedding_group(pg_collection)
    chunks = list(model_chunks)
    weight = _tied_weight(chunks)
    if group is None or weight is None:
        return
    with torch.no_grad():
        if getattr(weight, "shared_embedding", False):  # the last stage's copy
            weight.zero_()
        dist.all_reduce(weight.data, group=group)


def allreduce_tied_embedding_grads(
    model_chunks: Iterable[torch.nn.Module], pg_collection: ProcessGroupCollection
) -> None:
    """Sum the gradients of the two tied copies over the embedding group (``main_grad`` if present)."""
    group = _embedding_group(pg_collection)
    weight = _tied_weight(list(model_chunks))
    if group is None or weight is None:
        return
    grad = weight.main_grad if getattr(weight, "main_grad", None) is not None else weight.grad
    if grad is None:
        grad = weight.grad = torch.zeros_like(weight)
    dist.all_reduce(grad, group=group)
