"""Hybrid Mamba models in one spawned group of two ranks.

Rank 0: logits against ``transformers``' Mamba2 and Nemotron-H (``M*M-M``, and ``M*E-E`` with its MoE layers:
sigmoid group routing with the expert bias, shared expert) on 40 tokens (five of our 8-token scan chunks), both
ways (HF's weights imported, ours exported), within 1e-4 (fp32).

Greedy generation (``InferenceEngine`` with per-layer convolution/SSM states and the KV cache) of a
``M*M-`` Nemotron-H on one rank and under TP=2 equals greedy decoding by ``transformers``' full forward
(``generate``'s cached path departs from that full forward on one of these prompts, by a logit gap of 0.1).

Both ranks: a ``M*M-`` model under tensor parallelism (with and without sequence parallelism) and pipeline
parallelism equals the one-rank model with the same weights: the per-token loss and every gradient (TP
shards joined back, the mixers' ``[z, x, B, C, dt]`` layout too); rtol=1e-5, atol=1e-6 (only the order of
float additions differs).
"""

import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import batch, single_rank_groups
from tests.unit_tests.inference.hf_models import random_prompts
from tests.unit_tests.ssm.hf_mamba import (
    greedy_tokens,
    hf_greedy_full_forward,
    hf_nemotron_h,
    mamba2_parity,
    nemotron_h_parity,
    perturb,
)
from tests.unit_tests.ssm.mamba_utils import PATTERN, SEQ, VOCAB, build_mamba, full_tensors

RTOL, ATOL = 1e-5, 1e-6
HF_MAX_ABS = 1e-4
NEW_TOKENS = 8


def _loss_and_grads(model, tokens, labels, tp_group):
    loss = model(tokens, None, None, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads([model], tp_group)
    return loss.detach(), full_tensors(model, tp_group, grads=True), full_tensors(model, tp_group, grads=False)


def _assert_close(where, got, want):
    loss, grads, weights = got
    for name in grads:
        torch.testing.assert_close(weights[name], want[2][name], rtol=0, atol=0, msg=lambda m: f"{where} {name}: {m}")
    torch.testing.assert_close(loss, want[0], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    for name in grads:
        torch.testing.assert_close(
            grads[name], want[1][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {name}: {m}"
        )


def _pipeline_step(model, tokens, labels, first: bool):
    """One forward/backward over two stages with point-to-point send/recv; the loss on the last stage."""
    shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)  # [s, b, h]
    if first:
        hidden = model(tokens, None, None)  # [s, b, h]
        dist.send(hidden.detach().contiguous(), dst=1)
        grad = torch.empty(shape)
        dist.recv(grad, src=1)
        hidden.backward(grad)
        return None
    received = torch.empty(shape)
    dist.recv(received, src=0)
    model.set_input_tensor(received.requires_grad_(True))
    loss = model(tokens, None, None, labels=labels)  # [b, s]
    loss.mean().backward()
    dist.send(received.grad.contiguous(), dst=0)
    return loss.detach()


def _body(rank, world_size):
    tokens, labels = batch(vocab=VOCAB, s=SEQ)
    ref_groups = single_rank_groups()
    hf = {}
    if rank == 0:
        hf = {"mamba2": mamba2_parity(ref_groups, tokens), "nemotron_h": nemotron_h_parity(ref_groups, tokens)}
        hf["nemotron_h moe"] = nemotron_h_parity(ref_groups, tokens, pattern="M*E-E")
    ref = _loss_and_grads(build_mamba(ref_groups), tokens, labels, ref_groups.tp)
    tp = build_process_groups(ParallelLayout(world_size=world_size, tensor_model_parallel_size=world_size))
    for sp in (False, True):
        model = build_mamba(tp, config_extra={"sequence_parallel": sp})
        _assert_close(f"tp={world_size} sp={sp}", _loss_and_grads(model, tokens, labels, tp.tp), ref)
    pp = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    model = build_mamba(pp, pre_process=rank == 0, post_process=rank == 1)
    loss = _pipeline_step(model, tokens, labels, rank == 0)
    got = (ref[0] if loss is None else loss, full_tensors(model, pp.tp, True), full_tensors(model, pp.tp, False))
    _assert_close(f"pp={world_size} rank={rank}", got, ref)
    held = [None, None]
    dist.all_gather_object(held, sorted(got[1]))
    assert set(held[0]) | set(held[1]) == set(ref[1])  # the two stages hold every parameter
    torch.manual_seed(5)  # the same HF weights on both ranks
    model = hf_nemotron_h(PATTERN)
    perturb(model)
    prompts = random_prompts([3, 9, 6], vocab=VOCAB)
    generated = {"tp2": greedy_tokens(model, tp, prompts, NEW_TOKENS)}
    if rank == 0:
        generated["tp1"] = greedy_tokens(model, ref_groups, prompts, NEW_TOKENS)
        generated["hf"] = hf_greedy_full_forward(model, prompts, NEW_TOKENS)
    return hf, generated


def test_hybrid_mamba_matches_transformers_generates_and_tp_sp_pp_equal_single_rank():
    parity, generated = run_distributed(_body, 2)[0]
    for family, (imported, exported) in parity.items():
        assert imported < HF_MAX_ABS, (family, "HF weights imported", imported)
        assert exported < HF_MAX_ABS, (family, "our weights exported", exported)
    assert generated["tp1"] == generated["hf"], generated
    assert generated["tp2"] == generated["hf"], generated
