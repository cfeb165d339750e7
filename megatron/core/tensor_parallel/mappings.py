"""Communication between tensor-parallel ranks as autograd functions.

Each public function moves a tensor into or out of a tensor-parallel (TP) region
and has the matching collective in backward: an all-reduce in one direction is
the identity in the other, a split is undone by an all-gather, a reduce-scatter by
an all-gather. "Last dim" functions work on the hidden dimension (tensor
parallelism); "sequence" functions work on dim 0, the sequence dimension of the
``[s, b, h]`` activations (sequence parallelism).

Every function takes the group explicitly. ``group=None`` (Megatron's public signature)
means the TP group built by ``initialize_model_parallel``, looked up through
``parallel_state.get_tensor_model_parallel_group_if_none`` (raises when none was built);
code in ``megatron/core`` always passes its group. With a group of one rank every
function is the identity in forward and backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import divide
from megatron.core.utils import all_gather_into_tensor, reduce_scatter_tensor

ProcessGroup = dist.ProcessGroup


def resolve_tp_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group`` itself, or the default TP group for a library caller that passed none."""
    return parallel_state.get_tensor_model_parallel_group_if_none(group)


# ----------------------------------------------------------------------------------
# Plain collectives (no autograd), each a no-op on a single-rank group.
# ----------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    # Out of place: autograd may hand the same gradient tensor to several branches.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's equal piece of ``x`` along ``dim``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    piece = divide(x.size(dim), world)
    return x.narrow(dim, dist.get_rank(group) * piece, piece).contiguous()


def _gather_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, in group rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's piece of dim 0."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    out = torch.empty((divide(x.size(0), world),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in group rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    stacked = _gather_first_dim(x.unsqueeze(0), group)  # [world, ..., h/tp]
    return torch.cat(stacked.unbind(0), dim=-1)  # [..., h]


def _reduce_scatter_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's piece of the last dim."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    # Move the pieces of the last dim to a new leading dim so the collective is dim 0.
    pieces = torch.stack(x.split(divide(x.size(-1), world), dim=-1), dim=0)  # [world, ..., h/tp]
    return _reduce_scatter_first_dim(pieces, group).squeeze(0)  # [..., h/tp]


# ----------------------------------------------------------------------------------
# Autograd functions.
# ----------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, -1, ctx.group), None


class _ScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_along(grad, 0, ctx.group), None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _AllGatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_last_dim(grad, ctx.group), None


class _ReduceScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


# ----------------------------------------------------------------------------------
# Public API (Megatron names).
# ----------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return _CopyToRegion.apply(input_, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(input_, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the last dim."""
    return _ScatterLastDim.apply(input_, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather the last dim; backward keeps this rank's slice of the gradient."""
    return _GatherLastDim.apply(input_, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """``[s, b, h] -> [s/tp, b, h]`` (this rank's sequence piece); backward all-gathers dim 0."""
    return _ScatterFirstDim.apply(input_, resolve_tp_group(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """``[s/tp, b, h] -> [s, b, h]`` by all-gather along dim 0.

    Args:
        input_: this rank's sequence piece.
        tensor_parallel_output_grad: the consumer of the output is tensor-parallel,
            so each rank's gradient is a partial sum: backward reduce-scatters. When
            False the gradient is already complete on every rank and backward only
            keeps this rank's piece.
        group: TP group (None: the default TP group).
    """
    return _GatherFirstDim.apply(input_, resolve_tp_group(group), bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """``[s, b, h]`` partial sums -> summed ``[s/tp, b, h]``; backward all-gathers dim 0."""
    return _ReduceScatterFirstDim.apply(input_, resolve_tp_group(group))


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather the last dim; backward reduce-scatters the last dim (consumer is TP)."""
    return _AllGatherLastDim.apply(input_, resolve_tp_group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice of the last dim; backward all-gathers it."""
    return _ReduceScatterLastDim.apply(input_, resolve_tp_group(group))
