"""PyTorch FSDP2 (``TorchFullyShardedDataParallel``) against DDP + the distributed optimizer.

One spawn of two gloo ranks (DP=2) trains a 3-layer untied GPT in fp32 with two microbatches per step
under FSDP2 and under DDP + the distributed optimizer: the same arithmetic (each DP sum has two terms,
the division by 2 is exact), so losses and final weights must be bitwise equal, under activation
recomputation (full, uniform) too. FSDP2's shards hold other elements than the distributed
optimizer's, so the grad norm's partial sums group differently: equal to rounding (rtol 1e-6), and
clipping is off, where the norm changes nothing (as for Megatron-FSDP's per-layer shards).
It checks what FSDP2 keeps (each parameter a DTensor whose local rows are 1/2 of it, the
optimizer's state the same size) and, from the events of one step, that layer k+1's all-gather is
issued before layer k's forward ends; the same check fails once the explicit prefetch is removed
(FSDP2 then gathers a layer in its own pre-forward).
"""

from typing import List, Tuple

import pytest
import torch
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state as ps
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.optimizer import FullyShardedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt, gpt2_style
from tests.unit_tests.distributed import dp_training
from tests.unit_tests.distributed.dp_training import EPS, LR, WD, parallel_run, train_step

LAYERS, ITERS = 3, 2
MODEL = gpt2_style(num_layers=LAYERS, share_embeddings_and_output_weights=False)
RECOMPUTE = dict(MODEL, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _fsdp2_run(groups, kwargs, events=None, iters: int = ITERS):
    model = build_gpt(kwargs, groups)
    wrapped = TorchFullyShardedDataParallel(
        model.config, TorchFullyShardedDataParallelConfig(), model, pg_collection=groups, events=events
    )
    config = OptimizerConfig(lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=dp_training.CLIP, adam_eps=EPS)
    opt = get_megatron_optimizer(config, [wrapped], pg_collection=groups)
    losses, norms = zip(*[train_step(wrapped, opt, groups, it) for it in range(iters)])
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return list(losses), list(norms), weights, opt, wrapped


def _assert_bitwise(where: str, got, ref) -> None:
    assert got[0] == ref[0], f"{where}: losses {got[0]} != distributed optimizer {ref[0]}"
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), rtol=1e-6, atol=0, msg=where)
    for name, weight in ref[2].items():
        assert torch.equal(got[2][name], weight), f"{where}: weight {name} differs"


def prefetched(events: List[Tuple[str, int]]) -> bool:
    """Whether every layer k+1's all-gather was issued before layer k's forward ended."""
    forward = events[: events.index(("forward_end", LAYERS - 1)) + 1]
    return all(
        ("gather", k + 1) in forward and forward.index(("gather", k + 1)) < forward.index(("forward_end", k))
        for k in range(LAYERS - 1)
    )


def _assert_sharded(opt, wrapped, dp: int) -> None:
    assert isinstance(opt, FullyShardedOptimizer)
    for name, param in wrapped.module.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.to_local().shape[0] == -(-param.shape[0] // dp), f"{name}: not 1/{dp} of the rows"
    for link in opt.links:
        assert link.main.data_ptr() == link.model.to_local().data_ptr()  # the shard is the main parameter
        for value in opt.optimizer.state[link.main].values():
            assert value.dim() == 0 or value.shape == link.main.shape


def _fsdp2(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel()
    dp_training.CLIP = 0.0  # the norm's rounding depends on the shard layout (docstring)
    ref = parallel_run(groups, MODEL, dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True), ITERS)
    events: List[Tuple[str, int]] = []
    got = _fsdp2_run(groups, MODEL, events)
    _assert_bitwise("FSDP2", got, ref)
    _assert_sharded(got[3], got[4], world_size)
    assert prefetched(events), f"layer k+1 not gathered under layer k: {events}"
    ref = parallel_run(groups, RECOMPUTE, dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True), 1)
    _assert_bitwise("FSDP2 with full recomputation", _fsdp2_run(groups, RECOMPUTE, iters=1), ref)
    # Teeth: without the explicit prefetch each layer is gathered in its own pre-forward.
    wrapped = got[4]
    for _, unit in wrapped.units:
        unit.set_modules_to_forward_prefetch([])
    events.clear()
    train_step(wrapped, got[3], groups, ITERS)
    assert not prefetched(events), events


def test_fsdp2_equals_the_distributed_optimizer_and_prefetches():
    run_distributed(_fsdp2, 2)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(use_distributed_optimizer=True), "use_distributed_optimizer=True: FSDP2 shards"),
        (dict(use_megatron_fsdp=True), "use_megatron_fsdp=True"),
    ],
)
def test_refused_pairings_name_the_fields(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TorchFullyShardedDataParallelConfig(**kwargs)
