"""Context-parallel pieces: the load-balanced sequence slicing and attention under every CP scheme.

Attention: each CP rank runs ``DotProductAttention`` on its two chunks of q, k, v under each
``cp_comm_type`` (``all_gather``, ``p2p`` ring, ``a2a`` Ulysses); the output and the gradients of
its q, k and v must equal the matching rows of full (CP=1) attention on the whole sequence, for
grouped-query heads with a plain causal mask, sliding windows (global positions), an explicit
document mask (not ``a2a``), and values narrower than keys (multi-latent attention), on the SDPA
and unfused paths, with score tiles of 3 query rows (several per block). ``a2a+p2p`` on 2 x 2 ranks
(``hierarchical_context_parallel_sizes``), 1 x 4 and 4 x 1 in the full tier. fp32; rtol=1e-5, atol=1e-6.

The ring posts the transfer of step t + 1 before computing step t (a recording of its calls).

Attention dropout under ``p2p`` and ``a2a``: the gradient agrees with central differences of the
output with the same dropout seed (backward redraws forward's masks).

No square tensor: under ``p2p`` and ``a2a`` no op creates, and autograd saves, a tensor of
``s * s / 4`` elements or more (``tests.tensor_meter``, query tiles of 4 rows), while the
``all_gather`` scheme's ``[s/cp, s]`` mask is caught by the same check.
"""

import pytest
import torch

from megatron.core.context_parallel import cp_chunk_positions, gathered_order, get_batch_on_this_cp_rank
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer import cp_attention, tiled_attention
from megatron.core.transformer.attention import DotProductAttention
from megatron.core.transformer.cp_attention import context_parallel_attention
from megatron.core.transformer.tiled_attention import Visibility
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.tensor_meter import TensorMeter

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_holds_chunks_r_and_mirror(cp):
    seq = 4 * 2 * cp
    chunks = torch.arange(seq).view(2 * cp, -1)  # [2cp, s/2cp]
    pieces = [cp_chunk_positions(seq, cp, r) for r in range(cp)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, torch.cat([chunks[r], chunks[2 * cp - 1 - r]]))
    # Every rank's slices in chunk order give back the sequence.
    by_chunk = {r: p[: seq // (2 * cp)] for r, p in enumerate(pieces)}
    by_chunk.update({2 * cp - 1 - r: p[seq // (2 * cp) :] for r, p in enumerate(pieces)})
    assert torch.equal(torch.cat([by_chunk[c] for c in range(2 * cp)]), torch.arange(seq))
    assert torch.equal(torch.cat(pieces)[gathered_order(seq // cp, cp)], torch.arange(seq))


def test_sequence_not_divisible_by_two_cp_is_refused():
    with pytest.raises(ValueError, match=r"seq_length=12 must be divisible by 2 x context_parallel_size=4 = 8"):
        cp_chunk_positions(12, 4, 0)


def _attention(cp_group, window, backend, scheme=None, hcp=None):
    config = TransformerConfig(
        cp_comm_type=scheme,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        window_size=window,
        attention_backend=backend,
    )
    return DotProductAttention(config, 1, cp_group=cp_group, softmax_scale=0.3, hcp_groups=hcp)


def _document_mask(b, s):
    """[b, 1, s, s] causal mask with document boundaries (True = blocked)."""
    starts = torch.tensor([[0, 5, 11], [0, 3, 9]])
    doc = (torch.arange(s)[None, :, None] >= starts[:, None, :]).sum(-1)  # [b, s] document id
    blocked = doc[:, :, None] != doc[:, None, :]
    return (blocked | torch.ones(s, s, dtype=torch.bool).triu(1))[:, None]


CASES = (  # (window, backend, explicit mask, value head dim)
    (None, "auto", False, 8),
    ((3, 0), "auto", False, 8),
    ((2, 1), "unfused", False, 8),
    (None, "unfused", True, 8),
    ((4, 0), "auto", True, 8),
    (None, "auto", False, 6),
    ((5, 0), "auto", False, 6),
)


def _cp_groups(world_size, hierarchical=None):
    layout = ParallelLayout(
        world_size, context_parallel_size=world_size, hierarchical_context_parallel_sizes=hierarchical
    )
    return build_process_groups(layout)


def _compare_attention(rank, world_size, schemes, hierarchical=None, cases=CASES):
    groups = _cp_groups(world_size, hierarchical)
    tiled_attention.TILE_ROWS = 3  # several tiles per block, the last one short
    s, b, d = 4 * world_size * 2, 2, 8
    mask = _document_mask(b, s)
    positions = cp_chunk_positions(s, world_size, groups.rank_in("cp"))  # [s/cp]
    for scheme in schemes:
        for window, backend, use_mask, dv in cases:
            if use_mask and scheme in ("a2a", "a2a+p2p"):
                continue
            g = torch.Generator().manual_seed(0)
            q, k = (torch.randn(s, b, n, d, generator=g) for n in (4, 2))  # [s, b, heads|groups, d]
            v = torch.randn(s, b, 2, dv, generator=g)
            upstream = torch.randn(s, b, 4 * dv, generator=g)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = _attention(None, window, backend)(*full, mask if use_mask else None)  # [s, b, 4dv]
            ref.backward(upstream)
            local = [t[positions].clone().requires_grad_() for t in (q, k, v)]  # [s/cp, b, ., d]
            sliced = get_batch_on_this_cp_rank({"attention_mask": mask}, groups.cp)["attention_mask"]
            out = _attention(groups.cp, window, backend, scheme, groups.hcp)(*local, sliced if use_mask else None)
            out.backward(upstream[positions])
            what = f"{scheme} cp={world_size} window={window} {backend} mask={use_mask} dv={dv}"
            torch.testing.assert_close(out, ref[positions], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} out: {m}")
            for name, mine, whole in zip("qkv", local, full):
                torch.testing.assert_close(
                    mine.grad, whole.grad[positions], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} grad {name}: {m}"
                )


def _largest_tensors(rank, world_size, schemes=("all_gather", "p2p", "a2a"), hierarchical=None):
    """(largest created, largest saved) elements of one causal attention fwd+bwd at s = 128, per scheme."""
    groups = _cp_groups(world_size, hierarchical)
    tiled_attention.TILE_ROWS = 4
    s, found = 128, {}
    for scheme in schemes:
        q, k, v = (torch.randn(s // world_size, 1, n, 8, requires_grad=True) for n in (2, 1, 1))  # [s/cp, b, ., d]
        with TensorMeter() as meter:
            _attention(groups.cp, None, "auto", scheme, groups.hcp)(q, k, v, None).sum().backward()
        found[scheme] = (meter.largest_created, meter.largest_saved)
    return s, found


def _dropout_gradients(rank, world_size, schemes=("p2p", "a2a"), hierarchical=None):
    """With attention dropout, backward redraws forward's keep-masks: the gradient's directional derivative
    matches central differences of the output (a different mask would miss by about the dropped share)."""
    groups = _cp_groups(world_size, hierarchical)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 16, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))  # [b, ., s/cp, d]
    direction = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v)]
    weights = torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64)
    for scheme in schemes:

        def loss(*qkv, dropout=(0.3, 1234)):
            vis = Visibility(True, None)
            out = context_parallel_attention(*qkv, scheme, groups.cp, vis, 0.35, dropout=dropout, hcp=groups.hcp)
            total = (out * weights).sum()
            torch.distributed.all_reduce(total, group=groups.cp)
            return total

        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        loss(*inputs).backward()
        analytic = sum((t.grad * u).sum() for t, u in zip(inputs, direction))
        torch.distributed.all_reduce(analytic, group=groups.cp)
        eps = 1e-3
        plus = loss(*(t + eps * u for t, u in zip((q, k, v), direction)))
        minus = loss(*(t - eps * u for t, u in zip((q, k, v), direction)))
        numeric = (plus - minus) / (2 * eps)
        assert abs(float(loss(q, k, v)) - float(loss(q, k, v, dropout=None))) > 1e-3, f"{scheme}: nothing dropped"
        assert abs(float(analytic) - float(numeric)) < 1e-3 * max(1.0, abs(float(numeric))), (scheme, analytic, numeric)


def _ring_posts_before_computing(rank, world_size):
    """The ring's forward posts the transfer of the next key/value block before computing the current one."""
    groups = build_process_groups(ParallelLayout(world_size=world_size, context_parallel_size=world_size))
    events, block, post = [], cp_attention.block_forward, torch.distributed.batch_isend_irecv
    cp_attention.block_forward = lambda *a, **k: (events.append("compute"), block(*a, **k))[1]
    torch.distributed.batch_isend_irecv = lambda ops: (events.append("post"), post(ops))[1]
    try:
        q, k, v = (torch.randn(1, n, 8, 4) for n in (2, 1, 1))  # [b, ., s/cp, d]
        cp_attention.context_parallel_attention(q, k, v, "p2p", groups.cp, Visibility(True, None), 0.5)
    finally:
        cp_attention.block_forward, torch.distributed.batch_isend_irecv = block, post
    steps = "".join("p" if e == "post" else "c" for e in events).split("p")  # computes after each post
    assert events[0] == "post" and len(steps) == world_size and all(steps[1:]), events


def _cp_checks(rank, world_size, schemes):
    _ring_posts_before_computing(rank, world_size)
    _compare_attention(rank, world_size, schemes)
    _dropout_gradients(rank, world_size)
    return _largest_tensors(rank, world_size)


def test_every_cp_scheme_equals_full_attention_without_square_tensors():
    for s, found in run_distributed(_cp_checks, 2, ("all_gather", "p2p", "a2a")):
        limit = s * s // 4
        for scheme in ("p2p", "a2a"):
            (created, created_shape), (saved, saved_shape) = found[scheme]
            assert created < limit, f"{scheme}: created a tensor {created_shape}"
            assert saved < limit, f"{scheme}: saved a tensor {saved_shape}"
        assert found["all_gather"][0][0] >= limit, "the check misses the all_gather scheme's [s/cp, s] mask"


@pytest.mark.full
@pytest.mark.parametrize("world_size, schemes", [(3, ("all_gather", "p2p")), (4, ("p2p", "a2a"))])
def test_every_cp_scheme_equals_full_attention_on_more_ranks(world_size, schemes):
    run_distributed(_compare_attention, world_size, schemes)


def _slice_batch(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, context_parallel_size=world_size))
    s = 8
    batch = {
        "tokens": torch.arange(2 * s).view(2, s),
        "loss_mask": torch.ones(2, s),
        "position_ids": None,
        "attention_mask": torch.arange(2 * s * s).view(2, 1, s, s),
    }
    out = get_batch_on_this_cp_rank(batch, groups.cp)
    chunks = [(0, 1, 6, 7), (2, 3, 4, 5)][rank]
    assert out["tokens"].tolist() == [[row * s + c for c in chunks] for row in range(2)]
    assert out["position_ids"] is None and out["loss_mask"].shape == (2, 4)
    assert torch.equal(out["attention_mask"], batch["attention_mask"][:, :, list(chunks), :])


def test_batch_slicing_on_two_ranks():
    run_distributed(_slice_batch, 2)


def _hierarchical_checks(rank, world_size, cases):
    """a2a+p2p on 2 x 2 ranks: the groups (a2a: consecutive CP ranks; p2p: across them), equality with
    CP=1, dropout's redrawn masks, and the largest tensors."""
    groups = _cp_groups(world_size, (2, 2))
    assert groups.ranks["hcp0"] == [rank // 2 * 2, rank // 2 * 2 + 1], groups.ranks
    assert groups.ranks["hcp1"] == [rank % 2, rank % 2 + 2], groups.ranks
    _compare_attention(rank, world_size, ("a2a+p2p",), (2, 2), cases)
    _dropout_gradients(rank, world_size, ("a2a+p2p",), (2, 2))
    _peak_halves_from_two_to_four_ranks(groups)
    return _largest_tensors(rank, world_size, ("a2a+p2p",), (2, 2))


def _peak_halves_from_two_to_four_ranks(groups):
    """p2p and a2a at the same s on a 2-rank sub-group and on all 4 ranks: the peak bytes per rank
    (``tests.tensor_meter``, score tiles included) halve within 10%."""
    tiled_attention.TILE_ROWS = 16
    s, peaks = 512, {}
    for scheme in ("p2p", "a2a"):
        for cp, group in ((2, groups.hcp[1] if scheme == "p2p" else groups.hcp[0]), (4, groups.cp)):
            q, k, v = (torch.randn(1, 4, s // cp, 8) for _ in range(3))  # [b, heads, s/cp, d], MHA
            for t in (q, k, v):
                t.requires_grad_()
            with TensorMeter() as meter:
                context_parallel_attention(q, k, v, scheme, group, Visibility(True, None), 0.3).sum().backward()
            peaks[scheme, cp] = meter.peak_bytes
        assert abs(peaks[scheme, 2] / peaks[scheme, 4] / 2 - 1) < 0.1, peaks


def test_hierarchical_a2a_p2p_equals_full_attention_on_four_ranks():
    """Causal grouped-query, sliding window and MLA-shaped values (the other cases: the full tier)."""
    for s, found in run_distributed(_hierarchical_checks, 4, (CASES[0], CASES[1], CASES[5])):
        (created, created_shape), (saved, saved_shape) = found["a2a+p2p"]
        assert max(created, saved) < s * s // 4, (created_shape, saved_shape)


@pytest.mark.full
@pytest.mark.parametrize("hierarchical", [(2, 2), (1, 4), (4, 1)])
def test_hierarchical_a2a_p2p_every_case(hierarchical):
    run_distributed(_compare_attention, 4, ("a2a+p2p",), hierarchical)
