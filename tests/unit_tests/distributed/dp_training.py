"""Shared body: train a tiny GPT under TP x DP and compare with one rank on the global batch."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.model_utils import batch, build_gpt, gather_tp, single_rank_groups, tp_group_of

MICRO_BATCH, NUM_MICRO, ITERS = 2, 2, 5
LR, WD, CLIP = 1e-2, 0.1, 0.5
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (key biases: softmax is
# shift invariant) carries only float noise whose sign the summation order decides, and eps=1e-8 would
# turn that noise into +-lr. eps=1e-3 bounds that gain to lr/eps; the gradients here are 1e-3..1e-1.
EPS = 1e-3


def reference_run(kwargs: Dict, global_batch: int, iters: int = ITERS, optimizer: str = "adam"):
    """One rank, the whole global batch, torch.optim directly: (losses, grad norms, final weights)."""
    model = build_gpt(kwargs, single_rank_groups())
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    opt = (
        torch.optim.AdamW(groups, lr=LR, eps=EPS)
        if optimizer == "adam"
        else torch.optim.SGD(groups, lr=LR, momentum=0.9)
    )
    losses, norms = [], []
    for it in range(iters):
        tokens, labels = batch(seed=it, b=global_batch)
        opt.zero_grad()
        loss = model(tokens, None, None, labels=labels).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel_run(groups, kwargs: Dict, ddp_kwargs: Dict, opt_kwargs: Dict, iters: int = ITERS, per_token: bool = False):
    """TP x DP training with DDP + finalize_model_grads + the Megatron optimizer."""
    model = build_gpt(dict(kwargs, calculate_per_token_loss=per_token), groups)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(**ddp_kwargs), model, pg_collection=groups
    )
    config = OptimizerConfig(lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=CLIP, adam_eps=EPS, **opt_kwargs)
    opt = get_megatron_optimizer(config, [ddp], pg_collection=groups)
    losses, norms = [], []
    for it in range(iters):
        loss, norm = train_step(ddp, opt, groups, it, per_token)
        losses.append(loss)
        norms.append(norm)
    ddp.finish_param_sync()
    weights = {n: gather_tp(p.detach(), p, tp_group_of(p, groups)) for n, p in model.named_parameters()}
    return losses, norms, weights, opt, ddp


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (elementwise relative error is meaningless for Adam near zero grads)."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def train_step(ddp, opt, groups, it: int, per_token: bool = False):
    """One iteration on this DP rank's slice of global batch ``it``: (global mean loss, grad norm)."""
    dp, dp_rank = groups.size_of("dp"), groups.rank_in("dp")
    local = MICRO_BATCH * NUM_MICRO
    tokens, labels = batch(seed=it, b=local * dp)
    tokens, labels = tokens[dp_rank * local : (dp_rank + 1) * local], labels[dp_rank * local : (dp_rank + 1) * local]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    total = torch.zeros(1, dtype=torch.float64)
    num_tokens = torch.zeros(1)
    for m in range(NUM_MICRO):
        rows = slice(m * MICRO_BATCH, (m + 1) * MICRO_BATCH)
        ctx = ddp.no_sync() if m < NUM_MICRO - 1 else contextlib.nullcontext()
        with ctx:
            per_tok = ddp(tokens[rows], None, None, labels=labels[rows])  # [b, s]
            loss = per_tok.sum() if per_token else per_tok.mean() / NUM_MICRO
            opt.scale_loss(loss).backward()
        total += per_tok.detach().sum().double()
        num_tokens += per_tok.numel()
    finalize_model_grads([ddp], num_tokens if per_token else None, groups)
    ok, norm, _ = opt.step()
    assert ok
    dist.all_reduce(total, group=groups.dp)
    return float(total) / (num_tokens.item() * dp), norm


def assert_matches(where: str, got, ref, rtol: float) -> None:
    """Losses and grad norms elementwise within ``rtol``; each weight tensor within ``rtol`` in norm."""
    losses, norms, weights = got[:3]
    ref_losses, ref_norms, ref_weights = ref
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0, msg=lambda m: f"{where} losses: {m}"
    )
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=0, msg=lambda m: f"{where} grad norms: {m}"
    )
    assert set(weights) == set(ref_weights), where
    for name, ref_w in ref_weights.items():
        err = relative_error(weights[name], ref_w)
        assert err <= rtol, f"{where} weight {name}: relative error {err:.3g} > {rtol}"
