"""FP8 across the microbatches of a step: weights quantized once, delayed-scaling amaxes reduced in one
all-reduce per flush (``megatron.core.quantization.step``, entered by the schedules).

One rank, an FP8 GPT (4 linears per layer, 2 layers), 4 microbatches through
``forward_backward_no_pipelining``:
* tensorwise: each weight is quantized once per step (8 weight quantizations, counted at
  ``LinearQuantizer.quantize``), where the per-microbatch path (the cache switched off) quantizes
  32; gradients of this step and of the next, after an in-place (``.data``) weight update, are
  bitwise equal to that path; the same for blockwise, mxfp8 and nvfp4 (W and W^T: 16 vs 64);
* inside a step the cache follows the parameter's ``_version``, ``set_is_first_microbatch`` and
  Megatron-core's ``forward_step(is_first_microbatch=True)``;
* delayed scaling records each weight's amax once per step (TE's rule) and each input's once per
  microbatch; under full recompute through the schedule the results equal the plain run bitwise
  and no checkpointed scale is left queued.

Four ranks, TP=2 x DP=2, delayed scaling, DDP + SGD, three steps of 3 microbatches: deferred
reductions give bitwise the losses, weights and scaling state of one reduction per quantization
(the deferral switched off), with 3 amax all-reduces per step instead of 8 x (2 x 3 + 1); a
checkpoint after step 2 resumes to a bitwise-equal step 3. A state dict with an amax still pending is refused.

Four ranks, PP=2 with 2 virtual chunks x DP=2 (the interleaved executor, microbatches of both chunks
in flight): deferred equals per-operand bitwise (parameters, gradients, scaling state), each weight's
amax is recorded once, and the amax all-reduces number at most one per forward op instead of 72.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch
import torch.distributed as dist

import megatron.core.quantization.fp8 as fp8
import megatron.core.quantization.recipes as recipes
import megatron.core.quantization.step as qstep
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import model_sharded_state_dict
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, batch, build_gpt, llama_style, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import build_chunks, make_finalize, run_pipeline

MICRO = 2


def _fp8(recipe, **kw):
    return llama_style(bf16=True, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=8, **kw)


def _loss(output):  # [b, s] per-token loss
    return output.sum(), torch.tensor(output.numel()), {}


def _schedule(model, seeds, groups):
    """One ``forward_backward_no_pipelining`` call, microbatch ``i`` from ``batch(seeds[i])`` (this DP rank's rows)."""
    dp_rank, dp = groups.rank_in("dp"), groups.size_of("dp")
    data = []
    for seed in seeds:
        tokens, labels = batch(seed, b=MICRO * dp)
        rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
        data.append((tokens[rows], labels[rows]))
    it = iter(data)

    def step(data_iterator, m):
        tokens, labels = next(data_iterator)
        return m(tokens, None, None, labels=labels), _loss

    forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=it, model=[model], num_microbatches=len(seeds),
        seq_length=SEQ, micro_batch_size=MICRO, pg_collection=groups,
    )  # fmt: skip


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _nothing(quantizers):
    yield


@contextlib.contextmanager
def _count_weight_quantizations(model, counts):
    """Log each ``LinearQuantizer.quantize`` call (True for a weight operand)."""
    real = recipes.LinearQuantizer.quantize

    def counting(self, role, x, gemm="fprop", phase=None):
        counts.append(role == "weight")
        return real(self, role, x, gemm, phase)

    with _patched(recipes.LinearQuantizer, "quantize", counting):
        yield


class _CountingDist:
    """``torch.distributed`` as the FP8 module sees it, logging the amax all-reduces' sizes."""

    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls.append(tensor.numel())
        return dist.all_reduce(tensor, *args, **kwargs)


def _count_amax_all_reduces(calls):
    return _patched(fp8, "dist", _CountingDist(calls))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _cached_step_and_update(model, groups, cached):
    """Two schedule steps with an in-place ``.data`` update (as the optimizer writes) in between."""
    counts, out = [], []
    ctx = contextlib.nullcontext() if cached else _patched(qstep, "cache_quantized_weights", _nothing)
    with ctx, _count_weight_quantizations(model, counts):
        for seeds in ((0, 1, 2, 3), (4, 5, 6, 7)):
            model.zero_grad(set_to_none=True)
            _schedule(model, seeds, groups)
            out.append((sum(counts), _grads(model)))
            counts.clear()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad.data, alpha=-1e-1)
    return out


BLOCK = {
    "blockwise": dict(fp8="e4m3", fp8_recipe="blockwise"),
    "mxfp8": dict(fp8="hybrid", fp8_recipe="mxfp8"),
    "nvfp4": dict(fp4="e2m1", fp4_recipe="nvfp4"),
}


def _tensorwise_cache_body(rank, world_size):
    groups = single_rank_groups()
    # Per-tensor: W for forward only (dgrad transposes it); block recipes: W and W^T (dgrad).
    for kw, per_step in [(_fp8("tensorwise"), 8)] + [(llama_style(bf16=True, **b), 16) for b in BLOCK.values()]:
        cached = _cached_step_and_update(build_gpt(kw, groups), groups, True)
        plain = _cached_step_and_update(build_gpt(kw, groups), groups, False)
        counts = ([c for c, _ in cached], [c for c, _ in plain])
        assert counts == ([per_step] * 2, [4 * per_step] * 2), (kw.get("fp8_recipe", "nvfp4"), counts)
        assert all(_equal(g, g_ref) for (_, g), (_, g_ref) in zip(cached, plain)), kw
    # Inside a step: an in-place change (new _version) and Megatron's new-step mark re-quantize.
    model = build_gpt(_fp8("tensorwise"), groups)
    quantizer = model.decoder.layers[0].mlp.linear_fc1.quantizer
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    counts = []
    with _count_weight_quantizations(model, counts):
        with qstep.cache_quantized_weights(qstep.linear_quantizers([model])):
            first = quantizer.quantize_weight(weight)
            assert quantizer.quantize_weight(weight) is first and sum(counts) == 1
            with torch.no_grad():
                weight.mul_(2.0)
            assert quantizer.quantize_weight(weight) is not first and sum(counts) == 2
            model.set_is_first_microbatch()
            quantizer.quantize_weight(weight)
            assert sum(counts) == 3
            # Megatron-core's forward_step(is_first_microbatch=True) marks the new step the same way.
            step = lambda it, m: (m(*next(it), None, labels=labels), _loss)  # noqa: E731
            tokens, labels = batch(0)
            for is_first in (False, True):
                schedules.forward_step(step, iter([(tokens, None)]), model, 1, None, [], model.config,
                                       is_first_microbatch=is_first)  # fmt: skip
            assert sum(counts) == 3 + 7 + 8, counts  # the 7 others (fc1 cached), then all 8 again
        quantizer.quantize_weight(weight)  # the step is over: no cache
        quantizer.quantize_weight(weight)
    assert sum(counts) == 3 + 7 + 8 + 2
    return True


def test_weights_quantized_once_per_step_bitwise_equal_to_per_microbatch():
    assert all(run_distributed(_tensorwise_cache_body, 1))


def _history_entries(model, role):
    return {n: int((b != 0).sum()) for n, b in model.named_buffers() if n.endswith(f"delayed.{role}.amax_history")}


def _delayed_recompute_body(rank, world_size):
    groups = single_rank_groups()
    plain = build_gpt(_fp8("delayed"), groups)
    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recomputed = build_gpt(_fp8("delayed", **kw), groups)
    for model in (plain, recomputed):
        _schedule(model, (0, 1, 2, 3), groups)
    weights, inputs = _history_entries(plain, "weight"), _history_entries(plain, "input")
    assert len(weights) == 8 and set(weights.values()) == {1}, weights  # once per step
    assert set(inputs.values()) == {4}, inputs  # once per microbatch
    assert _equal(_grads(plain), _grads(recomputed))
    state = {n: b for n, b in plain.named_buffers() if ".quantizer." in n}
    assert _equal(state, {n: b for n, b in recomputed.named_buffers() if ".quantizer." in n})
    # Inside a step (amaxes pending) a state dict is refused rather than missing them.
    quantizers = qstep.linear_quantizers([plain])
    with qstep.defer_amax_reduction(quantizers):
        quantizers[0].quantize("input", torch.ones(4, 32))
        try:
            plain.state_dict()
            raise AssertionError("a state dict with a pending amax was taken")
        except RuntimeError as e:
            assert "pending" in str(e), e
    assert not any(s.pending for q in quantizers for s in q.delayed.values())
    queued = [len(m._checkpointed_scales) for m in recomputed.modules() if hasattr(m, "_checkpointed_scales")]
    return len(queued) == 24 and not any(queued)


def test_delayed_weight_amax_once_per_step_and_full_recompute():
    assert all(run_distributed(_delayed_recompute_body, 1))


# ----------------------------------------------------------------------------------
# TP=2 x DP=2: deferred amax reductions equal per-operand ones bitwise; checkpoint resume.
# ----------------------------------------------------------------------------------
STEPS, NUM_MB = 3, 3


def _trainer(groups, seed=1234, load_from=None):
    model = build_gpt(_fp8("delayed"), groups, seed=seed)
    if load_from is not None:
        dist_checkpointing.load(model_sharded_state_dict([model], pg_collection=groups), load_from)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=groups)
    ddp.config.finalize_model_grads_func = lambda chunks, tokens: finalize_model_grads(chunks, tokens, groups)
    ddp.config.no_sync_func = ddp.no_sync
    opt_config = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=1e-1, weight_decay=0.0, clip_grad=0.0)
    return model, ddp, get_megatron_optimizer(opt_config, [ddp], pg_collection=groups)


def _train_step(groups, trainer, it, amax_reductions):
    model, ddp, opt = trainer
    ddp.zero_grad_buffer()
    opt.zero_grad()
    calls = []
    seeds = [it * NUM_MB + m for m in range(NUM_MB)]
    with _count_amax_all_reduces(calls):
        _schedule(ddp, seeds, groups)
    assert opt.step()[0]
    amax_reductions.append(len(calls))


def _snapshot(model):
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def _run(groups, steps, trainer=None):
    trainer = trainer or _trainer(groups)
    reductions = []
    for it in steps:
        _train_step(groups, trainer, it, reductions)
    return trainer, reductions


def _deferred_body(rank, world_size, directory):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert groups.size_of("dp") == 2
    deferred, counts = _run(groups, range(STEPS))
    with _patched(qstep, "defer_amax_reduction", _nothing):
        per_operand, counts_ref = _run(groups, range(STEPS))
    assert counts == [NUM_MB] * STEPS, counts  # one flush per microbatch (the last at the step's end)
    assert counts_ref == [8 * (2 * NUM_MB + 1)] * STEPS, counts_ref  # X, dY per microbatch; W once
    state, ref = _snapshot(deferred[0]), _snapshot(per_operand[0])
    assert any(".delayed." in n for n in state)
    assert _equal(state, ref), [n for n in state if not torch.equal(state[n], ref[n])]
    # A checkpoint after step 2 (inside no step: nothing pending) resumes to the same step 3.
    first, _ = _run(groups, range(STEPS - 1))
    dist_checkpointing.save(model_sharded_state_dict([first[0]], pg_collection=groups), directory)
    resumed, _ = _run(groups, [STEPS - 1], _trainer(groups, seed=99, load_from=directory))
    resumed_state = _snapshot(resumed[0])
    assert _equal(resumed_state, state), [n for n in state if not torch.equal(state[n], resumed_state[n])]
    return True


def test_deferred_amax_reduction_bitwise_under_tp_dp_and_resume():
    with tempfile.TemporaryDirectory() as directory:
        assert all(run_distributed(_deferred_body, 4, directory))


# ----------------------------------------------------------------------------------
# PP=2 (interleaved, 2 chunks per rank) x DP=2: microbatches of both chunks in flight.
# ----------------------------------------------------------------------------------
def _pipelined(groups, num_mb, reductions):
    chunks = build_chunks(_fp8("delayed", num_layers=4), groups, vp=2)
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = make_finalize(groups)
    calls = []
    tokens, labels = batch(0, b=MICRO * num_mb * groups.size_of("dp"))
    with _count_amax_all_reduces(calls):
        run_pipeline(chunks, groups, tokens, labels, num_mb)
    reductions.append(len(calls))
    return {f"{i}.{n}": t for i, c in enumerate(chunks) for n, t in _snapshot(c).items()} | {
        f"{i}.{n}.grad": p.grad for i, c in enumerate(chunks) for n, p in c.named_parameters()
    }


def _pipeline_body(rank, world_size):
    groups = ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert groups.size_of("dp") == 2
    counts = []
    deferred = _pipelined(groups, 4, counts)
    with _patched(qstep, "defer_amax_reduction", _nothing):
        per_operand = _pipelined(groups, 4, counts)
    assert _equal(deferred, per_operand), [n for n in deferred if not torch.equal(deferred[n], per_operand[n])]
    weights = {n: int((t != 0).sum()) for n, t in deferred.items() if n.endswith("delayed.weight.amax_history")}
    assert len(weights) == 2 * 4 and set(weights.values()) == {1}, weights  # this rank's 2 layers x 4 linears
    per_op = 2 * 4 * (2 * 4) + 2 * 4  # X and dY of 8 linears per microbatch, 8 weights once
    assert counts[1] == per_op and 0 < counts[0] <= 2 * 4, counts  # at most one flush per forward op
    return counts[0]


def test_deferred_amax_reduction_under_interleaved_pipelining():
    assert all(run_distributed(_pipeline_body, 4))
