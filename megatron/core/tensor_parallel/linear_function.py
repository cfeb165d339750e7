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
``main_grad`` (the data-parallel buffer's view), ``dW`` is accumulated straight into ``main_grad``
by the GEMM itself, in ``main_grad``'s precision (fp32 for bf16/fp16 models; ``_wgrad_gemm_accumulate_``)
and ``weight.grad_added_to_main_grad`` is set; the gradient returned to autograd is a dummy
(uninitialised; zeros, a scalar expanded, for a weight marked ``zero_out_wgrad``, whose other users'
gradients are summed with it) so that AccumulateGrad still runs and DDP's hook fires, which then skips adding it.

With a ``quantizer`` (``quantization.recipes.LinearQuantizer``, FP8/FP4 training) the three GEMMs
run on quantized operands (``quantization.fp8_gemm.quantized_matmul``): X and W forward, dY and W for
the input gradient, dY and X for the weight gradient (in the activation dtype instead when the
recipe's ``wgrad`` is off, Megatron's ``--no-fp8-wgrad``). Per-tensor recipes quantize each
operand once (the amax reduced over the quantizer's group, so every TP rank uses one scale) and
save the FP8 input: under sequence parallelism the local ``[s/tp, b, h]`` piece is quantized
and its FP8 bytes are all-gathered, in forward and again in backward. Block recipes under
sequence parallelism do the same where their blocks stay inside a rank's piece (always along
``h``; along the tokens when ``s/tp * b`` is a multiple of the block): the piece is quantized for
forward and for the weight gradient, the forward copy's bytes and scales are gathered in forward
and the weight-gradient copy's in backward, started before the input-gradient GEMM and waited
for after it (``quantization.quantized_gather``), bit for bit what
quantizing the gathered input gives; otherwise the high-precision input is gathered.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.quantization.block_recipes import ROW_BLOCK
from megatron.core.quantization.fp8_gemm import quantized_matmul, transpose
from megatron.core.quantization.fp8_params import fp8_operand, is_fp8_param
from megatron.core.quantization.quantized_gather import all_gather_quantized, pieces_align, start_all_gather_quantized
from megatron.core.quantization.tensor import QuantizedTensor
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.tensor_parallel.tp_overlap import ring_all_gather_linear, ring_linear_reduce_scatter
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
    _wgrad_gemm_accumulate_(main_grad, grad_2d, input_2d)
    return _wgrad_dummy(weight)


def _wgrad_gemm_accumulate_(main_grad: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """``main_grad [o, h] += dY^T X`` as one GEMM accumulating in ``main_grad``'s dtype (fp32 for a
    bf16/fp16 model): no low-precision ``dW`` is rounded and added in a second pass. CUDA with Apex's
    ``fused_weight_gradient_mlp_cuda``: its low-precision-in, fp32-accumulate kernel; elsewhere the
    operands are upcast into an fp32 ``addmm_`` (on the CPU this is also the faster form: 0.36-0.52 s
    against 1.9-2.3 s for the bf16 GEMM and add at GPT-2's fc1 shape, 2 cores)."""
    if grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)
        return
    fused = _apex_wgrad_kernel(main_grad, grad_2d)
    if fused is not None:
        fused(input_2d.contiguous(), grad_2d.contiguous(), main_grad)
        return
    main_grad.addmm_(grad_2d.t().to(main_grad.dtype), input_2d.to(main_grad.dtype))


def _apex_wgrad_kernel(main_grad: torch.Tensor, grad_2d: torch.Tensor):
    """Apex's fp32-accumulating weight-gradient GEMM for CUDA bf16/fp16 into fp32, when importable."""
    if not main_grad.is_cuda or main_grad.dtype != torch.float32:
        return None
    try:
        import fused_weight_gradient_mlp_cuda  # Apex, built with --cuda_ext
    except ImportError:
        return None
    if grad_2d.dtype == torch.bfloat16 or grad_2d.dtype == torch.float16:
        return fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
    return None


def _wgrad_dtype(weight: torch.Tensor, fuse: bool) -> torch.dtype:
    """Where a weight gradient lands: ``main_grad``'s dtype when fused into it, else the weight's."""
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    return weight.dtype if main_grad is None else main_grad.dtype


def _accumulate_weight_grad(grad_weight: torch.Tensor, weight: torch.Tensor, fuse: bool) -> torch.Tensor:
    """Return ``grad_weight`` ``[o, h]``, or with ``fuse`` and a ``main_grad`` add it there (module doc)."""
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is None:
        if is_fp8_param(weight):
            raise ValueError(
                f"FP8 weight {tuple(weight.shape)} (fp8_param_gather): its gradient needs the data-parallel "
                "buffer's main_grad (wrap the model in DistributedDataParallel)"
            )
        return grad_weight.to(weight.dtype)
    main_grad.add_(grad_weight)
    return _wgrad_dummy(weight)


def _wgrad_dummy(weight: torch.Tensor) -> torch.Tensor:
    """What autograd receives for a gradient already added to ``main_grad``."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        # Zeros without a full-size fill: one scalar seen through zero strides. Autograd sums it into the
        # other user's dense gradient (the tied embedding's); alone, AccumulateGrad makes it dense itself.
        return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    return torch.empty_like(weight)


def _gather_quantized(q: QuantizedTensor, group: dist.ProcessGroup) -> Tuple[QuantizedTensor, Handle]:
    """Start all-gathering a per-tensor quantized ``[t/tp, h]`` piece's FP8 bytes to ``[t, h]`` (one scale)."""
    raw, handle = _start_gather_first_dim(q.data.view(torch.uint8), group)  # [t, h] bytes
    data = raw.view(q.data.dtype)
    return QuantizedTensor(data, q.scale_inv, (max(data.size(0), 1), max(data.size(1), 1))), handle


def _total_shape(input_: torch.Tensor, comm: str, group: Optional[dist.ProcessGroup]) -> Tuple[int, ...]:
    """The GEMM input's shape: ``[s, b, h]`` (``input_`` all-gathered along dim 0 under SP)."""
    if comm != COMM_SEQUENCE_PARALLEL:
        return tuple(input_.shape)
    return (input_.size(0) * dist.get_world_size(group),) + tuple(input_.shape[1:])


def _recompute_phase() -> Optional[str]:
    """``"checkpointed"`` in a checkpointed forward (no graph), ``"recompute"`` in its rerun, else None."""
    if not is_checkpointing():
        return None
    return "recompute" if torch.is_grad_enabled() else "checkpointed"


def _block_pieces(quantizer, input_: torch.Tensor, comm: str) -> bool:
    """Whether a block recipe under SP quantizes its local ``[s/tp, b, h]`` piece and gathers the bytes:
    its 1xN blocks along ``h`` are row-local; the weight gradient's along the tokens must be too."""
    if comm != COMM_SEQUENCE_PARALLEL or quantizer.per_tensor:
        return False
    tokens = input_.numel() // max(input_.size(-1), 1)  # s/tp * b
    return pieces_align(tokens, ROW_BLOCK[quantizer.recipe.recipe] if quantizer.recipe.wgrad else None)


def _quantize_input(quantizer, input_, group, comm, phase) -> Tuple[QuantizedTensor, Optional[QuantizedTensor]]:
    """The forward GEMM's X ``[s*b, h]`` and what backward keeps for the weight gradient.

    Per-tensor: the local piece ``[s*b(/tp), h]`` is quantized (amax reduced) and its FP8 bytes
    gathered; the piece is kept. Block recipes: the input is quantized along ``h`` for forward and
    along the tokens (``[h, s*b]``) for the weight gradient, which is kept; under SP, where the
    blocks allow (``_block_pieces``), per local piece, gathering the forward's quantized bytes (the
    kept ``[h, s*b/tp]`` piece is gathered in backward), else after gathering the input. None
    (keep the high-precision input) without ``wgrad``.
    """
    h, wgrad = input_.size(-1), quantizer.recipe.wgrad
    if _block_pieces(quantizer, input_, comm):
        x_piece = input_.reshape(-1, h)  # [s*b/tp, h]
        x_keep = quantizer.quantize("input", x_piece.t().contiguous(), "wgrad") if wgrad else None  # [h, s*b/tp]
        return all_gather_quantized(quantizer.quantize("input", x_piece), group, 0), x_keep  # [s*b, h]
    if quantizer.per_tensor:
        x_piece = quantizer.quantize("input", input_.reshape(-1, h), phase=phase)  # [s*b(/tp), h]
        x_q, handle = _gather_quantized(x_piece, group) if comm == COMM_SEQUENCE_PARALLEL else (x_piece, None)
        _wait(handle)
        return x_q, (x_piece if wgrad else None)
    total, handle = _start_gather_first_dim(input_, group) if comm == COMM_SEQUENCE_PARALLEL else (input_, None)
    _wait(handle)
    x2d = total.reshape(-1, h)  # [s*b, h]
    x_wgrad = quantizer.quantize("input", x2d.t().contiguous(), "wgrad") if wgrad else None  # [h, s*b]
    return quantizer.quantize("input", x2d), x_wgrad


def _quantized_forward(ctx, input_, weight, bias, group, comm, quantizer, phase) -> torch.Tensor:
    """``X W^T + b`` on quantized operands; saves what the quantized backward needs (module doc)."""
    shape = _total_shape(input_, comm, group)
    x_q, x_keep = _quantize_input(quantizer, input_, group, comm, phase)
    # [o, h]; an FP8 weight (fp8_param_gather) is used as stored, never re-quantized; others cached within a step
    w_q = fp8_operand(weight) if is_fp8_param(weight) else quantizer.quantize_weight(weight, "fprop", phase)
    out = quantized_matmul(x_q, w_q, input_.dtype)  # [s*b, o]
    if bias is not None:
        out = out + bias
    ctx.save_for_backward(
        input_ if x_keep is None else None,  # the high-precision [s(/tp), b, h] only when backward needs it
        weight,
        None if x_keep is None else x_keep.data,
        None if x_keep is None else x_keep.scale_inv,
        w_q.data if quantizer.per_tensor else None,
        w_q.scale_inv if quantizer.per_tensor else None,
        None if x_keep is None else x_keep.global_scale_inv,
        None if x_keep is None else x_keep.scale_raw,
    )
    ctx.x_block = None if x_keep is None else x_keep.block
    ctx.x_format, ctx.x_pieces = getattr(x_keep, "element_format", None), _block_pieces(quantizer, input_, comm)
    return out.reshape(shape[:-1] + (weight.size(0),))  # [s, b, o/tp]


def _quantized_wgrad_input(ctx, saved) -> Tuple[object, Handle]:
    """Start getting the weight gradient's X: the kept quantized input (gathered under SP when it is
    the per-tensor piece) or the high-precision input."""
    input_, _, x_data, x_scale_inv = saved[:4]
    if x_data is not None:
        x_q = QuantizedTensor(x_data, x_scale_inv, ctx.x_block, saved[7], saved[6], ctx.x_format)
        if ctx.comm == COMM_SEQUENCE_PARALLEL and ctx.quantizer.per_tensor:
            return _gather_quantized(x_q, ctx.group)  # [s*b, h]
        if ctx.x_pieces:
            return start_all_gather_quantized(x_q, ctx.group, 1)  # [h, s*b] once waited for
        return x_q, None
    if ctx.comm == COMM_SEQUENCE_PARALLEL:
        return _start_gather_first_dim(input_, ctx.group)  # [s, b, h]
    return input_, None


def _quantized_weight_grad(ctx, g2d, g_q, x_total, weight) -> torch.Tensor:
    """``dW = dY^T X`` ``[o, h]``: quantized GEMM, or in high precision without ``wgrad``."""
    quantizer = ctx.quantizer
    if not quantizer.recipe.wgrad:
        x2d = x_total.reshape(-1, x_total.size(-1))  # [s*b, h]
        return _accumulate_weight_grad(g2d.t().matmul(x2d.to(g2d.dtype)), weight, ctx.fuse)
    if quantizer.per_tensor:
        g_t, x_t = transpose(g_q), transpose(x_total)  # [o, s*b], [h, s*b]: exact for one scale
    else:  # x_total: X quantized in forward along the tokens, [h, s*b]
        g_t, x_t = quantizer.quantize("grad_output", g2d.t().contiguous(), "wgrad"), x_total  # [o, s*b]
    grad_weight = quantized_matmul(g_t, x_t, _wgrad_dtype(weight, ctx.fuse))  # [o, h]
    return _accumulate_weight_grad(grad_weight, weight, ctx.fuse)


def _quantized_backward(ctx, grad_output: torch.Tensor):
    """Input and weight gradients on quantized operands, with ``_ParallelLinear``'s overlap."""
    saved = ctx.saved_tensors
    weight, quantizer = saved[1], ctx.quantizer
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    g2d = grad_output.reshape(-1, grad_output.size(-1))  # [s*b, o/tp]
    g_q = quantizer.quantize("grad_output", g2d, "dgrad")  # e5m2 under hybrid
    x_total, gather = _quantized_wgrad_input(ctx, saved) if need_weight else (None, None)
    grad_input, reduction = None, None
    if need_input:
        if quantizer.per_tensor:
            w_t = transpose(QuantizedTensor(saved[4], saved[5], tuple(saved[4].shape)))  # [h, o]
        else:
            w_t = quantizer.quantize_weight(weight, "dgrad")  # [h, o], blocks along o
        grad_input = quantized_matmul(g_q, w_t, grad_output.dtype)  # [s*b, h] partial sum over TP
        grad_input = grad_input.reshape(grad_output.shape[:-1] + (weight.size(1),))  # [s, b, h]
    _wait(gather)
    if need_input:
        grad_input, reduction = _start_grad_input_reduction(grad_input, ctx.comm, ctx.group)
    grad_weight = _quantized_weight_grad(ctx, g2d, g_q, x_total, weight) if need_weight else None
    grad_bias = g2d.sum(dim=0) if (ctx.has_bias and need_bias) else None  # [o/tp], high precision
    _wait(reduction)
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


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
        quantizer=None,
        phase: Optional[str] = None,
        overlap: bool = False,
    ) -> torch.Tensor:
        # An FP8 weight's gradient always goes to main_grad (it has no high-precision .grad).
        ctx.group, ctx.comm, ctx.fuse = group, comm, fuse_wgrad_accumulation or is_fp8_param(weight)
        ctx.has_bias, ctx.quantizer = bias is not None, quantizer
        if quantizer is not None:
            return _quantized_forward(ctx, input_, weight, bias, group, comm, quantizer, phase)
        ctx.save_for_backward(input_, weight)  # [s/tp, b, h] under sequence parallelism
        if comm == COMM_SEQUENCE_PARALLEL and overlap:
            return ring_all_gather_linear(input_, weight, bias, group)  # [s, b, o/tp], chunk GEMMs under the ring
        if comm == COMM_SEQUENCE_PARALLEL:
            total_input, handle = _start_gather_first_dim(input_, group)  # [s, b, h]
            _wait(handle)
        else:
            total_input = input_  # [s, b, h]
        return F.linear(total_input, weight, bias)  # [s, b, o/tp]

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # grad_output: [s, b, o/tp]
        if ctx.quantizer is not None:
            return _quantized_backward(ctx, grad_output)
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
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def parallel_linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    comm: str = COMM_NONE,
    fuse_wgrad_accumulation: bool = False,
    quantizer=None,
    tp_comm_overlap: bool = False,
) -> torch.Tensor:
    """``F.linear(input_, weight, bias)`` with the TP communication ``comm`` (module doc).

    ``comm`` other than ``"none"`` needs ``group``; on a one-rank group pass ``"none"``.
    ``quantizer``: a ``quantization.recipes.LinearQuantizer`` for FP8/FP4 GEMMs, or None.
    ``tp_comm_overlap``: under ``"sequence_parallel"`` the input's all-gather runs as a ring whose
    transfers overlap per-chunk GEMMs (``tp_overlap.ring_all_gather_linear``; quantized GEMMs keep
    their own gather).
    """
    if comm not in _COMM_MODES:
        raise ValueError(f"comm={comm!r}: must be one of {_COMM_MODES}")
    if comm != COMM_NONE and group is None:
        raise ValueError(f"comm={comm!r} needs a process group")
    phase = None if quantizer is None else _recompute_phase()  # read outside the Function (no grad inside)
    return _ParallelLinear.apply(
        input_, weight, bias, group, comm, fuse_wgrad_accumulation, quantizer, phase, tp_comm_overlap
    )


class _LinearReduceScatter(torch.autograd.Function):
    """``tp_overlap.ring_linear_reduce_scatter`` forward; backward: all-gather the output gradient,
    then the input- and weight-gradient GEMMs (what the blocking reduce-scatter's backward feeds)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, fuse: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.fuse = group, fuse or is_fp8_param(weight)
        return ring_linear_reduce_scatter(x, weight, group)  # [s/tp, b, o]

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # [s/tp, b, o]
        x, weight = ctx.saved_tensors
        grad, handle = _start_gather_first_dim(grad_output, ctx.group)  # [s, b, o]
        _wait(handle)
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None  # [s, b, h/tp]
        grad_weight = _weight_grad(grad, x, weight, ctx.fuse) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None, None


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, fuse_wgrad_accumulation: bool = False
) -> torch.Tensor:
    """The row-parallel linear's GEMM and its sequence-parallel reduce-scatter overlapped in a ring:
    ``[s, b, h/tp] -> [s/tp, b, o]`` (``tp_comm_overlap``; the caller adds the bias after it)."""
    return _LinearReduceScatter.apply(x, weight, group, fuse_wgrad_accumulation)


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
