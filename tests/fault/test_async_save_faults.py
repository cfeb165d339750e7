"""kill -9 during an asynchronous save (``--async-save``) never leaves the tracker on an incomplete checkpoint.

Two ranks, the distributed optimizer, saves at iterations 2 and 4. The second save is killed at one of
three points: rank 1's background writer after its shard files (``kill-writer``), rank 0 when every
rank's files are written and nothing is published (``kill-before-publish``), rank 0 after
``metadata.json`` and before the tracker (``kill-before-tracker``). The tracker must still name 2, and a
resumed run must print the uninterrupted run's losses for iterations 3 and 4. The uninterrupted run
itself saves asynchronously and must match a synchronous run: the same losses and the same tensor files.
"""

from __future__ import annotations

import os

import pytest

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags
from tests.unit_tests.dist_checkpointing.test_async_save import checkpoint_content

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = [*tiny_gpt_flags(4), *mock_flags(), "--use-distributed-optimizer", "--save-interval", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(async run, its save directory) after checking it against a synchronous run."""
    tmp = tmp_path_factory.mktemp("straight")
    runs = {}
    for mode, extra in (("async", ["--async-save"]), ("sync", [])):
        runs[mode] = run_gpt(2, [*FLAGS, "--save", str(tmp / mode), *extra], str(tmp))
        assert_ok(runs[mode], f"{mode} run")
    assert runs["async"].losses() == runs["sync"].losses()
    assert "handed to the background writer" in runs["async"].output
    for iteration in ("iter_0000002", "iter_0000004"):
        ours, theirs = (checkpoint_content(str(tmp / m / iteration), ("common.json",)) for m in ("async", "sync"))
        assert [k for k in ours if k.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]  # both ranks write
        same = {k: ours[k] == theirs[k] for k in ours if k != "common.json"}  # common.json records the flags
        assert all(same.values()), same
    return runs["async"], tmp / "async"


@pytest.mark.parametrize("fault", ["kill-writer", "kill-before-publish", "kill-before-tracker"])
def test_kill_during_async_save_keeps_the_last_complete_checkpoint(tmp_path, uninterrupted, fault):
    straight, _ = uninterrupted
    save = tmp_path / "ckpt"
    flags = [*FLAGS, "--save", str(save), "--async-save"]
    killed = run_gpt(2, flags, str(tmp_path), script=[os.path.join(HERE, "faulty_gpt.py"), fault, "2"])
    assert killed.returncode != 0
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000002" / "metadata.json").exists()
    assert (save / "iter_0000004" / "metadata.json").exists() == (fault == "kill-before-tracker")

    resumed = run_gpt(2, [*flags, "--load", str(save)], str(tmp_path))
    assert_ok(resumed, f"resume after {fault}")
    assert [line["iteration"] for line in resumed.lines] == [3, 4]
    assert resumed.losses() == straight.losses()[2:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
