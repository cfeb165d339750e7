"""``--log-straggler``: a rank slowed by an injected sleep is named in the straggler report.

Four data-parallel ranks; rank 2 sleeps 150 ms in every forward (``faulty_gpt.py slow-rank 2``). Every
rank's step takes as long (they wait for rank 2 in the gradient reduction), but its compute does not:
the report every ``--log-interval`` must name rank 2 as the slowest, more than 1.5x the median.
"""

from __future__ import annotations

import os
import re

from megatron.training.straggler import straggler_line
from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags, with_flags

HERE = os.path.dirname(os.path.abspath(__file__))


def test_line_names_the_slowest_and_fastest_ranks_against_the_median():
    rows = [[0.010, 0.030, 0.041], [0.011, 0.029, 0.041], [0.040, 0.001, 0.041], [0.009, 0.031, 0.041]]
    line = straggler_line(rows, 11, 20, 2)
    assert "iterations 11-20, 4 ranks" in line
    slowest, fastest = line.split("slowest: ")[1].split(" | fastest: ")
    assert slowest.startswith("rank 2 3.81x (40.0 ms/iter), rank 1 1.05x")  # median of 9, 10, 11, 40 ms: 10.5
    assert fastest.startswith("rank 3 0.86x (9.0 ms/iter), rank 0 0.95x")


def test_slowed_rank_is_named_in_a_four_rank_run(tmp_path):
    flags = with_flags(tiny_gpt_flags(8) + mock_flags(), {"--log-interval": "4", "--eval-iters": "0"})
    run = run_gpt(
        4,
        [*flags, "--log-straggler", "--straggler-ctrlr-port", "0"],
        str(tmp_path),
        script=[os.path.join(HERE, "faulty_gpt.py"), "slow-rank", "2"],
    )
    assert_ok(run, "4-rank run with a slow rank")
    # Ranks share the output pipe and print writes a line's text and its newline apart: a report may follow another
    # rank's log line on the same line, so it is found anywhere in the output, not at line starts.
    reports = re.findall(r"straggler report \(iterations [^\n]*", run.output)
    assert [re.search(r"iterations (\d+-\d+)", r).group(1) for r in reports] == ["1-4", "5-8"], run.output[-3000:]
    for report in reports:
        slowdown = float(re.search(r"slowest: rank 2 ([\d.]+)x", report).group(1))
        assert slowdown > 1.5, report
