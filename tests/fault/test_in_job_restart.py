"""In-job restart: a rank killed mid-run, torchrun restarts the job (``--max-restarts``), training resumes from
the newest complete checkpoint and ends with the uninterrupted run's losses.

``--save`` and ``--load`` name one directory, so every attempt resumes from what the previous one completed
(a first attempt finds nothing and starts fresh); torchrun's ``--max-restarts`` bounds the attempts. Rank 1
is SIGKILLed before step 6 of its first attempt (``faulty_gpt.py kill-rank1-once 5``), after the save at 4.
"""

from __future__ import annotations

import os

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = [*tiny_gpt_flags(8), *mock_flags(), "--save-interval", "2", "--eval-iters", "0"]


def test_killed_rank_restarts_in_job_and_finishes_with_the_straight_losses(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    restarted = run_gpt(
        2,
        [*FLAGS, "--save", ckpt, "--load", ckpt],
        str(tmp_path),
        script=[os.path.join(HERE, "faulty_gpt.py"), "kill-rank1-once", "5"],
        launcher="torchrun",
        launcher_args=["--max-restarts", "1"],
    )
    assert_ok(restarted, "run restarted after a killed rank")
    iterations = [line["iteration"] for line in restarted.lines]
    assert iterations == [1, 2, 3, 4, 5, 5, 6, 7, 8], iterations  # step 5 ran, 6 did not; resumed from 4
    straight = run_gpt(2, FLAGS, str(tmp_path))
    assert_ok(straight, "straight run")
    assert restarted.losses()[-4:] == straight.losses()[-4:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


def test_without_restarts_left_the_killed_rank_fails_the_job(tmp_path):
    no_retry = run_gpt(
        2,
        [*FLAGS, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")],
        str(tmp_path),
        script=[os.path.join(HERE, "faulty_gpt.py"), "kill-rank1-once", "5"],
        launcher="torchrun",
        launcher_args=["--max-restarts", "0"],
    )
    assert no_retry.returncode != 0  # the attempts are bounded: none left, the job fails
