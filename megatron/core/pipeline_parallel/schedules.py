"""Forward-backward schedules over microbatches, with Megatron's keyword interface.

``get_forward_backward_func()`` picks one of:

* ``forward_backward_no_pipelining``: one stage; microbatches run one after another.
* ``forward_backward_pipelining_without_interleaving``: 1F1B (warm-up, steady state, cool-down).
* ``forward_backward_pipelining_with_interleaving``: interleaved 1F1B over virtual chunks.

The pipelined schedules are data first (``schedule_table.schedule_table``: the ordered
(forward|backward, microbatch, chunk) list of each rank) and then run by
``executor.run_schedule``. The per-microbatch pieces shared by all of them live in
``microbatch``: ``forward_step`` (model + loss scaling) and ``backward_step``; they are
re-exported here, where Megatron-core users import them from.

Loss convention (Megatron's): ``forward_step_func(data_iterator, model)`` returns
``(output_tensor, loss_func)``; on the last stage ``loss_func(output_tensor)`` returns
``(loss_sum, num_tokens, reporting_dict)`` or ``(mean_loss, reporting_dict)``. Unless
``config.calculate_per_token_loss``, the loss is divided by ``num_tokens`` and by the
number of microbatches before backward, so gradients are those of the batch mean.

Context parallelism (``config.context_parallel_size`` > 1): each CP rank's ``loss_func`` sees its
own tokens. For a 3-tuple the token count is summed over the CP group before dividing (exact even
when the ranks hold different numbers of counted tokens, where Megatron divides by the local
count), and the loss is multiplied by the CP size because the data-parallel wrapper averages
gradients over ``dp_cp``: the result is the gradient of (sum over CP of token losses) / (CP token
count). A 2-tuple loss must already be the CP-wide mean whose graph holds this rank's share
(e.g. local sum / all-reduced count); it is multiplied by the CP size likewise. With
``calculate_per_token_loss`` nothing is scaled here: ``finalize_model_grads`` divides by the
token count summed over ``dp_cp``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.executor import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.pipeline_parallel.microbatch import (
    ScheduleArgs,
    as_chunk_list,
    as_iterator_list,
    backward_step,
    context_parallel_group,
    finalize_grads,
    forward_step,
    get_model_config,
)

# Megatron-core's import path for the schedules and the per-microbatch pieces.
__all__ = [
    "backward_step",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "get_forward_backward_func",
    "get_model_config",
]


def _no_sync_context(config: Any) -> contextlib.AbstractContextManager:
    """``config.no_sync_func()`` (or every function of a per-chunk list), else a no-op."""
    funcs = config.no_sync_func
    if funcs is None:
        return contextlib.nullcontext()
    if not isinstance(funcs, (list, tuple)):
        return funcs()
    stack = contextlib.ExitStack()
    for func in funcs:
        stack.enter_context(func())
    return stack


# ----------------------------------------------------------------------------------
# No pipelining.
# ----------------------------------------------------------------------------------
def forward_backward_no_pipelining(**kwargs: Any) -> List[Any]:
    """Forward (and backward) every microbatch in turn on a single pipeline stage.

    Takes Megatron's keywords (``ScheduleArgs``). Gradients of all but the last microbatch
    accumulate under ``config.no_sync_func``.

    Returns:
        The reporting dicts of ``loss_func``, one per microbatch.
    """
    call = ScheduleArgs.parse("forward_backward_no_pipelining", kwargs)
    forward_step_func, num_microbatches = call.forward_step_func, call.num_microbatches
    forward_only, collect_non_loss_data = call.forward_only, call.collect_non_loss_data
    chunks = as_chunk_list(call.model)
    if len(chunks) != 1:
        raise ValueError(f"no-pipelining schedule takes one model chunk, got {len(chunks)}")
    iterator = as_iterator_list(call.data_iterator, 1)[0]
    config = get_model_config(chunks)
    store: List[Any] = []
    total_tokens = torch.tensor(0, dtype=torch.int)
    cp_group = context_parallel_group(config, call.groups)

    def one(grad_enabled: bool) -> None:
        nonlocal total_tokens
        with torch.set_grad_enabled(grad_enabled):
            output, tokens = forward_step(
                forward_step_func,
                iterator,
                chunks[0],
                num_microbatches,
                None,
                store,
                config,
                collect_non_loss_data=collect_non_loss_data,
                cp_group=cp_group,
            )
        total_tokens = total_tokens + tokens
        if not forward_only:
            backward_step(None, output, None, config)

    if forward_only:
        for _ in range(num_microbatches):
            one(False)
        return store
    with _no_sync_context(config):
        for _ in range(num_microbatches - 1):
            one(True)
    one(True)
    finalize_grads(config, chunks, total_tokens)
    return store


# ----------------------------------------------------------------------------------
# Selection.
# ----------------------------------------------------------------------------------
def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> Callable:
    """The schedule for ``pp_size`` stages and ``vp_size`` virtual chunks per stage.

    Without arguments (a library caller) the sizes come from the groups built by
    ``initialize_model_parallel`` (one stage if none were built); the training loop passes
    the sizes of its own groups.
    """
    if pp_size is None:
        initialized = parallel_state.model_parallel_is_initialized()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
        if vp_size is None and initialized:
            vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vp_size is not None and vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
