"""Forward-backward schedules over microbatches, with Megatron's keyword interface.

``get_forward_backward_func()`` picks one of:

* ``forward_backward_no_pipelining``: one stage; microbatches run one after another.
* ``forward_backward_pipelining_without_interleaving``: 1F1B (warm-up, steady state, cool-down).
* ``forward_backward_pipelining_with_interleaving``: interleaved 1F1B over virtual chunks.

The pipelined schedules are data first (``schedule_table.schedule_table``: the ordered
(forward|backward, microbatch, chunk) list of each rank) and then run by
``executor.run_schedule``. The per-microbatch pieces shared by all of them live in
``microbatch``; this module holds the three schedules with Megatron-core's keyword-only
signatures (a misspelt keyword is Python's own ``TypeError``) and, with ``schedule_utils``,
the other names Megatron-core users import from here (``forward_step``/``backward_step`` in
Megatron-core's positional form, ``deallocate_output_tensor``, ``custom_backward``,
``get_tensor_shapes`` ...).

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
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import microbatch
from megatron.core.pipeline_parallel.executor import run_schedule
from megatron.core.pipeline_parallel.microbatch import (
    ModelArg,
    ScheduleArgs,
    as_chunk_list,
    as_iterator_list,
    context_parallel_group,
    custom_backward,
    deallocate_output_tensor,
    finalize_grads,
    get_model_config,
)
from megatron.core.pipeline_parallel.schedule_utils import (
    Shape,
    check_first_val_step,
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
    get_pp_rank_microbatches,
    get_schedule_table,
    get_tensor_shapes,
    set_current_microbatch,
)
from megatron.core.quantization.step import quantized_step
from megatron.core.utils import unwrap_model

ProcessGroupCollection = parallel_state.ProcessGroupCollection
DataIterator = Union[Iterator, List[Iterator], None]

# Megatron-core's import path for the schedules and the per-microbatch pieces.
__all__ = [
    "Shape",
    "backward_step",
    "check_first_val_step",
    "clear_embedding_activation_buffer",
    "custom_backward",
    "deallocate_output_tensor",
    "finish_embedding_wgrad_compute",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "forward_step_calc_loss",
    "get_forward_backward_func",
    "get_model_config",
    "get_pp_rank_microbatches",
    "get_schedule_table",
    "get_tensor_shapes",
    "set_current_microbatch",
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
# The three schedules (Megatron-core's keyword-only signatures; see ``ScheduleArgs``).
# ----------------------------------------------------------------------------------
def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: DataIterator,
    model: ModelArg,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Any = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
) -> List[Any]:
    """Forward (and backward) every microbatch in turn on a single pipeline stage.

    ``seq_length``, ``micro_batch_size`` and ``decoder_seq_length`` are unused (nothing is sent).
    Gradients of all but the last microbatch accumulate under ``config.no_sync_func``.

    Returns:
        The reporting dicts of ``loss_func``, one per microbatch.
    """
    call = ScheduleArgs(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        decoder_seq_length, forward_only, collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn,
        p2p_communicator, pg_collection, force_all_reduce,
    )  # fmt: skip
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
            output, tokens = microbatch.run_forward(
                forward_step_func, iterator, chunks[0], num_microbatches, None, store, config,
                collect_non_loss_data=collect_non_loss_data, cp_group=cp_group,
            )  # fmt: skip
        total_tokens = total_tokens + tokens
        if not forward_only:
            microbatch.run_backward(None, output, None, config)

    with quantized_step(chunks):  # FP8: weights quantized once, amax reductions batched
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


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: DataIterator,
    model: ModelArg,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Any = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
) -> List[Any]:
    """1F1B: ``p - rank - 1`` warm-up forwards, then one forward and one backward at a time.

    Returns:
        The reporting dicts of ``loss_func`` (one per microbatch) on the last stage, ``[]`` elsewhere.
    """
    call = ScheduleArgs(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        decoder_seq_length, forward_only, collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn,
        p2p_communicator, pg_collection, force_all_reduce,
    )  # fmt: skip
    if len(as_chunk_list(call.model)) != 1:
        raise ValueError("the 1F1B schedule without interleaving takes one model chunk")
    return run_schedule(call)


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: DataIterator,
    model: ModelArg,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Any = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
) -> List[Any]:
    """Interleaved 1F1B over the model chunks (virtual stages) of each rank; m must be a multiple of p.

    Returns:
        The reporting dicts of ``loss_func`` (one per microbatch) on the last stage, ``[]`` elsewhere.
    """
    call = ScheduleArgs(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        decoder_seq_length, forward_only, collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn,
        p2p_communicator, pg_collection, force_all_reduce,
    )  # fmt: skip
    return run_schedule(call)


# ----------------------------------------------------------------------------------
# One microbatch, in Megatron-core's positional form.
# ----------------------------------------------------------------------------------
def forward_step(
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Optional[torch.Tensor],
    forward_data_store: List[Any],
    config: Any,
    cp_group_size: Optional[int] = None,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: Optional[bool] = None,
    is_first_microbatch: bool = False,
    current_microbatch: Optional[int] = None,
    vp_stage: Optional[int] = None,
    is_last_stage: bool = True,
) -> tuple:
    """Run one microbatch (``microbatch.run_forward``) with Megatron-core's arguments.

    ``is_first_microbatch`` marks a new step as in Megatron (``set_is_first_microbatch``: weights
    cached for FP8 are quantized again); ``vp_stage`` only steers a consistency check upstream: no
    effect. ``current_microbatch`` is recorded on the
    decoder layers (``set_current_microbatch``). A context-parallel size over 1 and
    ``checkpoint_activations_microbatch`` are refused: the schedules pass the CP group itself.

    Returns:
        ``(output_tensor, num_tokens)``: the activation, or on the last stage the loss scaled for backward.
    """
    if cp_group_size not in (None, 1) or checkpoint_activations_microbatch is not None:
        raise NotImplementedError(
            f"forward_step: cp_group_size={cp_group_size}, checkpoint_activations_microbatch="
            f"{checkpoint_activations_microbatch} not supported yet (the schedules pass the CP group)"
        )
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)
    if is_first_microbatch and hasattr(unwrap_model(model), "set_is_first_microbatch"):
        unwrap_model(model).set_is_first_microbatch()
    return microbatch.run_forward(
        forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
        is_last_stage=is_last_stage, collect_non_loss_data=collect_non_loss_data,
    )  # fmt: skip


def forward_step_calc_loss(
    model: torch.nn.Module,
    output_tensor: torch.Tensor,
    loss_func: Callable,
    config: Any,
    vp_stage: Optional[int],
    collect_non_loss_data: bool,
    num_microbatches: int,
    forward_data_store: List[Any],
    cp_group_size: Optional[int] = None,
    is_last_stage: Optional[bool] = None,
) -> tuple:
    """The loss half of ``forward_step`` in Megatron-core's form: ``(loss scaled for backward, num_tokens)``.

    ``is_last_stage`` None means the model's ``post_process`` (True for a model without one);
    ``vp_stage`` is unused; a context-parallel size over 1 is refused as in ``forward_step``.
    """
    if cp_group_size not in (None, 1):
        raise NotImplementedError(f"forward_step_calc_loss: cp_group_size={cp_group_size} not supported yet")
    if is_last_stage is None:
        is_last_stage = bool(getattr(unwrap_model(model), "post_process", True))
    return microbatch.calc_loss(
        model, output_tensor, loss_func, config, num_microbatches, forward_data_store,
        is_last_stage, collect_non_loss_data, None,
    )  # fmt: skip


def backward_step(
    input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, model_type: Any, config: Any
) -> Optional[torch.Tensor]:
    """Back-propagate one microbatch with Megatron-core's arguments; return the input's gradient.

    Tensors may come as one-element lists, as upstream passes them; ``model_type`` only matters to
    encoder-decoder pipelines upstream and is unused. An output deallocated by
    ``deallocate_output_tensor`` goes through ``custom_backward``.
    """
    was_list = isinstance(input_tensor, list)
    tensors = [x[0] if isinstance(x, list) else x for x in (input_tensor, output_tensor, output_tensor_grad)]
    grad = microbatch.run_backward(tensors[0], tensors[1], tensors[2], config)
    return [grad] if was_list else grad


# ----------------------------------------------------------------------------------
# Selection.
# ----------------------------------------------------------------------------------
def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> Callable:
    """The schedule for ``pp_size`` stages and ``vp_size`` virtual chunks per stage.

    Without arguments (a library caller) the sizes come from the groups built by
    ``initialize_model_parallel`` (one stage if none were built); the training loop passes
    the sizes of its own groups. ``vp_size`` 1 runs 1F1B without interleaving (one chunk).
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
