"""The per-microbatch primitives that every schedule runs: one forward, one backward, and their helpers.

``run_forward`` runs the model on one microbatch and, on the last stage, scales its loss (see the
loss convention in ``schedules``); ``run_backward`` back-propagates it; ``deallocate_output`` frees a
sent activation. ``schedules`` (no pipelining, the schedule selection) and ``executor`` (the
pipelined tables) both build on this module, and neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import AuxLossTracker, aux_loss_tracker_of
from megatron.core.utils import comm_device, unwrap_model

ModelArg = Union[torch.nn.Module, Sequence[torch.nn.Module]]


# ----------------------------------------------------------------------------------
# Small helpers.
# ----------------------------------------------------------------------------------
def as_chunk_list(model: ModelArg) -> List[torch.nn.Module]:
    """``model`` as a list of chunks (one chunk without virtual pipelining)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def get_model_config(model: ModelArg) -> Any:
    """The config of the (first) model chunk, inside its data-parallel wrapper."""
    return unwrap_model(as_chunk_list(model)[0]).config


def as_iterator_list(data_iterator: Any, num_chunks: int) -> List[Optional[Iterator]]:
    """One data iterator per model chunk: a list as given (its length checked), else the one repeated."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {num_chunks} model chunks")
        return list(data_iterator)
    return [data_iterator] * num_chunks


def context_parallel_group(
    config: Any, pg_collection: parallel_state.ProcessGroupCollection
) -> Optional[torch.distributed.ProcessGroup]:
    """``pg_collection.cp`` when ``config.context_parallel_size`` > 1, else None."""
    if getattr(config, "context_parallel_size", 1) == 1:
        return None
    return pg_collection.cp


def _refuse(keywords: List[str]) -> None:
    if keywords:
        raise NotImplementedError(
            f"forward-backward schedule: {', '.join(keywords)} not supported yet "
            "(the executor builds its own communicator from pg_collection.pp)"
        )


@dataclass
class ScheduleArgs:
    """The keywords of Megatron-core's forward-backward functions (all three take the same set).

    The schedules in ``schedules`` spell these keywords out in their signatures (so a typo is
    Python's own ``TypeError``) and hand them here, where the shared checks run.

    ``first_val_step`` only selects fp8 weight caching in Megatron, which this code base does
    not have: accepted, no effect. ``pg_collection`` None means the groups of
    ``initialize_model_parallel`` (a library caller; the training loop passes its own).
    ``adjust_tensor_shapes_fn``, ``p2p_communicator``, ``force_all_reduce`` and, with more than one
    pipeline stage, a ``decoder_seq_length`` other than ``seq_length`` (encoder-decoder pipelines) are
    refused with ``NotImplementedError``; without pipelining no activation is sent, so the decoder
    length (T5) changes nothing here.
    """

    forward_step_func: Callable
    data_iterator: Any
    model: ModelArg
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    decoder_seq_length: Optional[int] = None
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: Optional[bool] = None
    adjust_tensor_shapes_fn: Optional[Callable] = None
    p2p_communicator: Any = None
    pg_collection: Optional[parallel_state.ProcessGroupCollection] = None
    force_all_reduce: Optional[bool] = False

    def __post_init__(self) -> None:
        refused = [
            name for name in ("adjust_tensor_shapes_fn", "p2p_communicator", "force_all_reduce") if getattr(self, name)
        ]
        _refuse(refused)
        if self.pg_collection is None:
            self.pg_collection = parallel_state.ProcessGroupCollection.use_mpu_process_groups()
        if self.pg_collection.size_of("pp") > 1 and self.decoder_seq_length not in (None, self.seq_length):
            _refuse([f"decoder_seq_length={self.decoder_seq_length} != seq_length={self.seq_length}"])

    @property
    def groups(self) -> parallel_state.ProcessGroupCollection:
        """The resolved process groups (never None after construction)."""
        assert self.pg_collection is not None
        return self.pg_collection


def finalize_grads(config: Any, model_chunks: List[torch.nn.Module], total_num_tokens: torch.Tensor) -> None:
    """Call ``config.finalize_model_grads_func`` (DP / tied-embedding reductions) if set."""
    if config.finalize_model_grads_func is None:
        return
    per_token = getattr(config, "calculate_per_token_loss", False)
    config.finalize_model_grads_func(model_chunks, total_num_tokens if per_token else None)


# ----------------------------------------------------------------------------------
# One microbatch forward / backward.
# ----------------------------------------------------------------------------------
def _cp_token_count(num_tokens: torch.Tensor, cp_group: Optional[torch.distributed.ProcessGroup]) -> torch.Tensor:
    """``num_tokens`` summed over the context-parallel group (unchanged without one)."""
    if cp_group is None or torch.distributed.get_world_size(cp_group) == 1:
        return num_tokens
    total = num_tokens.clone().to(device=comm_device(cp_group))
    torch.distributed.all_reduce(total, group=cp_group)
    return total.to(num_tokens.device)


def _scaled_loss(
    outputs: tuple, num_microbatches: int, per_token: bool, cp_group: Optional[torch.distributed.ProcessGroup] = None
) -> Tuple[torch.Tensor, torch.Tensor, Any]:
    """(loss to back-propagate, num_tokens, reporting) from a ``loss_func`` result.

    A 3-tuple carries a loss summed over ``num_tokens`` tokens; a 2-tuple an averaged loss.
    ``num_tokens`` is returned as this rank's count (``finalize_model_grads`` sums it over ``dp_cp``).
    """
    cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
    if len(outputs) == 3:
        loss, num_tokens, reporting = outputs
        num_tokens = torch.as_tensor(num_tokens).detach()
        if not per_token:
            loss = loss / _cp_token_count(num_tokens, cp_group) * cp_size / num_microbatches
        return loss, num_tokens, reporting
    if len(outputs) == 2:
        if per_token:
            raise ValueError(
                "calculate_per_token_loss=True needs loss_func to return "
                "(loss_sum, num_tokens, reporting_dict), got a 2-tuple"
            )
        loss, reporting = outputs
        return loss * cp_size / num_microbatches, torch.tensor(0, dtype=torch.int), reporting
    raise ValueError(f"loss_func must return 2 or 3 values, got {len(outputs)}")


def parameter_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s (first) parameter lives; the CPU for a model without parameters."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def set_aux_loss_scale(
    config: Any, num_microbatches: int, tracker: AuxLossTracker, device: Optional[torch.device] = None
) -> None:
    """Scale the MoE aux losses' gradients like the main loss: fp16 loss scale, 1/microbatches (not per token).

    The scale is set on ``tracker``, the aux-loss state the model's routers are bound to.

    The scale is made on ``device`` (the model's), where the fp16 loss scale and the aux losses
    live: no host-device copy per microbatch or per layer.
    """
    scale = torch.ones(1, device=device)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale / num_microbatches
    tracker.set_loss_scale(scale)


def run_forward(
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Optional[torch.Tensor],
    forward_data_store: List[Any],
    config: Any,
    is_last_stage: bool = True,
    collect_non_loss_data: bool = False,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run one microbatch through ``model``; on the last stage apply the loss function. (Megatron-core's
    positional ``forward_step`` in ``schedules.py`` wraps this; the schedules call it directly.)

    ``cp_group``: the context-parallel group when CP > 1 (see the module docstring), else None.

    Returns:
        ``(output, num_tokens)``: the activation to send on (non-last stages) or the loss
        scaled for backward (last stage); ``num_tokens`` is 0 off the last stage.
    """
    unwrap_model(model).set_input_tensor([input_tensor])
    if getattr(config, "num_moe_experts", None) or getattr(config, "mtp_num_layers", None):
        set_aux_loss_scale(config, num_microbatches, aux_loss_tracker_of(model), parameter_device(model))
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    return calc_loss(
        model, output_tensor, loss_func, config, num_microbatches, forward_data_store,
        is_last_stage, collect_non_loss_data, cp_group,
    )  # fmt: skip


def calc_loss(
    model: torch.nn.Module,
    output_tensor: torch.Tensor,
    loss_func: Callable,
    config: Any,
    num_microbatches: int,
    forward_data_store: List[Any],
    is_last_stage: bool,
    collect_non_loss_data: bool,
    cp_group: Optional[torch.distributed.ProcessGroup],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss scaled for backward, num_tokens)`` on the last stage, ``(output_tensor, 0)`` elsewhere.

    On the last stage the reporting dict of ``loss_func`` (or, with ``collect_non_loss_data``, its
    ``non_loss_data=True`` result) is appended to ``forward_data_store``.
    """
    # On the parameters' device: finalize_model_grads broadcasts it over PP without a host copy.
    zero = torch.zeros((), dtype=torch.int, device=parameter_device(model))
    if not is_last_stage:
        return output_tensor, zero
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, zero
    per_token = getattr(config, "calculate_per_token_loss", False)
    loss, num_tokens, reporting = _scaled_loss(loss_func(output_tensor), num_microbatches, per_token, cp_group)
    forward_data_store.append(reporting)
    return loss, num_tokens


def run_backward(
    input_tensor: Optional[torch.Tensor],
    output_tensor: torch.Tensor,
    output_tensor_grad: Optional[torch.Tensor],
    config: Any,
) -> Optional[torch.Tensor]:
    """Back-propagate one microbatch; return the gradient of its input activation.

    On the last stage ``output_tensor`` is the loss (scaled by ``config.grad_scale_func``
    for fp16 loss scaling) and ``output_tensor_grad`` is None.
    """
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if output_tensor_grad is not None and output_tensor.shape != output_tensor_grad.shape:
        # The output's storage was released after it was sent (deallocate_output_tensor).
        custom_backward(output_tensor, output_tensor_grad)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False) -> None:
    """Swap the data of a stage output already sent on for a 1-element tensor (Megatron-core's name).

    Backward needs only the output's autograd node (the next stage returns its gradient), so the
    ``[s, b, h]`` storage can go; ``custom_backward`` starts backward from that node. Nothing happens
    for ``None`` or unless ``deallocate_pipeline_outputs``. (If an autograd node saved the output
    itself, that node keeps the old storage alive: still correct, nothing saved.)

    Raises:
        AssertionError: ``out`` is not a tensor, or is a view (freeing it would free nothing).
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    assert isinstance(out, torch.Tensor), f"expected a Tensor, got {type(out).__name__}"
    assert out._base is None, "a view shares its base's storage: deallocating it frees nothing"
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Back-propagate ``grad_output`` through ``output``'s graph, even when its data was deallocated.

    ``torch.autograd.backward`` compares the shapes of the tensor and its gradient; starting from
    the output's gradient edge (``torch.autograd.graph.get_gradient_edge``), whose node knows the
    real shape, avoids that check, so the 1-element placeholder of ``deallocate_output_tensor``
    works. ``grad_output`` None means a one-element output (a loss): its gradient is 1. Gradients
    accumulate into ``.grad`` like a normal backward; the graph is freed.
    """
    if grad_output is None:
        if output.numel() != 1:
            raise ValueError(f"an implicit gradient needs a one-element output, got shape {tuple(output.shape)}")
        torch.autograd.backward(output)
        return
    edge = torch.autograd.graph.get_gradient_edge(output)
    torch.autograd.backward(edge, grad_tensors=grad_output)


def deallocate_output(output_tensor: torch.Tensor) -> bool:
    """``deallocate_output_tensor`` for the executor: skips what cannot be freed, says whether it freed.

    A view or a tensor without a graph node keeps its data.
    """
    if output_tensor._base is not None or output_tensor.grad_fn is None or output_tensor.numel() <= 1:
        return False
    deallocate_output_tensor(output_tensor, deallocate_pipeline_outputs=True)
    return True
