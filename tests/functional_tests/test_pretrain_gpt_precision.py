"""Mixed precision through the command line, and the NaN check.

bf16 and fp16 (fp32 main weights, dynamic loss scaling from --initial-loss-scale 4096) training
of the tiny GPT-2-style model on the preprocessed corpus follows the fp32 loss curve over 50
iterations: every printed loss within 2% of fp32's at the same iteration, and the mean
absolute difference below 0.5% (measured: bf16 at most 0.015%, fp16 0.003%; the bounds leave
room for other CPUs' kernels), yet not identical to fp32. With --check-for-nan-in-loss-and-grad (on by default in fp32)
a NaN injected into the loss at iteration 3 stops the run with a message naming that iteration;
with --no-check-for-nan-in-loss-and-grad the run goes on and each line counts its NaN iterations.
"""

import math
import os

import pytest

from tests.functional_tests.gpt_runs import REPO, assert_ok, build_corpus, data_flags, run_gpt, tiny_gpt_flags

ITERS = 50
MAX_REL, MEAN_REL = 0.02, 0.005


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def fp32_losses(corpus, tmp_path_factory):
    result = run_gpt(1, tiny_gpt_flags(ITERS) + data_flags(corpus), str(tmp_path_factory.mktemp("fp32")))
    assert_ok(result, "fp32")
    return result.losses()


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]], ids=["bf16", "fp16"])
def test_half_precision_follows_fp32(corpus, fp32_losses, precision, tmp_path):
    result = run_gpt(1, tiny_gpt_flags(ITERS) + data_flags(corpus) + precision, str(tmp_path))
    assert_ok(result, precision[0])
    losses = result.losses()
    assert len(losses) == len(fp32_losses) == ITERS
    rel = [abs(a - b) / b for a, b in zip(losses, fp32_losses)]
    assert max(rel) < MAX_REL, f"{precision[0]}: worst relative difference {max(rel):.4f}"
    assert sum(rel) / len(rel) < MEAN_REL, f"{precision[0]}: mean relative difference {sum(rel) / len(rel):.4f}"
    assert fp32_losses[-1] < fp32_losses[0] - 0.5  # the curve being followed actually moves
    assert losses != fp32_losses, "identical to fp32 to the last digit: was the precision flag applied?"
    if "--fp16" in precision:
        assert result.lines[0]["loss scale"] == 4096.0


NAN_SCRIPT = [os.path.join(REPO, "tests", "functional_tests", "nan_injecting_gpt.py"), "3"]


def _one_microbatch_flags(iters):
    flags = tiny_gpt_flags(iters) + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "600"]
    flags[flags.index("--global-batch-size") + 1] = "2"  # one micro batch per iteration
    return flags


def test_injected_nan_stops_the_run_naming_the_iteration(tmp_path):
    result = run_gpt(1, _one_microbatch_flags(6), str(tmp_path), script=NAN_SCRIPT)
    assert result.returncode != 0
    assert "iteration 3: rank 0: found NaN" in result.output, result.output[-3000:]
    assert [line["iteration"] for line in result.lines] == [1, 2]


def test_nan_loss_without_the_check_is_counted_in_the_log(tmp_path):
    """--no-check-for-nan-in-loss-and-grad: training goes on, and a line printing a NaN loss counts it."""
    flags = _one_microbatch_flags(4) + ["--no-check-for-nan-in-loss-and-grad"]
    result = run_gpt(1, flags, str(tmp_path), script=NAN_SCRIPT)
    assert_ok(result, "NaN loss without the check")
    assert [line["iteration"] for line in result.lines] == [1, 2, 3, 4]
    assert math.isnan(result.lines[2]["lm loss"])  # the poisoned iteration
    for line in result.lines:
        assert line["number of nan iterations"] == int(math.isnan(line["lm loss"])), line
