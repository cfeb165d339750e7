"""Embedding weights with a copy on another pipeline stage: a tied input embedding / output layer,
and the embedding of the last stage under multi-token prediction.

The first stage holds the word (and position) embedding, the last stage a copy used as output
weight or to embed the shifted tokens of multi-token prediction. ``sync_tied_embeddings`` makes the
copies equal to the first stage's once after the model is built; ``allreduce_tied_embedding_grads``
sums each weight's two gradients every step over the embedding group (a piece of
``finalize_model_grads``), so both copies take the same optimizer step.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.utils import unwrap_model


def cross_stage_embedding_weights(model_chunks: Iterable[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """This rank's weights with a copy on another pipeline stage (``LanguageModule.cross_stage_embedding_weights``
    of its chunks), in one order on every rank of the embedding group."""
    weights: List[torch.nn.Parameter] = []
    for chunk in model_chunks:
        getter = getattr(unwrap_model(chunk), "cross_stage_embedding_weights", None)
        weights += getter() if getter is not None else []
    return weights


def _embedding_group(groups: ProcessGroupCollection) -> Optional[dist.ProcessGroup]:
    """The embedding group when this rank is in one with another rank, else None."""
    if groups.embd is None or dist.get_rank() not in groups.ranks.get("embd", []):
        return None
    return groups.embd if groups.size_of("embd") > 1 else None


def sync_tied_embeddings(model_chunks: Iterable[torch.nn.Module], pg_collection: ProcessGroupCollection) -> None:
    """Copy the first stage's embedding weights into the last stage's copies (output weight, MTP embedding).

    Call once after building the model, on every rank (ranks outside the embedding group
    return at once). The last stage zeroes its copy and the group sums, as Megatron does.
    """
    group = _embedding_group(pg_collection)
    if group is None:
        return
    with torch.no_grad():
        for weight in cross_stage_embedding_weights(model_chunks):
            if getattr(weight, "shared_embedding", False):  # the last stage's copy
                weight.zero_()
            dist.all_reduce(weight.data, group=group)


def allreduce_tied_embedding_grads(
    model_chunks: Iterable[torch.nn.Module], pg_collection: ProcessGroupCollection
) -> None:
    """Sum the gradients of each weight and its copy over the embedding group (``main_grad`` if present)."""
    group = _embedding_group(pg_collection)
    if group is None:
        return
    for weight in cross_stage_embedding_weights(model_chunks):
        grad = weight.main_grad if getattr(weight, "main_grad", None) is not None else weight.grad
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        dist.all_reduce(grad, group=group)
