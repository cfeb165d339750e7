"""Megatron-core's ``optimizer`` surface, called as upstream callers call it.

``OptimizerConfig`` has upstream's fields and defaults; ``get_megatron_optimizer(config,
model_chunks)`` after ``initialize_model_parallel`` (no groups passed) trains a DDP-wrapped model on
two ranks like ``torch.optim.AdamW`` on the whole batch in one process, with the plain and the
distributed optimizer; the public methods (``step_with_ready_grads``, ``reload_model_params``,
``state_dict`` / ``load_state_dict``, ``get_loss_scale``, ``zero_grad``) and ``ChainedOptimizer`` behave as
upstream's.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    AdamOptimizerConfig,
    ChainedOptimizer,
    OptimizerConfig,
    SGDOptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from tests.dist_harness import run_distributed

F32 = torch.float32
UPSTREAM_FIELDS = [
    ("lr", None), ("min_lr", None), ("decoupled_lr", None), ("decoupled_min_lr", None), ("weight_decay", 0.01),
    ("apply_wd_to_qk_layernorm", False), ("fp8_recipe", None), ("fp16", False), ("bf16", False),
    ("reuse_grad_buf_for_mxfp8_param_ag", False), ("params_dtype", F32), ("use_precision_aware_optimizer", False),
    ("store_param_remainders", True), ("main_grads_dtype", F32), ("main_params_dtype", F32),
    ("exp_avg_dtype", F32), ("exp_avg_sq_dtype", F32), ("optimizer", "adam"), ("loss_scale", None),
    ("initial_loss_scale", 2**32), ("min_loss_scale", 1.0), ("loss_scale_window", 1000), ("hysteresis", 2),
    ("adam_beta1", 0.9), ("adam_beta2", 0.999), ("adam_eps", 1e-08), ("decoupled_weight_decay", True),
    ("sgd_momentum", 0.9), ("muon_momentum", 0.95), ("muon_split_qkv", True), ("muon_use_nesterov", False),
    ("muon_scale_mode", "spectral"), ("muon_fp32_matmul_prec", "medium"), ("muon_num_ns_steps", 5),
    ("muon_tp_mode", "blockwise"), ("muon_extra_scale_factor", 1.0), ("use_distributed_optimizer", False),
    ("overlap_param_gather", False), ("overlap_param_gather_with_optimizer_step", False),
    ("optimizer_cpu_offload", False), ("optimizer_offload_fraction", 0.0),
    ("use_torch_optimizer_for_cpu_offload", False), ("overlap_cpu_optimizer_d2h_h2d", False),
    ("pin_cpu_grads", True), ("pin_cpu_params", True), ("clip_grad", 1.0), ("log_num_zeros_in_grad", False),
    ("barrier_with_L1_time", False), ("timers", None), ("config_logger_dir", ""),
]  # fmt: skip
SCHEDULER_PARAMS = [
    "self", "optimizer", "init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
    "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style", "use_checkpoint_opt_param_scheduler",
    "override_opt_param_scheduler", "wsd_decay_steps", "lr_wsd_decay_style",
]  # fmt: skip


def test_optimizer_config_fields_and_defaults_are_upstream():
    config = OptimizerConfig()
    assert [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)] == UPSTREAM_FIELDS
    with pytest.raises(TypeError):
        OptimizerConfig(learning_rate=1.0)
    assert AdamOptimizerConfig(lr=1.0).optimizer == "adam" and SGDOptimizerConfig(lr=1.0).optimizer == "sgd"
    assert [f.name for f in dataclasses.fields(SGDOptimizerConfig)] == [name for name, _ in UPSTREAM_FIELDS]
    for changes in (
        {"use_precision_aware_optimizer": True},  # needs adam and the distributed optimizer, as upstream
        {"exp_avg_dtype": torch.bfloat16},
        {"optimizer_offload_fraction": 1.5, "optimizer_cpu_offload": True},
        {"optimizer_cpu_offload": True, "optimizer": "muon"},
    ):
        with pytest.raises(ValueError, match=next(iter(changes))):
            OptimizerConfig(**changes)
    OptimizerConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer_cpu_offload=True)


def test_signatures_are_upstream():
    params = list(inspect.signature(get_megatron_optimizer).parameters)
    assert params[:6] == [
        "config", "model_chunks", "config_overrides", "use_gloo_process_groups", "pg_collection",
        "dump_param_to_param_group_map",
    ]  # fmt: skip
    assert list(inspect.signature(OptimizerParamScheduler.__init__).parameters) == SCHEDULER_PARAMS
    with pytest.raises(NotImplementedError, match="config_overrides"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), [torch.nn.Linear(1, 1)], {"key": "override"})


def _model() -> torch.nn.Sequential:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _reference(batches, steps: int, lr: float, wd: float) -> torch.nn.Sequential:
    model = _model()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    for step in range(steps):
        opt.zero_grad()
        torch.stack([model(x).square().mean() for x in batches[step]]).mean().backward()
        opt.step()
    return model


def _train(rank: int, batches, config: OptimizerConfig, steps: int):
    module = _model().to(torch.bfloat16 if config.bf16 else torch.float32)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=config.use_distributed_optimizer)
    ddp = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1), ddp_config, module
    )
    opt = get_megatron_optimizer(config, [ddp])  # the groups of initialize_model_parallel
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(batches[step][rank].to(module[0].weight.dtype)).float().square().mean().backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok and norm > 0
    return module, opt


def _check_chained(batches) -> None:
    """Two optimizers over the two layers, chained, step like one optimizer over both (with clipping)."""
    config = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.01)
    one, split = _model(), _model()
    single = get_megatron_optimizer(config, [one])
    chained = ChainedOptimizer([get_megatron_optimizer(config, [split[0]]), get_megatron_optimizer(config, [split[2]])])
    for model, opt in ((one, single), (split, chained)):
        opt.zero_grad()
        model(batches[0][0]).square().mean().backward()
        ok, norm, _ = opt.step()
        assert ok
        model.norm = norm
    assert chained.get_loss_scale().item() == 1.0 and len(chained.param_groups) == 4
    assert split.norm == pytest.approx(one.norm, rel=1e-6)
    for a, b in zip(one.parameters(), split.parameters()):
        torch.testing.assert_close(a, b)


def _body(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(9)
        batches = [[torch.randn(5, 4) for _ in range(world_size)] for _ in range(3)]  # [step][rank]
        reference = _reference(batches, 3, lr=0.01, wd=0.1)
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)  # HybridDeviceOptimizer
        for distributed, extra in ((False, {}), (True, {}), (False, offload)):
            config = OptimizerConfig(
                lr=0.01, weight_decay=0.1, clip_grad=0.0, use_distributed_optimizer=distributed, **extra
            )
            module, opt = _train(rank, batches, config, 3)
            assert isinstance(opt.optimizer, HybridDeviceOptimizer) == bool(extra)
            for got, want in zip(module.parameters(), reference.parameters()):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert opt.get_loss_scale().item() == 1.0
        # bf16: the fp32 main copies follow the model after reload_model_params; state round-trips.
        config = OptimizerConfig(lr=0.01, bf16=True, clip_grad=0.0)
        module, opt = _train(rank, batches, config, 1)
        with torch.no_grad():
            module[0].weight.fill_(0.5)
        opt.reload_model_params()
        assert any(bool((p == 0.5).all()) for p in opt.get_parameters())
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        assert opt.step_with_ready_grads() is True
        _check_chained(batches)
    finally:
        parallel_state.destroy_model_parallel()


def test_get_megatron_optimizer_the_upstream_way_matches_adamw():
    run_distributed(_body, 2)
