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

from typing import List, Optional

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


def _gather_first_dim_uneven(x: torch.Tensor, group: ProcessGroup, sizes: Optional[List[int]]) -> torch.Tensor:
    """Concatenate along dim 0 pieces of ``sizes[r]`` rows from each rank r (equal pieces when None)."""
    if sizes is None or dist.get_world_size(group) == 1:
        return _gather_first_dim(x, group)
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.size(0)] = x
    stacked = _gather_first_dim(padded, group).view((len(sizes), longest) + tuple(x.shape[1:]))
    return torch.cat([stacked[r, :n] for r, n in enumerate(sizes)], dim=0)


def _reduce_scatter_first_dim_uneven(x: torch.Tensor, group: ProcessGroup, sizes: Optional[List[int]]) -> torch.Tensor:
    """Sum over the ranks and keep this rank's ``sizes[rank]`` rows of dim 0 (equal pieces when None)."""
    if sizes is None or dist.get_world_size(group) == 1:
        return _reduce_scatter_first_dim(x, group)
    rank = dist.get_rank(group)
    return _all_reduce(x, group).narrow(0, sum(sizes[:rank]), sizes[rank]).contiguous()


def _all_to_all(
    x: torch.Tensor, group: ProcessGroup, output_sizes: Optional[List[int]], input_sizes: Optional[List[int]]
) -> torch.Tensor:
    """Send rows of dim 0 to each rank (``input_sizes[r]`` rows to rank r; equal pieces when None)."""
    if dist.get_world_size(group) == 1:
        return x
    rows = sum(output_sizes) if output_sizes is not None else x.size(0)
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_sizes, input_sizes, group=group)
    return out


# ----------------------------------------------------------------------------------
# Autograd functions (Megatron's names; the group is always given).
# ----------------------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        return _all_reduce(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """This rank's slice of the last dim forward; all-gather of the last dim backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along(input_, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather of the last dim forward; this rank's slice backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """This rank's piece of dim 0 forward; all-gather of dim 0 backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along(input_, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather of dim 0 forward; reduce-scatter (or split, see the wrapper) backward."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True, output_split_sizes=None, use_global_buffer=False):
        ctx.group, ctx.reduce_grad, ctx.sizes = group, tensor_parallel_output_grad, output_split_sizes
        return _gather_first_dim_uneven(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_first_dim_uneven(grad, ctx.group, ctx.sizes), None, None, None, None
        if ctx.sizes is not None:
            raise AssertionError("output_split_sizes needs tensor_parallel_output_grad=True")
        return _split_along(grad, 0, ctx.group), None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter of dim 0 forward; all-gather of dim 0 backward."""

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes=None, use_global_buffer=False):
        ctx.group, ctx.sizes = group, input_split_sizes
        return _reduce_scatter_first_dim_uneven(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim_uneven(grad, ctx.group, ctx.sizes), None, None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather of the last dim forward; reduce-scatter of the last dim backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_last_dim(grad, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter of the last dim forward; all-gather of the last dim backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """All-to-all of dim 0 forward; the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.sizes = group, (output_split_sizes, input_split_sizes)
        return _all_to_all(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes
        return None, _all_to_all(grad, ctx.group, input_sizes, output_sizes), None, None


# ----------------------------------------------------------------------------------
# Public API (Megatron names and signatures).
# ----------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return _CopyToModelParallelRegion.apply(input_, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the last dim."""
    return _ScatterToModelParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather the last dim; backward keeps this rank's slice of the gradient."""
    return _GatherFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """``[s, b, h] -> [s/tp, b, h]`` (this rank's sequence piece); backward all-gathers dim 0."""
    return _ScatterToSequenceParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: Optional[ProcessGroup] = None,
    output_split_sizes: Optional[List[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """``[s/tp, b, h] -> [s, b, h]`` by all-gather along dim 0.

    Args:
        input_: this rank's sequence piece.
        tensor_parallel_output_grad: the consumer of the output is tensor-parallel,
            so each rank's gradient is a partial sum: backward reduce-scatters. When
            False the gradient is already complete on every rank and backward only
            keeps this rank's piece.
        group: TP group (None: the default TP group).
        output_split_sizes: rows contributed by each rank when they differ.
        use_global_buffer: Megatron's reuse of one CUDA buffer; memory only, no effect here.
    """
    return _GatherFromSequenceParallelRegion.apply(
        input_, resolve_tp_group(group), bool(tensor_parallel_output_grad), output_split_sizes, use_global_buffer
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    input_split_sizes: Optional[List[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """``[s, b, h]`` partial sums -> summed ``[s/tp, b, h]`` (``input_split_sizes[rank]`` rows when given)."""
    return _ReduceScatterToSequenceParallelRegion.apply(
        input_, resolve_tp_group(group), input_split_sizes, use_global_buffer
    )


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather the last dim; backward reduce-scatters the last dim (consumer is TP)."""
    return _AllGatherFromTensorParallelRegion.apply(input_, resolve_tp_group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice of the last dim; backward all-gathers it."""
    return _ReduceScatterToTensorParallelRegion.apply(input_, resolve_tp_group(group))


def all_to_all(
    group: ProcessGroup,
    input_: torch.Tensor,
    output_split_sizes_: Optional[List[int]] = None,
    input_split_sizes: Optional[List[int]] = None,
) -> torch.Tensor:
    """All-to-all of dim 0 over ``group`` (required), differentiable."""
    if group is None:
        raise AssertionError("all_to_all needs a group")
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """``[tokens/tp, h] -> [tokens, h/tp]``: from sequence-split to hidden-split."""
    group = resolve_tp_group(group)
    world = dist.get_world_size(group)
    x = input_.reshape(-1, input_.shape[-1])  # [t/tp, h]
    pieces = torch.cat(torch.split(x, divide(x.shape[-1], world), dim=1), dim=0)  # [tp * t/tp, h/tp]
    return all_to_all(group, pieces)


def all_to_all_hp2sp(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """``[tokens, h/tp] -> [tokens/tp, h]``: from hidden-split to sequence-split."""
    group = resolve_tp_group(group)
    world = dist.get_world_size(group)
    x = all_to_all(group, input_.reshape(-1, input_.shape[-1]))  # [t, h/tp], row block r from rank r
    return torch.cat(torch.split(x, divide(x.shape[0], world), dim=0), dim=-1)  # [t/tp, h]
