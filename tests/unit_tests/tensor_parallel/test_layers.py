"""Tensor-parallel layers against plain F.linear / F.embedding with the same full weights.

With ``tp_comm_overlap`` the sequence-parallel linears run their ring all-gather / reduce-scatter
(``tp_overlap``) against the same reference, and a recorder of the ring's events checks the order:
each transfer posted before the GEMM it overlaps and waited for after it.

Each rank loads its shard of a seeded full weight, runs forward and backward, and
compares output, input gradient and weight/bias gradients with a single-process
reference computed in the same process from the full weight (shards compared
against slices of the reference's gradients). fp32, rtol 1e-5 / atol 1e-6.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import tp_overlap
from tests.dist_harness import run_distributed

RTOL, ATOL = 1e-5, 1e-6
S, B, H, O, V = 8, 2, 32, 48, 64  # all divisible by 1, 2, 4


def _rand(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _piece(x, dim, r, n):
    size = x.size(dim) // n
    return x.narrow(dim, r * size, size)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _reference(fn, inputs, grad_out):
    """Run ``fn`` on leaf copies of ``inputs``; return (output, grads of inputs)."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def _load(param, value):
    with torch.no_grad():
        param.copy_(value)


def _init_ones(w):
    return torch.nn.init.ones_(w)


def _check_column(r, n, sequence_parallel, gather_output, skip_bias_add, tied, overlap=False):
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=n, sequence_parallel=sequence_parallel, tp_comm_overlap=overlap
    )
    layer = tp.ColumnParallelLinear(
        H,
        O,
        config=cfg,
        init_method=_init_ones,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        skip_weight_param_allocation=tied,
    )
    x, w, b, g = _rand(1, S, B, H), _rand(2, O, H), _rand(3, O), _rand(4, S, B, O)
    ref_out, (ref_dx, ref_dw, ref_db) = _reference(F.linear, [x, w, b], g)
    w_shard = _piece(w, 0, r, n).clone().requires_grad_(True)
    if not tied:
        _load(layer.weight, w_shard)
    _load(layer.bias, _piece(b, 0, r, n))
    x_in = (_piece(x, 0, r, n) if sequence_parallel else x).clone().requires_grad_(True)
    out, out_bias = layer(x_in, weight=w_shard if tied else None)
    if skip_bias_add:
        assert out_bias is layer.bias
        out = out + out_bias
    else:
        assert out_bias is None
    out.backward(g if gather_output else _piece(g, -1, r, n))
    what = f"column sp={sequence_parallel} gather={gather_output} skip_bias={skip_bias_add} tied={tied} {overlap=}"
    _close(out, ref_out if gather_output else _piece(ref_out, -1, r, n), what + " out")
    _close(x_in.grad, _piece(ref_dx, 0, r, n) if sequence_parallel else ref_dx, what + " dx")
    _close((w_shard if tied else layer.weight).grad, _piece(ref_dw, 0, r, n), what + " dw")
    _close(layer.bias.grad, _piece(ref_db, 0, r, n), what + " db")


def _check_row(r, n, sequence_parallel, input_is_parallel, skip_bias_add, overlap=False):
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=n, sequence_parallel=sequence_parallel, tp_comm_overlap=overlap
    )
    layer = tp.RowParallelLinear(
        O, H, config=cfg, init_method=_init_ones, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add
    )
    x, w, b, g = _rand(5, S, B, O), _rand(6, H, O), _rand(7, H), _rand(8, S, B, H)
    ref_out, (ref_dx, ref_dw, ref_db) = _reference(F.linear, [x, w, b], g)
    _load(layer.weight, _piece(w, 1, r, n))
    _load(layer.bias, b)
    x_in = (_piece(x, -1, r, n) if input_is_parallel else x).clone().requires_grad_(True)
    out, out_bias = layer(x_in)
    if skip_bias_add:
        assert out_bias is layer.bias
        out = out + out_bias
    out.backward(_piece(g, 0, r, n) if sequence_parallel else g)
    what = f"row sp={sequence_parallel} parallel_in={input_is_parallel} skip_bias={skip_bias_add} {overlap=}"
    _close(out, _piece(ref_out, 0, r, n) if sequence_parallel else ref_out, what + " out")
    _close(x_in.grad, _piece(ref_dx, -1, r, n) if input_is_parallel else ref_dx, what + " dx")
    _close(layer.weight.grad, _piece(ref_dw, 1, r, n), what + " dw")
    bias_grad = layer.bias.grad.clone()
    assert layer.bias.sequence_parallel == sequence_parallel
    if sequence_parallel:  # each rank saw only its sequence piece: the training code sums over TP
        dist.all_reduce(bias_grad, group=layer.tp_group)
    _close(bias_grad, ref_db, what + " db")


def _check_embedding(r, n, reduce_scatter):
    cfg = ModelParallelConfig(tensor_model_parallel_size=n)
    layer = tp.VocabParallelEmbedding(
        V, H, init_method=_init_ones, config=cfg, reduce_scatter_embeddings=reduce_scatter
    )
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(9))
    w, g = _rand(10, V, H), _rand(11, S, B, H)  # g in [s, b, h]
    ref_out, (ref_dw,) = _reference(lambda t: F.embedding(ids, t), [w], g.transpose(0, 1))  # [b, s, h]
    _load(layer.weight, _piece(w, 0, r, n))
    out = layer(ids)
    if reduce_scatter:
        _close(out, _piece(ref_out.transpose(0, 1), 0, r, n), "embedding reduce-scatter out [s/tp, b, h]")
        out.backward(_piece(g, 0, r, n))
    else:
        _close(out, ref_out, "embedding out [b, s, h]")
        out.backward(g.transpose(0, 1))
    _close(layer.weight.grad, _piece(ref_dw, 0, r, n), f"embedding reduce_scatter={reduce_scatter} dw")


def _gather(shard, dim, group):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim)


def _check_cpu_initialization(r, n, single_group):
    """Same seed -> the same full weights for TP=n (shards gathered) as for a TP=1 layer."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=n, use_cpu_initialization=True)
    init = lambda t: torch.nn.init.normal_(t, std=1.0)  # noqa: E731
    builders = {
        "column": (
            lambda grp, stride=1: tp.ColumnParallelLinear(
                H, O, config=cfg, init_method=init, tp_group=grp, stride=stride
            ),
            0,
        ),
        "row": (lambda grp: tp.RowParallelLinear(O, H, config=cfg, init_method=init, tp_group=grp), 1),
        "embedding": (lambda grp: tp.VocabParallelEmbedding(V, H, config=cfg, init_method=init, tp_group=grp), 0),
    }
    tp_group = ps.get_tensor_model_parallel_group()
    for name, (build, dim) in builders.items():
        torch.manual_seed(1234)
        full = build(single_group).weight.detach()
        torch.manual_seed(1234)
        layer = build(tp_group)
        assert torch.equal(_gather(layer.weight.detach(), dim, tp_group), full), name
        assert layer.weight.partition_dim == dim and layer.weight.tensor_model_parallel, name
        if getattr(layer, "bias", None) is not None:
            assert not layer.bias.abs().sum(), f"{name} bias must start at zero"
    # stride 2: rank r holds output blocks r and r + n of 2n equal blocks.
    torch.manual_seed(99)
    full = builders["column"][0](single_group).weight.detach()
    torch.manual_seed(99)
    strided = builders["column"][0](tp_group, stride=2).weight.detach()
    block = O // (2 * n)
    rows = [j for j in range(O) if (j // block) % n == r]
    assert torch.equal(strided, full[rows])


def _check_sharded_initialization(r, n):
    """Without CPU init each rank fills its shard from 'model-parallel-rng' = seed + 2718 + tp_rank."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=n)
    tp.model_parallel_cuda_manual_seed(7)
    layer = tp.ColumnParallelLinear(H, O, config=cfg, init_method=lambda t: torch.nn.init.normal_(t))
    expected = torch.empty(O // n, H).normal_(generator=torch.Generator().manual_seed(7 + 2718 + r))
    assert torch.equal(layer.weight.detach(), expected)
    assert tp.param_is_not_tensor_parallel_duplicate(layer.weight, r)
    bf16 = ModelParallelConfig(tensor_model_parallel_size=n, params_dtype=torch.bfloat16)
    row = tp.RowParallelLinear(O, H, config=bf16, init_method=_init_ones)
    assert row.weight.dtype == torch.bfloat16 and row.bias.dtype == torch.bfloat16
    assert tp.param_is_not_tensor_parallel_duplicate(row.bias, r) == (r == 0)


class _RingRecorder:
    """Logs the order of ``tp_overlap``'s events: each ring transfer posted and waited for, each chunk GEMM."""

    def __init__(self):
        self.events, self.posts, self.gemms = [], 0, 0
        self.ring_step, self.gemm = tp_overlap._ring_step, tp_overlap._gemm

    def _posted(self, *args, **kwargs):
        step, self.posts = self.posts, self.posts + 1
        self.events.append(("post", step))
        works = self.ring_step(*args, **kwargs)
        recorder = self

        class _Work:
            def __init__(self, work):
                self.work = work

            def wait(self):
                recorder.events.append(("wait", step))
                return self.work.wait()

        return [_Work(w) for w in works]

    def _gemm(self, *args, **kwargs):
        self.events.append(("gemm", self.gemms))
        self.gemms += 1
        return self.gemm(*args, **kwargs)

    def __enter__(self):
        tp_overlap._ring_step, tp_overlap._gemm = self._posted, self._gemm
        return self

    def __exit__(self, *exc):
        tp_overlap._ring_step, tp_overlap._gemm = self.ring_step, self.gemm

    def at(self, event):
        """Where ``event`` first happened (an event that never happened is last)."""
        return self.events.index(event) if event in self.events else len(self.events)


def _check_overlap_order(r, n):
    """Structural: with tp_comm_overlap the transfer of chunk i+1 is posted before the GEMM of chunk i and
    waited for after it (all-gather); a partial sum's send travels during the next chunk's GEMM
    (reduce-scatter). A blocking gather before the GEMMs, or a wait before the GEMM, fails."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=n, sequence_parallel=True, tp_comm_overlap=True)
    column = tp.ColumnParallelLinear(H, O, config=cfg, init_method=_init_ones)
    row = tp.RowParallelLinear(O, H, config=cfg, init_method=_init_ones, input_is_parallel=True)
    with _RingRecorder() as gather:
        column(_rand(12, S // n, B, H))
    with _RingRecorder() as scatter:
        row(_rand(13, S, B, O // n))
    for log in (gather, scatter):
        assert log.gemms == n and log.posts == n - 1, log.events
    for i in range(n - 1):
        # all-gather step i: the piece for GEMM i+1 is posted before GEMM i and awaited after it
        assert gather.at(("post", i)) < gather.at(("gemm", i)) < gather.at(("wait", i)), gather.events
        # reduce-scatter: the partial sum posted after GEMM i travels during GEMM i+1
        assert scatter.at(("gemm", i)) < scatter.at(("post", i)) < scatter.at(("gemm", i + 1)), scatter.events
        assert scatter.at(("gemm", i + 1)) < scatter.at(("wait", i)), scatter.events


def _body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp.model_parallel_cuda_manual_seed(5)  # layers initialize their shards under the tracked TP stream
    singles = [dist.new_group([k]) for k in range(world_size)]
    r, n = ps.get_tensor_model_parallel_rank(), world_size
    for sp, gather, skip, tied in [
        (False, False, False, False),
        (False, True, False, False),
        (False, False, True, False),
        (True, False, False, False),
        (False, False, False, True),
        (True, False, True, False),
    ]:
        _check_column(r, n, sp, gather, skip, tied)
    for sp, parallel_in, skip in [
        (False, False, False),
        (False, True, False),
        (True, True, False),
        (False, True, True),
    ]:
        _check_row(r, n, sp, parallel_in, skip)
    # tp_comm_overlap: the ring all-gather / reduce-scatter under chunk GEMMs, against the same reference.
    _check_column(r, n, True, False, False, False, overlap=True)
    _check_column(r, n, True, False, True, True, overlap=True)
    _check_row(r, n, True, True, False, overlap=True)
    _check_row(r, n, True, True, True, overlap=True)
    _check_overlap_order(r, n)
    _check_embedding(r, n, reduce_scatter=False)
    _check_embedding(r, n, reduce_scatter=True)
    _check_cpu_initialization(r, n, singles[rank])
    _check_sharded_initialization(r, n)


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_match_single_process_reference(world_size):
    run_distributed(_body, world_size)


def test_divide_names_both_numbers():
    assert tp.divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        tp.divide(10, 4)


def test_invalid_layer_combinations_are_rejected():
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="gather_output"):
        tp.ColumnParallelLinear(8, 8, config=cfg, init_method=_init_ones, gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        tp.RowParallelLinear(8, 8, config=cfg, init_method=_init_ones, input_is_parallel=False)


def test_split_and_vocab_ranges():
    x = torch.arange(24.0).view(2, 12)
    pieces = tp.split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    assert [p.tolist() for p in pieces] == [
        [[0, 1, 2, 3], [12, 13, 14, 15]],
        [[4, 5, 6, 7], [16, 17, 18, 19]],
        [[8, 9, 10, 11], [20, 21, 22, 23]],
    ]
    assert all(p.is_contiguous() for p in pieces)
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(64, 2, 4) == (32, 48)
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(16, 3, 4) == (48, 64)
    with pytest.raises(ValueError, match="50 is not divisible by 4"):
        tp.VocabUtility.vocab_range_from_global_vocab_size(50, 0, 4)
