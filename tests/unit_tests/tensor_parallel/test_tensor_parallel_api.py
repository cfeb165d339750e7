"""Megatron Core 0.16's ``tensor_parallel`` API, called as upstream callers do (groups left out).

Every rank builds every rank's inputs from per-rank seeds, so each expected value is a
single-process computation (torch.cat / sum / slicing / the un-checkpointed block).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, CudaRNGStatesTracker
from tests.dist_harness import run_distributed

TP = 2


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _leaf(t):
    return t.clone().requires_grad_(True)


def _check_region_functions(rank):
    """The autograd functions under upstream names, applied with an explicit group."""
    group = ps.get_tensor_model_parallel_group()
    full = _rand(0, 4, 6)
    grads = [_rand(10 + r, 4, 6) for r in range(TP)]
    x = _leaf(full)
    mappings._CopyToModelParallelRegion.apply(x, group).backward(grads[rank])
    assert torch.allclose(x.grad, grads[0] + grads[1])
    x = _leaf(full)
    out = mappings._ScatterToModelParallelRegion.apply(x, group)
    assert torch.equal(out, full[:, 3 * rank : 3 * rank + 3])
    out.backward(grads[rank][:, :3])
    assert torch.equal(x.grad, torch.cat([grads[0][:, :3], grads[1][:, :3]], dim=-1))
    mine = _leaf(_rand(20 + rank, 4, 3))
    out = mappings._GatherFromModelParallelRegion.apply(mine, group)
    assert torch.equal(out, torch.cat([_rand(20, 4, 3), _rand(21, 4, 3)], dim=-1))
    out.backward(grads[0])
    assert torch.equal(mine.grad, grads[0][:, 3 * rank : 3 * rank + 3])
    # Uneven sequence pieces: rank 0 holds 3 rows, rank 1 holds 1.
    sizes = [3, 1]
    mine = _leaf(_rand(30 + rank, sizes[rank], 5))
    out = mappings._GatherFromSequenceParallelRegion.apply(mine, group, True, sizes)
    assert torch.equal(out, torch.cat([_rand(30, 3, 5), _rand(31, 1, 5)]))
    out.backward(_rand(40 + rank, 4, 5))
    summed = _rand(40, 4, 5) + _rand(41, 4, 5)
    assert torch.allclose(mine.grad, summed[:3] if rank == 0 else summed[3:])
    partial = _leaf(_rand(50 + rank, 4, 5))
    out = mappings._ReduceScatterToSequenceParallelRegion.apply(partial, group, sizes)
    summed = _rand(50, 4, 5) + _rand(51, 4, 5)
    assert torch.allclose(out, summed[:3] if rank == 0 else summed[3:])


def _check_wrappers_without_group(rank):
    """The public wrappers, the 1-D split/gather and all-to-all with the group left out."""
    full = _rand(1, 8, 6)
    x = _leaf(full)
    out = tensor_parallel.scatter_to_sequence_parallel_region(x)
    assert torch.equal(out, full[4 * rank : 4 * rank + 4])
    gathered = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
    assert torch.equal(gathered, full)
    gathered.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(full))  # split back, then gathered: every row once
    reduced = tensor_parallel.reduce_from_tensor_model_parallel_region(_rand(60 + rank, 3))
    assert torch.allclose(reduced, _rand(60, 3) + _rand(61, 3))
    # sp2hp: [tokens/tp, h] -> [tokens, h/tp]; hp2sp goes back.
    mine = full[4 * rank : 4 * rank + 4]
    hidden_split = tensor_parallel.all_to_all_sp2hp(mine)
    assert torch.equal(hidden_split, full[:, 3 * rank : 3 * rank + 3])
    assert torch.equal(tensor_parallel.all_to_all_hp2sp(hidden_split), mine)
    group = ps.get_tensor_model_parallel_group()
    sent = _leaf(_rand(70 + rank, 4, 2))
    received = tensor_parallel.all_to_all(group, sent, [1, 3] if rank == 0 else [3, 1], [1, 3] if rank == 0 else [3, 1])
    want = [_rand(70, 4, 2)[:1], _rand(71, 4, 2)[:3]] if rank == 0 else [_rand(70, 4, 2)[1:], _rand(71, 4, 2)[3:]]
    assert torch.equal(received, torch.cat(want))
    received.sum().backward()
    assert torch.equal(sent.grad, torch.ones(4, 2))
    view = tensor_parallel.split_tensor_into_1d_equal_chunks(full)
    copy = tensor_parallel.split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    assert torch.equal(view, full.view(-1)[24 * rank : 24 * rank + 24]) and torch.equal(copy, view)
    assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert copy.untyped_storage().nbytes() == full.untyped_storage().nbytes() // TP
    assert torch.equal(tensor_parallel.gather_split_1d_tensor(copy), full.view(-1))
    # Any-rank pieces gather flat, in each piece's logical (row-major) order; a transposed view too.
    pieces = [_rand(90 + r, 2, 4) for r in range(TP)]
    assert torch.equal(tensor_parallel.gather_split_1d_tensor(pieces[rank]), torch.cat(pieces).view(-1))
    want = torch.cat([p.t().reshape(-1) for p in pieces])
    assert torch.equal(tensor_parallel.gather_split_1d_tensor(pieces[rank].t()), want)


def _check_broadcast_data(rank):
    batch = {"text": torch.arange(12).view(3, 4), "labels": torch.arange(5) * 7}
    out = tensor_parallel.broadcast_data(["text", "labels"], batch if rank == 0 else None, torch.int64)
    assert torch.equal(out["text"], batch["text"]) and torch.equal(out["labels"], batch["labels"])
    with pytest.raises(AssertionError):  # every rank learns of rank 0's wrong dtype
        tensor_parallel.broadcast_data(["text"], batch if rank == 0 else None, torch.float32)


def _block(x, w):
    with tensor_parallel.get_cuda_rng_tracker().fork():
        h = F.dropout(F.linear(x, w), 0.5, training=True)
    return F.dropout(h.relu(), 0.2, training=True)


def _check_distributed_checkpoint(rank):
    """distribute_saved_activations=True: the input really shrinks to 1/tp until backward."""
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    x0, w0, g = _rand(80, 4, 2, 8), _rand(81, 6, 8), _rand(82, 4, 2, 6)
    start = tensor_parallel.get_cuda_rng_tracker().get_states(), torch.get_rng_state()
    x, w = _leaf(x0), _leaf(w0)
    reference = _block(x, w)
    reference.backward(g)
    ref_grads = x.grad, w.grad
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(start[0]))
    torch.set_rng_state(start[1])
    x, w = _leaf(x0), _leaf(w0)
    saved_bytes = []
    pack = lambda t: saved_bytes.append(t.untyped_storage().nbytes()) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tensor_parallel.checkpoint(_block, True, x, w)
    full_bytes = x0.numel() * x0.element_size()
    assert x.untyped_storage().nbytes() == full_bytes // TP and x.shape == (x0.numel() // TP,)
    assert saved_bytes[0] == full_bytes // TP
    assert torch.equal(out, reference)
    out.backward(g)
    assert x.shape == x0.shape and torch.equal(x.detach(), x0)
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])


def _check_linear_and_layer_helpers(rank):
    """Upstream's functional linear signature and the layer helpers, default group."""
    x0, w = _rand(100, 4, 2, 8), _rand(101 + rank, 3, 8)  # this rank's 3 output rows
    x = _leaf(x0)
    out = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=True, sequence_parallel=False
    )
    assert torch.allclose(out, F.linear(x0, w))
    out.backward(torch.ones_like(out))
    summed = sum(torch.ones(4, 2, 3) @ _rand(101 + r, 3, 8) for r in range(TP))  # both ranks' input grads
    assert torch.allclose(x.grad, summed)
    piece = _leaf(x0[2 * rank : 2 * rank + 2])
    out = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        piece, w, None, False, False, sequence_parallel=True
    )
    assert torch.allclose(out, F.linear(x0, w))  # the sequence was gathered first
    replicated, shard = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    tensor_parallel.set_tensor_model_parallel_attributes(shard, True, 0, 1)
    assert tensor_parallel.param_is_not_tensor_parallel_duplicate(replicated) == (rank == 0)
    assert tensor_parallel.param_is_not_tensor_parallel_duplicate(shard)


def _tensor_parallel_api_on_two_ranks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    checks = (_check_region_functions, _check_wrappers_without_group, _check_broadcast_data)
    for check in checks + (_check_linear_and_layer_helpers,):
        check(rank)
    _check_distributed_checkpoint(rank)


def test_tensor_parallel_api_on_two_ranks():
    run_distributed(_tensor_parallel_api_on_two_ranks, TP)


def test_checkpoint_without_output_frees_and_recomputes():
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    x0, w0 = _rand(90, 5, 8), _rand(91, 8, 8)
    start = tensor_parallel.get_cuda_rng_tracker().get_states(), torch.get_rng_state()
    x, w = _leaf(x0), _leaf(w0)
    reference = F.linear(_block(x, w), w)
    reference.sum().backward()
    ref_grads = x.grad, w.grad
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(start[0]))
    torch.set_rng_state(start[1])
    x, w = _leaf(x0), _leaf(w0)
    ckpt = CheckpointWithoutOutput()
    hidden = ckpt.checkpoint(lambda a, b, scale: _block(a, b) * scale, x, w, 1.0)  # a non-tensor input too
    out = F.linear(hidden, w)  # saves ``hidden`` for its backward
    ckpt.discard_output_and_register_recompute(out)
    assert hidden.untyped_storage().nbytes() == 0 and hidden.shape == (5, 8)
    assert torch.equal(out, reference)
    out.sum().backward()
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])


def test_rng_tracker_keeps_states_as_given_and_upstream_seed_keywords():
    tracker = CudaRNGStatesTracker()
    states = {"a": torch.get_rng_state()}
    tracker.set_states(states)
    assert tracker.states_ is states and tracker.get_states()["a"] is states["a"]
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0)
    current = tensor_parallel.get_cuda_rng_tracker()
    assert set(current.get_states()) == {"model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"}
    with current.fork(tensor_parallel.get_data_parallel_rng_tracker_name()):
        draw = torch.rand(3)
    assert torch.equal(draw, torch.rand(3, generator=torch.Generator().manual_seed(5)))
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    assert tensor_parallel.get_cuda_rng_tracker() is not current
    with pytest.raises(ValueError, match="not supported"):
        tensor_parallel.model_parallel_cuda_manual_seed(5, te_rng_tracker=True, tp_rank=0, ep_rank=0, etp_rank=0)
    assert tensor_parallel.get_expert_parallel_rng_tracker_name() == "expert-parallel-rng"
    assert not tensor_parallel.is_graph_safe_cuda_rng_tracker(tensor_parallel.get_cuda_rng_tracker())


def test_is_checkpointing_inside_forward_and_recompute():
    seen = []

    def block(x):
        seen.append(tensor_parallel.random.is_checkpointing())
        return x * 2

    x = _leaf(torch.ones(3))
    tensor_parallel.checkpoint(block, False, x).sum().backward()
    assert seen == [True, True] and not tensor_parallel.random.is_checkpointing()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
