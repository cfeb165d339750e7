"""pretrain_gpt.py with --context-parallel-size 2 prints the CP=1 losses; its checkpoint resumes under CP=1.

Mock data, CPU initialization, dropout off, ``--eod-mask-loss`` (so the two CP ranks count
different numbers of tokens). CP=2 on 2 ranks trains the first 3 iterations and saves; CP=1 on
one rank loads that checkpoint and trains 3 more. Every printed ``lm loss`` (and the validation
loss) equals the straight CP=1 run's to the printed 7 digits but for last-digit float noise
(relative 2e-6).
"""

import math

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 6
REL_TOL = 2e-6


def test_cp2_prints_the_cp1_losses_and_resumes_under_cp1(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + ["--eod-mask-loss", "--eval-interval", "3"]
    ckpt = str(tmp_path / "ckpt")
    single = run_gpt(1, base, str(tmp_path))
    first = run_gpt(
        2,
        base + ["--context-parallel-size", "2", "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"],
        str(tmp_path),
    )
    resumed = run_gpt(1, base + ["--load", ckpt], str(tmp_path))
    for name, result in (("CP=1", single), ("CP=2 first half", first), ("CP=1 resumed", resumed)):
        assert_ok(result, name)
    assert [line["iteration"] for line in resumed.lines] == [4, 5, 6]
    expected = single.losses()
    got = first.losses() + resumed.losses()
    assert len(got) == len(expected) == ITERS
    for i, (x, y) in enumerate(zip(got, expected)):
        assert math.isclose(x, y, rel_tol=REL_TOL), f"iteration {i + 1}: CP=2 / resumed {x} vs CP=1 {y}"

    # Evaluation at iteration 3 (forward only, the same CP slicing and loss reduction).
    def validation_at_3(result):
        return next(
            e["lm loss value"] for e in result.evaluations if e["prefix"] == "validation" and e["iteration"] == 3
        )

    assert math.isclose(validation_at_3(first), validation_at_3(single), rel_tol=REL_TOL)
