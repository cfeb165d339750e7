"""DeepSeek-V4 (the parity test's tiny model: CSA, HCA and sliding layers, three hyper-connection streams, hash-routed
and learned MoE layers, plus one MTP module: the last layer's spec on its own streams with its own hyper head; its
loss adds to the gradients) under TP=2 with sequence parallelism (MoE layers train under TP only with it, as in
Megatron) and EP=2 equals one rank: the per-token loss and every gradient (TP shards gathered, sequence-parallel
replicas summed) within rtol 1e-5, atol 1e-6 (times the tensor's largest entry when that is above 1: the q-norms
give gradients of order 5, and only the order of float additions differs). The compressed attention is replicated
over TP: its gradients are complete on each rank (not summed); the indexer gets none. The same pair trains PP=2 and
PP=2 with two virtual stages (one chunk empty) through the schedule against one rank (``pipeline_parity.check_parity``:
loss, every gradient, the weights after a step, an evaluation loss; the sent stage outputs are ``[s, b, n * h]``);
the full tier adds TP=2+SP inside PP=2 on four ranks.
"""

import pytest

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, single_rank_groups
from tests.unit_tests.models.test_deepseek_v4_parity import V4_MODEL, VOCAB, S
from tests.unit_tests.models.test_mla_parallel_parity import _loss_and_grads
from tests.unit_tests.pipeline_parallel.pipeline_parity import check_parity
from tests.unit_tests.transformer.test_moe_expert_parallel import _groups, _one_step

RTOL, ATOL = 1e-5, 1e-6
MODEL = dict(V4_MODEL, init_method_std=0.05, mtp_num_layers=1)
# PP=2: four layers so that the second stage holds a hash-routed MoE layer (its token ids reach it there) beside the
# learned one and the MTP module. With two virtual stages, LAYOUT's chunks (rank 0, rank 1, rank 0, rank 1) hold
# layer 0, layers 1-2, nothing (the streams pass through) and layer 3 with the MTP module.
LAYOUT = dict(pipeline_model_parallel_layout="Et|tt||tmL")
PP_MODEL = dict(
    MODEL,
    num_layers=4,
    compressed_attention_layer_types=V4_MODEL["compressed_attention_layer_types"] + ["compressed_sparse_attention"],
    moe_num_hash_layers=3,
)


def _check(where, loss, grads, ref_loss, ref_grads) -> float:
    """Loss and every gradient within rtol 1e-5, atol 1e-6 (times the tensor's largest entry when above 1);
    the worst difference relative to that tolerance (< 1: within)."""
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    worst = 0.0
    for name, got, ref in [("loss", loss, ref_loss)] + [(n, grads[n], r) for n, r in ref_grads.items()]:
        tolerance = RTOL * ref.abs() + ATOL * max(1.0, ref.abs().max().item())
        worst = max(worst, ((got - ref).abs() / tolerance).max().item())
        assert ((got - ref).abs() <= tolerance).all(), f"{where} {name}: max |diff| {(got - ref).abs().max():.3g}"
    return worst


def _body(rank, world_size):
    tokens, labels = batch(b=2, s=S, vocab=VOCAB)
    one = single_rank_groups()
    ref_loss, ref_grads = _loss_and_grads(build_gpt(MODEL, one), tokens, labels, one)
    assert not any(".indexer." in name for name in ref_grads), sorted(ref_grads)
    assert any("hyper_connection" in name for name in ref_grads) and any("hyper_head" in name for name in ref_grads)
    # the MTP module: the last layer's spec (sliding attention) on its own streams, collapsed by its own head
    for part in (
        "transformer_layer.mlp_hyper_connection",
        "transformer_layer.self_attention.attention_sinks",
        "hyper_head",
    ):
        assert f"mtp.layers.0.{part}" in "".join(ref_grads), part
    tp = build_process_groups(ParallelLayout(world_size=world_size, tensor_model_parallel_size=world_size))
    worst = {}
    model = build_gpt(dict(MODEL, sequence_parallel=True), tp)  # MoE trains under TP only with SP (Megatron's rule)
    worst["tp=2 sp"] = _check("tp=2 sp", *_loss_and_grads(model, tokens, labels, tp), ref_loss, ref_grads)
    ep_loss, ep_grads = _one_step(MODEL, _groups(1, 2), 2 * world_size)
    ref_loss, ref_grads = _one_step(MODEL, one, 2 * world_size)
    worst["ep=2"] = _check("ep=2", ep_loss, ep_grads, ref_loss, {n: ref_grads[n] for n in ep_grads})
    pp = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    # the stages exchange the packed streams [s, b, n * h] (pipeline_parity.check_released)
    check_parity(PP_MODEL, pp, 1, 2, f"pp={world_size}", iterations=1, rtol=RTOL, atol=ATOL)
    check_parity(PP_MODEL, pp, 2, 2, f"pp={world_size} vp=2", iterations=1, rtol=RTOL, atol=ATOL, chunk_extra=LAYOUT)
    return worst


def test_deepseek_v4_tp_sp_ep_pp_equal_one_rank():
    for worst in run_distributed(_body, 2):
        print(worst)
        assert max(worst.values()) <= 1.0, worst


def _tp_sp_pp(rank, world_size):
    """TP=2 with sequence parallelism inside each of two pipeline stages: the stages exchange [s/tp, b, n * h]."""
    groups = build_process_groups(
        ParallelLayout(world_size=world_size, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    )
    sp = dict(sequence_parallel=True)
    check_parity(PP_MODEL, groups, 1, 2, "tp=2 sp pp=2", iterations=1, rtol=RTOL, atol=ATOL, chunk_extra=sp)


@pytest.mark.full  # default-tier sibling: test_deepseek_v4_tp_sp_ep_pp_equal_one_rank (TP=2+SP and PP=2 apart)
def test_deepseek_v4_tp_sp_pp_equal_one_rank():
    run_distributed(_tp_sp_pp, 4)
