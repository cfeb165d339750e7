"""Checkpoints across expert-parallel sizes: a MoE GPT trained with EP=2 (distributed optimizer, bf16)
loads under EP=1 (DP=2, and TP=2) with the same weights and Adam state (moments and fp32 main
params), and an EP=1 checkpoint loads under EP=2. Experts are keyed by their global index. On 4 ranks,
expert-TP different from TP: TP=2 x EP=2 x ETP=1 (experts whole, expert-DP=2) loads under TP=2 x ETP=2
(experts split) and back under TP=1 x EP=2 x ETP=2."""

from __future__ import annotations

import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt
from tests.unit_tests.dist_checkpointing.ckpt_utils import assert_same_weights, full_weights_by_key, tiny_kwargs
from tests.unit_tests.dist_checkpointing.test_checkpointing_optimizer import BF16, _optimizer_state_by_key, _train_step


def _build(tp: int, ep: int, seed: int, distributed: bool, etp=None):
    layout = ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    groups = build_process_groups(layout)
    sp = dict(sequence_parallel=True) if tp > 1 else {}  # MoE with TP trains only with SP
    model = build_gpt(dict(tiny_kwargs("moe"), **BF16, **sp), groups, seed=seed)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model, pg_collection=groups
    )
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed, **BF16)
    return groups, model, ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _state(groups, model, ddp, opt):
    return full_weights_by_key(model, groups), _optimizer_state_by_key(groups, model, ddp, opt)


def _assert_same(where, expected, actual):
    (weights, optim), (got_weights, got_optim) = expected, actual
    assert any(".local_experts.3." in key for key in weights), f"{where}: global expert keys expected"
    assert_same_weights(weights, got_weights)
    for sub in optim:
        assert_same_weights(optim[sub], got_optim[sub])


def _body(rank, world, tmp_ep2, tmp_ep1):
    # EP=2 -> EP=1 (DP=2) and EP=1 x TP=2.
    groups, model, ddp, opt = _build(tp=1, ep=2, seed=1, distributed=True)
    for it in range(2):
        _train_step(groups, ddp, opt, it)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=tmp_ep2), {}, {"bf16": True})
    saved = _state(groups, model, ddp, opt)
    for tp in (1, 2):
        groups, model, ddp, opt = _build(tp=tp, ep=1, seed=5, distributed=False)
        assert load_checkpoint([ddp], opt, None, CheckpointConfig(load=tmp_ep2))[0] == 2
        _assert_same(f"EP=2 -> EP=1 TP={tp}", saved, _state(groups, model, ddp, opt))
    # EP=1 (TP=2, the Adam state just loaded, one more step) -> EP=2 with the distributed optimizer.
    _train_step(groups, ddp, opt, 2)
    save_checkpoint(3, [ddp], opt, None, CheckpointConfig(save=tmp_ep1), {}, {"bf16": True})
    saved = _state(groups, model, ddp, opt)
    groups, model, ddp, opt = _build(tp=1, ep=2, seed=7, distributed=True)
    assert load_checkpoint([ddp], opt, None, CheckpointConfig(load=tmp_ep1))[0] == 3
    _assert_same("EP=1 TP=2 -> EP=2", saved, _state(groups, model, ddp, opt))
    return True


def test_expert_parallel_checkpoint_loads_under_other_ep_and_tp(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ep2"), str(tmp_path / "ep1"))


def _etp_body(rank, world, tmp_a, tmp_b):
    groups, model, ddp, opt = _build(tp=2, ep=2, seed=1, distributed=True, etp=1)
    assert groups.size_of("expt_tp") == 1 and groups.size_of("expt_dp") == 2
    for it in range(2):
        _train_step(groups, ddp, opt, it)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=tmp_a), {}, {"bf16": True})
    saved = _state(groups, model, ddp, opt)
    groups, model, ddp, opt = _build(tp=2, ep=1, seed=5, distributed=False, etp=2)
    assert load_checkpoint([ddp], opt, None, CheckpointConfig(load=tmp_a))[0] == 2
    _assert_same("TP=2 EP=2 ETP=1 -> TP=2 ETP=2", saved, _state(groups, model, ddp, opt))
    _train_step(groups, ddp, opt, 2)
    save_checkpoint(3, [ddp], opt, None, CheckpointConfig(save=tmp_b), {}, {"bf16": True})
    saved = _state(groups, model, ddp, opt)
    groups, model, ddp, opt = _build(tp=1, ep=2, seed=7, distributed=True, etp=2)
    assert load_checkpoint([ddp], opt, None, CheckpointConfig(load=tmp_b))[0] == 3
    _assert_same("TP=2 ETP=2 -> TP=1 EP=2 ETP=2", saved, _state(groups, model, ddp, opt))
    return True


def test_expert_tensor_parallel_checkpoint_loads_under_other_etp(tmp_path):
    run_distributed(_etp_body, 4, str(tmp_path / "etp1"), str(tmp_path / "etp2"))
