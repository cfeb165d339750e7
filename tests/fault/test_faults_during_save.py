"""kill -9 or a full disk in the middle of a checkpoint save loses nothing that was complete.

The second save is killed after its shard files are written and before ``metadata.json``.
The tracker must still name the first checkpoint, the half-written directory must never be
loaded, and a resumed run must reproduce the straight run's losses from there on.
"""

from __future__ import annotations

import os

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

HERE = os.path.dirname(os.path.abspath(__file__))


def test_kill_during_save_keeps_last_complete_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    flags = [*tiny_gpt_flags(6), *mock_flags(), "--save", str(save), "--save-interval", "2"]
    killed = run_gpt(1, flags, str(tmp_path), script=[os.path.join(HERE, "faulty_gpt.py"), "kill-at-save", "2"])
    assert killed.returncode != 0
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000002" / "metadata.json").exists()
    assert (save / "iter_0000004").is_dir() and not (save / "iter_0000004" / "metadata.json").exists()

    resumed = run_gpt(1, [*flags, "--load", str(save)], str(tmp_path))
    assert_ok(resumed, "resume after kill -9")
    straight = run_gpt(1, tiny_gpt_flags(6) + mock_flags(), str(tmp_path))
    assert_ok(straight, "straight run")
    assert [l["iteration"] for l in resumed.lines] == [3, 4, 5, 6]
    assert resumed.losses() == straight.losses()[2:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (save / "iter_0000004" / "metadata.json").exists()  # the torn directory was rewritten whole


def test_full_disk_during_save_names_the_cause_and_keeps_nothing_half_written(tmp_path):
    save = tmp_path / "ckpt"
    flags = [*tiny_gpt_flags(4), *mock_flags(), "--save", str(save), "--save-interval", "2"]
    # 64 KiB: the JSON files fit, the model's shard (~0.8 MB) does not.
    full = run_gpt(
        1, flags, str(tmp_path), script=[os.path.join(HERE, "faulty_gpt.py"), "file-size-limit", str(64 << 10)]
    )
    assert full.returncode != 0
    assert "cannot write checkpoint" in full.output and "iter_0000002" in full.output, full.output[-3000:]
    assert "EFBIG" in full.output, full.output[-3000:]
    assert not (save / "latest_checkpointed_iteration.txt").exists()
    assert not (save / "iter_0000002" / "metadata.json").exists()
