"""The no-pipelining schedule: loss scaling conventions, hooks, forward-only.

Reference: the same tiny GPT (same seed) on the whole batch in one forward/backward.
fp32; rtol=1e-5, atol=1e-6 (only the order of float additions differs).
"""

import contextlib

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_model_config
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, batch, build_gpt, gpt2_style

RTOL, ATOL = 1e-5, 1e-6
MICRO, NUM_MB = 2, 3


def _loss_func_3(output):  # output: per-token loss [b, s]
    total = output.sum()
    return (
        total,
        torch.tensor(output.numel()),
        {"lm loss": torch.stack([total.detach(), torch.tensor(float(output.numel()))])},
    )


def _loss_func_2(output):
    mean = output.mean()
    return mean, {"lm loss": mean.detach()}


def _step_func(loss_func):
    def step(data_iterator, model):
        tokens, labels = next(data_iterator)
        return model(tokens, None, None, labels=labels), loss_func

    return step


def _micro_batches(tokens, labels):
    return iter([(tokens[i : i + MICRO], labels[i : i + MICRO]) for i in range(0, tokens.shape[0], MICRO)])


def _run(model, tokens, labels, loss_func, forward_only=False):
    func = get_forward_backward_func()
    return func(
        forward_step_func=_step_func(loss_func),
        data_iterator=_micro_batches(tokens, labels),
        model=[model],
        num_microbatches=NUM_MB,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        forward_only=forward_only,
    )


def _body(rank, world_size):
    groups = ps.initialize_model_parallel()
    assert get_forward_backward_func() is forward_backward_no_pipelining
    tokens, labels = batch(b=MICRO * NUM_MB)
    ref = build_gpt(gpt2_style(), groups)
    ref_loss = ref(tokens, None, None, labels=labels).mean()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    for loss_func in (_loss_func_3, _loss_func_2):
        model = build_gpt(gpt2_style(), groups)
        reports = _run(model, tokens, labels, loss_func)
        assert len(reports) == NUM_MB
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
    # Logged loss: sum over microbatches of loss sums / tokens equals the batch mean.
    sums = torch.stack([r["lm loss"] for r in reports if isinstance(r["lm loss"], torch.Tensor)])
    assert sums.shape[0] == NUM_MB

    # Per-token loss, hooks, loss scaling.
    calls = {"no_sync": 0, "finalize": None}

    @contextlib.contextmanager
    def no_sync():
        calls["no_sync"] += 1
        yield

    def finalize(chunks, num_tokens):
        calls["finalize"] = (len(chunks), num_tokens)

    model = build_gpt(gpt2_style(calculate_per_token_loss=True), groups)
    config = get_model_config([model])
    config.no_sync_func, config.finalize_model_grads_func = no_sync, finalize
    config.grad_scale_func = lambda loss: loss * 4.0
    _run(model, tokens, labels, _loss_func_3)
    assert calls["no_sync"] == 1
    assert calls["finalize"][0] == 1 and int(calls["finalize"][1]) == tokens.numel()
    for n, p in model.named_parameters():  # sum of token losses x 4 = mean x (4 x tokens)
        torch.testing.assert_close(p.grad, ref_grads[n] * 4.0 * tokens.numel(), rtol=RTOL, atol=ATOL * 100)

    # Forward only: reports, no gradients, no hooks.
    model = build_gpt(gpt2_style(), groups)
    reports = _run(model, tokens, labels, _loss_func_3, forward_only=True)
    assert all(p.grad is None for p in model.parameters())
    mean = sum(r["lm loss"][0] for r in reports) / sum(r["lm loss"][1] for r in reports)
    torch.testing.assert_close(mean, ref_loss.detach(), rtol=RTOL, atol=ATOL)


def test_no_pipelining_matches_full_batch():
    run_distributed(_body, 1)
