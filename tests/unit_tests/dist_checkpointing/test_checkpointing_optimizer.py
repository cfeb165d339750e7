"""Checkpoints with the real Megatron optimizer: bitwise resume with the distributed optimizer (DP=2, bf16),
and its Adam state resharded into a TP=2 run with the plain mixed-precision optimizer."""

from __future__ import annotations

import os

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style
from tests.unit_tests.dist_checkpointing.ckpt_utils import assert_same_weights, full_weights_by_key, groups_for

BF16 = {"params_dtype": torch.bfloat16, "bf16": True}


def _build(tp, seed, distributed):
    groups = groups_for(tp)
    model = build_gpt(gpt2_style(**BF16), groups, seed=seed)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model, pg_collection=groups
    )
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed, **BF16)
    return groups, model, ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _train_step(groups, ddp, opt, it):
    tokens, labels = batch(seed=10 * it + groups.rank_in("dp"), b=2)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens, None, None, labels=labels).float().mean()
    opt.scale_loss(loss).backward()
    finalize_model_grads([ddp], None, groups)
    assert opt.step()[0]


def _optimizer_state_by_key(groups, model, ddp, opt):
    state = opt.state_dict_by_param_name([ddp], all_ranks=True)
    return {
        sub: full_weights_by_key(model, groups, {n: state[n][sub] for n, _ in model.named_parameters()})
        for sub in ("exp_avg", "exp_avg_sq", "main_param")
    }


def _optimizer_body(rank, world, tmp):
    cfg = CheckpointConfig(save=tmp, load=tmp)
    groups, model, ddp, opt = _build(tp=1, seed=1, distributed=True)
    for it in range(2):
        _train_step(groups, ddp, opt, it)
    save_checkpoint(2, [ddp], opt, None, cfg, {"consumed_train_samples": 8}, {"bf16": True})
    saved_state = _optimizer_state_by_key(groups, model, ddp, opt)
    _train_step(groups, ddp, opt, 2)
    straight = full_weights_by_key(model, groups)

    # Resume in the same layout: the third step is bitwise the same.
    groups, model, ddp, opt = _build(tp=1, seed=5, distributed=True)
    assert load_checkpoint([ddp], opt, None, cfg) == (2, {"consumed_train_samples": 8})
    _train_step(groups, ddp, opt, 2)
    assert_same_weights(straight, full_weights_by_key(model, groups))

    # Into TP=2 x DP=1 with the non-distributed optimizer: Adam moments and fp32 main params resharded.
    groups, model, ddp, opt = _build(tp=2, seed=6, distributed=False)
    assert load_checkpoint([ddp], opt, None, cfg)[0] == 2
    loaded = _optimizer_state_by_key(groups, model, ddp, opt)
    for sub in saved_state:
        assert_same_weights(saved_state[sub], loaded[sub])
    assert os.path.isfile(os.path.join(tmp, "iter_0000002", "metadata.json"))
    return True


def test_real_optimizer_resume_and_reshard(tmp_path):
    run_distributed(_optimizer_body, 2, str(tmp_path))
