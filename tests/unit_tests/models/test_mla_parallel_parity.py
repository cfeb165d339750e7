"""A DeepSeek-V3-style GPTModel (MLA + YaRN, shared experts with a gate, sigmoid group-limited
routing with expert bias, one multi-token prediction module) under TP=2 with sequence
parallelism (MoE with TP trains only with it), CP=2, PP=2 and EP=2 equals one rank.

One spawned pair of ranks checks TP, SP and CP against a one-rank reference built on each rank from
the same seed: the per-token loss (under CP at this rank's global positions) and every gradient of
the summed loss plus the MTP loss (TP shards gathered; sequence-parallel replicas, i.e. norms, the
replicated MLA down projections and the shared-expert gate, summed over TP; under CP averaged over
CP with the loss scaled by the CP size, as training does, so the MTP loss's shift across the CP
chunk boundaries and its token count over all CP ranks are both checked), and DeepSeek-V3.2's sparse
attention under TP+SP (its indexer replicated and without gradient). The same pair then
trains PP=2 through the schedule (``pipeline_parity.check_parity``: loss, every gradient, the
weights after two SGD steps, an evaluation loss), the last stage holding the MTP module and its
copy of the embedding: once DeepSeek-style (with a tracked balance loss: the MTP layer keeps its
global number on the last stage), once GPT-2-style (tied output layer, learned positions, both
copied), once with DSA; the last stage's MTP checkpoint keys are the one-rank model's. EP=2 runs
with DSA as well. fp32; rtol=1e-5,
atol=1e-6 (only the order of float additions differs).
"""

import torch
import torch.distributed as dist

from megatron.core.context_parallel import cp_chunk_positions, get_batch_on_this_cp_rank
from megatron.core.dist_checkpointing.state_dict import sharded_state_dict
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, deepseek_style, gather_tp, gpt2_style, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import check_parity
from tests.unit_tests.transformer.test_moe_expert_parallel import E, _compare, _groups, _one_step

RTOL, ATOL = 1e-5, 1e-6
STYLE = dict(moe_shared_expert_gate=True, moe_router_dtype="fp32")
MTP = dict(mtp_num_layers=1)
DSA = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=8, dsa_indexer_head_dim=12, dsa_indexer_topk=4)


def _loss_and_grads(model, tokens, labels, groups):
    """Per-token loss ``[b, s(/cp)]`` and full gradients of its sum over every token of every rank
    (plus the MTP loss, gradient scale 1). Under CP, as in training, each rank back-propagates its
    sum times the CP size and the gradients are averaged over CP."""
    loss = model(tokens, None, None, labels=labels)
    cp = groups.size_of("cp")
    (loss.sum() * cp).backward()
    allreduce_sequence_parallel_grads([model], groups.tp)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:  # DSA's indexer: the top-k selection has no gradient
            continue
        if cp > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=groups.cp)
            grad /= cp
        grads[name] = gather_tp(grad, p, groups.tp)
    return loss.detach(), grads


def _check(where, loss, grads, ref_loss, ref_grads):
    assert set(grads) == set(ref_grads), where
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {name}: {m}")


def _compare_layouts(rank, world_size):
    tokens, labels = batch()
    one = single_rank_groups()
    tp = build_process_groups(ParallelLayout(world_size=world_size, tensor_model_parallel_size=world_size))
    ref_loss, ref_grads = _loss_and_grads(build_gpt(deepseek_style(**STYLE, **MTP), one), tokens, labels, one)
    model = build_gpt(deepseek_style(sequence_parallel=True, **STYLE, **MTP), tp)
    _check(f"tp={world_size} sp mtp", *_loss_and_grads(model, tokens, labels, tp), ref_loss, ref_grads)
    _check_sparse_attention(tokens, labels, one, tp)
    cp = build_process_groups(ParallelLayout(world_size=world_size, context_parallel_size=world_size))
    local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, cp.cp)
    model = build_gpt(deepseek_style(**STYLE, **MTP), cp)
    loss, grads = _loss_and_grads(model, local["tokens"], local["labels"], cp)
    positions = cp_chunk_positions(tokens.shape[1], world_size, dist.get_rank(cp.cp))
    _check(f"cp={world_size} mtp", loss, grads, ref_loss[:, positions], ref_grads)
    pp = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    balanced = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)  # tracked per global layer
    deepseek = deepseek_style(num_layers=4, moe_layer_freq=[0, 1, 1, 1], **STYLE, **MTP, **balanced)
    dsa = deepseek_style(num_layers=2, moe_layer_freq=[0, 1], **STYLE, **DSA)
    for name, kw in (("deepseek", deepseek), ("gpt2 tied", gpt2_style(**MTP)), ("deepseek dsa", dsa)):
        check_parity(kw, pp, 1, 2, f"{name} pp={world_size} mtp", iterations=2)
    _check_mtp_checkpoint_keys(deepseek, one, pp)


def _check_sparse_attention(tokens, labels, one, tp):
    """DeepSeek Sparse Attention (4 of up to 16 keys) under TP+SP equals one rank; the indexer,
    replicated, gets no gradient anywhere, and dense MLA gives another loss (so the selection acts)."""
    ref_loss, ref_grads = _loss_and_grads(build_gpt(deepseek_style(**STYLE, **MTP, **DSA), one), tokens, labels, one)
    assert not any(".indexer." in name for name in ref_grads), sorted(ref_grads)
    dense_loss, _ = _loss_and_grads(build_gpt(deepseek_style(**STYLE, **MTP), one), tokens, labels, one)
    assert (dense_loss - ref_loss).abs().max() > 1e-3, "the indexer's selection does not change the loss"
    model = build_gpt(deepseek_style(sequence_parallel=True, **STYLE, **MTP, **DSA), tp)
    _check(f"dsa tp={tp.size_of('tp')} sp mtp", *_loss_and_grads(model, tokens, labels, tp), ref_loss, ref_grads)


def _check_mtp_checkpoint_keys(kw, one, pp):
    """The last stage names the MTP module (and its layer's global number) as one rank does."""
    last = pp.rank_in("pp") == pp.size_of("pp") - 1
    chunk = build_gpt(kw, pp, pre_process=not last, post_process=last)
    keys = {k for k in sharded_state_dict(chunk) if k.startswith("mtp.")}
    ref = {k for k in sharded_state_dict(build_gpt(kw, one)) if k.startswith("mtp.")}
    assert keys == (ref if last else set()), sorted(keys ^ ref)
    assert not last or "mtp.layers.0.transformer_layer.mlp.router.weight" in keys, sorted(keys)


def test_deepseek_style_tp_sp_cp_pp_equal_one_rank():
    run_distributed(_compare_layouts, 2)


def _expert_parallel(rank, world_size):
    """EP=2 (each rank half the routed experts, shared experts and MLA with DSA's indexer replicated, DDP
    over both ranks) against one rank on the whole batch: the mean loss and every gradient after
    finalize_model_grads."""
    kw = deepseek_style(
        num_moe_experts=E, moe_router_topk=2, moe_router_num_groups=2, moe_router_group_topk=1, **STYLE, **MTP, **DSA
    )
    global_batch = 2 * world_size
    return _compare(
        "ep=2", _one_step(kw, _groups(1, 2), global_batch), _one_step(kw, single_rank_groups(), global_batch)
    )


def test_deepseek_style_ep2_equals_one_rank():
    assert max(run_distributed(_expert_parallel, 2)) < 1e-5
