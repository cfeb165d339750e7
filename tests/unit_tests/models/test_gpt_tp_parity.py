"""GPTModel under tensor (and sequence) parallelism equals the TP=1 model with the same weights.

For each rank count, one spawned group checks GPT-2-style and Llama-style configs (the latter
also with the attention output gate), with and without sequence parallelism: the per-token loss,
and every parameter's gradient (TP shards gathered back to full tensors) against a TP=1 reference
built on the same rank from the same seed. fp32; tolerance rtol=1e-5, atol=1e-6 (only the order of
float additions differs).
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gather_tp, gpt2_style, llama_style, single_rank_groups

RTOL, ATOL = 1e-5, 1e-6


def _loss_and_grads(model, tokens, labels, tp_group):
    loss = model(tokens, None, None, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads([model], tp_group)
    grads = {n: gather_tp(p.grad, p, tp_group) for n, p in model.named_parameters()}
    weights = {n: gather_tp(p.data, p, tp_group) for n, p in model.named_parameters()}
    return loss.detach(), grads, weights


def _compare_with_reference(rank, world_size):
    tp_groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    ref_groups = single_rank_groups()
    tokens, labels = batch()

    def gated(**kw):  # Qwen3-Next's gated attention output: the gate columns split with their query group
        return llama_style(attention_output_gate=True, **kw)

    for name, style in (("gpt2", gpt2_style), ("llama", llama_style), ("llama gated", gated)):
        ref_loss, ref_grads, ref_weights = _loss_and_grads(
            build_gpt(style(), ref_groups), tokens, labels, ref_groups.tp
        )
        for sp in (False, True):
            model = build_gpt(style(sequence_parallel=sp), tp_groups)
            loss, grads, weights = _loss_and_grads(model, tokens, labels, tp_groups.tp)
            where = f"{name} tp={world_size} sp={sp}"
            assert set(grads) == set(ref_grads), where
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
            for pname in ref_grads:
                torch.testing.assert_close(
                    weights[pname], ref_weights[pname], rtol=0, atol=0, msg=lambda m: f"{where} initial {pname}: {m}"
                )
                torch.testing.assert_close(
                    grads[pname], ref_grads[pname], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {pname}: {m}"
                )


# [4] in the full tier: [2] runs the same checks (4 query groups: 2 per rank under TP=2, 1 under TP=4).
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
def test_gpt_tp_equals_single_rank(world_size):
    run_distributed(_compare_with_reference, world_size)


def _logits_gathered(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tokens, _ = batch()
    ref = build_gpt(gpt2_style(), single_rank_groups())(tokens)  # [b, s, v]
    parallel = build_gpt(gpt2_style(), groups)(tokens)  # [b, s, v/tp]
    full = build_gpt(gpt2_style(), groups, parallel_output=False)(tokens)  # [b, s, v]
    assert parallel.shape[-1] == ref.shape[-1] // world_size
    torch.testing.assert_close(full, ref, rtol=RTOL, atol=ATOL)
    chunk = ref.shape[-1] // world_size
    torch.testing.assert_close(parallel, ref[..., rank * chunk : (rank + 1) * chunk], rtol=RTOL, atol=ATOL)


def test_logits_parallel_and_gathered():
    run_distributed(_logits_gathered, 2)
