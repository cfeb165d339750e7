"""Device placement of the optimizer, schedules and gradient reductions, proven on fake CUDA.

Every test runs the component on ``cuda:0`` tensors under ``FakeCuda`` (no GPU needed) and, where
collectives are involved, on ``fake`` process groups that behave like NCCL (``nccl_like``: CUDA
tensors only). Each one failed before its fix: a CPU tensor mixed into a CUDA op
(``FakeTensorDeviceMismatchError``), a CPU tensor handed to NCCL (``ValueError``), or more host
syncs / host-to-device copies than the counts asserted here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    unscale_and_find_nonfinite,
)
from megatron.core.pipeline_parallel.schedules import forward_step
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_aux_loss_tracker
from tests.unit_tests.gpu.fake_cuda import FakeCuda, fake_world, nccl_like, on_cuda


class _Dense(torch.nn.Module):
    """``x W^T + b`` with parameters made on the fake GPU (``nn.Linear``'s uniform_ init is not fakeable)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, device="cuda", dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(8, device="cuda", dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)  # [b, 8]


def _layers(n: int, dtype: torch.dtype) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[_Dense(dtype) for _ in range(n)])


def _set_grads(model: torch.nn.Module, opt) -> None:
    """Gradients as a scaled backward leaves them (autograd cannot run on fake CUDA in a CPU build)."""
    scale = opt.get_loss_scale()
    for param in model.parameters():
        param.grad = (torch.randn(param.shape, device=param.device) * scale).to(param.dtype)


# ---------------------------------------------------------------- fp16 loss scaling (issue 19, item 2)
@pytest.mark.parametrize("num_layers", [2, 6])
def test_fp16_step_unscales_on_device_with_one_sync_per_statistic(monkeypatch, num_layers):
    """The scale lives on the parameters' device; found-inf and the norm are read once each,
    whatever the number of parameters (it was one sync per parameter)."""
    with fake_world(2), FakeCuda() as mode:
        nccl_like(monkeypatch)
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=2, tensor_model_parallel_size=2))
        model = _layers(num_layers, torch.float16)
        config = OptimizerConfig(lr=1e-3, fp16=True, params_dtype=torch.float16, log_num_zeros_in_grad=True)
        opt = get_megatron_optimizer(config, [model], pg_collection=groups)
        _set_grads(model, opt)
        before = mode.counts()
        ok, _, _ = opt.step()  # unscaling by a CPU [1] tensor raised FakeTensorDeviceMismatchError
        syncs, copies = (a - b for a, b in zip(mode.counts(), before))
        assert ok and on_cuda(opt.get_loss_scale())
        assert syncs == 3, f"{syncs} host syncs in one fp16 step: expected found-inf, grad norm, zero count"
        assert copies == 0, f"{copies} host-to-device copies in one fp16 step"


def test_loss_scale_loaded_from_a_checkpoint_stays_on_device():
    with fake_world(1), FakeCuda():
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=1e-3, fp16=True, params_dtype=torch.float16),
            [_layers(1, torch.float16)],
            pg_collection=groups,
        )
        opt.grad_scaler.load_state_dict({"scale": 1024.0, "growth_tracker": 0, "hysteresis_tracker": 2})
        assert on_cuda(opt.get_loss_scale())


# ---------------------------------------------------------------- gradient statistics (issue 19, item 7)
def _grads(n: int) -> List[torch.Tensor]:
    return [torch.randn(5 + i, 7, device="cuda") for i in range(n)] + [torch.randn(9, device="cuda").bfloat16()]


def test_grad_norm_clip_and_zero_count_read_the_host_once(monkeypatch):
    with fake_world(2), FakeCuda() as mode:
        nccl_like(monkeypatch)
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=2, tensor_model_parallel_size=2))
        grads, expert = _grads(6), _grads(3)
        for name, run, syncs in (
            ("norm", lambda: get_grad_norm_fp32(grads, [groups.mp], expert, [groups.tp_ep_pp]), 1),
            ("zeros", lambda: count_zeros_fp32(grads, [groups.mp], expert, [groups.tp_ep_pp]), 1),
            ("clip", lambda: clip_grad_by_total_norm_fp32(grads, 1.0, 10.0), 0),
        ):
            before = mode.counts()
            run()
            assert (mode.syncs - before[0], mode.host_to_device - before[1]) == (syncs, 0), name


# ---------------------------------------------------------------- per-token loss with PP > 1 (issue 19, item 5)
def test_per_token_count_of_a_non_last_stage_travels_on_the_gpu(monkeypatch):
    with fake_world(2, rank=0), FakeCuda():
        nccl_like(monkeypatch)
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=2, pipeline_model_parallel_size=2))
        chunk = _layers(1, torch.float32)
        # Off the last stage the schedule's token count is its CPU zero.
        finalize_model_grads([chunk], torch.tensor(0, dtype=torch.int), groups)


# ---------------------------------------------------------------- every microbatch (issue 19, item 6)
class _Chunk(torch.nn.Module):
    """A one-layer stage whose output carries an MoE aux loss (its gradient uses the aux-loss scale)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.linear = _Dense()

    def set_input_tensor(self, tensors) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)  # [b, h]
        return MoEAuxLossAutoScaler.apply(out, out.float().pow(2).mean(), 1.0)


def _forward_step_func(data_iterator, model):
    out = model(torch.randn(4, 8, device="cuda"))

    def loss_func(output: torch.Tensor):
        return output.float().sum(), torch.ones(4, device="cuda").sum(), {}  # a loss mask's count

    return out, loss_func


@pytest.mark.parametrize("fp16", [False, True])
def test_a_microbatch_copies_nothing_to_the_device(fp16):
    """Loss scaling (with or without an fp16 scaler) and the MoE aux-loss scale are made on the device.

    Autograd cannot run on fake CUDA in a CPU build, so forward runs without a graph and backward's
    device work is replayed by hand:
    the loss scaling ``backward_step`` applies and the aux-loss gradient of ``MoEAuxLossAutoScaler``.
    """
    with fake_world(1), FakeCuda() as mode:
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        config = SimpleNamespace(num_moe_experts=2, calculate_per_token_loss=False, grad_scale_func=None)
        chunk = _Chunk(config)
        precision = {"fp16": True, "params_dtype": torch.float32} if fp16 else {"bf16": True}
        config.grad_scale_func = get_megatron_optimizer(
            OptimizerConfig(lr=1e-3, **precision), [chunk], pg_collection=groups
        ).scale_loss
        before = mode.counts()
        for _ in range(2):
            with torch.no_grad():  # recording a graph on fake CUDA aborts a CPU build too
                loss, _ = forward_step(_forward_step_func, None, chunk, 2, None, [], config)
            scaled = config.grad_scale_func(loss)  # what backward_step back-propagates
            aux = torch.zeros((), device="cuda")
            ctx = SimpleNamespace(saved_tensors=(aux,), weight=1.0, tracker=get_aux_loss_tracker())
            _, aux_grad, _, _ = MoEAuxLossAutoScaler.backward(ctx, torch.ones(4, 8, device="cuda"))
        assert mode.counts() == before, f"(host syncs, host-to-device copies) {before} -> {mode.counts()}"
        assert on_cuda(scaled) and on_cuda(aux_grad)


# ---------------------------------------------------------------- distributed-optimizer save (issue 19, item 3)
def _distributed_optimizer(groups) -> tuple:
    """Two bf16 layers wrapped for the distributed optimizer on the fake GPU, after one step."""
    model = _layers(2, torch.bfloat16)
    ddp = DistributedDataParallel(
        SimpleNamespace(calculate_per_token_loss=False),
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        model,
        pg_collection=groups,
    )
    config = OptimizerConfig(lr=1e-3, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(config, [ddp], pg_collection=groups)
    for param in model.parameters():
        param.main_grad.normal_()
    assert opt.step()[0]
    return model, ddp, opt


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_optimizer_state_is_gathered_on_the_gpu_by_bucket(monkeypatch, rank):
    """Shards travel over (NCCL-like) DP on the GPU, come to the host once per bucket and state key,
    and only DP rank 0, which writes the checkpoint, keeps the whole state."""
    with fake_world(2, rank=rank), FakeCuda() as mode:
        nccl_like(monkeypatch)
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=2))
        model, ddp, opt = _distributed_optimizer(groups)
        before = mode.syncs
        state = opt.state_dict_by_param_name([ddp])  # CPU shards were handed to NCCL: ValueError
        buckets = sum(len(b.buckets) for b in ddp.buffers)
        # Rank 0: exp_avg, exp_avg_sq, main_param per bucket; every rank: the step count.
        assert mode.syncs - before == (3 * buckets if rank == 0 else 0) + 1
        names = [name for name, _ in model.named_parameters()]
        if rank == 0:
            assert all(state[n][k].device.type == "cpu" for n in names for k in ("exp_avg", "main_param"))
        else:
            assert not any(n in state for n in names)


# ---------------------------------------------------------------- resume (issue 19, item 4)
def _cpu_state(model: torch.nn.Module, with_main: bool) -> dict:
    """A by-name optimizer state as a legacy checkpoint loads it (``map_location="cpu"``)."""
    state = {"step": 3, "param_groups": [], "loss_scaler": None}
    for name, param in model.named_parameters():
        state[name] = {"exp_avg": torch.ones(param.shape), "exp_avg_sq": torch.ones(param.shape)}
        if with_main:
            state[name]["main_param"] = torch.zeros(param.shape)
    return state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resumed_optimizer_state_lives_with_its_parameter(precision):
    """Moments, fp32 main copies and ``step`` go to the parameter's device, where torch's fused
    AdamW (every fp32 main parameter on CPU or CUDA: fp32 and bf16 training) needs them."""
    with fake_world(1), FakeCuda():
        groups = ps.build_process_groups(ps.ParallelLayout(world_size=1))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = _layers(2, dtype)
        kw = {"bf16": True, "params_dtype": dtype} if precision == "bf16" else {}
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, **kw), [model], pg_collection=groups)
        opt.load_state_dict_by_param_name([model], _cpu_state(model, with_main=precision == "bf16"))
        for group in opt.optimizer.param_groups:
            assert group.get("fused")
            for main in group["params"]:
                state = opt.optimizer.state[main]
                assert on_cuda(state["exp_avg"]) and on_cuda(state["exp_avg_sq"]), precision
                assert state["step"].device.type == "cuda", precision
        _set_grads(model, opt)
        assert opt.step()[0]


# ---------------------------------------------------------------- numerics on a real GPU (skipped without one)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("numel", [4097, 1_000_003, 50_000_000])
def test_cuda_grad_norm_matches_float64(numel):
    """Multi-tensor fp32 norms summed in float64 stay within the CPU path's 5e-6 of a float64 sum."""
    g = torch.Generator(device="cuda").manual_seed(numel)
    grads = [
        torch.randn(numel, device="cuda", generator=g) * 1e-3 + 1e-3,
        torch.randn(3, 5, device="cuda"),
        torch.randn(4096, device="cuda").bfloat16(),
    ]
    exact = sum(t.double().pow(2).sum() for t in grads).sqrt().item()
    got = get_grad_norm_fp32(grads, [])
    assert abs(got - exact) <= 5e-6 * exact, (got, exact)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_unscale_clip_and_zero_count_equal_the_per_tensor_ops(device):
    grads = [torch.randn(1000 + i, device=device) * 1000 for i in range(5)]
    expected = [t.clone() for t in grads]
    inv_scale = torch.tensor([1 / 3.0], device=device)
    assert not unscale_and_find_nonfinite(grads, inv_scale, [])
    for t in expected:
        t.mul_(inv_scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    clip_grad_by_total_norm_fp32(grads, 1.0, 10.0)
    assert all(torch.equal(a, b.mul_(1.0 / (10.0 + 1e-6))) for a, b in zip(grads, expected))
    grads[2][7] = float("nan")
    assert unscale_and_find_nonfinite(grads, inv_scale, [])
    assert count_zeros_fp32([torch.zeros(7, device=device), torch.ones(3, device=device)], []) == 7
