"""The tensor-parallel linears' autograd function: what it saves, how backward overlaps, wgrad fusion.

* Under sequence parallelism ColumnParallelLinear saves only the local ``[s/tp, b, h]`` input
  piece for backward (bytes counted with ``saved_tensors_hooks``), not the gathered ``[s, b, h]``.
* Backward launches the input re-gather (SP) before the input-gradient GEMM, and the input-gradient
  all-reduce / reduce-scatter asynchronously before the weight-gradient GEMM, waiting after it.
* With ``gradient_accumulation_fusion`` under DDP (tied GPT, 2 microbatches, overlapped buckets)
  ``param.grad`` stays None, DDP's hooks still dispatch every bucket, and the main grads equal the
  unfused run's (atol 1e-6, fp32).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import linear_function as lf
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style

S, B, H, O = 8, 2, 32, 48


def _rand(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _column(n, sequence_parallel, **config):
    cfg = ModelParallelConfig(tensor_model_parallel_size=n, sequence_parallel=sequence_parallel, **config)
    return tp.ColumnParallelLinear(H, O, config=cfg, init_method=torch.nn.init.normal_)


# ----------------------------------------------------------------------------------
# 1. Saved activation bytes under sequence parallelism.
# ----------------------------------------------------------------------------------
def saved_activation_bytes(layer, x):
    """Bytes autograd saves for backward in ``layer(x)``, parameters excluded."""
    params = {p.data_ptr() for p in layer.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    return out, sum(saved)


def _saved_bytes_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp.model_parallel_cuda_manual_seed(5)
    layer = _column(world_size, sequence_parallel=True)
    x = _rand(1, S // world_size, B, H).requires_grad_(True)  # [s/tp, b, h]
    out, saved = saved_activation_bytes(layer, x)
    assert out.shape == (S, B, O // world_size)
    local, gathered = x.numel() * x.element_size(), S * B * H * x.element_size()
    assert saved == local, f"saved {saved} bytes for backward, local piece {local}, gathered {gathered}"
    out.sum().backward()  # backward re-gathers the piece
    assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape
    return saved, gathered


def test_sequence_parallel_column_linear_saves_only_the_local_piece():
    (saved, gathered), _ = run_distributed(_saved_bytes_body, 2)
    assert saved * 2 == gathered


# ----------------------------------------------------------------------------------
# 2. Order of communication and GEMMs in backward.
# ----------------------------------------------------------------------------------
class _RecordedWork:
    def __init__(self, work, name, events):
        self.work, self.name, self.events = work, name, events

    def wait(self):
        self.events.append(f"wait {self.name}")
        return self.work.wait()


def _recording(fn, name, events):
    def wrapped(*args, async_op=False, **kwargs):
        events.append(f"{'launch' if async_op else 'sync'} {name}")
        work = fn(*args, async_op=async_op, **kwargs)
        return _RecordedWork(work, name, events) if async_op else work

    return wrapped


@contextlib.contextmanager
def _record_backward(events):
    """Record collectives (launch / wait) and GEMMs: dgrad is 3-d ``dY @ W``, wgrad 2-d ``dY^T @ X``."""
    originals = (lf.all_gather_into_tensor, lf.reduce_scatter_tensor, dist.all_reduce, torch.Tensor.matmul)
    matmul = originals[3]

    def recorded_matmul(self, other):
        events.append("dgrad" if self.dim() == 3 else "wgrad")
        return matmul(self, other)

    lf.all_gather_into_tensor = _recording(originals[0], "all_gather", events)
    lf.reduce_scatter_tensor = _recording(originals[1], "reduce_scatter", events)
    dist.all_reduce = _recording(originals[2], "all_reduce", events)
    torch.Tensor.matmul = recorded_matmul
    try:
        yield
    finally:
        lf.all_gather_into_tensor, lf.reduce_scatter_tensor, dist.all_reduce, torch.Tensor.matmul = originals


def _backward_events(n, sequence_parallel):
    layer = _column(n, sequence_parallel)
    x = _rand(1, S // n if sequence_parallel else S, B, H).requires_grad_(True)
    out, _ = layer(x)
    events = []
    with _record_backward(events):
        out.backward(torch.ones_like(out))
    return events


def _order_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp.model_parallel_cuda_manual_seed(5)
    assert _backward_events(world_size, sequence_parallel=False) == [
        "dgrad",
        "launch all_reduce",
        "wgrad",
        "wait all_reduce",
    ]
    assert _backward_events(world_size, sequence_parallel=True) == [
        "launch all_gather",
        "dgrad",
        "wait all_gather",
        "launch reduce_scatter",
        "wgrad",
        "wait reduce_scatter",
    ]


def test_backward_overlaps_input_grad_reduction_with_weight_grad_gemm():
    run_distributed(_order_body, 2)


# ----------------------------------------------------------------------------------
# 3. Gradient-accumulation fusion under DDP.
# ----------------------------------------------------------------------------------
def _fusion_run(groups, fused, sequence_parallel):
    """Two microbatches of a tied GPT under DDP (overlapped, several buckets).

    Returns (main grads by name, names of params whose hook saw a fused gradient).
    """
    kwargs = gpt2_style(gradient_accumulation_fusion=fused, sequence_parallel=sequence_parallel)
    model = build_gpt(kwargs, groups)
    flagged = set()
    names = {id(p): n for n, p in model.named_parameters()}

    def spy(param):
        if getattr(param, "grad_added_to_main_grad", False):
            flagged.add(names[id(param)])

    for p in model.parameters():  # registered before DDP's: sees the dummy and the flag
        p.register_post_accumulate_grad_hook(spy)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=3000),
        model,
        pg_collection=groups,
    )
    assert sum(len(b.buckets) for b in ddp.buffers) > 1
    ddp.zero_grad_buffer()
    tokens, labels = batch(seed=3, b=4)
    layouts = []  # the embedding's output: the residual stream's memory layout, which its gradients inherit
    model.embedding.register_forward_hook(lambda module, args, out: layouts.append(out.is_contiguous()))
    for m in range(2):
        ctx = ddp.no_sync() if m == 0 else contextlib.nullcontext()
        with ctx:
            ddp(tokens[2 * m : 2 * m + 2], None, None, labels=labels[2 * m : 2 * m + 2]).mean().backward()
        assert all(p.grad is None for p in model.parameters())
    assert all(b.dispatched for buf in ddp.buffers for b in buf.buckets), "a DDP hook did not fire"
    # [s, b, h] contiguous: a [b, s, h] view would make every proj / fc2 GEMM copy its gradient operand
    assert layouts == [True, True], layouts
    dummy = lf._wgrad_dummy(model.embedding.word_embeddings.weight)  # tied: summed with the lookup's gradient
    assert dummy.stride() == (0, 0) and not dummy.any(), "the tied weight's dummy fills a [V, h] tensor"
    model.embedding.word_embeddings.weight.grad_added_to_main_grad = False
    ddp.finish_grad_sync()
    assert not any(getattr(p, "grad_added_to_main_grad", False) for p in model.parameters())
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}, flagged


def _fusion_body(rank, world_size, tp_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    sp = tp_size > 1
    ref, ref_flagged = _fusion_run(groups, fused=False, sequence_parallel=sp)
    got, flagged = _fusion_run(groups, fused=True, sequence_parallel=sp)
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert grad.abs().sum() > 0, name
    assert not ref_flagged
    linear_weights = {n for n in ref if n.endswith(".weight") and ("linear_" in n or "word_embeddings" in n)}
    assert flagged == linear_weights, sorted(flagged ^ linear_weights)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_gradient_accumulation_fusion_matches_unfused_ddp(tp_size):
    run_distributed(_fusion_body, 2, tp_size)


def _mixed_dtype_body(rank, world_size):
    """bf16 weight, fp32 main_grad: the fused path accumulates the product in fp32 inside the GEMM, so it
    is at least as close to the exact sum as DDP's hook adding the bf16-rounded GEMM, and within bf16 of it."""
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp.model_parallel_cuda_manual_seed(5)
    grads = []
    for fused in (False, True):
        layer = _column(world_size, True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=fused)
        with torch.no_grad():
            layer.weight.copy_(_rand(2, O // world_size, H))
        layer.weight.main_grad = torch.ones(layer.weight.shape)  # [o/tp, h] fp32, earlier microbatches
        x = _rand(1, S // world_size, B, H).to(torch.bfloat16).requires_grad_(True)
        out, _ = layer(x)
        out.backward(torch.ones_like(out))
        if not fused:
            layer.weight.main_grad.add_(layer.weight.grad)
        grads.append(layer.weight.main_grad)
    pieces = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(pieces, x.detach())  # the sequence-parallel input, [S, B, H]
    exact = 1 + torch.cat(pieces).reshape(-1, H).double().sum(0).expand(grads[0].shape)  # dY = 1: column sums
    err_hook, err_fused = ((g.double() - exact).abs().max() for g in grads)
    assert err_fused <= err_hook and err_fused < 1e-4, (err_fused, err_hook)
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-2)


def test_fused_weight_grad_into_fp32_main_grad_is_the_fp32_accumulation():
    run_distributed(_mixed_dtype_body, 2)


def _no_main_grad_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp.model_parallel_cuda_manual_seed(5)
    layer = _column(world_size, False, gradient_accumulation_fusion=True)
    out, _ = layer(_rand(1, S, B, H))
    out.sum().backward()
    assert layer.weight.grad is not None and not hasattr(layer.weight, "grad_added_to_main_grad")


def test_fusion_without_main_grad_returns_the_weight_gradient():
    run_distributed(_no_main_grad_body, 2)
