"""``overlap_param_gather``: each bucket's all-gather is waited for by the first module that needs it.

Two gloo ranks train a 4-layer GPT under DDP + the distributed optimizer with several buckets.
The all-gathers are wrapped to record their waits next to the layers' forward starts and the end
of each forward: every bucket is waited once, in forward order, inside the first forward of the
iteration (not in the optimizer step before it), and the wait for bucket 0 (the last layers: buckets
follow backward order) comes after the first layer's forward has started, i.e. the forward overlaps
the gathers it does not need yet. A step that waits for its own gathers fails this. Losses and
final weights must equal the run that waits for every gather in the optimizer step, bitwise.
"""

from typing import List, Tuple

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import param_and_grad_buffer
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style
from tests.unit_tests.distributed.dp_training import parallel_run, train_step

DIST = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000)
ITERS = 3


class _RecordedWork:
    """A collective handle that logs ``("wait", bucket)`` the first time it is waited on."""

    def __init__(self, work, bucket: int, events: List[Tuple[str, int]]) -> None:
        self.work, self.bucket, self.events = work, bucket, events

    def wait(self) -> bool:
        self.events.append(("wait", self.bucket))
        return self.work.wait()


def _record(events: List[Tuple[str, int]], bucket_of_ptr: dict):
    real = param_and_grad_buffer.all_gather_into_tensor

    def gather(output, inp, group=None, async_op=False):
        work = real(output, inp, group=group, async_op=async_op)
        return _RecordedWork(work, bucket_of_ptr[output.data_ptr()], events) if async_op else work

    return gather


def _overlapped(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel()
    model_kwargs = gpt2_style(num_layers=4)
    events: List[Tuple[str, int]] = []
    bucket_of_ptr: dict = {}
    original = param_and_grad_buffer.all_gather_into_tensor
    param_and_grad_buffer.all_gather_into_tensor = _record(events, bucket_of_ptr)
    try:
        got = parallel_run(
            groups, model_kwargs, DIST, dict(use_distributed_optimizer=True, overlap_param_gather=True), iters=0
        )
        _, _, _, opt, ddp = got
        (buffer,) = ddp.buffers
        assert len(buffer.buckets) >= 3, f"want several buckets, got {len(buffer.buckets)}"
        bucket_of_ptr.update({b.param_data.data_ptr(): b.index for b in buffer.buckets})
        for i, layer in enumerate(ddp.module.decoder.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", i)))
        ddp.module.register_forward_hook(lambda m, a, o: events.append(("forward_done", -1)))
        overlapped = _train(groups, ddp, opt, events)
    finally:
        param_and_grad_buffer.all_gather_into_tensor = original
    log = overlapped[2]
    first_forward = log.index(("forward", 0))
    last_wait = log.index(("wait", 0))
    assert last_wait > first_forward, f"bucket 0 waited before the first layer ran: {log}"
    forward_done = log.index(("forward_done", -1))
    late = [b for i, (kind, b) in enumerate(log) if kind == "wait" and i > forward_done]
    assert not late, f"buckets {late} waited after the first forward, not under it: {log}"
    waits = [b for kind, b in log if kind == "wait"]
    assert waits == sorted(waits, reverse=True), f"buckets not waited in forward order: {waits}"
    assert sorted(waits) == list(range(len(buffer.buckets))), f"not every bucket waited once: {waits}"

    plain = parallel_run(groups, model_kwargs, DIST, dict(use_distributed_optimizer=True), iters=0)
    reference = _train(groups, plain[4], plain[3], [])
    assert overlapped[0] == reference[0], f"losses differ: {overlapped[0]} vs {reference[0]}"
    for name, weight in reference[1].items():
        assert torch.equal(overlapped[1][name], weight), f"weight {name} differs"


def _train(groups, ddp, opt, events: List[Tuple[str, int]]):
    """(losses, final weights, the events of the last iteration alone)."""
    losses = []
    for it in range(ITERS):
        events.clear()  # the last iteration's forward waits for the previous step's gathers
        losses.append(train_step(ddp, opt, groups, it)[0])
    log = list(events)
    ddp.finish_param_sync()
    return losses, {n: p.detach().clone() for n, p in ddp.module.named_parameters()}, log


def test_overlap_param_gather_waits_per_bucket_and_matches_bitwise():
    run_distributed(_overlapped, 2)


def _save_right_after_a_step(rank: int, world_size: int, save_dir: str) -> None:
    from megatron.training import checkpointing

    groups = ps.initialize_model_parallel()
    _, _, _, opt, ddp = parallel_run(
        groups, gpt2_style(num_layers=2), DIST, dict(use_distributed_optimizer=True, overlap_param_gather=True), iters=0
    )
    train_step(ddp, opt, groups, 0)
    (buffer,) = ddp.buffers
    assert any(b.param_gather_handle is not None for b in buffer.buckets)  # the step left gathers running
    real_save = checkpointing.dc.save

    def save(sharded_sd, directory, *args, **kwargs):
        pending = [b.index for b in buffer.buckets if b.param_gather_handle is not None]
        assert not pending, f"parameters written while buckets {pending} were still being gathered"
        return real_save(sharded_sd, directory, *args, **kwargs)

    checkpointing.dc.save = save
    try:  # no optimizer state: nothing on the optimizer's side waits for the gathers
        checkpointing.save_checkpoint(1, [ddp], None, None, checkpointing.CheckpointConfig(save=save_dir), {}, {})
    finally:
        checkpointing.dc.save = real_save


def test_a_checkpoint_waits_for_the_parameter_gathers(tmp_path):
    run_distributed(_save_right_after_a_step, 2, str(tmp_path / "ckpt"))


def _stale_fusion_flags_cleared(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel()
    _, _, _, _, ddp = parallel_run(
        groups, gpt2_style(num_layers=1), DIST, dict(use_distributed_optimizer=True), iters=0
    )
    params = list(ddp.module.parameters())
    ddp.zero_grad_buffer()  # creates the attribute TE's fused weight-gradient accumulation sets
    assert all(p.grad_added_to_main_grad is False for p in params)
    for param in params:  # what a backward that raised after the fused wgrad leaves behind
        param.grad_added_to_main_grad = True
    ddp.zero_grad_buffer()
    assert all(p.grad_added_to_main_grad is False for p in params)


def test_zero_grad_buffer_creates_and_clears_the_fusion_flags():
    run_distributed(_stale_fusion_flags_cleared, 1)


def _step_waits_and_issue_order(rank: int, world_size: int) -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    groups = ps.initialize_model_parallel()
    issued: List[int] = []
    bucket_of_ptr: dict = {}
    real_gather = param_and_grad_buffer.all_gather_into_tensor

    def gather(output, inp, group=None, async_op=False):
        issued.append(bucket_of_ptr.get(output.data_ptr(), -1))
        return real_gather(output, inp, group=group, async_op=async_op)

    _, _, _, opt, ddp = parallel_run(
        groups, gpt2_style(num_layers=2), DIST, dict(use_distributed_optimizer=True, overlap_param_gather=True), iters=0
    )
    (buffer,) = ddp.buffers
    bucket_of_ptr.update({b.param_data.data_ptr(): b.index for b in buffer.buckets})
    real_step = MegatronOptimizer.step

    def checked_step(self):
        pending = [b.index for b in buffer.buckets if b.param_gather_handle is not None]
        assert not pending, f"the update writes the parameter buffer while buckets {pending} are gathering"
        return real_step(self)

    param_and_grad_buffer.all_gather_into_tensor, MegatronOptimizer.step = gather, checked_step
    try:
        train_step(ddp, opt, groups, 0)  # leaves the gathers running
        assert issued == sorted(issued, reverse=True) and len(issued) == len(buffer.buckets), issued
        opt.step()  # again with no forward in between: nothing waited for the gathers yet
    finally:
        param_and_grad_buffer.all_gather_into_tensor, MegatronOptimizer.step = real_gather, real_step


def test_step_waits_for_the_gathers_issued_last_bucket_first():
    run_distributed(_step_waits_and_issue_order, 2)
