"""Loads that must not be trusted blindly (issue 9): flipped bits and a
full disk. Two gloo ranks, TP=2 unless said otherwise."""

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
from megatron.training import checkpointing as ckpt
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt, gpt2_style
from tests.unit_tests.dist_checkpointing.ckpt_utils import (StubOptimizer, assert_same_weights, full_weights_by_key,
                                                            groups_for)

# The architecture flags of gpt2_style() as a run would save them (validated destinations).
ARCH = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 4, "kv_channels": 8,
        "ffn_hidden_size": 128, "position_embedding_type": "learned_absolute", "max_position_embeddings": 32,
        "normalization": "LayerNorm", "apply_residual_connection_post_layernorm": False, "swiglu": False,
        "add_bias_linear": True, "rotary_base": 10000, "padded_vocab_size": 128, "lr": 3e-4}


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
    rows = embedding[embedding.shape[0] // 2:].contiguous().numpy().tobytes()
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
        changed = got[got.shape[0] // 2:].contiguous().numpy().tobytes()
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
        _flip_bit(os.path.join(iter_dir, "mp_rank_01", "model_optim_rng.pt"),
                  embedding[embedding.shape[0] // 2:].contiguous().numpy().tobytes())
    dist.barrier()
    groups = groups_for(2)
    model = _model(groups, 2)
    if rank == 1:  # legacy files are read (and checked) by the rank that loads them
        with pytest.raises(CheckpointingError, match=r"checkpoint file corrupt: .*mp_rank_01/model_optim_rng.pt: "
                                                     r"sha256 .*iter_0000010/checksums.json"):
            load_checkpoint([model], None, None, cfg)
    else:
        assert load_checkpoint([model], None, None, cfg)[0] == 10
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
        with pytest.raises(CheckpointingError, match=r"cannot write checkpoint .*iter_0000020.*maximum file size "
                                                     r"\(EFBIG.*still names 10, the last complete checkpoint"):
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


@pytest.mark.parametrize("fmt, limit_of", [("torch_dist", _rng_file_fails), ("torch_dist", _shard_fails),
                                           ("torch", _legacy_file_fails)], ids=["rng_json", "distcp", "legacy"])
def test_a_full_disk_names_the_cause_and_keeps_the_last_checkpoint(tmp_path, fmt, limit_of):
    run_distributed(_full_disk_body, 2, str(tmp_path), fmt, limit_of)
