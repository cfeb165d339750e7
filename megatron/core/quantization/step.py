"""What a training step changes for the quantized linears: weights cached, amax reductions batched.

The schedules run each ``forward_backward`` call inside ``quantized_step(model_chunks)``:

* ``cache_quantized_weights``: every ``LinearQuantizer`` quantizes its weight once for the step
  (``LinearQuantizer.quantize_weight``), as Transformer Engine does with ``is_first_microbatch``;
  the weights cannot change before the optimizer step that follows, and the cache is dropped when
  the step ends, so a forward outside a schedule quantizes afresh.
* ``defer_amax_reduction``: delayed-scaling states record their local amaxes and one
  ``fp8.AmaxReducer`` per amax group reduces them in one all-reduce, when a state is about to
  quantize again (the next microbatch) and when the step ends. Nothing is pending after the
  step, so a checkpoint taken between steps holds every amax.
* ``te_first_microbatch``: Transformer Engine's linears get ``is_first_microbatch=True`` at their
  first forward of the step and False after it (TE casts each weight once and reuses it), None
  outside a step.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Sequence

import torch

from megatron.core.quantization.fp8 import AmaxReducer
from megatron.core.quantization.recipes import LinearQuantizer


def linear_quantizers(model_chunks: Sequence[torch.nn.Module]) -> List[LinearQuantizer]:
    """Every ``LinearQuantizer`` of the chunks, in module order (the same on every rank of a stage)."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, LinearQuantizer)]


@contextlib.contextmanager
def cache_quantized_weights(quantizers: Sequence[LinearQuantizer]) -> Iterator[None]:
    """Each weight quantized once inside the block (module doc)."""
    for q in quantizers:
        q.start_weight_cache()
    try:
        yield
    finally:
        for q in quantizers:
            q.stop_weight_cache()


@contextlib.contextmanager
def defer_amax_reduction(quantizers: Sequence[LinearQuantizer]) -> Iterator[None]:
    """Delayed-scaling amaxes reduced in batches inside the block, the rest flushed at its end.

    On an exception the pending amaxes are dropped (a flush would be a collective that other
    ranks may never join).
    """
    reducers: Dict[int, AmaxReducer] = {}
    states = [(q, s) for q in quantizers if q.recipe.recipe == "delayed" for s in q.delayed.values()]
    for q, state in states:
        state.reducer = reducers.setdefault(id(q.amax_group), AmaxReducer(q.amax_group))
    completed = False
    try:
        yield
        completed = True
    finally:
        if completed:
            for reducer in reducers.values():
                reducer.flush()
        for _, state in states:
            state.reducer, state.pending = None, False


def te_linears(model_chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    """The chunks' Transformer Engine linears (the adapter's classes carry ``te_parallel_mode``)."""
    return [m for chunk in model_chunks for m in chunk.modules() if getattr(m, "te_parallel_mode", None)]


@contextlib.contextmanager
def te_first_microbatch(linears: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Each TE linear's next forward is the step's first (module doc); back to None at the end."""
    for linear in linears:
        linear.is_first_microbatch = True
    try:
        yield
    finally:
        for linear in linears:
            linear.is_first_microbatch = None


@contextlib.contextmanager
def quantized_step(model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """One schedule call: weights cached and amax reductions deferred (module doc)."""
    quantizers = linear_quantizers(model_chunks)
    with (
        cache_quantized_weights(quantizers),
        defer_amax_reduction(quantizers),
        te_first_microbatch(te_linears(model_chunks)),
    ):
        yield
