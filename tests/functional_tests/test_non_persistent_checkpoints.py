"""Non-persistent checkpoints (``--non-persistent-save-interval``, ``--non-persistent-ckpt-type global|local``).

A 2-rank job (distributed optimizer) saves persistently every 4 iterations and non-persistently every 2,
and dies (every rank SIGKILLed, ``faulty_gpt.py kill-all-at 6``: no exit save) before step 7. Resume must
take iteration 6's non-persistent checkpoint and continue with the losses of a straight run that was never
interrupted (the reference); old non-persistent checkpoints are gone; a local checkpoint one rank lacks the
completion marker of is not used (resume falls back to the persistent iteration 4, again with the straight
losses). With ``--async-save`` the global ones are written in the background and cleaned the same way.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron.training import checkpoint_local
from megatron.training.checkpoint_config import CheckpointConfig
from megatron.training.checkpoint_dirs import remove_other_checkpoints, save_dir_problem
from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

FAULTY = os.path.join(os.path.dirname(__file__), "..", "fault", "faulty_gpt.py")
ITERS = 8
BASE = tiny_gpt_flags(ITERS) + mock_flags() + ["--use-distributed-optimizer"]  # local: each rank its shard


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: the reference losses."""
    result = run_gpt(2, BASE, str(tmp_path_factory.mktemp("straight")))
    assert_ok(result, "straight run")
    assert len(result.losses()) == ITERS
    return result.losses()


def _killed_at_6(tmp_path, saving):
    """The job with ``saving`` flags, dead before step 7; its losses of iterations 1..6."""
    killed = run_gpt(2, BASE + saving, str(tmp_path), script=[FAULTY, "kill-all-at", "6"])
    assert killed.returncode != 0, killed.output[-3000:]
    assert [line["iteration"] for line in killed.lines] == list(range(1, 7))
    return killed.losses()


def _resume(tmp_path, saving, expected_first):
    resumed = run_gpt(2, BASE + saving + ["--load", saving[1]], str(tmp_path))
    assert_ok(resumed, "resumed run")
    assert [line["iteration"] for line in resumed.lines] == list(range(expected_first, ITERS + 1))
    return resumed


def test_global_non_persistent_resume_and_cleanup(straight, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saving = ["--save", ckpt, "--save-interval", "4", "--non-persistent-save-interval", "2"]
    saving += ["--non-persistent-ckpt-type", "global"]
    first = _killed_at_6(tmp_path, saving)
    np_dir = os.path.join(ckpt, "non_persistent")
    assert sorted(os.listdir(np_dir)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]  # iteration 2 removed
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "4"
    resumed = _resume(tmp_path, saving, 7)
    assert f"non-persistent (global), iteration 6, in {np_dir}" in resumed.output
    assert first + resumed.losses() == straight  # printed values, exactly
    # With --async-save the global ones are written in the background; the old one still goes once 6 is published.
    ckpt_async = str(tmp_path / "ckpt_async")
    background = run_gpt(2, BASE + [ckpt_async if f == ckpt else f for f in saving] + ["--async-save"], str(tmp_path))
    assert_ok(background, "--async-save run")
    assert background.output.count("handed to the background writer") == 4  # persistent 4, 8; non-persistent 2, 6
    assert sorted(os.listdir(os.path.join(ckpt_async, "non_persistent"))) == sorted(os.listdir(np_dir))
    assert background.losses() == straight


def test_local_non_persistent_resume_and_incomplete_fallback(straight, tmp_path):
    ckpt, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    saving = ["--save", ckpt, "--save-interval", "4", "--non-persistent-save-interval", "2"]
    saving += ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local]
    first = _killed_at_6(tmp_path, saving)
    names = ["rank_00000.done", "rank_00000.pt", "rank_00001.done", "rank_00001.pt"]
    assert os.listdir(local) == ["iter_0000006"] and sorted(os.listdir(os.path.join(local, "iter_0000006"))) == names
    # A copy of the job's files where rank 1 never finished writing iteration 6: no marker.
    ckpt_b, local_b = str(tmp_path / "ckpt_b"), str(tmp_path / "local_b")
    shutil.copytree(ckpt, ckpt_b)
    shutil.copytree(local, local_b)
    os.remove(os.path.join(local_b, "iter_0000006", "rank_00001.done"))

    resumed = _resume(tmp_path, saving, 7)
    assert f"non-persistent (local), iteration 6, in {local}" in resumed.output
    assert first + resumed.losses() == straight

    saving_b = saving[:1] + [ckpt_b] + saving[2:-1] + [local_b]
    fallback = _resume(tmp_path, saving_b, 5)
    assert f"persistent, iteration 4, in {ckpt_b}" in fallback.output
    assert first[:4] + fallback.losses() == straight


def test_non_persistent_config_refusals():
    """in_memory, local without a directory, an interval without a type, local with --async-save."""
    cases = [
        (dict(non_persistent_ckpt_type="in_memory"), "in-job restart starts new processes"),
        (dict(non_persistent_ckpt_type="local"), "needs non_persistent_local_ckpt_dir"),
        (dict(save="/s", non_persistent_save_interval=2), "needs non_persistent_ckpt_type"),
        (dict(non_persistent_ckpt_type="global", non_persistent_save_interval=2), "needs save"),
        (dict(non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/l", async_save=True), "synchronously"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            CheckpointConfig(**kwargs)
    assert CheckpointConfig(save="/s").non_persistent_global_dir("/s") == "/s/non_persistent"


def test_stale_non_persistent_checkpoints_are_refused_or_removed(tmp_path):
    """Checkpoints an earlier job left: a fresh --save refuses a complete global one (a later resume would take
    it); publishing removes every other global one, newer too; a local marker of another layout does not count."""
    save = str(tmp_path / "save")
    for iteration in (3, 10):
        os.makedirs(os.path.join(save, "non_persistent", f"iter_{iteration:07d}"))
    open(os.path.join(save, "non_persistent", "iter_0000010", "metadata.json"), "w").close()
    cfg = CheckpointConfig(save=save, non_persistent_ckpt_type="global", non_persistent_save_interval=2)
    assert "non_persistent/iter_0000010" in save_dir_problem(cfg)
    assert save_dir_problem(CheckpointConfig(save=save)) is None
    remove_other_checkpoints(os.path.join(save, "non_persistent"), 3)
    assert os.listdir(os.path.join(save, "non_persistent")) == ["iter_0000003"]

    local, layout = str(tmp_path / "local"), {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "cp": 1}
    for iteration, saved_layout in ((2, layout), (4, dict(layout, tp=2)), (6, layout)):
        path = checkpoint_local.rank_file(local, iteration, 0)
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(b"x" * 5)
        marker = {"iteration": iteration, "layout": saved_layout, "bytes": 5}
        if iteration != 6:  # 6: the marker was never written
            with open(checkpoint_local.rank_file(local, iteration, 0, ".done"), "w") as f:
                json.dump(marker, f)
    assert checkpoint_local.complete_iterations(local, 0, layout) == {2}
