"""save_checkpoint / load_checkpoint: layout changes, optimizer and scheduler state, RNG, tracker, legacy format."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.training import checkpointing as ckpt
from megatron.training.checkpoint_formats.base import TORCH_DIST
from megatron.training.checkpoint_formats.registry import get_format
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.unit_tests.dist_checkpointing.ckpt_utils import (
    StubOptimizer,
    assert_same_weights,
    build_stage,
    full_weights_by_key,
    groups_for,
)

ARGS = {"num_layers": 2, "hidden_size": 32, "lr": 0.5, "data_path": ["a", "b"], "fp16": False}
TRAIN_STATE = {
    "consumed_train_samples": 320,
    "consumed_valid_samples": 64,
    "num_floating_point_operations_so_far": 1.5e12,
}


# ------------------------------------------------------------------ no processes
def test_config_validation():
    assert CheckpointConfig(no_save_optim=None).no_save_optim is False
    with pytest.raises(ValueError, match="not supported yet: --ckpt-format torch_dcp"):
        CheckpointConfig(ckpt_format="torch_dcp")
    with pytest.raises(ValueError, match="ckpt_format='zarr'"):
        CheckpointConfig(ckpt_format="zarr")
    with pytest.raises(ValueError, match="save_interval=0"):
        CheckpointConfig(save_interval=0)


def test_config_from_megatron_flags():
    from megatron.training.arguments import checkpoint_config_from_args, parse_args

    args = parse_args(
        ["--save", "/s", "--load", "/l", "--save-interval", "5", "--no-load-rng", "--ckpt-format", "torch"]
    )
    cfg = checkpoint_config_from_args(args)
    assert (cfg.save, cfg.load, cfg.save_interval, cfg.no_load_rng, cfg.no_save_optim, cfg.ckpt_format) == (
        "/s",
        "/l",
        5,
        True,
        False,
        "torch",
    )


def test_args_to_plain_data():
    import argparse

    ns = argparse.Namespace(params_dtype=torch.bfloat16, activation_func=torch.nn.functional.silu, sizes=(1, 2))
    assert ckpt.args_to_plain_data(ns) == {"params_dtype": "torch.bfloat16", "activation_func": "silu", "sizes": [1, 2]}


def test_args_to_plain_data_turns_int_enums_into_numbers():
    """--exit-signal is a signal.Signals: kept as such, the legacy .pt file could not be read with weights_only."""
    import argparse
    import io
    import signal

    plain = ckpt.args_to_plain_data(argparse.Namespace(exit_signal=signal.SIGTERM))
    assert plain == {"exit_signal": int(signal.SIGTERM)} and type(plain["exit_signal"]) is int
    buffer = io.BytesIO()
    torch.save({"args": plain}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"args": plain}


# ------------------------------------------------------------------ 2 ranks
def _scheduler():
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(
        dummy,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )


def _setup(tp, pp=1, seed=1, style="llama"):
    groups = groups_for(tp, pp)
    model_parallel_cuda_manual_seed(123, tp_rank=groups.rank_in("tp"), ep_rank=0, etp_rank=0)
    model = build_stage(style, groups, seed)
    optimizer = StubOptimizer()
    optimizer.fill_from([model])
    return groups, model, optimizer


def _draws():
    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return [random.random(), float(np.random.rand()), torch.rand(3), tracked]


def _same_draws(a, b):
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2:], b[2:]))


def _scramble_rng():
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)


def _check_optimizer(opt, model, groups, expected_weights):
    exp_avg = full_weights_by_key(model, groups, {n: s["exp_avg"] for n, s in _per_param(opt, model).items()})
    exp_avg.pop("tied_copy", None)  # the last stage's own copy: its state is not compared here
    expected = {k: 2 * v.float() + 1 for k, v in expected_weights.items() if k != "tied_copy"}
    assert_same_weights(expected, exp_avg)
    assert opt.state["step"] == 7 and opt.state["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(opt.state["grad_scaler"]["scale"], torch.tensor(1024.0))


def _per_param(opt, model):
    return {n: opt.state[n] for n, _ in model.named_parameters()}


def _sharded_body(rank, world, tmp):
    cfg = CheckpointConfig(save=tmp, load=tmp)
    groups, model, opt = _setup(tp=2)
    sched = _scheduler()
    sched.step(5)
    saved = full_weights_by_key(model, groups)
    save_checkpoint(10, [model], opt, sched, cfg, TRAIN_STATE, ARGS)
    after_save = _draws()
    iter_dir = os.path.join(tmp, "iter_0000010")
    with open(os.path.join(tmp, ckpt.TRACKER_FILE)) as f:
        assert f.read() == "10"
    with open(os.path.join(iter_dir, ckpt.COMMON_FILE)) as f:
        common = json.load(f)  # plain JSON, no pickle anywhere but DCP's own .metadata
    assert common["args"] == ARGS and common["train_state"] == TRAIN_STATE

    # Same layout: everything back, including the RNG streams.
    _scramble_rng()
    groups, model, opt = _setup(tp=2, seed=5)
    sched2 = _scheduler()
    assert load_checkpoint([model], opt, sched2, cfg) == (10, TRAIN_STATE)
    assert _same_draws(_draws(), after_save), "RNG not restored"
    assert sched2.num_steps == 5
    assert_same_weights(saved, full_weights_by_key(model, groups))
    _check_optimizer(opt, model, groups, saved)

    # TP=2 -> TP=1 x DP=2: model and optimizer resharded (RNG skipped with a warning).
    groups1, model1, opt1 = _setup(tp=1, seed=6)
    assert load_checkpoint([model1], opt1, _scheduler(), cfg) == (10, TRAIN_STATE)
    assert_same_weights(saved, full_weights_by_key(model1, groups1))
    _check_optimizer(opt1, model1, groups1, saved)

    # Finetune: weights only, iteration 0, optimizer untouched.
    groups, model, opt = _setup(tp=2, seed=7)
    before = dict(opt.state)
    assert load_checkpoint([model], opt, _scheduler(), CheckpointConfig(load=tmp, finetune=True)) == (0, {})
    assert opt.state == before
    assert_same_weights(saved, full_weights_by_key(model, groups))
    _crash_body(rank, tmp, cfg, saved)
    return True


def _crash_body(rank, tmp, cfg, saved_at_10):
    """A save that dies after the DCP write leaves the tracker on the previous checkpoint."""
    groups, model, opt = _setup(tp=2, seed=8)
    sharded = get_format(TORCH_DIST)
    original = sharded.save

    def dies_after_write(*a, **k):
        original(*a, **k)
        raise KeyboardInterrupt("killed after the DCP write")

    sharded.save = dies_after_write
    try:
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(20, [model], opt, _scheduler(), cfg, TRAIN_STATE, ARGS)
    finally:
        del sharded.save  # the class's method again
    with open(os.path.join(tmp, ckpt.TRACKER_FILE)) as f:
        assert f.read() == "10"
    groups, model, opt = _setup(tp=2, seed=9)
    assert load_checkpoint([model], opt, _scheduler(), cfg)[0] == 10
    assert_same_weights(saved_at_10, full_weights_by_key(model, groups))
    # A directory interrupted before metadata.json is refused by name.
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(tmp, "iter_0000020", "metadata.json"))
    dist.barrier()
    with pytest.raises(CheckpointingError, match=r"iter_0000020 holds neither metadata.json.*incomplete"):
        load_checkpoint([model], opt, _scheduler(), CheckpointConfig(load=tmp, ckpt_step=20))


def test_sharded_save_load_resume_and_crash(tmp_path):
    run_distributed(_sharded_body, 2, str(tmp_path))


def _legacy_body(rank, world, tmp):
    # TP=1 x PP=2 (file suffix _{pp:03d}); the tied output copy travels in the last stage's file.
    cfg = CheckpointConfig(save=tmp, load=tmp, ckpt_format="torch")
    groups, model, opt = _setup(tp=1, pp=2, style="gpt2")
    saved = full_weights_by_key(model, groups)
    save_checkpoint(5, [model], opt, _scheduler(), cfg, TRAIN_STATE, ARGS)
    after_save = _draws()
    path = os.path.join(tmp, "iter_0000005", f"mp_rank_00_{rank:03d}", "model_optim_rng.pt")
    state = torch.load(path, weights_only=True)
    assert state["args"] == ARGS and state["iteration"] == 5 and state["checkpoint_version"] == 3.0
    _scramble_rng()
    groups, model, opt = _setup(tp=1, pp=2, seed=3, style="gpt2")
    assert load_checkpoint([model], opt, _scheduler(), cfg) == (5, TRAIN_STATE)
    assert _same_draws(_draws(), after_save)
    got = full_weights_by_key(model, groups)
    assert torch.equal(got.pop("tied_copy"), saved.pop("tied_copy"))
    assert_same_weights(saved, got)
    _check_optimizer(opt, model, groups, saved)
    # Another layout cannot read a legacy checkpoint: say so.
    groups, model, opt = _setup(tp=2, style="gpt2")
    with pytest.raises(CheckpointingError, match=r"mp_rank_0\d/model_optim_rng.pt \(a torch-format"):
        load_checkpoint([model], opt, _scheduler(), cfg)
    _error_checks(rank, tmp)
    return True


def _error_checks(rank, tmp):
    groups, model, opt = _setup(tp=1, pp=2, style="gpt2")
    empty = os.path.join(tmp, "empty")
    with pytest.raises(CheckpointingError, match=r"empty/latest_checkpointed_iteration.txt not found"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=empty, exit_on_missing_checkpoint=True))
    assert load_checkpoint([model], opt, None, CheckpointConfig(load=empty)) == (0, {})
    with pytest.raises(TypeError, match="args_dict must be plain data"):
        save_checkpoint(1, [model], opt, None, CheckpointConfig(save=tmp), {}, {"f": torch.zeros(1)})
    # Saved without optimizer: loading it asks for --no-load-optim.
    no_opt = os.path.join(tmp, "no_opt")
    save_checkpoint(3, [model], opt, None, CheckpointConfig(save=no_opt, no_save_optim=True), {}, ARGS)
    with pytest.raises(CheckpointingError, match="no optimizer state.*--no-load-optim"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=no_opt))
    assert load_checkpoint([model], opt, None, CheckpointConfig(load=no_opt, no_load_optim=True))[0] == 3
    # A release checkpoint: weights only, iteration 0.
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.copytree(os.path.join(tmp, "iter_0000005"), os.path.join(tmp, "rel", "release"))
        with open(os.path.join(tmp, "rel", ckpt.TRACKER_FILE), "w") as f:
            f.write("release")
    dist.barrier()
    before = dict(opt.state)
    assert load_checkpoint([model], opt, None, CheckpointConfig(load=os.path.join(tmp, "rel"))) == (0, {})
    assert opt.state == before
    # Corrupt files name their path.
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "iter_0000005", "mp_rank_00_000", "model_optim_rng.pt"), "r+b") as f:
            f.truncate(100)
        with open(os.path.join(no_opt, "iter_0000003", "common.json"), "w") as f:
            f.write("{not json")
        os.makedirs(empty + "2")
        with open(os.path.join(empty + "2", ckpt.TRACKER_FILE), "w") as f:
            f.write("abc")
    dist.barrier()
    # Only rank 0's file is bad; every rank raises (the others name rank 0's cause), none hangs.
    with pytest.raises(
        CheckpointingError,
        match=r"checkpoint file corrupt: .*mp_rank_00_000/model_optim_rng.pt "
        r"has 100 bytes, .*iter_0000005/checksums.json records",
    ):
        load_checkpoint([model], opt, None, CheckpointConfig(load=tmp))
    with pytest.raises(CheckpointingError, match=r"cannot read legacy checkpoint .*mp_rank_00_000"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=tmp, verify_checkpoint=False))
    with pytest.raises(CheckpointingError, match=r"checkpoint file corrupt: .*iter_0000003/common.json has 9 bytes"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=no_opt, no_load_optim=True))
    with pytest.raises(CheckpointingError, match=r"checkpoint common state is corrupt: .*iter_0000003/common.json"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=no_opt, no_load_optim=True, verify_checkpoint=False))
    with pytest.raises(CheckpointingError, match=r"corrupt tracker file .*empty2"):
        load_checkpoint([model], opt, None, CheckpointConfig(load=empty + "2"))


def test_legacy_format_round_trip_and_errors(tmp_path):
    run_distributed(_legacy_body, 2, str(tmp_path))


def _new_format_body(rank, world, tmp):
    """A format from one module in tests/ (``json_format.py``): saved, detected and loaded by the
    same ``save_checkpoint`` / ``load_checkpoint`` the training loop calls, with nothing else changed."""
    from tests.unit_tests.dist_checkpointing import json_format

    cfg = CheckpointConfig(save=tmp, load=tmp, ckpt_format=json_format.NAME)
    groups, model, opt = _setup(tp=2)
    saved = full_weights_by_key(model, groups)
    save_checkpoint(4, [model], opt, _scheduler(), cfg, TRAIN_STATE, ARGS)
    after_save = _draws()
    iter_dir = os.path.join(tmp, "iter_0000004")
    assert os.path.isfile(json_format.rank_file(iter_dir, rank)) and ckpt.detect_format(iter_dir) == json_format.NAME
    assert ckpt.saved_args(iter_dir) == ARGS
    _scramble_rng()
    groups, model, opt = _setup(tp=2, seed=5)
    # Loading needs no --ckpt-format: the directory is detected through the registry.
    assert load_checkpoint([model], opt, _scheduler(), CheckpointConfig(load=tmp)) == (4, TRAIN_STATE)
    assert _same_draws(_draws(), after_save)
    assert_same_weights(saved, full_weights_by_key(model, groups))
    _check_optimizer(opt, model, groups, saved)
    return True


def test_a_new_format_is_one_registered_module(tmp_path):
    from megatron.training.checkpoint_formats import registry

    with pytest.raises(ValueError, match="ckpt_format='test_json': must be one of \\('torch_dist', 'torch'\\)"):
        CheckpointConfig(ckpt_format="test_json")  # unknown until its module registers it
    run_distributed(_new_format_body, 2, str(tmp_path))
    assert registry.format_names() == ("torch_dist", "torch")  # the spawned ranks registered it, not this process
