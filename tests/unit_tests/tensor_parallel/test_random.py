"""RNG tracker streams and activation checkpointing with RNG replay.

References are fresh ``torch.Generator``s seeded with the documented seeds, and
the same block run without checkpointing from the same RNG states. Dropout masks
and gradients must be bit-identical (tolerance 0: same ops in the same order).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from tests.dist_harness import run_distributed


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_tracker_rejects_duplicates_and_unknown_streams():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 10)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 11)
    with pytest.raises(ValueError, match="seed 10"):
        tracker.add("b", 10)
    with pytest.raises(RuntimeError, match="'missing' is not tracked"):
        with tracker.fork("missing"):
            pass


def test_fork_draws_from_stream_and_leaves_outer_stream_alone():
    tracker = CudaRNGStatesTracker()
    tracker.add("s", 77)
    torch.manual_seed(5)
    outer, inner = _gen(5), _gen(77)
    first = torch.randn(4)
    with tracker.fork("s"):
        in_fork = torch.randn(4)
    with tracker.fork("s"):  # the stream continues where it stopped
        in_fork_again = torch.randn(4)
    after = torch.randn(4)
    assert torch.equal(first, torch.randn(4, generator=outer))
    assert torch.equal(after, torch.randn(4, generator=outer))
    assert torch.equal(in_fork, torch.randn(4, generator=inner))
    assert torch.equal(in_fork_again, torch.randn(4, generator=inner))
    saved = tracker.get_states()
    with tracker.fork("s"):
        replay_a = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("s"):
        replay_b = torch.rand(3)
    assert torch.equal(replay_a, replay_b)


def test_seed_formula_with_explicit_ranks():
    tp.model_parallel_cuda_manual_seed(100, tp_rank=3, ep_rank=2, etp_rank=1)
    tracker = tp.get_cuda_rng_tracker()
    with tracker.fork("model-parallel-rng"):
        tp_draw = torch.rand(3)
    with tracker.fork("expert-parallel-rng"):
        ep_draw = torch.rand(3)
    assert torch.equal(tp_draw, torch.rand(3, generator=_gen(100 + 2718 + 3)))
    assert torch.equal(ep_draw, torch.rand(3, generator=_gen(100 + 1024 + 100 * 2 + 1)))
    assert torch.equal(torch.rand(3), torch.rand(3, generator=_gen(100)))


def _block(x, w, scale):
    """Linear, then dropout inside the TP stream and outside it; two outputs."""
    h = F.linear(x, w)  # [s, b, o]
    with tp.get_cuda_rng_tracker().fork():
        h = F.dropout(h, 0.5, training=True)
    return F.dropout(h.relu(), 0.3, training=True) * scale, h.sum(-1)


def _compare_checkpoint(distribute, seed, tp_group=None):
    """Same block with and without checkpointing from identical RNG states: identical results."""
    x0 = torch.randn(4, 2, 8, generator=_gen(seed))
    w0 = torch.randn(6, 8, generator=_gen(seed + 1))
    g0, g1 = torch.randn(4, 2, 6, generator=_gen(seed + 2)), torch.randn(4, 2, generator=_gen(seed + 3))
    cpu_state, tracked = torch.get_rng_state(), tp.get_cuda_rng_tracker().get_states()
    results = []
    for use_checkpoint in (False, True):
        torch.set_rng_state(cpu_state)
        tp.get_cuda_rng_tracker().set_states(dict(tracked))  # set_states keeps the dict it is given
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if use_checkpoint:
            saved_sizes = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_sizes.append(t.numel()) or t, lambda t: t):
                out, total = tp.checkpoint(_block, distribute, x, w, 2.0, tp_group=tp_group)
            # Only the inputs are kept; with distribution the first one is split over TP.
            shards = dist.get_world_size(tp_group or ps.get_tensor_model_parallel_group()) if distribute else 1
            assert saved_sizes == [x0.numel() // shards, w0.numel()], saved_sizes
        else:
            out, total = _block(x, w, 2.0)
        # Later layers draw between forward and backward; the recompute must not rewind them.
        torch.rand(5)
        with tp.get_cuda_rng_tracker().fork():
            torch.rand(5)
        torch.autograd.backward([out, total], [g0, g1])
        with tp.get_cuda_rng_tracker().fork():
            next_tp = torch.rand(2)
        results.append((out.detach(), total.detach(), x.grad, w.grad, torch.rand(2), next_tp))
    names = ("out", "sum", "dx", "dw", "next default draw", "next tp-stream draw")
    for name, plain, ckpt in zip(names, *results):
        assert torch.equal(plain, ckpt), f"checkpoint(distribute={distribute}): {name} differs"


def test_checkpoint_replays_dropout_single_process():
    tp.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
    _compare_checkpoint(False, 11)


def _gathered_mask(group, stream):
    """Dropout mask drawn on this rank (under ``stream`` or the default), gathered from every rank."""
    x = torch.ones(64)
    if stream:
        with tp.get_cuda_rng_tracker().fork():
            mask = F.dropout(x, 0.5, training=True)
    else:
        mask = F.dropout(x, 0.5, training=True)
    masks = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(masks, mask, group=group)
    return masks


def _body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp.model_parallel_cuda_manual_seed(1234)
    world = dist.group.WORLD
    tp_rank = ps.get_tensor_model_parallel_rank()
    outside = _gathered_mask(world, stream=False)
    assert all(torch.equal(m, outside[0]) for m in outside), "default-stream dropout must agree on all ranks"
    inside = _gathered_mask(world, stream=True)
    for other in range(world_size):
        same_tp_rank = other % 2 == tp_rank  # tp is the fastest-varying dimension
        assert torch.equal(inside[other], inside[rank]) == same_tp_rank, (rank, other)
    _compare_checkpoint(False, 21)
    _compare_checkpoint(True, 31)  # first input stored as 1/tp per rank, gathered for the recompute
    _compare_checkpoint(True, 41, tp_group=ps.get_tensor_model_parallel_group())


@pytest.mark.parametrize("world_size", [2, 4])
def test_tracker_and_checkpoint_across_ranks(world_size):
    run_distributed(_body, world_size)
