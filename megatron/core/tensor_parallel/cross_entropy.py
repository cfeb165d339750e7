"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

Each rank holds ``logits[..., V/tp]`` for its contiguous vocab slice. The loss
needs three reductions over TP: the max logit (for stability), the target's logit
(owned by one rank) and the softmax denominator. Nothing of size V is gathered.

Label smoothing follows Megatron: the target keeps ``1 - ls`` of the probability
mass and the other ``V - 1`` classes share ``ls`` equally. Written with
``s = ls * V / (V - 1)`` this is
``loss = (1 - s) * (-log p_target) + s * mean_over_V(-log p)``, i.e. torch's
``cross_entropy(label_smoothing=s)``.

All statistics are fp32. fp32 logits take one pass over the whole tensor and keep
the softmax for the backward. bf16/fp16 logits are never upcast as a whole (a
``[tokens, V]`` fp32 copy is 4x the memory traffic of the matmul that made them):
they are upcast a block of rows at a time, small enough to stay in cache, and the
backward recomputes the softmax from the saved low-precision logits and the fp32
log-sum-exp, rounding the fp32 gradient once to the logits' dtype. On one TP rank nothing is
reduced across ranks, so each block takes torch's fused fp32 log-softmax (forward) and softmax
(backward) instead of separate max-shift, exp and sum passes; fp32 logits likewise take one
fused log-softmax over the whole tensor, turned into the gradient in place.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import resolve_tp_group
from megatron.core.tensor_parallel.utils import VocabUtility

# fp32 working set of one block of rows of low-precision logits: a few MB stays in
# the L2/L3 caches, where the upcast, exp and sum run several times faster than on
# a tensor streamed from memory (measured on the 2-core CI machine, V = 50304).
_BLOCK_BYTES = 8 * 2**20
# On a GPU each block costs a handful of kernel launches and caches do not matter: blocks of up
# to 1 GiB of fp32 (one block for a usual microbatch, e.g. 8192 rows of V/tp = 32k) only bound
# the transient fp32 copy.
_CUDA_BLOCK_BYTES = 2**30


def _all_reduce_(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _local_targets(
    target: torch.Tensor, per_partition: int, group: dist.ProcessGroup
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``not_mine``: target outside this rank's vocab slice, ``local_target``: index into it, 0 if not mine)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world)
    not_mine = (target < first) | (target >= last)
    return not_mine, (target - first).masked_fill(not_mine, 0)


def _target_logit(shifted_target: torch.Tensor, not_mine: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The (max-shifted) target logit, summed over TP: only the owning rank contributes."""
    return _all_reduce_(shifted_target.masked_fill(not_mine, 0.0), dist.ReduceOp.SUM, group)


def _smoothing(label_smoothing: float, vocab_size: int) -> float:
    return label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0


def _loss(
    log_sum_exp: torch.Tensor,
    predicted: torch.Tensor,
    smoothing: float,
    vocab_size: int,
    sum_shifted: Optional[torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``(1 - s) * (-log p_target) + s * mean_over_V(-log p)`` from fp32 row statistics."""
    loss = log_sum_exp - predicted  # [...], -log p_target
    if smoothing > 0:
        # mean over V of -log p = log_sum_exp - mean(shifted); the sum needs every rank's slice.
        sum_shifted = _all_reduce_(sum_shifted, dist.ReduceOp.SUM, group)
        mean_neg_log_p = log_sum_exp - sum_shifted / vocab_size
        loss = (1.0 - smoothing) * loss + smoothing * mean_neg_log_p
    return loss


def _softmax_to_grad_(
    softmax: torch.Tensor,
    not_mine: torch.Tensor,
    local_target: torch.Tensor,
    smoothing: float,
    vocab_size: int,
    grad_loss: torch.Tensor,
) -> torch.Tensor:
    """In place: ``d loss / d logits = (p - (1 - s) * onehot(target) - s / V) * grad_loss``."""
    if smoothing > 0:
        softmax.sub_(smoothing / vocab_size)
    target_weight = (~not_mine).to(softmax.dtype) * (1.0 - smoothing)  # [...]
    softmax.scatter_add_(-1, local_target.unsqueeze(-1), -target_weight.unsqueeze(-1))
    return softmax.mul_(grad_loss.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """fp32 (or fp64, computed in fp32) logits: one pass over the whole tensor; the softmax is kept."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        ctx.input_dtype = logits.dtype
        logits = logits.float()  # [..., V/tp]
        logits_max = logits.amax(dim=-1)  # [...]
        _all_reduce_(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)  # [..., V/tp], <= 0 everywhere

        per_partition = logits.size(-1)
        not_mine, local_target = _local_targets(target, per_partition, group)
        predicted = _target_logit(shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), not_mine, group)

        vocab_size = per_partition * dist.get_world_size(group)
        smoothing = _smoothing(label_smoothing, vocab_size)
        sum_shifted = shifted.sum(dim=-1) if smoothing > 0 else None
        exp_logits = shifted.exp_()  # [..., V/tp], in place: no second [tokens, V] tensor
        sum_exp = _all_reduce_(exp_logits.sum(dim=-1), dist.ReduceOp.SUM, group)  # [...]
        loss = _loss(sum_exp.log(), predicted, smoothing, vocab_size, sum_shifted, group)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [..., V/tp]
        ctx.save_for_backward(softmax, not_mine, local_target)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place (no [tokens, V] copy); a second backward
        # through this graph (retain_graph) raises on the saved tensor's version instead of reusing it.
        softmax, not_mine, local_target = ctx.saved_tensors
        grad = _softmax_to_grad_(softmax, not_mine, local_target, ctx.smoothing, ctx.vocab_size, grad_loss)
        return grad.to(ctx.input_dtype), None, None, None


def rows_per_block(num_rows: int, vocab: int, device: torch.device) -> int:
    """Rows of fp32 logits of width ``vocab`` processed at once: ``_BLOCK_BYTES`` of them on a
    CPU (cache sized), ``_CUDA_BLOCK_BYTES`` on a GPU (few kernels); at least 1, at most ``num_rows``."""
    budget = _CUDA_BLOCK_BYTES if torch.device(device).type == "cuda" else _BLOCK_BYTES
    return max(1, min(num_rows, budget // (4 * vocab)))


def _row_blocks(rows: int, cols: int, device: torch.device) -> Iterator[slice]:
    """Slices of ``rows_per_block`` rows of width ``cols``."""
    step = rows_per_block(rows, cols, device)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """bf16/fp16 logits: fp32 statistics block by block; the backward recomputes the softmax.

    Saves the low-precision logits (alive anyway) and per-row fp32 max and log-sum-exp
    instead of an fp32 softmax of the whole vocab.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        per_partition = logits.size(-1)
        flat = logits.reshape(-1, per_partition)  # [n, V/tp]
        logits_max = flat.amax(dim=-1).float()  # [n]; exact: the max of bf16 values is one of them
        _all_reduce_(logits_max, dist.ReduceOp.MAX, group)

        not_mine, local_target = _local_targets(target.reshape(-1), per_partition, group)
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
        predicted = _target_logit(target_logit - logits_max, not_mine, group)

        vocab_size = per_partition * dist.get_world_size(group)
        smoothing = _smoothing(label_smoothing, vocab_size)
        sum_exp = torch.empty_like(logits_max)
        sum_shifted = torch.empty_like(logits_max) if smoothing > 0 else None
        for rows in _row_blocks(*flat.shape, flat.device):
            shifted = flat[rows].float().sub_(logits_max[rows].unsqueeze(-1))  # [block, V/tp] fp32
            if sum_shifted is not None:
                sum_shifted[rows] = shifted.sum(dim=-1)
            sum_exp[rows] = shifted.exp_().sum(dim=-1)
        log_sum_exp = _all_reduce_(sum_exp, dist.ReduceOp.SUM, group).log()
        loss = _loss(log_sum_exp, predicted, smoothing, vocab_size, sum_shifted, group)

        ctx.save_for_backward(logits, not_mine, local_target, logits_max, log_sum_exp)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, not_mine, local_target, logits_max, log_sum_exp = ctx.saved_tensors
        flat = logits.reshape(-1, logits.size(-1))
        grad_loss = grad_loss.reshape(-1).float()
        grad = torch.empty_like(flat)
        for rows in _row_blocks(*flat.shape, flat.device):
            # p = exp(l - max - lse): subtract the two fp32 terms one at a time (max may be large).
            softmax = flat[rows].float().sub_(logits_max[rows].unsqueeze(-1))
            softmax.sub_(log_sum_exp[rows].unsqueeze(-1)).exp_()
            grad[rows] = _softmax_to_grad_(
                softmax, not_mine[rows], local_target[rows], ctx.smoothing, ctx.vocab_size, grad_loss[rows]
            )  # one rounding to bf16/fp16
        return grad.view_as(logits), None, None, None


def _outside(target: torch.Tensor, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``outside``: target not in ``[0, V)``, e.g. BERT/T5's -1 for unpredicted positions; the target with those
    set to 0). As on several TP ranks, such a row's loss is ``logsumexp - max`` and its target gets no gradient."""
    outside = (target < 0) | (target >= vocab_size)
    return outside, target.masked_fill(outside, 0)


def _smoothed_nll(log_p: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """``(1 - s) * (-log p_target) + s * mean_over_V(-log p)`` from full-vocab fp32 ``log_p`` ``[..., V]``."""
    outside, local = _outside(target, log_p.size(-1))
    nll = -log_p.gather(-1, local.unsqueeze(-1)).squeeze(-1)  # [...]
    # The multi-rank value, where the "target logit" is the max (shifted logit 0); no host sync to skip it.
    nll = torch.where(outside, -log_p.amax(dim=-1), nll)
    if smoothing > 0:
        nll = (1.0 - smoothing) * nll - smoothing * log_p.mean(dim=-1)
    return nll


class _SingleRankCrossEntropy(torch.autograd.Function):
    """fp32 (or fp64, computed in fp32) logits over the whole vocabulary (one TP rank).

    One fused log-softmax makes the only ``[tokens, V]`` tensor; the backward turns it into the
    softmax and then the gradient in place (a second backward through the graph raises).
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        ctx.input_dtype = logits.dtype
        log_p = torch.log_softmax(logits.float(), dim=-1)  # [..., V]
        ctx.smoothing = _smoothing(label_smoothing, logits.size(-1))
        ctx.save_for_backward(log_p, target)
        return _smoothed_nll(log_p, target, ctx.smoothing)

    @staticmethod
    def backward(ctx, grad_loss):
        log_p, target = ctx.saved_tensors
        outside, local = _outside(target, log_p.size(-1))
        grad = _softmax_to_grad_(log_p.exp_(), outside, local, ctx.smoothing, log_p.size(-1), grad_loss)
        return grad.to(ctx.input_dtype), None, None, None


class _SingleRankBlockwiseCrossEntropy(torch.autograd.Function):
    """bf16/fp16 logits over the whole vocabulary (one TP rank): torch's fused row kernels per block.

    With no statistic to reduce across ranks, a block's fp32 log-softmax (forward) and softmax
    (backward) are one fused pass each, instead of the separate max-shift, exp and sum passes
    ``_BlockwiseCrossEntropy`` needs for its cross-rank reductions. Saves only the logits.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        vocab_size = logits.size(-1)
        flat, flat_target = logits.reshape(-1, vocab_size), target.reshape(-1)  # [n, V], [n]
        smoothing = _smoothing(label_smoothing, vocab_size)
        loss = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)  # [n]
        for rows in _row_blocks(*flat.shape, flat.device):
            log_p = torch.log_softmax(flat[rows], dim=-1, dtype=torch.float32)  # [block, V] fp32
            loss[rows] = _smoothed_nll(log_p, flat_target[rows], smoothing)
        ctx.save_for_backward(logits, flat_target)
        ctx.smoothing = smoothing
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, flat_target = ctx.saved_tensors
        flat = logits.reshape(-1, logits.size(-1))  # [n, V]
        grad_loss = grad_loss.reshape(-1).float()
        grad = torch.empty_like(flat)
        for rows in _row_blocks(*flat.shape, flat.device):
            softmax = torch.softmax(flat[rows], dim=-1, dtype=torch.float32)  # [block, V] fp32
            outside, local = _outside(flat_target[rows], flat.size(-1))
            grad[rows] = _softmax_to_grad_(
                softmax, outside, local, ctx.smoothing, flat.size(-1), grad_loss[rows]
            )  # one rounding to bf16/fp16
        return grad.view_as(logits), None, None, None


def check_cross_entropy_inputs(
    logits: torch.Tensor, target: torch.Tensor, label_smoothing: float, group: dist.ProcessGroup
) -> None:
    """Raise ValueError unless ``0 <= label_smoothing < (V-1)/V`` and ``target`` has the logits' leading shape."""
    vocab_size = logits.size(-1) * dist.get_world_size(group)
    if not 0.0 <= label_smoothing < (vocab_size - 1) / vocab_size:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, (V-1)/V) for vocab size V={vocab_size}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match the logits' leading shape {tuple(logits.shape[:-1])}"
        )


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocab-split logits, with fp32 statistics whatever their dtype.

    Args:
        vocab_parallel_logits: ``[s, b, V/tp]`` (or ``[b, s, V/tp]``), this rank's vocab slice.
        target: ``[s, b]`` (matching the logits' leading dims), global token ids.
        label_smoothing: Megatron's ``ls`` (see module doc); must satisfy ``0 <= ls < (V-1)/V``.
        tp_group: group the vocab is split over (None: the default TP group).

    Returns:
        fp32 loss with the logits' leading shape; the logits' gradient has their dtype
        (computed in fp32, rounded once).
    """
    group = resolve_tp_group(tp_group)
    check_cross_entropy_inputs(vocab_parallel_logits, target, label_smoothing, group)
    low_precision = vocab_parallel_logits.dtype in (torch.bfloat16, torch.float16)
    if dist.get_world_size(group) == 1:
        function = _SingleRankBlockwiseCrossEntropy if low_precision else _SingleRankCrossEntropy
    else:
        function = _BlockwiseCrossEntropy if low_precision else _VocabParallelCrossEntropy
    return function.apply(vocab_parallel_logits, target, float(label_smoothing), group)
