"""Multi-rank optimizer checks: gradient-norm counting over TP x PP, the distributed optimizer's
1/d state and its by-name checkpoint contract, CPU offloading (HybridDeviceOptimizer) under it, and
check_for_nan_in_grad.

References: the norm of the distinct full tensors computed locally on every rank; a plain
(non-sharded) optimizer loaded from the distributed optimizer's by-name state (tolerance:
weights rtol 1e-6 after one more step, the only difference being the order of additions).
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    NonFiniteGradientError,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style
from tests.unit_tests.distributed.dp_training import EPS, LR, train_step


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stage_module(groups):
    """Per stage: a column-sharded weight, a replicated norm; tied embedding on first + last stage."""
    tp, tp_rank, pp_rank, pp = (groups.size_of("tp"), groups.rank_in("tp"), groups.rank_in("pp"), groups.size_of("pp"))
    module = torch.nn.Module()
    full = {f"col{pp_rank}": _full(10 + pp_rank, 8, 3), f"norm{pp_rank}": _full(20 + pp_rank, 5)}
    for name, value in full.items():
        sharded = name.startswith("col")
        data = value.chunk(tp, dim=0)[tp_rank] if sharded else value
        param = torch.nn.Parameter(data.clone())
        set_tensor_model_parallel_attributes(param, sharded, 0, 1)
        module.register_parameter(name, param)
    embedding = _full(30, 6, 4)
    for name, present in (("emb", pp_rank == 0), ("out", pp_rank == pp - 1)):
        if present:
            param = torch.nn.Parameter(embedding.chunk(tp, dim=0)[tp_rank].clone())
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            param.shared_embedding = name == "out"
            module.register_parameter(name, param)
    for param in module.parameters():
        param.grad = param.detach().clone()  # grad = value: the expected norm is the norm of the values
    expected = sum(_full(10 + s, 8, 3).pow(2).sum() + _full(20 + s, 5).pow(2).sum() for s in range(pp))
    return module, float((expected + embedding.pow(2).sum()).sqrt())


def _grad_norm_counts_each_tensor_once(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    module, expected = _stage_module(groups)
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=1.0), [module], pg_collection=groups
    )
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(expected, rel=1e-6)
    for param in module.parameters():  # clipped in place by max_norm / (norm + 1e-6)
        torch.testing.assert_close(param.grad, param.detach() / (expected + 1e-6), rtol=1e-6, atol=0)


def test_grad_norm_over_tp_and_pp_counts_replicas_once():
    run_distributed(_grad_norm_counts_each_tensor_once, 4)


def _build(groups, distributed, bf16=False, **opt_kwargs):
    kw = {"params_dtype": torch.bfloat16, "bf16": True} if bf16 else {}
    model = build_gpt(gpt2_style(**kw), groups)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True),
        model,
        pg_collection=groups,
    )
    config = OptimizerConfig(
        lr=LR, weight_decay=0.1, adam_eps=EPS, use_distributed_optimizer=distributed, **kw, **opt_kwargs
    )
    return model, ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _distributed_state(rank, world_size, bf16):
    groups = ps.initialize_model_parallel()
    dp = groups.size_of("dp")
    model, ddp, opt = _build(groups, distributed=True, bf16=bf16)
    for it in range(2):
        train_step(ddp, opt, groups, it)
    # Measured: Adam moments (and fp32 main copies) on this rank cover 1/dp of the padded buffer.
    buffer_numel = sum(b.grad_data.numel() for b in ddp.buffers)
    state_numel = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert state_numel == 2 * buffer_numel // dp, (state_numel, buffer_numel)
    if bf16:
        assert sum(link.main.numel() for link in opt.links) == buffer_numel // dp
    writer_state = opt.state_dict_by_param_name([ddp])  # only DP rank 0 writes checkpoints: keeps the state
    assert any(name in writer_state for name, _ in model.named_parameters()) == (groups.rank_in("dp") == 0)
    state = opt.state_dict_by_param_name([ddp], all_ranks=True)
    for name, param in model.named_parameters():
        assert state[name]["exp_avg"].shape == param.shape, name
        assert state[name]["exp_avg"].device.type == "cpu", name
        if groups.rank_in("dp") == 0:
            assert torch.equal(writer_state[name]["exp_avg"], state[name]["exp_avg"]), name
    # The same state drives a plain optimizer on a fresh copy: one more step agrees.
    plain_model, plain_ddp, plain_opt = _build(groups, distributed=False, bf16=bf16)
    plain_model.load_state_dict(model.state_dict())
    plain_opt.load_state_dict_by_param_name([plain_ddp], state)
    train_step(ddp, opt, groups, 2)
    train_step(plain_ddp, plain_opt, groups, 2)
    ddp.finish_param_sync()
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(
            p.float(), q.float(), rtol=1e-6, atol=1e-7 if not bf16 else 1e-2, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_optimizer_state_is_sharded_and_portable(world_size):
    run_distributed(_distributed_state, world_size, False)


def test_distributed_optimizer_bf16_state():
    run_distributed(_distributed_state, 2, True)


OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, use_precision_aware_optimizer=True)


def _offloaded_state(rank, world_size):
    """DP=2 distributed optimizer with half of each rank's shard offloaded: where things live, the same
    steps as without offloading (bitwise: the same fused AdamW on the same fp32 values), and a by-name
    checkpoint round trip into a fresh offloaded optimizer that continues bit for bit."""
    groups = ps.initialize_model_parallel()
    ref_model, ref_ddp, ref = _build(groups, distributed=True)
    model, ddp, opt = _build(groups, distributed=True, **OFFLOAD)
    hdo = opt.optimizer
    assert isinstance(hdo, HybridDeviceOptimizer)
    mains = [p for g in opt.param_groups for p in g["params"]]
    total, sizes = sum(p.numel() for p in mains), [p.numel() for p in hdo.offloaded_params]
    assert sum(sizes) >= total / 2 > sum(sizes) - sizes[-1]  # the first half of the elements, in group order
    host = {id(p) for o in hdo.cpu_optimizers for g in o.param_groups for p in g["params"]}
    in_place = [p for g in hdo.gpu_optimizer.param_groups for p in g["params"]]
    assert {id(hdo.param_to_inner_param[p]) for p in hdo.offloaded_params} == host  # separate host copies
    assert all(hdo.param_to_inner_param[p].data_ptr() != p.data_ptr() for p in hdo.offloaded_params)
    assert {id(p) for p in in_place} == {id(p) for p in mains} - {id(p) for p in hdo.offloaded_params}
    for it in range(2):
        assert train_step(ddp, opt, groups, it) == train_step(ref_ddp, ref, groups, it)
    for p in hdo.offloaded_params:  # the moments of an offloaded shard are the host copy's
        inner = hdo.param_to_inner_param[p]
        assert any(inner in o.state for o in hdo.cpu_optimizers) and hdo.state[p]["exp_avg"].shape == p.shape
    for p in in_place:
        assert p in hdo.gpu_optimizer.state
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    state = opt.state_dict_by_param_name([ddp], all_ranks=True)
    assert all("master_param" not in state[name] for name, _ in model.named_parameters())
    again_model, again_ddp, again = _build(groups, distributed=True, **OFFLOAD)
    again_model.load_state_dict(model.state_dict())
    again.load_state_dict_by_param_name([again_ddp], state)
    for p in again.optimizer.offloaded_params:
        assert torch.equal(again.optimizer.state[p]["exp_avg"], opt.optimizer.state[_same(opt, again, p)]["exp_avg"])
    assert train_step(again_ddp, again, groups, 2) == train_step(ddp, opt, groups, 2)
    for p, q in zip(again_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def _same(opt, again, main):
    """``opt``'s main parameter at ``again``'s ``main``'s position."""
    index = [id(link.main) for link in again.links].index(id(main))
    return opt.links[index].main


def test_cpu_offloaded_distributed_optimizer_steps_and_reloads_bitwise():
    run_distributed(_offloaded_state, 2)


def _nan_check(rank, world_size):
    groups = ps.initialize_model_parallel()
    model = build_gpt(gpt2_style(), groups)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(check_for_nan_in_grad=True), model, pg_collection=groups
    )
    tokens, labels = batch()
    ddp(tokens, None, None, labels=labels).mean().backward()
    grad = next(model.parameters()).main_grad.view(-1)
    grad[0] = float("inf")  # an inf alone is left to the loss scaler (fp16 skips the step)
    finalize_model_grads([ddp], None, groups)
    ddp.zero_grad_buffer()
    ddp(tokens, None, None, labels=labels).mean().backward()
    next(model.parameters()).main_grad.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=f"rank {rank}: found NaN"):
        finalize_model_grads([ddp], None, groups)


def test_check_for_nan_in_grad_names_the_rank():
    run_distributed(_nan_check, 2)
