"""Start-up checks of what the flags name, and the once-only report (no processes: the pieces directly)."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron.training import preflight
from megatron.training.validation import ArgumentsError


def _args(**kw) -> argparse.Namespace:
    base = dict(mock_data=False, data_path=None, train_data_path=None, valid_data_path=None, test_data_path=None)
    base.update(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None, tokenizer_model=None)
    base.update(load=None, ckpt_step=None, exit_on_missing_checkpoint=False, skip_train=False, finetune=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_data_prefixes_need_both_files_and_weights_are_not_prefixes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for ext in (".bin", ".idx"):
        open(a + ext, "w").close()
    open(b + ".bin", "w").close()
    assert preflight.data_prefixes(_args(data_path=["0.3", a, "0.7", b])) == [a, b]
    assert preflight.data_problem(_args(data_path=[a])) is None
    assert preflight.data_problem(_args(data_path=["0.3", a, "0.7", b])) == f"--data-path {b}: {b}.idx not found"
    assert preflight.data_problem(_args(data_path=[b], mock_data=True)) is None
    assert "without .bin/.idx" in preflight.data_problem(_args(data_path=[a + ".bin"]))


def test_tokenizer_files(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    assert preflight.tokenizer_problem(_args(vocab_file=str(vocab))) is None
    missing = str(tmp_path / "merges.txt")
    assert preflight.tokenizer_problem(_args(vocab_file=str(vocab), merge_file=missing)) == (
        f"--merge-file {missing}: no such file (--tokenizer-type GPT2BPETokenizer)"
    )
    hub = _args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/model")  # a hub name, not a file
    assert preflight.tokenizer_problem(hub) is None


def test_load_without_checkpoint_is_an_error_only_when_the_run_needs_the_weights(tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert preflight.load_problem(_args(load=empty)) is None  # training from scratch: Megatron's warning
    message = preflight.load_problem(_args(load=empty, finetune=True))
    assert (
        message.startswith(f"--load {empty}: no checkpoint to load") and "--finetune starts from its weights" in message
    )
    assert preflight.load_problem(_args(load=empty, finetune=True, ckpt_step=5)) is None  # named explicitly
    iter_dir = tmp_path / "empty" / "iter_0000002"
    iter_dir.mkdir()
    (iter_dir / "metadata.json").write_text("{}")  # complete, but the tracker is gone: never start over
    assert "has no latest_checkpointed_iteration.txt" in preflight.load_problem(_args(load=empty))


def test_output_directory_must_be_creatable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert preflight.writable_dir_problem("--tensorboard-dir", str(tmp_path / "tb")) is None
    assert preflight.writable_dir_problem("--tensorboard-dir", str(blocker / "tb")).startswith(
        f"--tensorboard-dir {blocker / 'tb'}: the directory cannot be created or written"
    )


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_user_error_prints_on_the_reporting_rank_only(monkeypatch, rank, printed):
    monkeypatch.setenv("RANK", rank)
    slept = []  # a silent rank waits before exiting, so the launcher does not stop the reporter mid-print
    monkeypatch.setattr(preflight.time, "sleep", slept.append)
    with pytest.raises(ArgumentsError) as caught:
        with preflight.reported_once():
            raise ArgumentsError("--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2")
    # SystemExit prints a string code and exits 1; an int code exits silently with that status.
    assert caught.value.code == (
        "--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2" if printed else 1
    )
    assert slept == ([] if printed else [preflight.SILENT_RANK_GRACE_S])
    with pytest.raises(preflight.InputError) as caught:
        with preflight.reported_once():
            raise preflight.InputError("rank 1: --data-path x: x.bin not found", reporter=1)
    assert (caught.value.code == 1) == printed  # reported by rank 1, not rank 0
