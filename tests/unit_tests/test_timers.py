"""Timers: elapsed time, levels, reports in each option, and the cross-rank min/max."""

import re
import time

import pytest

from megatron.core.timers import Timers
from tests.dist_harness import run_distributed


class RecordingWriter:
    """Collects add_scalar calls like a TensorBoard writer would receive them."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)


def test_elapsed_covers_the_sleep_and_resets():
    timers = Timers(log_level=0, log_option="minmax")
    timers("work", log_level=0).start()
    time.sleep(0.02)
    timers("work").stop()
    assert timers("work").elapsed(reset=False) >= 0.02
    assert timers("work").elapsed(reset=True) >= 0.02
    assert timers("work").elapsed() == 0.0


def test_elapsed_accumulates_and_keeps_a_running_timer_running():
    timers = Timers(log_level=0, log_option="max")
    timer = timers("work", log_level=0)
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert timer.elapsed(reset=False) >= 0.02
    timer.start()
    timer.elapsed()
    assert timer.is_running
    timer.stop()


def test_misuse_raises():
    timers = Timers(log_level=1, log_option="minmax")
    timer = timers("t", log_level=1)
    with pytest.raises(RuntimeError, match="not started"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already been started"):
        timer.start()
    with pytest.raises(ValueError, match="log_level=1"):
        timers("t", log_level=0)
    with pytest.raises(ValueError, match="log_option"):
        Timers(log_level=0, log_option="mean")
    with pytest.raises(ValueError, match="log_level=3"):
        Timers(log_level=3, log_option="max")


def test_timers_above_the_level_are_dummies_and_never_report():
    timers = Timers(log_level=0, log_option="minmax")
    fine = timers("fine", log_level=1)
    default = timers("default")  # no level given: the finest level, 2
    assert fine is default
    fine.start()
    fine.start()  # a dummy keeps no state, so this is not an error
    fine.stop()
    assert timers.log(["fine", "default"]) is None
    with pytest.raises(RuntimeError):
        fine.elapsed()


def test_report_strings_in_each_option(capsys):
    reports = {}
    for option in ("max", "minmax", "all"):
        timers = Timers(log_level=2, log_option=option)
        timers("forward-backward", log_level=1).start()
        time.sleep(0.01)
        timers("forward-backward").stop()
        reports[option] = timers.log(["forward-backward", "never-created"], normalizer=2.0)
    printed = capsys.readouterr().out
    assert reports["max"].startswith("max time across ranks (ms):\n    forward-backward....")
    assert reports["minmax"].startswith("(min, max) time across ranks (ms):\n    forward-backward")
    assert reports["all"].startswith("times across ranks (ms):\n    forward-backward:\n        rank  0: ")
    assert all(report in printed for report in reports.values())
    assert "never-created" not in printed
    # normalizer 2 halves the 10+ ms: the value is at least 5 ms
    lo, hi = map(float, re.search(r"\.: \((\S+), (\S+)\)", reports["minmax"]).groups())
    assert 5.0 <= lo == hi
    assert len(reports["max"].splitlines()[1].split(":")[0]) == 4 + 48


def test_write_adds_max_seconds_per_timer():
    timers = Timers(log_level=0, log_option="minmax")
    timers("optimizer", log_level=0).start()
    time.sleep(0.01)
    timers("optimizer").stop()
    writer = RecordingWriter()
    timers.write(["optimizer", "absent"], writer, iteration=7, normalizer=1.0)
    value, step = writer.scalars["optimizer-time"]
    assert step == 7 and value >= 0.01
    assert "absent-time" not in writer.scalars


def _two_rank_report(rank, world_size):
    reports = {}
    for option in ("minmax", "max", "all"):
        timers = Timers(log_level=0, log_option=option)
        timers("step", log_level=0).start()
        time.sleep(0.01 if rank == 0 else 0.3)
        timers("step").stop()
        if rank == 1:
            timers("only-on-rank-1", log_level=0).start()
            timers("only-on-rank-1").stop()
        reports[option] = timers.log(["step", "only-on-rank-1"], reset=True)
    return reports


def test_two_ranks_report_min_and_max_across_ranks():
    results = run_distributed(_two_rank_report, 2, timeout=120)
    assert results[0] == results[1]  # every rank gathered the same table
    minmax = results[0]["minmax"]
    lo, hi = map(float, re.search(r"step\.+: \((\S+), (\S+)\)", minmax).groups())
    assert lo < 300.0 <= hi
    assert "only-on-rank-1" in minmax  # present on one rank only: reported from that rank
    assert float(re.search(r"step\.+: (\S+)", results[0]["max"]).group(1)) >= 300.0
    every = results[0]["all"]
    assert "rank  0:" in every and "rank  1:" in every
    assert every.count("rank  1:") == 2 and every.count("rank  0:") == 1
