"""``megatron.training.run_progress``: how far a saved run got, the requeue decision of the Slurm example."""

import json

import pytest

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.training import run_progress as rp


def _checkpoint(root, iteration, **args):
    """A tracker and an iteration directory with just what run_progress reads (common.json's args)."""
    iter_dir = root / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    (iter_dir / "metadata.json").write_text("{}")
    (iter_dir / "common.json").write_text(json.dumps({"iteration": iteration, "args": args}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_iterations_against_train_iters(tmp_path, capsys):
    _checkpoint(tmp_path, 5, train_iters=10)
    assert rp.run_progress(str(tmp_path)) == rp.RunProgress(5, 10)
    assert rp.main([str(tmp_path)]) == rp.UNFINISHED
    assert "iteration 5 of 10 (unfinished)" in capsys.readouterr().out
    _checkpoint(tmp_path, 10, train_iters=10)
    assert rp.run_progress(str(tmp_path)).finished and rp.main([str(tmp_path)]) == rp.FINISHED


def test_train_samples_count_in_iterations(tmp_path):
    _checkpoint(tmp_path, 9, train_iters=None, train_samples=80, global_batch_size=8, rampup_batch_size=None)
    assert rp.run_progress(str(tmp_path)) == rp.RunProgress(9, 10)


def test_nothing_to_resume_and_release(tmp_path):
    assert rp.run_progress(str(tmp_path)) is None and rp.main([str(tmp_path)]) == rp.NO_CHECKPOINT
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(CheckpointingError, match="release"):
        rp.run_progress(str(tmp_path))
