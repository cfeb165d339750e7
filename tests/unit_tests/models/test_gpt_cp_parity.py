"""GPTModel under context parallelism (with TP, SP and PP) equals the CP=1 model with the same weights.

Both models run through the real schedule with a masked (sum, count) loss function, two
microbatches, and a loss mask whose counted tokens differ between CP ranks (and microbatches).
Checked: each CP rank's per-token losses against the reference's at the same global positions,
the reported ``lm loss`` (sums and counts added over CP), and every gradient after summing over
CP and dividing by the CP size, as the data-parallel wrapper's average over ``dp_cp`` does. fp32;
rtol=1e-5, atol=1e-6 (only the order of float additions differs).
"""

from functools import partial

import torch
import torch.distributed as dist

from megatron.core.context_parallel import cp_chunk_positions, get_batch_on_this_cp_rank
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, batch, build_gpt, gather_tp, gpt2_style, llama_style, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import build_chunks, load_reference, reference_name

RTOL, ATOL = 1e-5, 1e-6
MICRO, NUM_MB = 2, 2
STYLES = {"gpt2": gpt2_style, "llama": llama_style}


def _micro_batches(with_positions: bool):
    """NUM_MB micro batches ``{tokens, labels, loss_mask[, position_ids]}`` ``[MICRO, SEQ]``; uneven masks."""
    tokens, labels = batch(seed=3, b=MICRO * NUM_MB)
    mask = (torch.rand(tokens.shape, generator=torch.Generator().manual_seed(5)) > 0.25).float()
    mask[0, :6] = 0.0  # CP=2: rank 0 (positions 0-3, 12-15) loses more counted tokens than rank 1
    out = []
    for i in range(0, MICRO * NUM_MB, MICRO):
        mb = {"tokens": tokens[i : i + MICRO], "labels": labels[i : i + MICRO], "loss_mask": mask[i : i + MICRO]}
        if with_positions:
            mb["position_ids"] = torch.arange(SEQ).expand(MICRO, SEQ)
        out.append(mb)
    return out


def _loss_func(loss_mask, output):
    total = torch.sum(output.float().view(-1) * loss_mask.view(-1))
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}


def _forward_step(outputs, data_iterator, model):
    groups = model.pg_collection
    mb = get_batch_on_this_cp_rank(next(data_iterator), groups.cp if groups.size_of("cp") > 1 else None)
    output = model(mb["tokens"], mb.get("position_ids"), None, labels=mb["labels"])  # [b, s/cp] on the last stage
    outputs.append(output)
    return output, partial(_loss_func, mb["loss_mask"])


def _run(chunks, groups, with_positions):
    """One schedule call; returns (per-token losses per microbatch, reported mean loss or None)."""
    outputs = []
    func = get_forward_backward_func(groups.size_of("pp"), len(chunks))
    reports = func(
        forward_step_func=partial(_forward_step, outputs),
        data_iterator=iter(_micro_batches(with_positions)),
        model=chunks[0],
        num_microbatches=NUM_MB,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        pg_collection=groups,
    )
    if not reports:
        return outputs, None
    summed = torch.stack([r["lm loss"] for r in reports]).sum(0)  # [2]
    dist.all_reduce(summed, group=groups.cp)  # what reduce_losses does over dp_cp
    return outputs, summed[0] / summed[1]


def _cp_grads_like_ddp(chunk, groups):
    """Gradients summed over CP / cp (DDP's dp_cp average), SP norms over TP, tied copies; TP shards gathered."""
    cp = groups.size_of("cp")
    for p in chunk.parameters():
        dist.all_reduce(p.grad, group=groups.cp)
        p.grad /= cp
    allreduce_sequence_parallel_grads([chunk], groups.tp)
    allreduce_tied_embedding_grads([chunk], groups)
    return {n: gather_tp(p.grad, p, groups.tp) for n, p in chunk.named_parameters()}


def _check(style, tp, pp, sp, with_positions, world_size, **extra):
    groups = build_process_groups(
        ParallelLayout(
            world_size=world_size,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=2,
        )
    )
    kwargs = STYLES[style](num_layers=2 * pp, sequence_parallel=sp, **extra)
    what = f"{style} cp=2 tp={tp} pp={pp} sp={sp} {extra}"
    reference = build_gpt(kwargs, single_rank_groups(), seed=7)
    ref_outputs, ref_loss = _run([reference], single_rank_groups(), with_positions)
    chunks = build_chunks(kwargs, groups, 1)
    load_reference(chunks, reference, groups)
    outputs, loss = _run(chunks, groups, with_positions)
    if loss is not None:  # the last pipeline stage
        positions = cp_chunk_positions(SEQ, 2, groups.rank_in("cp"))
        for i, (mine, ref) in enumerate(zip(outputs, ref_outputs)):
            torch.testing.assert_close(
                mine, ref[:, positions], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} mb {i} token losses: {m}"
            )
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} lm loss: {m}")
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in _cp_grads_like_ddp(chunks[0], groups).items():
        torch.testing.assert_close(
            grad,
            ref_grads[reference_name(chunks[0], name)],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{what} grad {name}: {m}",
        )


def _two_ranks(rank, world_size):
    _check("gpt2", 1, 1, False, with_positions=False, world_size=world_size)
    _check("llama", 1, 1, False, with_positions=False, world_size=world_size)
    _check("llama", 1, 1, False, with_positions=False, world_size=world_size, window_size=(5, 0))


def _four_ranks(rank, world_size):
    _check("gpt2", 2, 1, True, with_positions=True, world_size=world_size)
    _check("llama", 2, 1, False, with_positions=False, world_size=world_size)
    _check("gpt2", 1, 2, False, with_positions=True, world_size=world_size)


def test_cp2_equals_cp1():
    run_distributed(_two_ranks, 2)


def test_cp2_with_tp2_sp_and_pp2_equals_cp1():
    run_distributed(_four_ranks, 4)
