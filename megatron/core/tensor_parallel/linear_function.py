"""One autograd function for the tensor-parallel linears: ``Y = X W^T + b`` with its TP communication.

Forward (``comm``):

* ``"none"``: ``X`` is used as given (row-parallel linears, expert linears, a one-rank group);
* ``"all_reduce"``: ``X`` is replicated over TP; backward all-reduces the input gradient;
* ``"sequence_parallel"``: ``X`` is this rank's ``[s/tp, b, h]`` piece, all-gathered to
  ``[s, b, h]`` for the GEMM; backward reduce-scatters the input gradient back to ``[s/tp, b, h]``.

Only the input as given is saved for backward: under sequence parallelism that is the local
``[s/tp, b, h]`` piece (not the gathered ``[s, b, h]``), re-gathered in backward for the weight
gradient. Backward overlaps communication with computation:

1. start the re-gather of the input (asynchronous, sequence parallelism only);
2. input-gradient GEMM ``dX = dY W``; wait for the gather;
3. start the input-gradient all-reduce / reduce-scatter (asynchronous);
4. weight-gradient GEMM ``dW = dY^T X`` (and the bias gradient) while it runs; wait.

With ``fuse_wgrad_accumulation`` (``gradient_accumulation_fusion``) and a weight that has
``main_grad`` (the data-parallel buffer's view), ``dW`` is added straight into ``main_grad``
and ``weight.grad_added_to_main_grad`` is set; the gradient returned to autograd is a dummy
(uninitialised; zeros for a weight marked ``zero_out_wgrad``, whose other users' gradients are
summed with it) so that AccumulateGrad still runs and DDP's hook fires, which then skips adding it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import divide
from megatron.core.utils import all_gather_into_tensor, reduce_scatter_tensor

COMM_NONE, COMM_ALL_REDUCE, COMM_SEQUENCE_PARALLEL = "none", "all_reduce", "sequence_parallel"
_COMM_MODES = (COMM_NONE, COMM_ALL_REDUCE, COMM_SEQUENCE_PARALLEL)

Handle = Optional[dist.Work]


def _start_gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> Tuple[torch.Tensor, Handle]:
    """Start the all-gather of ``x`` along dim 0: ``[s/tp, b, h] -> [s, b, h]`` (handle to wait on)."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)


def _start_grad_input_reduction(
    grad_input: torch.Tensor, comm: str, group: dist.ProcessGroup
) -> Tuple[torch.Tensor, Handle]:
    """Start summing the input gradient over TP: all-reduce ``[s, b, h]`` in place, or
    reduce-scatter it to ``[s/tp, b, h]`` under sequence parallelism."""
    if comm == COMM_ALL_REDUCE:
        return grad_input, dist.all_reduce(grad_input, group=group, async_op=True)
    if comm == COMM_SEQUENCE_PARALLEL:
        world = dist.get_world_size(group)
        out = torch.empty(
            (divide(grad_input.size(0), world),) + tuple(grad_input.shape[1:]),
            dtype=grad_input.dtype,
            device=grad_input.device,
        )
        return out, reduce_scatter_tensor(out, grad_input, group=group, async_op=True)
    return grad_input, None


def _wait(handle: Handle) -> None:
    if handle is not None:
        handle.wait()


def _weight_grad(
    grad_output: torch.Tensor, total_input: torch.Tensor, weight: torch.Tensor, fuse: bool
) -> torch.Tensor:
    """``dW = dY^T X`` ``[o, h]``; with ``fuse`` and a ``main_grad`` it is added there instead."""
    grad_2d = grad_output.reshape(-1, grad_output.size(-1))  # [s*b, o]
    input_2d = total_input.reshape(-1, total_input.size(-1))  # [s*b, h]
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is None:
        return grad_2d.t().matmul(input_2d)  # [o, h]
    if main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)  # one GEMM accumulating into the buffer
    else:
        main_grad.add_(grad_2d.t().matmul(input_2d))  # e.g. bf16 GEMM into an fp32 buffer
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


class _ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        comm: str,
        fuse_wgrad_accumulation: bool,
    ) -> torch.Tensor:
        if comm == COMM_SEQUENCE_PARALLEL:
            total_input, handle = _start_gather_first_dim(input_, group)  # [s, b, h]
            _wait(handle)
        else:
            total_input = input_  # [s, b, h]
        ctx.save_for_backward(input_, weight)  # [s/tp, b, h] under sequence parallelism
        ctx.group, ctx.comm, ctx.fuse = group, comm, fuse_wgrad_accumulation
        ctx.has_bias = bias is not None
        return F.linear(total_input, weight, bias)  # [s, b, o/tp]

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # grad_output: [s, b, o/tp]
        input_, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        total_input, gather = input_, None
        if ctx.comm == COMM_SEQUENCE_PARALLEL and need_weight:
            total_input, gather = _start_gather_first_dim(input_, ctx.group)  # [s, b, h], overlaps dX
        grad_input, reduction = None, None
        if need_input:
            grad_input = grad_output.matmul(weight)  # [s, b, h] partial sum over TP
        _wait(gather)
        if need_input:
            grad_input, reduction = _start_grad_input_reduction(grad_input, ctx.comm, ctx.group)
        grad_weight = _weight_grad(grad_output, total_input, weight, ctx.fuse) if need_weight else None
        grad_bias = None
        if ctx.has_bias and need_bias:
            grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0)  # [o/tp]
        _wait(reduction)  # grad_input: [s, b, h], or [s/tp, b, h] under sequence parallelism
        return grad_input, grad_weight, grad_bias, None, None, None


def parallel_linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    comm: str = COMM_NONE,
    fuse_wgrad_accumulation: bool = False,
) -> torch.Tensor:
    """``F.linear(input_, weight, bias)`` with the TP communication ``comm`` (module doc).

    ``comm`` other than ``"none"`` needs ``group``; on a one-rank group pass ``"none"``.
    """
    if comm not in _COMM_MODES:
        raise ValueError(f"comm={comm!r}: must be one of {_COMM_MODES}")
    if comm != COMM_NONE and group is None:
        raise ValueError(f"comm={comm!r} needs a process group")
    return _ParallelLinear.apply(input_, weight, bias, group, comm, fuse_wgrad_accumulation)


def _default_tp_group(tp_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``tp_group``, or the default TP group for a caller of the public function that gave none."""
    return parallel_state.get_tensor_model_parallel_group_if_none(tp_group)


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    async_grad_allreduce: Optional[bool] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Megatron's signature for ``parallel_linear``: the flags choose the communication.

    ``sequence_parallel`` all-gathers the input and reduce-scatters its gradient;
    ``allreduce_dgrad`` (older name ``async_grad_allreduce``) all-reduces the input gradient.
    ``tp_group=None`` means the default TP group. Deferred weight gradients
    (``grad_output_buffer``, ``wgrad_deferral_limit``) are not supported yet.
    """
    if grad_output_buffer is not None or wgrad_deferral_limit:
        raise ValueError("grad_output_buffer / wgrad_deferral_limit (deferred wgrad): not supported yet")
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    comm = COMM_SEQUENCE_PARALLEL if sequence_parallel else COMM_ALL_REDUCE if allreduce_dgrad else COMM_NONE
    group = None
    if comm != COMM_NONE:
        group = _default_tp_group(tp_group)
        comm = comm if dist.get_world_size(group) > 1 else COMM_NONE
    return parallel_linear(input, weight, bias, group, comm, gradient_accumulation_fusion)
