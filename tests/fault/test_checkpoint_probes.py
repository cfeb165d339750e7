"""pretrain_gpt.py end to end: resuming refuses another architecture (or takes the checkpoint's with
--use-checkpoint-args), an unwritable --save stops the run before training, and a deleted tracker or a
from-scratch run never overwrites complete checkpoints, and a flipped bit in a shard is named (issue 9)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 4
ARCH_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads")


def _without(flags, names):
    """``flags`` minus each flag of ``names`` and its value."""
    out, skip = [], False
    for word in flags:
        if skip:
            skip = False
        elif word in names:
            skip = True
        else:
            out.append(word)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-rank learned-position LayerNorm GPT saved at iteration 2 of 4 (then exited)."""
    work = tmp_path_factory.mktemp("trust")
    base = tiny_gpt_flags(ITERS) + mock_flags()
    ckpt = str(work / "ckpt")
    first = run_gpt(1, base + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], str(work))
    assert_ok(first, "first half")
    return work, base, ckpt


def _copy(saved, name):
    work, _, ckpt = saved
    target = str(work / name)
    shutil.copytree(ckpt, target)
    return target


def test_resume_with_another_architecture_is_refused(saved):
    work, base, _ = saved
    ckpt = _copy(saved, "other_arch")
    changed = base + ["--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    result = run_gpt(1, changed + ["--load", ckpt, "--save", ckpt], str(work))
    assert result.returncode != 0 and not result.lines, result.output[-3000:]
    for text in (
        "other_arch/iter_0000002 was saved with another model architecture",
        "--position-embedding-type: checkpoint 'learned_absolute', this run 'rope'",
        "--normalization: checkpoint 'LayerNorm', this run 'RMSNorm'",
        "--use-checkpoint-args",
    ):
        assert text in result.output, (text, result.output[-3000:])


def test_use_checkpoint_args_takes_the_model_flags_from_the_checkpoint(saved):
    work, base, _ = saved
    ckpt = _copy(saved, "use_args")
    with open(os.path.join(ckpt, "iter_0000002", "common.json")) as f:
        reference = json.load(f)["args"]
    # No model size flags at all, and a conflicting architecture: the checkpoint's flags win.
    flags = _without(base, ARCH_FLAGS) + [
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--use-checkpoint-args",
        "--load",
        ckpt,
        "--save",
        ckpt,
    ]
    result = run_gpt(1, flags, str(work))
    assert_ok(result, "resume with --use-checkpoint-args")
    assert [line["iteration"] for line in result.lines] == [3, 4]
    with open(os.path.join(ckpt, "iter_0000004", "common.json")) as f:
        resumed = json.load(f)["args"]
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "position_embedding_type",
        "normalization",
        "max_position_embeddings",
        "ffn_hidden_size",
        "padded_vocab_size",
    ):
        assert resumed[dest] == reference[dest], dest


def test_unwritable_save_stops_before_training(saved):
    work, base, _ = saved
    blocker = work / "a_file"
    blocker.write_text("not a directory")
    result = run_gpt(1, base + ["--save", str(blocker / "ckpt")], str(work))
    assert result.returncode != 0 and not result.lines, result.output[-3000:]
    assert f"--save {blocker / 'ckpt'}: the checkpoint directory cannot be created or written" in result.output


def _contents(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


def test_deleted_tracker_and_fresh_start_never_overwrite(saved):
    work, base, _ = saved
    ckpt = _copy(saved, "no_tracker")
    os.remove(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    before = _contents(work / "no_tracker" / "iter_0000002")
    base = base + ["--save-interval", "2"]  # a fresh start would rewrite iter_0000002
    resumed = run_gpt(1, base + ["--load", ckpt, "--save", ckpt], str(work))
    assert resumed.returncode != 0 and not resumed.lines, resumed.output[-3000:]
    assert "no_tracker has no latest_checkpointed_iteration.txt but holds 1 complete checkpoint(s)" in resumed.output
    assert "--ckpt-step 2" in resumed.output
    fresh = run_gpt(1, base + ["--save", ckpt], str(work))
    assert fresh.returncode != 0 and not fresh.lines, fresh.output[-3000:]
    assert "already holds 1 complete checkpoint(s)" in fresh.output and "this run starts from scratch" in fresh.output
    assert _contents(work / "no_tracker" / "iter_0000002") == before


def test_flipped_bit_in_a_shard_is_named(saved):
    work, base, _ = saved
    ckpt = _copy(saved, "flipped")
    shard = os.path.join(ckpt, "iter_0000002", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    result = run_gpt(1, base + ["--load", ckpt, "--save", ckpt], str(work))
    assert result.returncode != 0 and not result.lines
    assert f"checkpoint file corrupt: {shard}" in result.output, result.output[-3000:]
