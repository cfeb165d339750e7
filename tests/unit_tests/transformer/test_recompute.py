"""Activation recomputation changes memory, not results: with dropout on, full (uniform, block) and
selective recomputation give bit-identical losses and gradients to no recomputation, because the
recompute replays the RNG states (TP=2 with sequence parallelism, so the tracked stream is used)."""

import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style

SETTINGS = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def _run(groups, **recompute):
    style = gpt2_style(hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=True)
    model = build_gpt(style, groups, **recompute)
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)  # same dropout masks for every setting
    tokens, labels = batch()
    loss = model(tokens, None, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    base_loss, base_grads = _run(groups)
    for name, recompute in SETTINGS.items():
        loss, grads = _run(groups, **recompute)
        assert torch.equal(loss, base_loss), name
        for key, grad in grads.items():
            assert torch.equal(grad, base_grads[key]), f"{name}: {key}"


def test_recompute_is_exact_with_dropout():
    run_distributed(_body, 2)
