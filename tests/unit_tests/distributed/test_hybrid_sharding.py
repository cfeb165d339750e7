"""Hybrid sharding: ``num_distributed_optimizer_instances`` = 2 at DP=4 (two instances of two ranks).

One spawn of four gloo ranks trains a 2-layer GPT with two microbatches per step under DDP + the
distributed optimizer sharded over all four ranks (the reference), then with two instances, under the
distributed optimizer and under Megatron-FSDP's ``optim_grads_params``. Each instance reduce-scatters
within its two ranks and all-reduces the reduced slice with the other instance: per element the sum
is (a + b) + (c + d) where the reference's reduce-scatter adds the four in its own order, so losses,
grad norms and weights agree to rounding (rtol 1e-6; weights near zero atol 1e-7), not bitwise.
Also checked on the same ranks:

* each rank holds the state of 1/2 of the parameters (the instance size), and its instance peer the
  other half; the other instance the same halves (its replica of the state);
* from the recorded events of one step: every bucket's cross-instance all-reduce is issued after its
  reduce-scatter within the instance is done, and all of them are done before the optimizer step;
* a checkpoint piece of the optimizer state is written by instance 0 only (instance 1's are replicas).
"""

from typing import List

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.process_groups import ParallelLayout
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style
from tests.unit_tests.distributed import dp_training
from tests.unit_tests.distributed.dp_training import parallel_run, train_step

LAYERS, ITERS, RTOL = 2, 2, 1e-6
DIST_OPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)
HYBRID = dict(DIST_OPT, num_distributed_optimizer_instances=2)
FSDP_HYBRID = dict(HYBRID, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")


def _assert_close(where: str, got, ref) -> None:
    for i, what in ((0, "losses"), (1, "grad norms")):
        torch.testing.assert_close(
            torch.tensor(got[i]), torch.tensor(ref[i]), rtol=RTOL, atol=0, msg=lambda m: f"{where} {what}: {m}"
        )
    for name, weight in ref[2].items():
        torch.testing.assert_close(got[2][name], weight, rtol=RTOL, atol=1e-7, msg=lambda m: f"{where} {name}: {m}")


def _assert_state_split(where: str, ddp, opt, groups) -> None:
    """Optimizer state elements per rank: the buffers' over the instance size; instances replicate."""
    state = sum(s["exp_avg"].numel() for s in opt.optimizer.state.values())
    padded = sum(b.grad_data.numel() for b in ddp.all_buffers)
    unpadded = sum(p.numel() for b in ddp.all_buffers for p in b.params)
    assert all(b.dp_size == 2 for b in ddp.all_buffers), where
    totals = torch.tensor([state], dtype=torch.int64)
    torch.distributed.all_reduce(totals, group=groups.intra_dp_cp)
    assert int(totals) == unpadded, f"{where}: the instance holds {int(totals)} state elements of {unpadded}"
    assert state <= padded // 2, where
    mine = torch.tensor([float(sum(float(s["exp_avg"].sum()) for s in opt.optimizer.state.values()))])
    peer = mine.clone()
    torch.distributed.all_reduce(peer, group=groups.inter_dist_opt)
    assert torch.equal(peer, 2 * mine), f"{where}: the instances' state differ"


def _assert_reduction_order(events: List[tuple], buckets: List[tuple]) -> None:
    """Per bucket: reduce-scatter issued, done, then the cross-instance all-reduce issued, done; the step last."""
    step = events.index(("step",))
    for buffer, bucket in buckets:
        order = [events.index((what, buffer, bucket)) for what in _ORDER]
        assert order == sorted(order), f"bucket {(buffer, bucket)} out of order: {events}"
        assert order[-1] < step, f"bucket {(buffer, bucket)} reduced after the optimizer step: {events}"


_ORDER = ("reduce_scatter", "reduce_scatter_done", "all_reduce_instances", "all_reduce_instances_done")


def _record_step(opt, events: List[tuple]) -> None:
    inner = opt.optimizer.step

    def step(*args, **kwargs):
        events.append(("step",))
        return inner(*args, **kwargs)

    opt.optimizer.step = step


def _hybrid(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    model = gpt2_style(num_layers=LAYERS)
    dp_training.CLIP = 0.0  # optim_grads_params' norm groups by per-layer shards: rounding only
    ref = parallel_run(groups, model, DIST_OPT, dict(use_distributed_optimizer=True), ITERS)
    for where, ddp_kwargs in (("hybrid", HYBRID), ("fsdp-hybrid", FSDP_HYBRID)):
        run = parallel_run(groups, model, ddp_kwargs, dict(use_distributed_optimizer=True), ITERS)
        _assert_close(where, run, ref)
        _, _, _, opt, ddp = run
        _assert_state_split(where, ddp, opt, groups)
        ddp.comm_events = []
        _record_step(opt, ddp.comm_events)
        train_step(ddp, opt, groups, ITERS)
        buckets = [(i, b.index) for i, buffer in enumerate(ddp.all_buffers) for b in buffer.buckets]
        _assert_reduction_order(ddp.comm_events, buckets)
        _assert_replicas(opt, model, groups)


def _assert_replicas(opt, model, groups) -> None:
    """Instance 0 writes the optimizer state (replica id 0); instance 1's identical pieces are replicas."""
    from megatron.core.dist_checkpointing.state_dict import sharded_tensors_by_param_name

    specs = sharded_tensors_by_param_name([opt.model_chunks[0]], groups, dp_replicas=False)
    pieces, _ = opt.sharded_state_to_save(opt.model_chunks, specs)
    assert pieces
    instance = groups.rank_in("inter_dist_opt")
    assert all((piece.replica_id == 0) == (instance == 0) for piece in pieces.values()), instance


def test_two_instances_match_one_and_reduce_in_order():
    run_distributed(_hybrid, 4)


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: DistributedDataParallelConfig(num_distributed_optimizer_instances=2), "distributed optimizer"),
        (lambda: DistributedDataParallelConfig(**dict(DIST_OPT, num_distributed_optimizer_instances=0)), "positive"),
        (lambda: ParallelLayout(world_size=6, num_distributed_optimizer_instances=4), "not divisible"),
    ],
)
def test_refusals_name_the_fields(build, words):
    with pytest.raises((ValueError, AssertionError), match=words) as err:
        build()
    assert "num_distributed_optimizer_instances" in str(err.value)


def test_the_command_line_names_the_flag_for_an_uneven_split():
    from megatron.training import arguments as A
    from tests.functional_tests.gpt_runs import mock_flags, tiny_gpt_flags

    flags = tiny_gpt_flags(2) + mock_flags() + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances"]
    A.validate_args(A.parse_args(flags + ["2"], entry_point="gpt"), 4)
    with pytest.raises(A.ArgumentsError, match="not divisible by --num-distributed-optimizer-instances 3"):
        A.validate_args(A.parse_args(flags + ["3"], entry_point="gpt"), 4)
