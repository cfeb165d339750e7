"""Loads that must not be trusted blindly (issue 9): another architecture, unused tensors, flipped bits,
an unwritable or full disk, a deleted tracker. Two gloo ranks, TP=2 unless said otherwise."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.training import checkpointing as ckpt
from megatron.training.checkpoint_args import architecture_args, check_checkpoint_args
from megatron.training.checkpointing import CheckpointConfig, check_save_dir, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt, gpt2_style
from tests.unit_tests.dist_checkpointing.ckpt_utils import (
    StubOptimizer,
    assert_same_weights,
    full_weights_by_key,
    groups_for,
)

# The architecture flags of gpt2_style() as a run would save them (validated destinations).
ARCH = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "kv_channels": 8,
    "ffn_hidden_size": 128,
    "position_embedding_type": "learned_absolute",
    "max_position_embeddings": 32,
    "normalization": "LayerNorm",
    "apply_residual_connection_post_layernorm": False,
    "swiglu": False,
    "add_bias_linear": True,
    "rotary_base": 10000,
    "padded_vocab_size": 128,
    "lr": 3e-4,
}


class Records(logging.Handler):
    """Collects the messages of one logger (the harness runs ranks in subprocesses: no caplog)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.messages = []
        self.target = logging.getLogger(name)
        self.target.addHandler(self)
        self.target.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _model(groups, seed, **overrides):
    return build_gpt(gpt2_style(**overrides), groups, seed=seed)


def _saved(tmp, name, fmt="torch_dist", iteration=10, **overrides):
    """Save gpt2_style(**overrides) with optimizer state under tmp/name; returns (cfg, weights by key)."""
    groups = groups_for(2)
    model = _model(groups, 1, **overrides)
    opt = StubOptimizer()
    opt.fill_from([model])
    cfg = CheckpointConfig(save=os.path.join(tmp, name), load=os.path.join(tmp, name), ckpt_format=fmt)
    save_checkpoint(iteration, [model], opt, None, cfg, {}, ARCH)
    return cfg, full_weights_by_key(model, groups)


# ------------------------------------------------------------------ 2 ranks: checksums
def _flip_bit(path, inside: bytes) -> None:
    """Flip one bit in the middle of the first copy of ``inside`` (a tensor's raw bytes) in the file."""
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(inside)
        assert at >= 0, f"the tensor's bytes are not in {path}"
        f.seek(at + len(inside) // 2)
        f.write(bytes([data[at + len(inside) // 2] ^ 0x10]))


def _checksum_body(rank, world, tmp):
    cfg, saved = _saved(tmp, "ck")
    iter_dir = os.path.join(cfg.load, "iter_0000010")
    groups = groups_for(2)
    # TP rank 1 writes the second half of the vocabulary rows of the word embedding to __1_0.distcp.
    embedding = saved["embedding.word_embeddings.weight"]
    rows = embedding[embedding.shape[0] // 2 :].contiguous().numpy().tobytes()
    dist.barrier()
    if rank == 0:
        _flip_bit(os.path.join(iter_dir, "__1_0.distcp"), rows)
    dist.barrier()
    with pytest.raises(CheckpointingError, match=r"checkpoint file corrupt: .*iter_0000010/__1_0.distcp: sha256 "):
        load_checkpoint([_model(groups, 2)], None, None, cfg)
    model = _model(groups, 2)
    load_checkpoint([model], None, None, CheckpointConfig(load=cfg.load, verify_checkpoint=False))
    got = full_weights_by_key(model, groups)["embedding.word_embeddings.weight"]
    assert (got != embedding).sum() == 1, "unverified, the flipped bit reaches the model"
    # A checkpoint without checksums (written before them) loads, with a warning.
    records = Records("megatron.core.dist_checkpointing.serialization")
    dist.barrier()
    if rank == 0:
        changed = got[got.shape[0] // 2 :].contiguous().numpy().tobytes()
        _flip_bit(os.path.join(iter_dir, "__1_0.distcp"), changed)  # flipped back
        with open(os.path.join(iter_dir, "metadata.json")) as f:
            meta = json.load(f)
        meta.pop("checksums")
        with open(os.path.join(iter_dir, "metadata.json"), "w") as f:
            json.dump(meta, f)
    dist.barrier()
    model = _model(groups, 2)
    load_checkpoint([model], None, None, cfg)
    assert_same_weights(saved, full_weights_by_key(model, groups))
    assert rank != 0 or any("records no checksums" in m for m in records.messages), records.messages
    return True


def test_a_flipped_bit_is_reported_with_the_file_name(tmp_path):
    run_distributed(_checksum_body, 2, str(tmp_path))


def _legacy_checksum_body(rank, world, tmp):
    cfg, saved = _saved(tmp, "legacy", "torch")
    iter_dir = os.path.join(cfg.load, "iter_0000010")
    with open(os.path.join(iter_dir, "checksums.json")) as f:
        assert sorted(json.load(f)["files"]) == ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]
    embedding = saved["embedding.word_embeddings.weight"]
    dist.barrier()
    if rank == 0:
        _flip_bit(
            os.path.join(iter_dir, "mp_rank_01", "model_optim_rng.pt"),
            embedding[embedding.shape[0] // 2 :].contiguous().numpy().tobytes(),
        )
    dist.barrier()
    groups = groups_for(2)
    model = _model(groups, 2)
    # Rank 1 reads (and checks) the bad file; rank 0's own file is fine, yet it must stop too, not hang.
    with pytest.raises(
        CheckpointingError,
        match=r"checkpoint file corrupt: .*mp_rank_01/model_optim_rng.pt: "
        r"sha256 .*iter_0000010/checksums.json",
    ):
        load_checkpoint([model], None, None, cfg)
    return True


def test_a_flipped_bit_in_a_legacy_file_is_reported(tmp_path):
    run_distributed(_legacy_checksum_body, 2, str(tmp_path))


# ------------------------------------------------------------------ 2 ranks: full disk
def _limit_file_size(nbytes):
    """This process's files may not grow past ``nbytes``: writes fail with EFBIG (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _full_disk_body(rank, world, tmp, fmt, limit_of):
    cfg, saved = _saved(tmp, fmt, fmt)
    groups = groups_for(2)
    model = _model(groups, 3)
    limit = limit_of(os.path.join(cfg.save, "iter_0000010"))
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if rank == 1:  # one rank's disk is full: both must stop, none may hang
        _limit_file_size(limit)
    try:
        with pytest.raises(
            CheckpointingError,
            match=r"cannot write checkpoint .*iter_0000020.*maximum file size "
            r"\(EFBIG.*still names 10, the last complete checkpoint",
        ):
            save_checkpoint(20, [model], None, None, cfg, {}, ARCH)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    with open(os.path.join(cfg.save, ckpt.TRACKER_FILE)) as f:
        assert f.read() == "10"
    model = _model(groups, 4)
    assert load_checkpoint([model], None, None, CheckpointConfig(load=cfg.load, ckpt_format=fmt))[0] == 10
    assert_same_weights(saved, full_weights_by_key(model, groups))
    return True


def _rng_file_fails(iter_dir):
    return 64  # the first file rank 1 writes (its RNG state, kilobytes of JSON) already fails


def _shard_fails(iter_dir):
    # The RNG file fits, the tensor shard (much larger) does not: DCP's own write fails.
    return os.path.getsize(os.path.join(iter_dir, "rng", "rank_00001.json")) + 4096


def _legacy_file_fails(iter_dir):
    return 4096


@pytest.mark.parametrize(
    "fmt, limit_of",
    [("torch_dist", _rng_file_fails), ("torch_dist", _shard_fails), ("torch", _legacy_file_fails)],
    ids=["rng_json", "distcp", "legacy"],
)
def test_a_full_disk_names_the_cause_and_keeps_the_last_checkpoint(tmp_path, fmt, limit_of):
    run_distributed(_full_disk_body, 2, str(tmp_path), fmt, limit_of)


# ------------------------------------------------------------------ no processes
def test_architecture_check_names_each_flag_values_and_checkpoint():
    run = dict(
        ARCH,
        num_attention_heads=8,
        normalization="RMSNorm",
        apply_residual_connection_post_layernorm=True,
        position_embedding_type="rope",
        lr=1.0,
    )
    with pytest.raises(CheckpointingError) as err:
        check_checkpoint_args(ARCH, run, "/ck/iter_0000010")
    text = str(err.value)
    for line in (
        "--num-attention-heads: checkpoint 4, this run 8",
        "--normalization: checkpoint 'LayerNorm', this run 'RMSNorm'",
        "--apply-residual-connection-post-layernorm: checkpoint False, this run True",
        "--position-embedding-type: checkpoint 'learned_absolute', this run 'rope'",
    ):
        assert line in text, text
    assert "/ck/iter_0000010" in text and "--use-checkpoint-args" in text and "lr" not in text.split("\n", 1)[1]
    # Flags that do not shape this checkpoint's model, and flags it does not record, are not compared.
    check_checkpoint_args(ARCH, dict(ARCH, rotary_base=500000, lr=1.0, moe_router_topk=4), "/ck")
    check_checkpoint_args({"num_layers": 2}, dict(ARCH, hidden_size=64), "/ck")


def test_a_hybrid_mamba_checkpoint_loads_at_its_own_tensor_parallel_size_only():
    # A Mamba mixer's in_proj / conv1d rows are laid out per TP rank: another TP size would load wrong weights.
    saved = dict(ARCH, tensor_model_parallel_size=2)
    check_checkpoint_args(saved, dict(ARCH, tensor_model_parallel_size=1), "/ck")  # a GPT reshards freely
    hybrid = dict(saved, is_hybrid_model=True)
    with pytest.raises(CheckpointingError, match="--tensor-model-parallel-size: checkpoint 2, this run 1"):
        check_checkpoint_args(hybrid, dict(hybrid, tensor_model_parallel_size=1), "/ck")
    check_checkpoint_args(hybrid, dict(hybrid), "/ck")


def test_every_architecture_flag_is_a_real_destination():
    from megatron.training.arguments import flag_specs

    dests = {spec.dest for spec in flag_specs()}
    assert set(architecture_args()) <= dests, set(architecture_args()) - dests


# ------------------------------------------------------------------ 2 ranks: architecture
def _architecture_body(rank, world, tmp):
    for fmt in ("torch_dist", "torch"):
        cfg, saved = _saved(tmp, fmt, fmt)
        groups = groups_for(2)
        run = dict(ARCH, num_attention_heads=8, normalization="RMSNorm")
        for variant in (
            cfg,
            CheckpointConfig(load=cfg.load, finetune=True),
            CheckpointConfig(load=cfg.load, no_load_optim=True),
        ):
            model = _model(groups, 2)  # same shapes as the saved one: only the flags tell them apart
            with pytest.raises(
                CheckpointingError,
                match=r"(?s)iter_0000010.*another model architecture.*"
                r"--num-attention-heads: checkpoint 4, this run 8",
            ):
                load_checkpoint([model], StubOptimizer(), None, variant, run_args=run)
        model = _model(groups, 2)
        opt = StubOptimizer()
        opt.fill_from([model])
        assert load_checkpoint([model], opt, None, cfg, run_args=dict(ARCH, lr=1.0))[0] == 10
        assert_same_weights(saved, full_weights_by_key(model, groups))
    return True


def test_another_architecture_is_refused_in_both_formats(tmp_path):
    run_distributed(_architecture_body, 2, str(tmp_path))


# ------------------------------------------------------------------ 2 ranks: unused and absent keys
def _strictness_body(rank, world, tmp):
    cfg, saved = _saved(tmp, "learned")
    groups = groups_for(2)
    records = Records("megatron.core.dist_checkpointing.validation")
    # RoPE over a learned-position checkpoint: same shapes, the position table would be dropped.
    rope = _model(groups, 2, position_embedding_type="rope")
    with pytest.raises(
        CheckpointingError,
        match=r"1 tensor\(s\) in the checkpoint .*learned/iter_0000010 are not "
        r"used by this model: embedding.position_embeddings.weight",
    ):
        load_checkpoint([rope], None, None, cfg)
    for opt_out in ("raise_unexpected", "log_all"):
        rope = _model(groups, 2, position_embedding_type="rope")
        load_checkpoint([rope], None, None, CheckpointConfig(load=cfg.load, dist_ckpt_strictness=opt_out))
        expected = {k: v for k, v in saved.items() if k != "embedding.position_embeddings.weight"}
        assert_same_weights(expected, full_weights_by_key(rope, groups))
    assert rank != 0 or any(
        "not used by this model, not loaded: embedding.position_embeddings.weight" in m for m in records.messages
    ), records.messages  # rank 0 reports it
    # The optimizer state a --no-load-optim / finetune load leaves unread is expected, not unused.
    model = _model(groups, 2)
    assert load_checkpoint([model], StubOptimizer(), None, CheckpointConfig(load=cfg.load, no_load_optim=True))[0] == 10
    # A model tensor the checkpoint lacks: an error by default; log_unexpected keeps its initial value.
    qk = _model(groups, 2, qk_layernorm=True)
    with pytest.raises(
        CheckpointingError,
        match=r"tensor\(s\) of this model are not in the checkpoint .*"
        r"q_layernorm.*log_unexpected",
    ):
        load_checkpoint([qk], None, None, cfg)
    qk = _model(groups, 2, qk_layernorm=True)
    initial = full_weights_by_key(qk, groups)
    load_checkpoint([qk], None, None, CheckpointConfig(load=cfg.load, dist_ckpt_strictness="log_unexpected"))
    got = full_weights_by_key(qk, groups)
    for key, value in got.items():
        assert torch.equal(value, initial[key] if "layernorm" in key and key not in saved else saved[key]), key
    return True


def test_unused_checkpoint_tensors_are_an_error_unless_strictness_says_otherwise(tmp_path):
    run_distributed(_strictness_body, 2, str(tmp_path))


def test_strictness_values_are_megatrons():
    from megatron.training.arguments import flag_specs

    spec = next(s for s in flag_specs() if s.dest == "dist_ckpt_strictness")
    assert [s.value for s in StrictHandling] == list(
        spec.choices
    ) and spec.default == CheckpointConfig().dist_ckpt_strictness
    with pytest.raises(ValueError, match="dist_ckpt_strictness='strict': must be one of assume_ok_unexpected"):
        CheckpointConfig(dist_ckpt_strictness="strict")


# ------------------------------------------------------------------ 2 ranks: directories
def _directories_body(rank, world, tmp):
    cfg, _ = _saved(tmp, "ck")
    groups = groups_for(2)
    # Unwritable --save: a path below a regular file, or an existing directory no one may write (/proc).
    blocker = os.path.join(tmp, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    for save in (os.path.join(blocker, "ckpt"), "/proc"):
        with pytest.raises(
            CheckpointingError, match=f"--save {save}: the checkpoint directory cannot be created or written"
        ):
            check_save_dir(CheckpointConfig(save=save))
    # Starting from scratch (or finetuning) into a --save that holds checkpoints would overwrite them.
    for variant in (
        CheckpointConfig(save=cfg.save),
        CheckpointConfig(save=cfg.save, load=tmp),
        CheckpointConfig(save=cfg.save, load=cfg.save, finetune=True),
    ):
        with pytest.raises(
            CheckpointingError,
            match=r"already holds 1 complete checkpoint\(s\), the newest "
            r".*ck/iter_0000010.*would overwrite",
        ):
            check_save_dir(variant)
    check_save_dir(cfg)  # resuming from it
    check_save_dir(CheckpointConfig(save=os.path.join(tmp, "fresh")))
    # The tracker deleted: refuse to start over, say how to resume.
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(cfg.load, ckpt.TRACKER_FILE))
    dist.barrier()
    with pytest.raises(
        CheckpointingError,
        match=r"ck has no latest_checkpointed_iteration.txt but holds 1 complete "
        r"checkpoint\(s\), the newest .*iter_0000010.*--ckpt-step 10",
    ):
        load_checkpoint([_model(groups, 2)], None, None, cfg)
    assert load_checkpoint([_model(groups, 2)], None, None, CheckpointConfig(load=cfg.load, ckpt_step=10))[0] == 10
    return True


def test_unwritable_save_and_overwrites_are_refused(tmp_path):
    run_distributed(_directories_body, 2, str(tmp_path))
