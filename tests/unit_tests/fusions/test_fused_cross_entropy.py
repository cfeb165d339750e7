"""The fused vocab-parallel cross entropy (``--cross-entropy-loss-fusion``) against the unfused reference.

Both at TP=1 and TP=2 in one spawn of two ranks (TP=1: each rank's own one-rank group), fp32 and bf16,
with and without label smoothing, logits around 0 and around 1000 (stability), and a target outside the
vocabulary (-1). Tolerances: the loss (fp32 either way) within rtol 1e-5 / atol 1e-6 (the same math,
summed in another order); fp32 gradients the same; bf16 gradients within one bf16 rounding (rtol 2^-8:
both round an fp32 gradient once, and values a few ulps of fp32 apart can round to neighbours).

Saved bytes: the tensors saved for backward that are not the inputs themselves (the logits and target
exist anyway) are two fp32 numbers per row for the fused form, against a full-size fp32 softmax
(fp32 logits) or five per-row tensors (bf16 logits under TP) for the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.dist_harness import run_distributed

S, B, V = 6, 3, 32
FP32 = dict(rtol=1e-5, atol=1e-6)


def _run(fn, logits, target, ls, group):
    """(loss, the logits' gradient) under a fixed random upstream gradient."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss = fn(leaf, target, label_smoothing=ls, tp_group=group)
    loss.backward(torch.rand(target.shape, generator=torch.Generator().manual_seed(9)))
    return loss.detach(), leaf.grad


def _new_saved_bytes(fn, logits, target, group) -> int:
    """Bytes of the tensors ``fn`` saves for backward, less those sharing storage with its inputs."""
    leaf = logits.detach().clone().requires_grad_(True)
    inputs = {leaf.untyped_storage().data_ptr(), target.untyped_storage().data_ptr()}
    sizes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(leaf, target, tp_group=group)
    return sum(sizes)


def _inputs(rank, tp, dtype, offset):
    gen = torch.Generator().manual_seed(offset + 1)
    full = (torch.randn(S, B, V, generator=gen) * 3 + offset).to(dtype)  # [s, b, V]
    target = torch.randint(0, V, (S, B), generator=gen)
    target[0, 0] = -1  # outside the vocabulary (BERT/T5's unpredicted position)
    piece = V // tp
    return full[..., rank * piece : (rank + 1) * piece].contiguous(), target


def _compare(rank, tp, group):
    for dtype in (torch.float32, torch.bfloat16):
        for ls in (0.0, 0.1):
            for offset in (0, 1000):
                logits, target = _inputs(rank if tp > 1 else 0, tp, dtype, offset)
                label = f"tp={tp} {dtype} ls={ls} offset={offset}"
                loss, grad = _run(fused_vocab_parallel_cross_entropy, logits, target, ls, group)
                ref_loss, ref_grad = _run(vocab_parallel_cross_entropy, logits, target, ls, group)
                assert loss.dtype == torch.float32 and grad.dtype == dtype, label
                torch.testing.assert_close(loss, ref_loss, **FP32, msg=lambda m: f"{label} loss: {m}")
                tol = FP32 if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
                torch.testing.assert_close(grad.float(), ref_grad.float(), **tol, msg=lambda m: f"{label} grad: {m}")


def _saved_bytes(rank, tp, group):
    rows = S * B
    for dtype in (torch.float32, torch.bfloat16):
        logits, target = _inputs(rank if tp > 1 else 0, tp, dtype, 0)
        fused = _new_saved_bytes(fused_vocab_parallel_cross_entropy, logits, target, group)
        reference = _new_saved_bytes(vocab_parallel_cross_entropy, logits, target, group)
        assert fused == rows * 2 * 4, (tp, dtype, fused)  # the global max and log-sum-exp, fp32 per row
        if dtype == torch.float32:  # the reference keeps a new fp32 softmax of the full size
            assert reference >= logits.numel() * 4 > fused, (tp, reference)
        elif tp > 1:  # max, log-sum-exp, the local target and its mask, per row
            assert reference > fused, (tp, dtype, reference)
        # (bf16 at TP=1: the reference recomputes each row's softmax in backward and saves nothing new.)


def _body(rank, world_size):
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    for tp, group in ((1, singles[rank]), (2, dist.group.WORLD)):
        _compare(rank, tp, group)
        _saved_bytes(rank, tp, group)


def test_fused_cross_entropy_matches_the_reference_at_tp1_and_tp2():
    run_distributed(_body, 2)


def _compiled_body(rank, world_size):
    from torch._dynamo.utils import counters

    from megatron.core.fusions import jit

    assert jit.jit_fuser_enabled()
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        logits, target = _inputs(0, 1, dtype, 0)
        ref = _run(vocab_parallel_cross_entropy, logits, target, 0.1, group)
        for _ in range(2):  # the second call compiles nothing
            loss, grad = _run(fused_vocab_parallel_cross_entropy, logits, target, 0.1, group)
        torch.testing.assert_close(loss, ref[0], **FP32)
        tol = FP32 if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(grad.float(), ref[1].float(), **tol)
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])  # 2 regions x 2 dtypes
    assert {name.split("(")[0] for name, _ in jit.compile_log()} == {"row_statistics", "logits_grad"}


@pytest.mark.full  # default-tier sibling: test_fused_cross_entropy_matches_the_reference_at_tp1_and_tp2 (eager)
def test_compiled_fused_cross_entropy_matches_the_reference(monkeypatch):
    """Both regions compiled (fullgraph: a graph break raises, and the region would warn and run eagerly)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    run_distributed(_compiled_body, 1)
