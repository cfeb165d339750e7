"""Megatron-core's ``distributed`` surface, called as upstream callers call it.

``DistributedDataParallel(config, ddp_config, module)`` after ``initialize_model_parallel``; its
buffers and buckets follow upstream's rule (parameters in reverse order, a bucket closes once it
holds at least ``bucket_size`` elements; one bucket without ``overlap_grad_reduce``, with
``disable_bucketing`` or on a pipeline stage after the first); ``no_sync`` / ``start_grad_sync`` /
``finish_grad_sync`` / ``scale_gradients`` / ``zero_grad_buffer`` / ``broadcast_params`` /
``start_param_sync`` and ``finalize_model_grads(model)`` against a single-process reference.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.transformer import TransformerConfig
from tests.dist_harness import run_distributed

# megatron-core 0.16's fields and defaults, in its order.
UPSTREAM_FIELDS = [
    ("grad_reduce_in_fp32", False), ("overlap_grad_reduce", False), ("overlap_param_gather", False),
    ("align_param_gather", False), ("use_distributed_optimizer", False), ("num_distributed_optimizer_instances", 1),
    ("check_for_nan_in_grad", False), ("check_for_large_grads", False), ("bucket_size", None),
    ("pad_buckets_for_high_nccl_busbw", False), ("reduce_scatter_with_fp32_accumulation", False),
    ("average_in_collective", False), ("fp8_param_gather", False), ("reuse_grad_buf_for_mxfp8_param_ag", False),
    ("use_megatron_fsdp", False), ("use_custom_fsdp", False), ("data_parallel_sharding_strategy", "no_shard"),
    ("gradient_reduce_div_fusion", True), ("suggested_communication_unit_size", None),
    ("preserve_fp32_weights", True), ("keep_fp8_transpose_cache", False), ("nccl_ub", False),
    ("fsdp_double_buffer", False), ("outer_dp_sharding_strategy", "no_shard"),
    ("disable_symmetric_registration", False), ("fsdp_manual_registration", False), ("delay_wgrad_compute", False),
]  # fmt: skip
SIZES = [(6, 5), (5, 3), (3, 4), (4, 2)]  # Linear(in, out): weights 30, 15, 12, 8; biases 5, 3, 4, 2


def test_ddp_config_fields_and_defaults_are_upstream():
    config = DistributedDataParallelConfig()
    assert [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)] == UPSTREAM_FIELDS
    with pytest.raises(TypeError):
        DistributedDataParallelConfig(bucket_sise=10)
    for name in ("delay_wgrad_compute", "reduce_scatter_with_fp32_accumulation"):
        with pytest.raises(ValueError, match=name):
            DistributedDataParallelConfig(**{name: True})
    DistributedDataParallelConfig(nccl_ub=True, gradient_reduce_div_fusion=False)  # no effect here


def upstream_buckets(numels: List[int], bucket_size: Optional[int]) -> List[List[int]]:
    """Indices per bucket by upstream's rule: reverse order, close once the bucket holds >= bucket_size."""
    buckets, current, filled = [], [], 0
    for index in reversed(range(len(numels))):
        current.append(index)
        filled += numels[index]
        if bucket_size is not None and filled >= bucket_size:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


def _model() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(*[torch.nn.Linear(i, o) for i, o in SIZES])


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)


def _bucket_indices(ddp: DistributedDataParallel, params: List[torch.nn.Parameter]) -> List[List[int]]:
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in group.params] for group in ddp.bucket_groups]


def _check_buckets(rank: int) -> None:
    params = list(_model().parameters())
    numels = [p.numel() for p in params]
    for size in (1, 10, 20, 35, 50, 1000):
        module = _model()
        ddp = DistributedDataParallel(
            _config(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=size), module
        )
        got = [sorted(b) for b in _bucket_indices(ddp, list(module.parameters()))]
        assert got == [sorted(b) for b in upstream_buckets(numels, size)], size
        assert [len(g.buckets) for g in ddp.bucket_groups] == [1] * len(got)
        assert ddp.bucket_size == size and len(ddp.buffers) == 1 and ddp.expert_parallel_buffers == []
    # One bucket without overlap, or with disable_bucketing; the default size with overlap.
    one = [list(range(len(numels)))]
    for ddp_config, kwargs in (
        (DistributedDataParallelConfig(bucket_size=10), {}),
        (DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10), {"disable_bucketing": True}),
        (DistributedDataParallelConfig(overlap_grad_reduce=True), {}),
    ):
        module = _model()
        ddp = DistributedDataParallel(_config(), ddp_config, module, **kwargs)
        assert [sorted(b) for b in _bucket_indices(ddp, list(module.parameters()))] == one
    assert ddp.bucket_size == 40_000_000 and ddp_config.bucket_size is None  # max(40M, 1M x dp); config untouched
    # Expert parameters (allreduce=False) get buffers of their own.
    module = _model()
    for p in module[0].parameters():
        p.allreduce = False
    ddp = DistributedDataParallel(_config(), DistributedDataParallelConfig(), module)
    assert {id(p) for b in ddp.expert_parallel_buffers for p in b.params} == {id(p) for p in module[0].parameters()}
    assert len(ddp.expert_parallel_bucket_groups) == 1 and len(ddp.param_to_bucket_group) == len(numels)
    assert len(ddp.params_with_grad) == len(numels)


def _reference_grads(batches: List[torch.Tensor]) -> List[torch.Tensor]:
    """Gradients of the mean over ranks of each rank's loss (what DP averaging gives)."""
    model = _model()
    for x in batches:
        (model(x).square().sum() / len(batches)).backward()
    return [p.grad for p in model.parameters()]


def _check_grad_sync(rank: int, world_size: int) -> None:
    module = _model()
    ddp = DistributedDataParallel(
        _config(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=20), module
    )
    torch.manual_seed(11)
    batches = [[torch.randn(3, 6) for _ in range(world_size)] for _ in range(2)]  # [microbatch][rank]
    with ddp.no_sync():
        ddp(batches[0][rank]).square().sum().backward()
    assert all(not b.dispatched for b in ddp.buffers[0].buckets)  # nothing reduced under no_sync
    ddp(batches[1][rank]).square().sum().backward()
    assert all(b.dispatched for b in ddp.buffers[0].buckets)  # overlap: reduced during backward
    finalize_model_grads([ddp])  # pg_collection None: initialize_model_parallel's groups
    expected = _reference_grads([x for mb in batches for x in mb])
    for param, grad in zip(module.parameters(), expected):
        torch.testing.assert_close(param.main_grad, grad * 2)  # 2 microbatches summed, ranks averaged
    ddp.scale_gradients(0.5)
    torch.testing.assert_close(next(module.parameters()).main_grad, expected[0])
    ddp.zero_grad_buffer()
    assert all(float(p.main_grad.abs().sum()) == 0 for p in module.parameters())
    ddp(batches[0][rank]).square().sum().backward()
    ddp.start_grad_sync()
    ddp.finish_grad_sync()
    expected = _reference_grads(batches[0])
    torch.testing.assert_close(next(module.parameters()).main_grad, expected[0])


def _check_params(rank: int, world_size: int) -> None:
    module = _model()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(rank)
    DistributedDataParallel(_config(), DistributedDataParallelConfig(), module).broadcast_params()
    for p, ref in zip(module.parameters(), _model().parameters()):
        torch.testing.assert_close(p, ref)  # rank 0's
    # Distributed optimizer: each rank changes its own shard; start_param_sync gathers them all.
    module = _model()
    ddp = DistributedDataParallel(_config(), DistributedDataParallelConfig(use_distributed_optimizer=True), module)
    (buffer,) = ddp.buffers
    shard = buffer.param_data.numel() // world_size
    buffer.param_data[rank * shard : (rank + 1) * shard] = rank + 1.0
    ddp.start_param_sync(force_sync=True)
    assert buffer.param_data.tolist() == [float(1 + i // shard) for i in range(buffer.param_data.numel())]
    ddp.disable_forward_pre_hook(param_sync=False)
    ddp.enable_forward_pre_hook()
    assert set(ddp.state_dict(prefix="m.")) == {f"m.{k}" for k in module.state_dict()}


def _ddp_body(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel()
    try:
        _check_buckets(rank)
        _check_grad_sync(rank, world_size)
        _check_params(rank, world_size)
    finally:
        parallel_state.destroy_model_parallel()


def _later_stage_body(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10)
        ddp = DistributedDataParallel(_config(), ddp_config, _model())
        # Only the first pipeline stage splits its buffer into buckets.
        assert (ddp.bucket_size, len(ddp.bucket_groups) > 1) == ((10, True) if rank == 0 else (None, False))
    finally:
        parallel_state.destroy_model_parallel()


def test_ddp_buckets_grad_and_param_sync_on_two_ranks():
    run_distributed(_ddp_body, 2)


def test_pipeline_stages_after_the_first_use_one_bucket():
    run_distributed(_later_stage_body, 2)
