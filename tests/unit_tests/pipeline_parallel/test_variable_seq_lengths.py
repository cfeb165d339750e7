"""Pipelined training with microbatches of different sequence lengths (``variable_seq_lengths``).

Each transfer is preceded by its shape, so the receiving stage allocates the right buffer.
Loss and every gradient equal the single-process reference that runs the same microbatches
one by one (fp32; rtol=1e-5, atol=1e-6: only the order of float additions differs).
"""

import torch

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, build_gpt, gpt2_style, llama_style, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import (
    MICRO,
    _loss_func,
    build_chunks,
    compare,
    load_reference,
    make_finalize,
)

LENGTHS = (8, 16, 4, 12)  # one sequence length per microbatch


def _microbatches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in LENGTHS:
        tokens = torch.randint(0, VOCAB, (MICRO, length + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens, None, None, labels=labels), _loss_func


def _check(kwargs, groups, vp: int, what: str) -> None:
    reference = build_gpt(kwargs, single_rank_groups(), seed=7)
    chunks = build_chunks(kwargs, groups, vp)
    load_reference(chunks, reference, groups)
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = make_finalize(groups)  # tied-embedding gradient sum
    micro = _microbatches(seed=3)
    func = get_forward_backward_func(groups.size_of("pp"), vp)
    reports = func(
        forward_step_func=_forward_step,
        data_iterator=[iter(micro) for _ in chunks],
        model=chunks,
        num_microbatches=len(micro),
        seq_length=max(LENGTHS),
        micro_batch_size=MICRO,
        pg_collection=groups,
    )
    ref_losses = [reference(tokens, None, None, labels=labels).mean() for tokens, labels in micro]
    (torch.stack(ref_losses).sum() / len(micro)).backward()
    if reports:  # last stage: per-microbatch (sum, tokens) as loss_func reported them
        got = torch.stack([r["lm loss"][0] / r["lm loss"][1] for r in reports])
        torch.testing.assert_close(got, torch.stack(ref_losses).detach(), rtol=1e-5, atol=1e-6)
    compare(chunks, reference, groups, what, 1e-5, 1e-6, grads=True)


def _body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=2))
    _check(gpt2_style(num_layers=4, variable_seq_lengths=True), groups, 1, "gpt2 pp=2")
    _check(
        llama_style(num_layers=4, variable_seq_lengths=True, deallocate_pipeline_outputs=True),
        groups,
        2,
        "llama pp=2 vp=2 dealloc",
    )


def test_variable_sequence_lengths_through_the_pipeline():
    run_distributed(_body, 2)
