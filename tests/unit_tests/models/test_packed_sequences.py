"""Packed sequences (THD, ``PackedSeqParams``): a packed row equals its sequences run one at a time.

Reference: the same model run on each sequence alone, ``[1, L]``, unpacked (plain causal attention,
positions from 0). Checked, fp32 rtol=1e-5: every sequence's per-token losses, and the gradients of
each sequence's loss (single process), or of a randomly weighted sum of the sequences' losses (so
every sequence's gradient counts) under TP=2 + sequence parallelism with PP=2, and CP=2 with PP=2
(each sequence split into 2 x cp load-balanced chunks). Styles: GPT-2 (learned positions), Llama
(RoPE, grouped-query attention 8 heads / 4 groups), with and without a sliding window, and Qwen (Llama with
QKV bias and query/key norms); the windowed Llama case also under selective recomputation.

No ``[t, t]`` tensor: every tensor an op creates during a packed forward and backward (a
``TorchDispatchMode``) and every tensor autograd saves is checked for two dimensions of size ``t``;
the same probe flags the dense windowed mask of an unpacked row (it sees what it should).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.context_parallel import get_batch_on_this_cp_rank, packed_cp_indices
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.packed_seq_params import PackedSeqParams, packed_seq_params_from_lengths
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads
from megatron.core.transformer.packed_attention import packed_segments
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt, gather_tp, gpt2_style, llama_style, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import build_chunks, load_reference, reference_name

RTOL, ATOL = 1e-5, 1e-6
LENGTHS = [4, 12, 8, 12]  # every length divisible by 2 x cp = 4; total 36 (no model dimension is 36)
TOTAL = sum(LENGTHS)
STYLES = {
    "gpt2": gpt2_style,
    "llama": llama_style,
    "qwen": lambda **kw: llama_style(add_qkv_bias=True, qk_layernorm=True, **kw),  # Qwen2's bias, Qwen3's norms
}


def _sequences(seed: int = 0):
    """Token ids and next-token labels of each sequence, ``[1, L]`` each."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 128, (1, n + 1), generator=g) for n in LENGTHS]
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


def _packed_batch(seqs):
    """The packed row ``{tokens, labels}`` ``[1, t]`` and its ``PackedSeqParams``."""
    tokens = torch.cat([t for t, _ in seqs], dim=1)
    labels = torch.cat([lab for _, lab in seqs], dim=1)
    return {"tokens": tokens, "labels": labels}, packed_seq_params_from_lengths(LENGTHS)


def _kwargs(style, **extra):
    return STYLES[style](max_sequence_length=TOTAL, **extra)


def _split(per_token: torch.Tensor):
    """``[1, t]`` -> each sequence's ``[1, L]``."""
    return list(torch.split(per_token, LENGTHS, dim=1))


@pytest.mark.parametrize(
    "style,window,recompute",
    [("gpt2", None, None), ("llama", None, None), ("llama", (5, 0), "selective"), ("qwen", None, None)],
)
def test_packed_row_equals_sequences_alone(style, window, recompute):
    run_distributed(_single, 1, style, window, recompute)


def _single(rank, world_size, style, window, recompute):
    groups = single_rank_groups()
    model = build_gpt(_kwargs(style, window_size=window, recompute_granularity=recompute), groups)
    seqs = _sequences()
    batch, params = _packed_batch(seqs)
    for i, (tokens, labels) in enumerate(seqs):
        packed = _split(model(batch["tokens"], None, None, labels=batch["labels"], packed_seq_params=params))
        model.zero_grad(set_to_none=True)
        alone = model(tokens, None, None, labels=labels)  # [1, L]
        alone.sum().backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.testing.assert_close(packed[i], alone, rtol=RTOL, atol=ATOL, msg=lambda m: f"seq {i} losses: {m}")
        model.zero_grad(set_to_none=True)
        packed[i].sum().backward()  # this sequence's loss, taken from the packed row
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"seq {i} {name}: {m}")


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _square(shapes, t):
    return [(op, s) for op, s in shapes if list(s).count(t) >= 2]


def _probe(model, tokens, labels, **kw):
    """Shapes of every tensor created (ops) or saved (autograd) in a forward and backward."""
    saved = []

    def pack(x):
        saved.append(("saved", tuple(x.shape)))
        return x

    with _Shapes() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(tokens, None, None, labels=labels, **kw).sum().backward()
    return mode.shapes + saved


def test_no_t_by_t_tensor_for_a_packed_row():
    run_distributed(_no_square, 1)


def _no_square(rank, world_size):
    model = build_gpt(_kwargs("llama", window_size=(5, 0)), single_rank_groups())
    batch, params = _packed_batch(_sequences())
    shapes = _probe(model, batch["tokens"], batch["labels"], packed_seq_params=params)
    assert shapes and not _square(shapes, TOTAL), _square(shapes, TOTAL)[:5]
    # The probe sees a dense mask where there is one: the same row unpacked, windowed.
    assert _square(_probe(model, batch["tokens"], batch["labels"]), TOTAL)
    with pytest.raises(NotImplementedError, match="packed_seq_params with an attention_mask"):
        model(batch["tokens"], None, torch.zeros(1, 1, TOTAL, TOTAL, dtype=torch.bool), packed_seq_params=params)
    with pytest.raises(ValueError, match=r"expected \(1, cu_seqlens\[-1\] / cp\) = \(1, 36\)"):
        model(batch["tokens"][:, :-4], None, None, packed_seq_params=params)


def test_segments_of_a_cp_rank_and_of_windows():
    cu = torch.tensor([0, 8, 16])
    held = packed_cp_indices(cu, 2, 0)  # chunks 0 and 3 of each sequence
    assert held.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    segs = packed_segments(held, cu)
    assert [(s.q_start, s.q_end, s.k_start, s.k_end, s.mask is None) for s in segs] == [
        (0, 2, 0, 2, True),
        (2, 4, 0, 8, False),
        (4, 6, 8, 10, True),
        (6, 8, 8, 16, False),
    ]
    # The later chunk's queries (positions 6, 7) see keys 0..6 and 0..7.
    assert (~segs[1].mask).sum(1).tolist() == [7, 8]
    windowed = packed_segments(torch.arange(16), cu, (2, 0))
    assert all(s.k_start >= (0 if s.q_start < 8 else 8) for s in windowed)
    assert (~windowed[0].mask).sum(1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]


def test_refusals():
    with pytest.raises(ValueError, match=r"length 6 .* divisible by 2 x context_parallel_size=2"):
        packed_cp_indices(torch.tensor([0, 6]), 2, 0)
    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 4])).layout_cu_seqlens()


# --- distributed: TP=2 + SP with PP=2, and CP=2 with PP=2, through the real schedule ---------------


def _weights():
    return torch.rand(len(LENGTHS), generator=torch.Generator().manual_seed(9)) + 0.5  # [n]


def _weighted(per_token: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Sum over this rank's tokens (packed-row indices ``held``) of each token's loss times its sequence's weight."""
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    weight = _weights()[torch.searchsorted(cu, held, right=True) - 1]  # [t(/cp)]
    return (per_token[0] * weight).sum()


def _forward_step(out, params, data_iterator, model):
    groups = model.pg_collection
    cp = groups.cp if groups.size_of("cp") > 1 else None
    mb = get_batch_on_this_cp_rank(next(data_iterator), cp, params.layout_cu_seqlens())
    output = model(mb["tokens"], None, None, labels=mb["labels"], packed_seq_params=params)
    held = packed_cp_indices(params.layout_cu_seqlens(), groups.size_of("cp"), groups.rank_in("cp"))
    out.append(output)
    return output, lambda o: (_weighted(o, held), {})


def _run_packed(chunks, groups, params):
    outputs = []
    batch, _ = _packed_batch(_sequences())
    func = get_forward_backward_func(groups.size_of("pp"), len(chunks))
    func(
        forward_step_func=partial(_forward_step, outputs, params),
        data_iterator=iter([batch]),
        model=chunks[0],
        num_microbatches=1,
        seq_length=TOTAL,
        micro_batch_size=1,
        pg_collection=groups,
        forward_only=False,
    )
    return outputs


def _check_parallel(style, tp, pp, cp, window, world_size):
    groups = build_process_groups(
        ParallelLayout(
            world_size=world_size,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
        )
    )
    kwargs = _kwargs(style, num_layers=2 * pp, sequence_parallel=tp > 1, window_size=window)
    what = f"{style} tp={tp} pp={pp} cp={cp} window={window}"
    reference = build_gpt(kwargs, single_rank_groups(), seed=7)
    alone = [reference(t, None, None, labels=lab) for t, lab in _sequences()]  # [1, L] each
    sum(w * a.sum() for w, a in zip(_weights(), alone)).backward()
    chunks = build_chunks(kwargs, groups, 1)
    load_reference(chunks, reference, groups)
    params = packed_seq_params_from_lengths(LENGTHS, 2 * cp if cp > 1 else 1)
    outputs = _run_packed(chunks, groups, params)
    if outputs and groups.rank_in("pp") == pp - 1:
        held = packed_cp_indices(params.layout_cu_seqlens(), cp, groups.rank_in("cp"))
        expected = torch.cat(alone, dim=1)[:, held]  # [1, t/cp]
        torch.testing.assert_close(outputs[0], expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} losses: {m}")
    for p in chunks[0].parameters():  # the schedule scales the loss by cp: DDP's dp_cp average, as Megatron
        dist.all_reduce(p.grad, group=groups.cp)
        p.grad /= cp
    allreduce_sequence_parallel_grads([chunks[0]], groups.tp)
    allreduce_tied_embedding_grads([chunks[0]], groups)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in chunks[0].named_parameters():
        torch.testing.assert_close(
            gather_tp(p.grad, p, groups.tp),
            ref_grads[reference_name(chunks[0], name)],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{what} grad {name}: {m}",
        )


def _four_ranks(rank, world_size):
    _check_parallel("llama", 2, 2, 1, (5, 0), world_size)
    _check_parallel("llama", 1, 2, 2, (5, 0), world_size)
    _check_parallel("gpt2", 2, 1, 2, None, world_size)


def test_packed_equals_alone_under_tp_sp_pp_and_cp():
    run_distributed(_four_ranks, 4)
