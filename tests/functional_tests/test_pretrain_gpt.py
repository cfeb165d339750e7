"""pretrain_gpt.py end to end on CPU ranks: logging, layout invariance, bitwise resume.

Each run is a real ``torchrun`` launch of the entry point with Megatron flags. The same
global batch with CPU initialization and dropout off must print the same ``lm loss`` for
TP=1/DP=1, TP=2 and DP=2 (equal to the printed 7 digits but for last-digit float noise:
relative 2e-6). With dropout 0.1, a run resumed from the checkpoint a straight run saved after N
iterations reproduces the straight run's next N losses bit for bit under TP=2 and under PP=2 (fp32,
same layout; compared through TensorBoard's float32 scalars and the printed lines).
"""

import glob
import math
import os

import pytest

from tests.functional_tests.gpt_runs import (
    REPO,
    assert_ok,
    build_corpus,
    data_flags,
    mock_flags,
    run_gpt,
    tiny_gpt_flags,
    with_flags,
)
from tests.functional_tests.gpt_runs import tb_losses as _tb_losses

ITERS = 6
REL_TOL = 2e-6
LINE_FIELDS = (
    "lm loss",
    "elapsed time per iteration (ms)",
    "grad norm",
    "learning rate",
    "consumed samples",
    "global batch size",
    "number of skipped iterations",
    "number of nan iterations",
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def layout_runs(corpus, tmp_path_factory):
    """The same tiny training on the preprocessed corpus as TP=1/DP=1, TP=2 and DP=2."""
    work = tmp_path_factory.mktemp("runs")
    base = tiny_gpt_flags(ITERS) + data_flags(corpus) + ["--log-params-norm", "--timing-log-level", "1"]
    tb, wb = str(work / "tb"), str(work / "wandb")
    runs = {
        "single": run_gpt(1, base, str(work)),
        "tp2": run_gpt(
            2,
            base
            + [
                "--tensor-model-parallel-size",
                "2",
                "--tensorboard-dir",
                tb,
                "--wandb-project",
                "quick",
                "--wandb-exp-name",
                "tp2",
                "--wandb-save-dir",
                wb,
            ],
            str(work),
        ),
        "dp2": run_gpt(2, base, str(work)),
    }
    for name, result in runs.items():
        assert_ok(result, name)
    return runs, {"tb": tb, "wandb": wb}


def _assert_same_losses(a, b, what):
    la, lb = a.losses(), b.losses()
    assert len(la) == len(lb) == ITERS, what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert math.isclose(x, y, rel_tol=REL_TOL), f"{what}: iteration {i + 1}: {x} vs {y}"


def test_runs_log_megatron_lines_and_learn(layout_runs):
    runs, _ = layout_runs
    for name, result in runs.items():
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), name
        for line in result.lines:
            for key in LINE_FIELDS:
                assert key in line, f"{name}: '{key}' missing in {line}"
            assert math.isfinite(line["lm loss"])
        assert result.losses()[-1] < result.losses()[0] - 0.1, f"{name}: loss did not fall: {result.losses()}"
        prefixes = {e["prefix"] for e in result.evaluations}
        assert {"validation", "test"} <= prefixes, f"{name}: final evaluations missing, got {prefixes}"


def test_tp2_and_dp2_print_the_single_rank_losses(layout_runs):
    runs, _ = layout_runs
    _assert_same_losses(runs["single"], runs["tp2"], "TP=2 vs TP=1")
    _assert_same_losses(runs["single"], runs["dp2"], "DP=2 vs TP=1")
    # Norms count every parameter once, whatever the layout (printed with 3 decimals).
    for name in ("tp2", "dp2"):
        for key in ("params norm", "grad norm"):
            assert [l[key] for l in runs[name].lines] == [l[key] for l in runs["single"].lines], (name, key)


def test_timers_reported_at_level_one(layout_runs):
    runs, _ = layout_runs
    for name, result in runs.items():
        assert "forward-backward" in result.output and "optimizer" in result.output, name


def test_tensorboard_and_offline_wandb_written(layout_runs):
    runs, dirs = layout_runs
    scalars = _tb_losses(dirs["tb"])
    assert sorted(scalars) == list(range(1, ITERS + 1))
    for step, value in scalars.items():
        assert math.isclose(value, runs["tp2"].losses()[step - 1], rel_tol=1e-6)
    assert glob.glob(os.path.join(dirs["wandb"], "wandb", "offline-run-*")), "no offline W&B run directory"


def test_missing_tensorboard_and_wandb_warn_and_every_rank_trains_on(tmp_path):
    """Neither package importable on any rank: Megatron's warning instead of a dead last rank and a hung peer."""
    tb, wb = tmp_path / "tb", tmp_path / "wb"
    flags = (
        tiny_gpt_flags(3)
        + mock_flags()
        + ["--tensorboard-dir", str(tb), "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(wb)]
    )
    script = [
        os.path.join(REPO, "tests", "functional_tests", "without_packages_gpt.py"),
        "tensorboard,torch.utils.tensorboard,wandb",
    ]
    result = run_gpt(2, flags, str(tmp_path), script=script)
    assert_ok(result, "without tensorboard and wandb")
    assert [line["iteration"] for line in result.lines] == [1, 2, 3]
    for flag, package in (("--tensorboard-dir", "tensorboard"), ("--wandb-project", "wandb")):
        assert f"{flag}=" in result.output and f"the {package} package cannot be imported" in result.output, flag
    assert not glob.glob(str(tb / "*tfevents*")) and not glob.glob(str(wb / "wandb" / "*run-*"))


def test_mock_data_layouts_agree(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags()
    single = run_gpt(1, base, str(tmp_path))
    tp2 = run_gpt(2, base + ["--tensor-model-parallel-size", "2"], str(tmp_path))
    dp2 = run_gpt(2, base, str(tmp_path))
    for name, result in (("single", single), ("tp2", tp2), ("dp2", dp2)):
        assert_ok(result, f"mock {name}")
    _assert_same_losses(single, tp2, "mock TP=2 vs TP=1")
    _assert_same_losses(single, dp2, "mock DP=2 vs TP=1")


RESUME_ITERS = 4
DROPOUT = {"--hidden-dropout": "0.1", "--attention-dropout": "0.1"}
RESUME_LAYOUTS = {
    # Preprocessed corpus, --eval-interval left out (Megatron's default): dropout inside the TP regions
    # draws from the tracked model-parallel stream, outside from the default generator.
    "tp2": ({"--tensor-model-parallel-size": "2", "--eval-interval": None}, True, 2),
    # Mock data, validation after every iteration: evaluation (whose iterator starts lazily) must not
    # move the training generators; each stage has its own seed.
    "pp2": ({"--pipeline-model-parallel-size": "2", "--eval-interval": "1"}, False, 2),
    # Both at once on 4 ranks: tracked TP streams on every pipeline stage.
    "tp2pp2": (
        {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2", "--eval-interval": "2"},
        False,
        4,
    ),
}


@pytest.mark.parametrize("layout", sorted(RESUME_LAYOUTS))
def test_resume_with_dropout_reproduces_the_straight_run_bitwise(layout, corpus, tmp_path):
    """A straight run of 4 iterations saving at 2 (as a long run saves on its way) vs a run resumed from that
    checkpoint (``--ckpt-step 2``); dropout 0.1."""
    changes, on_corpus, nproc = RESUME_LAYOUTS[layout]
    base = with_flags(
        tiny_gpt_flags(RESUME_ITERS) + (data_flags(corpus) if on_corpus else mock_flags()), {**DROPOUT, **changes}
    )
    half, ckpt = RESUME_ITERS // 2, str(tmp_path / "ckpt")
    tb_straight, tb_resume = str(tmp_path / "tb_straight"), str(tmp_path / "tb_resume")
    save = ["--save", ckpt, "--save-interval", str(half), "--tensorboard-dir", tb_straight]
    straight = run_gpt(nproc, base + save, str(tmp_path))
    assert_ok(straight, f"{layout} straight run")
    assert os.path.exists(os.path.join(ckpt, f"iter_{half:07d}", "metadata.json"))
    resumed = run_gpt(
        nproc, base + ["--load", ckpt, "--ckpt-step", str(half), "--tensorboard-dir", tb_resume], str(tmp_path)
    )
    assert_ok(resumed, f"{layout} resumed run")
    assert [line["iteration"] for line in resumed.lines] == list(range(half + 1, RESUME_ITERS + 1))
    assert len(straight.losses()) == RESUME_ITERS
    assert resumed.losses() == straight.losses()[half:]  # printed values, exactly
    straight_tb = _tb_losses(tb_straight)
    assert _tb_losses(tb_resume) == {step: v for step, v in straight_tb.items() if step > half}  # float32, exactly
    assert resumed.evaluations == [e for e in straight.evaluations if e["iteration"] > half]
    for a, b in zip(resumed.lines, straight.lines[half:]):
        for key in ("consumed samples", "learning rate", "grad norm"):
            assert a[key] == b[key], (layout, key, a, b)


def test_train_samples_with_batch_rampup(tmp_path):
    """--train-samples with --rampup-batch-size 2 2 8: Megatron's ramp, sample-based LR warmup;
    --decoupled-lr gives the embedding and output weights their own schedule."""
    flags = tiny_gpt_flags(1) + mock_flags()
    i = flags.index("--train-iters")
    del flags[i : i + 2]
    i = flags.index("--lr-warmup-iters")
    del flags[i : i + 2]
    flags += [
        "--train-samples",
        "48",
        "--rampup-batch-size",
        "2",
        "2",
        "8",
        "--lr-warmup-samples",
        "8",
        "--lr-decay-samples",
        "40",
        "--lr-decay-style",
        "linear",
        "--min-lr",
        "0",
        "--decoupled-lr",
        "1e-2",
        "--decoupled-min-lr",
        "1e-3",
    ]
    result = run_gpt(1, flags, str(tmp_path))
    assert_ok(result, "ramp-up")
    # The batch grows by 2 every 8/3 samples from 2 to 8 (Megatron's rule), then stays.
    consumed, expected_batches = 0, []
    while consumed < 48:
        batch = min(8, 2 + 2 * int(consumed // (8 / 3)))
        expected_batches.append(batch)
        consumed += batch
    assert [line["global batch size"] for line in result.lines] == expected_batches
    sums = [sum(expected_batches[: k + 1]) for k in range(len(expected_batches))]
    assert [line["consumed samples"] for line in result.lines] == sums
    # Linear warmup over 8 samples to 3e-3, then linear decay to 0 at 40 samples.
    for line, done in zip(result.lines, sums):
        for key, top, bottom in (("learning rate", 3e-3, 0.0), ("decoupled learning rate", 1e-2, 1e-3)):
            want = top * done / 8 if done <= 8 else bottom + (top - bottom) * max(0.0, (40 - done) / 32)
            assert math.isclose(line[key], want, rel_tol=1e-5, abs_tol=1e-12), (key, done, line[key])


def test_skip_train_with_load_evaluates_the_checkpoint(tmp_path):
    """``--skip-train --load CKPT`` (Megatron's evaluation run) reports the validation and test losses the training
    run reported after saving that checkpoint."""
    base = tiny_gpt_flags(3) + mock_flags()
    ckpt = str(tmp_path / "ckpt")
    trained = run_gpt(1, base + ["--save", ckpt], str(tmp_path))
    assert_ok(trained, "training run")
    evaluated = run_gpt(1, base + ["--load", ckpt, "--skip-train"], str(tmp_path))
    assert_ok(evaluated, "--skip-train run")
    assert not evaluated.lines  # no training iteration
    assert [e["prefix"] for e in evaluated.evaluations] == ["validation", "test"]
    assert evaluated.evaluations == trained.evaluations
