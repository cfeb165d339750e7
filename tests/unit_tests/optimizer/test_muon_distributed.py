"""``optimizer="muon"`` with the distributed optimizer and TP, against the single-process reference of
``muon_reference`` (plain torch on the full matrices), and resumed from a torch_dist checkpoint bit for bit.

Gradients come from a loss linear in the parameters (``muon_reference.Toy.forward``), different on each DP
rank, reduced by ``DistributedDataParallel``; the reference averages them. Under DP=2 each Muon matrix lies
whole in one rank's slice (``keep_muon_matrices_whole``), so that rank orthogonalises the whole matrix;
under TP=2 ``duplicated`` gathers the shards first, ``distributed`` sums the Gram matrices over TP. The
resume check trains a tiny Llama-style GPT (fused GQA QKV split into Q, K, V; a stride-2 SwiGLU fc1)
4 steps straight and 2 + save + load + 2.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import plan_buckets, plan_whole_buckets
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, keep_muon_matrices_whole
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, llama_style
from tests.unit_tests.dist_checkpointing.ckpt_utils import groups_for
from tests.unit_tests.optimizer.muon_reference import LR, MU, WD, Toy, check_against, ref_name, reference

TOL = dict(rtol=1e-5, atol=1e-6)
MUON_NAMES = {"col", "row", "rep", "qkv"}  # 2-D, not the output layer
_DDP_MODEL_CONFIG = SimpleNamespace(calculate_per_token_loss=False)  # all DDP reads of the model's config


def _wrapped_toy(groups, whole=True, **kw):
    """The TP-sharded Toy in DDP with the distributed optimizer, and its Muon optimizer."""
    tp_rank, tp = groups.rank_in("tp"), groups.size_of("tp")
    module = Toy(tp_rank, tp)
    if whole:
        keep_muon_matrices_whole([module])
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp = DistributedDataParallel(_DDP_MODEL_CONFIG, ddp_config, module, pg_collection=groups)
    fields = dict(lr=LR, weight_decay=WD, clip_grad=0.0, muon_momentum=MU, muon_fp32_matmul_prec="high")
    config = OptimizerConfig(optimizer="muon", use_distributed_optimizer=True, **{**fields, **kw})
    return module, ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _train_toy(groups, module, ddp, opt, steps):
    tp_rank, tp, dp_rank = groups.rank_in("tp"), groups.size_of("tp"), groups.rank_in("dp")
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(step, tp_rank, tp, dp_rank).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]


def _owned_matrices(module, opt):
    """Names of the Muon matrices this rank's optimizer updates (whole: main shaped like the parameter)."""
    names = {id(p): ref_name(n) for n, p in module.named_parameters()}
    owned = {names[id(link.model)] for link in opt.links if names[id(link.model)] in MUON_NAMES}
    for link in opt.links:
        if names[id(link.model)] in owned:
            assert link.main.shape == link.model.shape and link.flat_range == (0, link.model.numel())
    return owned


def _toy_cases(groups):
    """Each case equals its reference after 2 steps (fp32 Newton–Schulz)."""
    tp, dp = groups.size_of("tp"), groups.size_of("dp")
    cases = [
        (dict(muon_tp_mode="duplicated", muon_split_qkv=False), dict()),
        (
            dict(muon_tp_mode="duplicated", muon_use_nesterov=True, muon_scale_mode="unit_rms_norm"),
            dict(nesterov=True, scale_mode="unit_rms_norm", split_qkv=True),
        ),
    ]
    if tp > 1:  # blockwise is honoured (each shard on its own); distributed sums Gram matrices over TP instead
        cases.append((dict(muon_tp_mode="blockwise", muon_split_qkv=False), dict(blockwise_tp=tp)))
        cases.append((dict(muon_tp_mode="distributed", muon_split_qkv=False), dict()))
    for kw, ref in cases:
        module, ddp, opt = _wrapped_toy(groups, **kw)
        _train_toy(groups, module, ddp, opt, 2)
        expected = reference(2, ref.pop("nesterov", False), ref.pop("scale_mode", "spectral"), dp=dp, **ref)
        check_against(module, expected, groups.rank_in("tp"), tp, **TOL)
    return module, opt


def _toy_body(rank, world_size, tp):
    groups = groups_for(tp)
    module, opt = _toy_cases(groups)
    # Every Muon matrix is whole on exactly one DP rank, and both ranks get some (the work is split).
    owned = [None] * groups.size_of("dp")
    dist.all_gather_object(owned, sorted(_owned_matrices(module, opt)), group=groups.dp)
    assert sorted(sum(owned, [])) == sorted(MUON_NAMES), owned
    assert all(owned) or len(owned) == 1, owned
    if groups.size_of("dp") > 1:
        # Without the whole layout the flat slices cut a matrix (a [3, 4] one over elements 10-21 of 2 x 11): refused.
        module = torch.nn.Module()
        for name, shape in (("a", (3, 4)), ("b", (2, 4)), ("c", (2,))):
            module.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(_DDP_MODEL_CONFIG, ddp_config, module, pg_collection=groups)
        config = OptimizerConfig(optimizer="muon", lr=LR, use_distributed_optimizer=True)
        with pytest.raises(ValueError, match="keep_muon_matrices_whole"):
            get_megatron_optimizer(config, [ddp], pg_collection=groups)


@pytest.mark.parametrize("tp", [1, 2])
def test_muon_distributed_optimizer_equals_reference(tp):
    """DP=2 (tp=1) and TP=2 (DP=1) with the distributed optimizer."""
    run_distributed(_toy_body, 2, tp)


def test_muon_distributed_optimizer_tp2_dp2_equals_reference():
    run_distributed(_toy_body, 4, 2)


def _gpt(groups, seed, distributed=True):
    model = build_gpt(llama_style(hidden_size=32, ffn_hidden_size=64), groups, seed=seed)
    if distributed:
        keep_muon_matrices_whole([model])
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=groups)
    config = OptimizerConfig(
        optimizer="muon", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed, muon_tp_mode="duplicated"
    )
    return ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _train_gpt(groups, ddp, opt, steps, first=0):
    for it in range(first, first + steps):
        tokens, labels = batch(seed=10 * it + groups.rank_in("dp"), b=2)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens, None, None, labels=labels).float().mean().backward()
        finalize_model_grads([ddp], None, groups)
        assert opt.step()[0]


def _params(ddp):
    ddp.finish_param_sync()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _resume_body(rank, world_size, tmp, tp):
    groups = groups_for(tp)
    ddp, opt = _gpt(groups, seed=1)
    _train_gpt(groups, ddp, opt, 4)
    straight = _params(ddp)
    ddp, opt = _gpt(groups, seed=1)
    _train_gpt(groups, ddp, opt, 2)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=tmp), {}, {})
    ddp, opt = _gpt(groups, seed=7)
    load_checkpoint([ddp], opt, None, CheckpointConfig(load=tmp, no_load_rng=True))
    _train_gpt(groups, ddp, opt, 2, first=2)
    resumed = _params(ddp)
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
    # The same steps on the non-distributed optimizer (every rank orthogonalises every matrix): the same
    # parameters and the same by-name state (momentum_buffer for the matrices, Adam's moments for the rest).
    by_name = opt.state_dict_by_param_name([ddp], all_ranks=True)
    ddp, opt = _gpt(groups, seed=1, distributed=False)
    _train_gpt(groups, ddp, opt, 4)
    for name, value in _params(ddp).items():
        torch.testing.assert_close(value, straight[name], **TOL, msg=name)
    reference_state = opt.state_dict_by_param_name([ddp])
    assert {key for name in straight for key in reference_state[name]} == {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    for name in straight:
        assert sorted(by_name[name]) == sorted(reference_state[name]), name
        for key, value in reference_state[name].items():
            torch.testing.assert_close(by_name[name][key], value, **TOL, msg=f"{name} {key}")
    ps.destroy_model_parallel()


def test_muon_distributed_optimizer_resumes_bitwise(tmp_path):
    """DP=2: 4 steps straight equal 2 + torch_dist save + load into a fresh model + 2, bit for bit."""
    run_distributed(_resume_body, 2, os.fspath(tmp_path), 1)


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("bucket_size", [None, 40])
def test_plan_whole_buckets_keeps_every_parameter_in_one_slice(dp, bucket_size):
    """The buckets of ``plan_buckets``, each parameter inside one of the dp equal slices, none overlapping."""
    numels = [12, 7, 30, 1, 16, 16, 5, 24, 9]
    ranges, plans = plan_whole_buckets(numels, bucket_size, dp)
    _, ordinary = plan_buckets(numels, bucket_size, 1)
    assert [p.param_indices for p in plans] == [p.param_indices for p in ordinary]
    for plan in plans:
        size = (plan.end - plan.start) // dp
        assert plan.end - plan.start == dp * size
        spans = sorted(ranges[i] for i in plan.param_indices)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
        slices = {(start - plan.start) // size for start, _ in spans}
        for start, end in spans:
            assert (start - plan.start) // size == (end - 1 - plan.start) // size  # whole in one slice
        assert len(slices) == min(dp, len(spans))  # every rank gets work when there is enough of it
