"""Fused vocab-parallel cross entropy (``--cross-entropy-loss-fusion``): one region each way over the logits.

The reference (``tensor_parallel/cross_entropy.py``) makes separate passes over this rank's
``[s, b, V/tp]`` logits (max, shift, exp, sum, divide; in blocks of rows for bf16/fp16) and, for fp32
logits, keeps a new fp32 softmax of the full size for backward. Here:

* forward: one compiled region reads the logits once and returns per-row fp32 statistics: the local
  max ``m``, ``sum exp(l - m)``, ``sum (l - m)`` (label smoothing) and the target's logit. Under TP
  the same three all-reduces as the reference follow on ``[rows]`` tensors: the max ``M``, the target
  logit (minus ``M``, from the owning rank), and the sum of exponentials rescaled to the global max,
  ``sum exp(l - m) * exp(m - M)`` (the online-softmax identity);
* saved for backward: the logits themselves (in their dtype, no copy), the target, and two fp32
  numbers per row (``M`` and ``log sum exp(l - M)``);
* backward: one compiled elementwise region,
  ``dl = (exp(l - M - lse) - s/V - (1 - s) * onehot(target)) * dloss``, rounded once to the logits' dtype.

The loss is the reference's (``_loss``: Megatron's label smoothing). Under ``--disable-jit-fuser`` (or
on fake tensors) the regions run op by op: the same numbers and saved tensors, not the single pass.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.fusions.jit import jit_fuser
from megatron.core.tensor_parallel.cross_entropy import (
    _all_reduce_,
    _local_targets,
    _loss,
    _smoothing,
    _target_logit,
    check_cross_entropy_inputs,
)
from megatron.core.tensor_parallel.mappings import resolve_tp_group


@jit_fuser
def row_statistics(
    flat: torch.Tensor, local_target: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flat`` ``[n, V/tp]``, ``local_target`` ``[n]`` -> fp32 ``[n]`` each: (local max ``m``,
    ``sum exp(l - m)``, ``sum (l - m)``, the logit at ``local_target``)."""
    x = flat.float()  # [n, V/tp]
    row_max = x.amax(dim=-1)  # [n]
    shifted = x - row_max.unsqueeze(-1)  # [n, V/tp]
    target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [n]
    return row_max, shifted.exp().sum(dim=-1), shifted.sum(dim=-1), target_logit


@jit_fuser
def logits_grad(
    flat: torch.Tensor,
    local_target: torch.Tensor,
    target_weight: torch.Tensor,
    row_max: torch.Tensor,
    log_sum_exp: torch.Tensor,
    grad_loss: torch.Tensor,
    uniform: float,
) -> torch.Tensor:
    """``(softmax - uniform - target_weight * onehot(local_target)) * grad_loss`` ``[n, V/tp]`` in
    ``flat``'s dtype; ``row_max``, ``log_sum_exp``, ``target_weight``, ``grad_loss`` are fp32 ``[n]``."""
    shifted = flat.float() - row_max.unsqueeze(-1)  # [n, V/tp]; the max may be large: subtract it first
    softmax = torch.exp(shifted - log_sum_exp.unsqueeze(-1))
    columns = torch.arange(flat.size(-1), device=flat.device)  # [V/tp]
    onehot = (columns == local_target.unsqueeze(-1)).to(softmax.dtype)  # [n, V/tp]
    grad = softmax - uniform - onehot * target_weight.unsqueeze(-1)
    return (grad * grad_loss.unsqueeze(-1)).to(flat.dtype)


def _global_statistics(
    stats: Tuple[torch.Tensor, ...], not_mine: torch.Tensor, per_partition: int, group: dist.ProcessGroup
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's row statistics -> (``M``, the target logit minus ``M``, ``log sum exp(l - M)``, this rank's
    ``sum (l - M)``), all ``[n]`` fp32, with the reference's all-reduces: max, target logit, sum of exps."""
    row_max, sum_exp, sum_shifted, target_logit = stats
    global_max = _all_reduce_(row_max.clone(), dist.ReduceOp.MAX, group)
    predicted = _target_logit(target_logit - global_max, not_mine, group)
    rescale = row_max - global_max  # [n], <= 0
    sum_exp = _all_reduce_(sum_exp * rescale.exp(), dist.ReduceOp.SUM, group)
    return global_max, predicted, sum_exp.log(), sum_shifted + per_partition * rescale


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The fused cross entropy (module doc); the arguments are ``vocab_parallel_cross_entropy``'s."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        per_partition = logits.size(-1)
        flat = logits.reshape(-1, per_partition)  # [n, V/tp]
        not_mine, local_target = _local_targets(target.reshape(-1), per_partition, group)
        stats = row_statistics(flat, local_target)
        global_max, predicted, log_sum_exp, sum_shifted = _global_statistics(stats, not_mine, per_partition, group)
        vocab_size = per_partition * dist.get_world_size(group)
        smoothing = _smoothing(label_smoothing, vocab_size)
        loss = _loss(log_sum_exp, predicted, smoothing, vocab_size, sum_shifted if smoothing > 0 else None, group)
        ctx.save_for_backward(logits, target, global_max, log_sum_exp)
        ctx.smoothing, ctx.vocab_size, ctx.group = smoothing, vocab_size, group
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, global_max, log_sum_exp = ctx.saved_tensors
        per_partition = logits.size(-1)
        not_mine, local_target = _local_targets(target.reshape(-1), per_partition, ctx.group)
        target_weight = (~not_mine).float() * (1.0 - ctx.smoothing)  # [n]
        grad = logits_grad(
            logits.reshape(-1, per_partition),
            local_target,
            target_weight,
            global_max,
            log_sum_exp,
            grad_loss.reshape(-1).float().contiguous(),
            ctx.smoothing / ctx.vocab_size,
        )  # [n, V/tp]
        return grad.view_as(logits), None, None, None


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy`` (same arguments, same fp32 loss ``[s, b]``, gradient in the logits'
    dtype) as one fused region each way (module doc)."""
    group = resolve_tp_group(tp_group)
    check_cross_entropy_inputs(vocab_parallel_logits, target, label_smoothing, group)
    return FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), group)
