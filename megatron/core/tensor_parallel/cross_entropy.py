"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

Each rank holds ``logits[..., V/tp]`` for its contiguous vocab slice. The loss
needs three reductions over TP: the max logit (for stability), the target's logit
(owned by one rank) and the softmax denominator. Nothing of size V is gathered.

Label smoothing follows Megatron: the target keeps ``1 - ls`` of the probability
mass and the other ``V - 1`` classes share ``ls`` equally. Written with
``s = ls * V / (V - 1)`` this is
``loss = (1 - s) * (-log p_target) + s * mean_over_V(-log p)``, i.e. torch's
``cross_entropy(label_smoothing=s)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import resolve_tp_group
from megatron.core.tensor_parallel.utils import VocabUtility


def _all_reduce_(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        ctx.input_dtype = logits.dtype
        logits = logits.float()  # [..., V/tp]; fp32 whatever the input dtype
        logits_max = logits.max(dim=-1).values  # [...]
        _all_reduce_(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)  # [..., V/tp], <= 0 everywhere

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        per_partition = logits.size(-1)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world)
        not_mine = (target < first) | (target >= last)  # [...]
        local_target = (target - first).masked_fill(not_mine, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [...]
        predicted = _all_reduce_(predicted.masked_fill(not_mine, 0.0), dist.ReduceOp.SUM, group)

        exp_logits = shifted.exp()  # [..., V/tp]
        sum_exp = _all_reduce_(exp_logits.sum(dim=-1), dist.ReduceOp.SUM, group)  # [...]
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted  # [...], -log p_target

        vocab_size = per_partition * world
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # mean over V of -log p = log_sum_exp - mean(shifted); the sum needs every rank's slice.
            sum_shifted = _all_reduce_(shifted.sum(dim=-1), dist.ReduceOp.SUM, group)
            mean_neg_log_p = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - smoothing) * loss + smoothing * mean_neg_log_p

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [..., V/tp]
        ctx.save_for_backward(softmax, not_mine, local_target)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, not_mine, local_target = ctx.saved_tensors
        # d loss / d logits = p - (1 - s) * onehot(target) - s / V
        grad = softmax.clone()
        if ctx.smoothing > 0:
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        target_weight = (~not_mine).to(grad.dtype) * (1.0 - ctx.smoothing)  # [...]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -target_weight.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0,
                                 tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-token cross entropy of vocab-split logits.

    Args:
        vocab_parallel_logits: ``[s, b, V/tp]`` (or ``[b, s, V/tp]``), this rank's vocab slice.
        target: ``[s, b]`` (matching the logits' leading dims), global token ids.
        label_smoothing: Megatron's ``ls`` (see module doc); must satisfy ``0 <= ls < (V-1)/V``.
        tp_group: group the vocab is split over (None: the default TP group).

    Returns:
        fp32 loss with the logits' leading shape; the logits' gradient has their dtype.
    """
    group = resolve_tp_group(tp_group)
    vocab_size = vocab_parallel_logits.size(-1) * dist.get_world_size(group)
    if not 0.0 <= label_smoothing < (vocab_size - 1) / vocab_size:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, (V-1)/V) for vocab size V={vocab_size}")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match the logits' leading shape "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), group)
