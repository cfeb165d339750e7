"""Megatron-FSDP's sharding strategies on the distributed optimizer's buffers (``fsdp_units``).

One spawn of two gloo ranks (DP=2) trains a 3-layer GPT with two microbatches per step under each
strategy and under DDP + the distributed optimizer (the reference: the same arithmetic, so losses,
grad norms and final weights must be bitwise equal). ``optim_grads_params`` lays its buckets out per
layer, so each rank's shard holds other elements and the grad norm's partial sums group differently:
its norm equals to rounding (rtol 1e-6) and, with clipping off (the norm then changes nothing),
losses and weights are bitwise equal. It also checks what each strategy keeps
between steps (the full gradient buffer freed under ``optim_grads``, every unit's full parameters
freed under ``optim_grads_params``, only 1/dp shards left) and, from the recorded events of one
step, that layer k+1's parameter all-gather is issued before layer k's forward ends and waited for
only after it (prefetch that overlaps), and that in backward layer k-1's gather is issued before
layer k's backward is done.
"""

from typing import List, Tuple

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style
from tests.unit_tests.distributed import dp_training
from tests.unit_tests.distributed.dp_training import CLIP, parallel_run, train_step

LAYERS, ITERS = 3, 2
DIST_OPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def _fsdp(strategy: str) -> dict:
    return dict(DIST_OPT, use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)


def _assert_bitwise(strategy: str, got, ref) -> None:
    assert got[0] == ref[0], f"{strategy} losses {got[0]} != distributed optimizer {ref[0]}"
    if strategy == "optim_grads_params":  # the norm's partial sums group by the per-layer shards
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), rtol=1e-6, atol=0)
    else:
        assert got[1] == ref[1], f"{strategy} grad norms {got[1]} != distributed optimizer {ref[1]}"
    for name, weight in ref[2].items():
        assert torch.equal(got[2][name], weight), f"{strategy}: weight {name} differs"


def _assert_kept_shards(strategy: str, ddp, opt) -> None:
    """After a step: what the strategy keeps of the gradients and parameters (storage bytes)."""
    for buffer in ddp.all_buffers:
        grad_bytes = buffer.grad_data.untyped_storage().nbytes()
        full = buffer.grad_data.numel() * buffer.grad_data.element_size()
        if strategy == "optim":
            assert grad_bytes == full and buffer.grad_shard is None
        else:
            assert grad_bytes == 0, f"{strategy}: the full gradient buffer is still held ({grad_bytes} bytes)"
            assert buffer.grad_shard.numel() * buffer.dp_size == buffer.grad_data.numel()
        if strategy == "optim_grads_params":
            held = [b.index for b in buffer.buckets if b.param_data.untyped_storage().nbytes()]
            assert not held, f"buckets {held} keep their full parameters after the step"
            assert buffer.param_shard.numel() * buffer.dp_size == buffer.grad_data.numel()
    # The optimizer reads the shards: its fp32 main grads are views/copies of the kept slices.
    assert all(link.grad_source is not None for link in opt.links) == (strategy != "optim")


def _check_prefetch(events: List[Tuple[str, int]]) -> None:
    """Forward: gather k+1 issued before layer k's forward ends, waited after it; backward: gather k-1
    issued before layer k's backward is done (its ``free``)."""
    forward = events[: events.index(("backward_start", LAYERS - 1))]
    backward = events[len(forward) :]
    for k in range(LAYERS - 1):
        end = forward.index(("forward_end", k))
        assert forward.index(("gather", k + 1)) < end, f"layer {k + 1} not prefetched under layer {k}: {forward}"
        assert forward.index(("wait", k + 1)) > end, f"layer {k + 1} waited before layer {k} ended: {forward}"
    for k in range(LAYERS - 1, 0, -1):
        done = backward.index(("free", k))
        assert backward.index(("gather", k - 1)) < done, f"layer {k - 1} not prefetched in backward: {backward}"
    frees = [k for what, k in forward if what == "free"]
    assert frees == list(range(LAYERS)), f"forward did not free each layer after it ran: {forward}"


def _strategies(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel()
    model = gpt2_style(num_layers=LAYERS)
    refs = {}
    for strategy in STRATEGIES:
        # Clipping scales by the grad norm, whose rounding depends on the shard layout (docstring).
        dp_training.CLIP = 0.0 if strategy == "optim_grads_params" else CLIP
        if dp_training.CLIP not in refs:
            refs[dp_training.CLIP] = parallel_run(groups, model, DIST_OPT, dict(use_distributed_optimizer=True), ITERS)
        ref = refs[dp_training.CLIP]
        run = parallel_run(groups, model, _fsdp(strategy), dict(use_distributed_optimizer=True), iters=ITERS)
        _assert_bitwise(strategy, run, ref)
        _, _, _, opt, ddp = run
        train_step(ddp, opt, groups, ITERS)  # after parallel_run's finish_param_sync gathered everything
        if ddp.fsdp_units is not None:
            ddp.fsdp_units.events = []
        train_step(ddp, opt, groups, ITERS + 1)
        _assert_kept_shards(strategy, ddp, opt)
        if ddp.fsdp_units is not None:
            _check_prefetch(ddp.fsdp_units.events)


def test_sharding_strategies_match_the_distributed_optimizer_and_prefetch():
    run_distributed(_strategies, 2)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(data_parallel_sharding_strategy="optim_grads"), "needs use_megatron_fsdp=True"),
        (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim"), "distributed optimizer's buffers"),
        (dict(use_megatron_fsdp=True, use_distributed_optimizer=True), "no_shard shards nothing"),
        (dict(data_parallel_sharding_strategy="zero3"), "must be one of"),
        (
            dict(
                _fsdp("optim_grads_params"),
                overlap_param_gather=True,
            ),
            "layer by layer",
        ),
    ],
)
def test_refused_pairings_name_the_fields(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DistributedDataParallelConfig(**kwargs)
