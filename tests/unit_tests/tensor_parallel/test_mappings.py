"""Each TP communication primitive against its single-process definition, forward and backward.

Every rank can build every rank's input and upstream gradient (seeded per rank),
so the expected result on rank r is computed locally with torch.cat / sum / slicing.
Exact comparison (fp32 sums of a handful of terms; tolerance rtol 1e-5, atol 1e-6).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_harness import run_distributed

RTOL, ATOL = 1e-5, 1e-6
S, B, H = 8, 2, 12  # divisible by 1, 2 and 4


def _rand(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _piece(x, dim, r, n):
    size = x.size(dim) // n
    return x.narrow(dim, r * size, size)


def _cases(n):
    """name -> (function(x, group), input shape, output shape, replicated input, expected out, expected grad).

    Expected functions receive the list of all ranks' inputs (or upstream grads) and the rank.
    """
    total = lambda ts: torch.stack(ts).sum(0)  # noqa: E731
    return {
        "copy_to": (
            tp.copy_to_tensor_model_parallel_region,
            (S, B, H),
            (S, B, H),
            True,
            lambda xs, r: xs[r],
            lambda gs, r: total(gs),
        ),
        "reduce_from": (
            tp.reduce_from_tensor_model_parallel_region,
            (S, B, H),
            (S, B, H),
            False,
            lambda xs, r: total(xs),
            lambda gs, r: gs[r],
        ),
        "scatter_last": (
            tp.scatter_to_tensor_model_parallel_region,
            (S, B, H),
            (S, B, H // n),
            True,
            lambda xs, r: _piece(xs[r], -1, r, n),
            lambda gs, r: torch.cat(gs, -1),
        ),
        "gather_last": (
            tp.gather_from_tensor_model_parallel_region,
            (S, B, H // n),
            (S, B, H),
            False,
            lambda xs, r: torch.cat(xs, -1),
            lambda gs, r: _piece(gs[r], -1, r, n),
        ),
        "scatter_seq": (
            tp.scatter_to_sequence_parallel_region,
            (S, B, H),
            (S // n, B, H),
            True,
            lambda xs, r: _piece(xs[r], 0, r, n),
            lambda gs, r: torch.cat(gs, 0),
        ),
        "gather_seq_reduce_grad": (
            lambda x, g: tp.gather_from_sequence_parallel_region(x, True, group=g),
            (S // n, B, H),
            (S, B, H),
            False,
            lambda xs, r: torch.cat(xs, 0),
            lambda gs, r: _piece(total(gs), 0, r, n),
        ),
        "gather_seq_split_grad": (
            lambda x, g: tp.gather_from_sequence_parallel_region(x, False, group=g),
            (S // n, B, H),
            (S, B, H),
            False,
            lambda xs, r: torch.cat(xs, 0),
            lambda gs, r: _piece(gs[r], 0, r, n),
        ),
        "reduce_scatter_seq": (
            tp.reduce_scatter_to_sequence_parallel_region,
            (S, B, H),
            (S // n, B, H),
            False,
            lambda xs, r: _piece(total(xs), 0, r, n),
            lambda gs, r: torch.cat(gs, 0),
        ),
        "all_gather_last": (
            tp.all_gather_last_dim_from_tensor_parallel_region,
            (S, B, H // n),
            (S, B, H),
            False,
            lambda xs, r: torch.cat(xs, -1),
            lambda gs, r: _piece(total(gs), -1, r, n),
        ),
        "reduce_scatter_last": (
            tp.reduce_scatter_last_dim_to_tensor_parallel_region,
            (S, B, H),
            (S, B, H // n),
            False,
            lambda xs, r: _piece(total(xs), -1, r, n),
            lambda gs, r: torch.cat(gs, -1),
        ),
    }


def _check_all(group, label):
    """Run every case over ``group`` (None: the default TP group) and compare with its definition."""
    ref_group = group if group is not None else ps.get_tensor_model_parallel_group()
    n, r = dist.get_world_size(ref_group), dist.get_rank(ref_group)
    for idx, (name, (fn, in_shape, out_shape, replicated, want_out, want_grad)) in enumerate(_cases(n).items()):
        xs = [_rand(1000 * idx + (0 if replicated else k), in_shape) for k in range(n)]
        gs = [_rand(1000 * idx + 500 + k, out_shape) for k in range(n)]
        x = xs[r].clone().requires_grad_(True)
        out = fn(x, group)
        out.backward(gs[r])
        where = f"{label}/{name} (rank {r} of {n})"
        torch.testing.assert_close(out, want_out(xs, r), rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} out: {m}")
        torch.testing.assert_close(x.grad, want_grad(gs, r), rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad: {m}")


def _check_identity_on_single_rank_group(single):
    for name, (fn, in_shape, _, _, _, _) in _cases(1).items():
        x = _rand(7, in_shape).requires_grad_(True)
        g = _rand(8, in_shape)
        out = fn(x, single)
        out.backward(g)
        assert torch.equal(out, x.detach()), name
        assert torch.equal(x.grad, g), name


def _body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    _check_all(None, "default group")
    # Explicit subgroups must be honoured instead of the default (world-sized) TP group.
    pairs = [dist.new_group([k, k + 1]) for k in range(0, world_size, 2)]
    _check_all(pairs[rank // 2], "explicit pair")
    singles = [dist.new_group([k]) for k in range(world_size)]
    _check_identity_on_single_rank_group(singles[rank])


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_match_definitions(world_size):
    run_distributed(_body, world_size)


def test_default_group_required():
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="not initialized"):
        tp.copy_to_tensor_model_parallel_region(torch.zeros(2))
