"""Expert parallelism: a GPT with MoE layers under EP=2 (and EP=2 x TP=2 with SP)
equals the EP=1 run with the same data-parallel layout and the single-rank reference.

Each rank holds half of the experts; its expert parameters are compared with the reference's
parameters of the same global index. References: the same layout with EP=1 (every loss and
gradient, Switch aux loss included) and one rank on the whole global batch (z-loss only: the
Switch balance loss is not additive over data-parallel shards, the z-loss is a token mean).
fp32; rtol 1e-5 / atol 1e-6 for one step's gradients, relative 1e-6 in norm for weights after
several optimizer steps (only the order of float additions differs).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.parallel_state import ParallelLayout, ProcessGroupCollection, build_process_groups
from megatron.core.transformer.moe import MoEAuxLossAutoScaler
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gather_tp, llama_style, single_rank_groups, tp_group_of
from tests.unit_tests.distributed import dp_training as dpt

RTOL, ATOL, WEIGHT_RTOL = 1e-5, 1e-6, 1e-6
E = 4
Z_ONLY = dict(num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=32, moe_z_loss_coeff=1e-3)
WITH_AUX = dict(Z_ONLY, moe_aux_loss_coeff=1e-2)


def _kwargs(moe: Dict, **extra) -> Dict:
    return llama_style(
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        moe_layer_freq=[1, 0],
        **moe,
        **extra,
    )


def _groups(tp: int, ep: int, etp: Optional[int] = None) -> ProcessGroupCollection:
    """All ranks as TP x EP (expert-TP ``etp``, default TP)."""
    layout = ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    return build_process_groups(layout)


def global_name(name: str, groups: ProcessGroupCollection) -> str:
    """``local_experts.{i}`` -> ``local_experts.{global index}`` for this rank's EP position."""
    per_rank = E // groups.size_of("ep")
    return re.sub(
        r"local_experts\.(\d+)\.", lambda m: f"local_experts.{groups.rank_in('ep') * per_rank + int(m.group(1))}.", name
    )


def _one_step(kwargs: Dict, groups: ProcessGroupCollection, global_batch: int):
    """Forward/backward of this DP rank's share, DDP reduction: (global mean loss, full grads by global name)."""
    model = build_gpt(kwargs, groups)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=groups)
    dp, rank = groups.size_of("dp"), groups.rank_in("dp")
    tokens, labels = batch(seed=0, b=global_batch)
    local = global_batch // dp
    rows = slice(rank * local, (rank + 1) * local)
    loss = ddp(tokens[rows], None, None, labels=labels[rows]).mean()
    loss.backward()
    finalize_model_grads([ddp], None, groups)
    total = loss.detach().clone()
    dist.all_reduce(total, group=groups.dp)
    grads = {
        global_name(n, groups): gather_tp(p.main_grad, p, tp_group_of(p, groups)) for n, p in model.named_parameters()
    }
    return total / dp, grads


def _compare(where: str, got, ref) -> float:
    loss, grads = got
    ref_loss, ref_grads = ref
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    assert set(grads) <= set(ref_grads) and any("local_experts" in n for n in grads), where
    worst = (loss - ref_loss).abs().item()
    for name, grad in grads.items():
        assert grad.shape == ref_grads[name].shape, f"{where} {name}: {grad.shape} vs {ref_grads[name].shape}"
        worst = max(worst, (grad - ref_grads[name]).abs().max().item())
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {name}: {m}"
        )
    return worst


def _grads_body(rank, world_size, tp, sp_values):
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    ref_groups, ep_groups, dp_groups = single_rank_groups(), _groups(tp, 2), _groups(tp, 1)
    global_batch = 2 * ep_groups.size_of("dp")
    worst = 0.0
    for sp in sp_values:
        extra = dict(sequence_parallel=sp) if sp else {}
        single = _one_step(_kwargs(Z_ONLY), ref_groups, global_batch)
        for moe, name in ((Z_ONLY, "z-loss"), (WITH_AUX, "aux+z-loss")):
            got = _one_step(_kwargs(moe, **extra), ep_groups, global_batch)
            dense = _one_step(_kwargs(moe, **extra), dp_groups, global_batch)
            where = f"tp={tp} sp={sp} {name}"
            worst = max(worst, _compare(f"{where} EP=2 vs EP=1", got, dense))
            if moe is Z_ONLY:
                worst = max(worst, _compare(f"{where} EP=2 vs one rank", got, single))
                _compare(f"{where} EP=1 vs one rank", dense, single)
    return worst


@pytest.mark.parametrize("world_size,tp,sp_values", [(2, 1, (False,)), (4, 2, (True,))])
def test_ep2_loss_and_grads_equal_ep1_and_single_rank(world_size, tp, sp_values):
    assert max(run_distributed(_grads_body, world_size, tp, sp_values)) < 1e-5


# ----------------------------------------------------------------------------------
# Training: DDP variants, the distributed optimizer and gradient clipping over EP.
# ----------------------------------------------------------------------------------
DIST = dict(use_distributed_optimizer=True)
VARIANTS = {
    "plain": ({}, {}),
    "overlap_nan_check": (dict(overlap_grad_reduce=True, bucket_size=2000, check_for_nan_in_grad=True), {}),
    "distopt_overlap": (dict(DIST, overlap_grad_reduce=True, bucket_size=2000), dict(DIST, overlap_param_gather=True)),
}


def _training_body(rank, world_size, tp):
    groups = _groups(tp, 2)
    kwargs = _kwargs(Z_ONLY, **(dict(sequence_parallel=True) if tp > 1 else {}))
    global_batch = dpt.MICRO_BATCH * dpt.NUM_MICRO * groups.size_of("dp")
    MoEAuxLossAutoScaler.set_loss_scale(1.0)  # the reference: one backward of the global mean
    ref_losses, ref_norms, ref_weights = dpt.reference_run(kwargs, global_batch)
    assert min(ref_norms) > dpt.CLIP, "clipping must be active"
    worst = 0.0
    for name, (ddp_kw, opt_kw) in VARIANTS.items():
        MoEAuxLossAutoScaler.set_loss_scale(1.0 / dpt.NUM_MICRO)  # what forward_step sets
        losses, norms, weights, _, _ = dpt.parallel_run(groups, kwargs, ddp_kw, opt_kw)
        weights = {global_name(n, groups): w for n, w in weights.items()}
        # Expert weights were gathered over TP with the dense TP group: expert-TP has the same ranks.
        dpt.assert_matches(
            f"tp={tp} ep=2 {name}",
            (losses, norms, weights),
            (ref_losses, ref_norms, {n: ref_weights[n] for n in weights}),
            WEIGHT_RTOL,
        )
        worst = max([worst] + [dpt.relative_error(w, ref_weights[n]) for n, w in weights.items()])
    return worst


# (4, 1): expert-DP = 2. (2, 1) in the full tier: (4, 2) trains the same three variants under EP=2 (with
# TP=2+SP); EP=2 without TP: test_ep2_loss_and_grads_equal_ep1_and_single_rank[2-1-...].
@pytest.mark.parametrize("world_size,tp", [pytest.param(2, 1, marks=pytest.mark.full), (4, 1), (4, 2)])
def test_ep2_training_with_clipping_equals_single_rank(world_size, tp):
    assert max(run_distributed(_training_body, world_size, tp)) <= WEIGHT_RTOL
