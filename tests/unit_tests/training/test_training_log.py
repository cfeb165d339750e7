"""Training logs: the line and its parser, the FLOPs formula, the interval logic, TensorBoard and W&B."""

import argparse
import glob
import logging
import math
import os
import sys
from datetime import datetime

import pytest

from megatron.core.timers import Timers
from megatron.training.arguments import flops_config_from_args, logging_config_from_args, parse_args
from megatron.training.training_log import (
    FlopsConfig,
    IterationStats,
    LoggingConfig,
    TrainingLogger,
    format_evaluation_block,
    format_log_line,
    num_floating_point_operations,
    parse_evaluation_line,
    parse_log_line,
)
from tests.dist_harness import run_distributed

STAMP = datetime(2026, 1, 1, 12, 0, 0)
COMPAT_EXAMPLE = (  # megatron-compat.md section 5
    "[2026-01-01 12:00:00] iteration      100/   10000 | consumed samples:         3200 | "
    "elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 151.2 | "
    "learning rate: 1.500000E-04 | global batch size:    32 | lm loss: 6.512345E+00 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def example_line(**overrides):
    kw = dict(
        iteration=100,
        train_iters=10000,
        consumed_samples=3200,
        elapsed_ms_per_iter=812.3,
        tflops_per_gpu=151.2,
        learning_rate=1.5e-4,
        global_batch_size=32,
        losses={"lm loss": 6.512345},
        loss_scale=1.0,
        grad_norm=1.234,
        timestamp=STAMP,
    )
    kw.update(overrides)
    return format_log_line(**kw)


# ---------------------------------------------------------------------- line format
def test_line_matches_the_documented_example_exactly():
    assert example_line() == COMPAT_EXAMPLE


def test_optional_fields_appear_in_megatron_order():
    line = example_line(
        tokens_per_sec_per_gpu=1234.56,
        decoupled_lr=3e-5,
        params_norm=250.5,
        num_zeros=17,
        losses={"lm loss": 2.0, "mtp loss": 0.5},
        skipped_iters=2,
        nan_iters=1,
    )
    names = [piece.split(":")[0].strip() for piece in line.split("] ", 1)[1].split("|")[1:-1]]
    assert names == [
        "consumed samples",
        "elapsed time per iteration (ms)",
        "throughput per GPU (TFLOP/s/GPU)",
        "tokens per second per GPU",
        "learning rate",
        "decoupled learning rate",
        "global batch size",
        "lm loss",
        "mtp loss",
        "loss scale",
        "grad norm",
        "num zeros",
        "params norm",
        "number of skipped iterations",
        "number of nan iterations",
    ]
    assert "| tokens per second per GPU: 1234.6 |" in line
    assert "| number of skipped iterations:   2 | number of nan iterations:   1 |" in line


def test_parse_round_trip():
    fields = parse_log_line(example_line(tokens_per_sec_per_gpu=99.0, params_norm=3.25, num_zeros=4))
    assert fields["timestamp"] == "2026-01-01 12:00:00"
    assert (fields["iteration"], fields["train_iters"], fields["consumed samples"]) == (100, 10000, 3200)
    assert fields["lm loss"] == pytest.approx(6.512345)
    assert fields["elapsed time per iteration (ms)"] == pytest.approx(812.3)
    assert fields["throughput per GPU (TFLOP/s/GPU)"] == pytest.approx(151.2)
    assert fields["learning rate"] == pytest.approx(1.5e-4)
    assert fields["grad norm"] == pytest.approx(1.234)
    assert fields["params norm"] == pytest.approx(3.25)
    assert (fields["num zeros"], fields["global batch size"], fields["tokens per second per GPU"]) == (4, 32, 99.0)
    assert fields["number of skipped iterations"] == 0 and fields["number of nan iterations"] == 0
    assert math.isnan(parse_log_line(example_line(losses={"lm loss": float("nan")}))["lm loss"])


def test_parse_ignores_other_lines():
    assert parse_log_line("building GPT model ...") is None
    assert parse_log_line(" validation loss at iteration 10 | lm loss value: 1.0E+00 |") is None
    assert parse_evaluation_line(COMPAT_EXAMPLE) is None


def test_evaluation_block_shape_and_parse():
    block = format_evaluation_block("validation", "iteration 100", {"lm loss": 6.5})
    rule, line, rule2 = block.split("\n")
    assert line == " validation loss at iteration 100 | lm loss value: 6.500000E+00 | lm loss PPL: 6.651416E+02 | "
    assert rule == rule2 == "-" * (len(line) + 1)
    fields = parse_evaluation_line(line)
    assert (fields["prefix"], fields["iteration"]) == ("validation", 100)
    assert fields["lm loss PPL"] == pytest.approx(math.exp(6.5), rel=1e-6)
    capped = format_evaluation_block("test", "the end of training", {"lm loss": 50.0})
    assert f"lm loss PPL: {math.exp(20):.6E}" in capped


# ---------------------------------------------------------------------- FLOPs
def test_flops_formula_against_a_hand_count():
    # 1 layer, h=8, 2 heads of 4 (GQA: 1 group), f=16, s=4, V=10, one sequence; per-token forward MACs:
    # Q 8*8 + K,V 2*8*4 + out 8*8 = 192; scores 4*8 + values 4*8 = 64; MLP 8*16*2 = 256; logits 8*10 = 80.
    cfg = FlopsConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=16,
        seq_length=4,
        padded_vocab_size=10,
    )
    assert num_floating_point_operations(cfg, batch_size=1) == 3 * 2 * 4 * (192 + 64 + 256 + 80)
    # SwiGLU: the first projection is 8 -> 2*16; batch scales linearly.
    swiglu = FlopsConfig(**{**cfg.__dict__, "swiglu": True})
    assert num_floating_point_operations(swiglu, batch_size=3) == 3 * 3 * 2 * 4 * (192 + 64 + 384 + 80)


def test_flops_equal_megatron_closed_form():
    cfg = FlopsConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=5632,
        seq_length=4096,
        padded_vocab_size=50304,
        swiglu=True,
    )
    h, L, s, b = 2048, 24, 4096, 8
    closed = 12 * b * s * L * h * h * ((1 + 4 / 16 + s / h) * 1.0 + 5632 / h * 1.5 + 50304 / (2 * L * h))
    assert num_floating_point_operations(cfg, b) == pytest.approx(closed, rel=1e-12)


def _measured_flops(rank, world_size):
    from torch.utils.flop_counter import FlopCounterMode

    from tests.model_utils import SEQ, VOCAB, batch, build_gpt, gpt2_style, llama_style, single_rank_groups

    results = []
    for kw in (gpt2_style(), llama_style()):
        # The unfused path runs attention as matmuls, which the counter sees (CPU SDPA it does not).
        model = build_gpt(kw, single_rank_groups(), attention_backend="unfused")
        tokens, labels = batch(b=2)
        with FlopCounterMode(display=False) as forward:
            model(tokens, labels=labels)
        with FlopCounterMode(display=False) as both:
            model(tokens, labels=labels).sum().backward()
        cfg = model.config
        flops_cfg = FlopsConfig(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size,
            seq_length=SEQ,
            padded_vocab_size=VOCAB,
            kv_channels=cfg.kv_channels,
            swiglu=cfg.gated_linear_unit,
        )
        results.append(
            (forward.get_total_flops(), both.get_total_flops(), num_floating_point_operations(flops_cfg, batch_size=2))
        )
    return results


def test_flops_formula_matches_counted_matmuls_of_a_gpt():
    for forward, forward_backward, formula in run_distributed(_measured_flops, 1, timeout=120)[0]:
        assert 3 * forward == formula
        assert forward_backward == formula


def test_flops_config_from_args():
    args = parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention"]
        + ["--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--kv-channels", "8"]
        + ["--swiglu"]
    )
    args.padded_vocab_size = 256
    cfg = flops_config_from_args(args)
    assert (cfg.num_query_groups, cfg.swiglu, cfg.padded_vocab_size) == (2, True, 256)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        flops_config_from_args(argparse.Namespace(**{**vars(args), "padded_vocab_size": None}))


# ---------------------------------------------------------------------- config
def test_logging_config_from_megatron_flags(tmp_path):
    args = parse_args(
        [
            "--log-interval",
            "5",
            "--timing-log-level",
            "2",
            "--timing-log-option",
            "all",
            "--tensorboard-dir",
            str(tmp_path),
            "--log-throughput",
            "--wandb-project",
            "p",
            "--wandb-exp-name",
            "e",
            "--save",
            str(tmp_path / "ckpt"),
            "--no-log-loss-scale-to-tensorboard",
        ]
    )
    cfg = logging_config_from_args(args, environ={})
    assert (cfg.log_interval, cfg.timing_log_level, cfg.timing_log_option) == (5, 2, "all")
    assert cfg.log_throughput and not cfg.log_loss_scale_to_tensorboard
    assert cfg.wandb_save_dir == str(tmp_path / "ckpt" / "wandb") and cfg.wandb_mode == "offline"
    assert logging_config_from_args(args, environ={"WANDB_MODE": "online"}).wandb_mode == "online"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(log_interval=0), "--log-interval=0"),
        (dict(timing_log_option="mean"), "--timing-log-option"),
        (dict(wandb_project="p"), "--wandb-exp-name"),
        (dict(wandb_mode="cloud"), "WANDB_MODE"),
    ],
)
def test_logging_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoggingConfig(**kwargs)


# ---------------------------------------------------------------------- the logger
def step(logger, iteration, loss, **overrides):
    timers = overrides.pop("timers", None)
    kw = dict(
        iteration=iteration,
        train_iters=8,
        losses={"lm loss": loss},
        learning_rate=1e-3,
        consumed_samples=4 * iteration,
        global_batch_size=4,
        elapsed_ms_per_iter=100.0,
        seq_length=16,
        grad_norm=0.5,
        flops_per_iter=2e11,
    )
    kw.update(overrides)
    return logger.training_log(IterationStats(**kw), timers)


def test_interval_averages_and_counts(capsys):
    logger = TrainingLogger(LoggingConfig(log_interval=4, log_throughput=True), rank=1, world_size=2)
    assert step(logger, 1, 4.0) is None
    step(logger, 2, float("inf"), skipped=True)  # skipped with a non-finite loss: a NaN iteration
    step(logger, 3, 2.0, elapsed_ms_per_iter=300.0)
    line = step(logger, 4, 3.0)
    assert capsys.readouterr().out.strip() == line
    fields = parse_log_line(line)
    assert fields["lm loss"] == pytest.approx(3.0)  # the mean of the 3 iterations not skipped
    assert fields["number of skipped iterations"] == 1 and fields["number of nan iterations"] == 1
    assert fields["elapsed time per iteration (ms)"] == pytest.approx(150.0)
    # below 1 TFLOP/s (a CPU's rate) three significant digits, not Megatron's one decimal that would read 0.0
    assert fields["throughput per GPU (TFLOP/s/GPU)"] == pytest.approx(4 * 2e11 / (0.6 * 2 * 1e12), rel=1e-3)
    assert fields["tokens per second per GPU"] == pytest.approx(4 * 4 * 16 / (0.6 * 2), abs=0.05)
    assert "params norm" not in fields  # --log-params-norm not given
    line = step(logger, 8, 1.0, nan=True)
    fields = parse_log_line(line)
    assert fields["number of skipped iterations"] == 0 and fields["number of nan iterations"] == 1
    logger.close()


def test_a_nan_loss_that_was_applied_counts_as_a_nan_iteration(capsys):
    """--no-check-for-nan-in-loss-and-grad in fp32: nothing skips the step, the line prints nan and must count it."""
    logger = TrainingLogger(LoggingConfig(log_interval=3), rank=0, world_size=1)
    step(logger, 1, 2.0)
    step(logger, 2, float("nan"))
    fields = parse_log_line(step(logger, 3, float("-inf")))
    assert math.isnan(fields["lm loss"])
    assert fields["number of skipped iterations"] == 0 and fields["number of nan iterations"] == 2
    logger.close()


def test_only_the_last_rank_prints(capsys):
    logger = TrainingLogger(LoggingConfig(log_interval=1), rank=0, world_size=2)
    assert step(logger, 1, 1.0) is None
    assert logger.evaluation_log(1, "validation", {"lm loss": 1.0}) is None
    assert capsys.readouterr().out == ""


def test_timers_are_reported_after_the_line(capsys):
    timers = Timers(log_level=1, log_option="minmax")
    timers("forward-backward", log_level=1).start()
    timers("forward-backward").stop()
    logger = TrainingLogger(LoggingConfig(log_interval=1), rank=0, world_size=1)
    step(logger, 1, 1.0, timers=timers)
    out = capsys.readouterr().out.splitlines()
    assert parse_log_line(out[0]) is not None
    assert out[1] == "(min, max) time across ranks (ms):" and out[2].startswith("    forward-backward...")


def read_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_written(tmp_path):
    cfg = LoggingConfig(
        log_interval=2,
        tensorboard_dir=str(tmp_path / "tb"),
        log_timers_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True,
        log_memory_to_tensorboard=True,
        log_world_size_to_tensorboard=True,
        log_params_norm=True,
    )
    timers = Timers(log_level=0, log_option="max")
    with TrainingLogger(cfg, rank=0, world_size=1, run_config={"seed": 1234}) as logger:
        for iteration, loss in ((1, 5.0), (2, 4.0)):
            timers("forward-backward", log_level=0).start()
            timers("forward-backward").stop()
            step(logger, iteration, loss, params_norm=12.5, timers=timers)
        logger.evaluation_log(2, "validation", {"lm loss": 3.5}, consumed_samples=8)
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["lm loss"] == [(1, 5.0), (2, 4.0)]
    assert scalars["lm loss vs samples"] == [(4, 5.0), (8, 4.0)]
    assert scalars["learning-rate"][0] == (1, pytest.approx(1e-3))
    assert scalars["grad-norm"] == [(1, 0.5), (2, 0.5)]
    assert scalars["params-norm"][1] == (2, 12.5)
    assert scalars["batch-size"][0] == (1, 4.0) and scalars["loss-scale"][0] == (1, 1.0)
    assert scalars["world-size"][0] == (1, 1.0)
    assert scalars["throughput"] == [(2, pytest.approx(2 * 2e11 / (0.2 * 1e12)))]
    assert scalars["iteration-time"] == [(2, pytest.approx(0.1))]
    assert [s for s, _ in scalars["forward-backward-time"]] == [2]
    assert scalars["lm loss validation"] == [(2, 3.5)] and scalars["lm loss validation vs samples"] == [(8, 3.5)]
    assert scalars["lm loss validation ppl"] == [(2, pytest.approx(math.exp(3.5), rel=1e-6))]
    assert scalars["mem-max-rss-bytes"][0][1] > 0


def _service_children():
    """Processes whose parent is this one (a W&B service left behind would be one)."""
    children = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                text = f.read()
        except OSError:
            continue
        if f"\nPPid:\t{os.getpid()}\n" in text:
            children.append(text.split("\n", 1)[0])
    return children


def test_wandb_offline_run_directory(tmp_path, monkeypatch, capsys):
    for var in (
        "WANDB_CACHE_DIR",
        "WANDB_CONFIG_DIR",
        "WANDB_DATA_DIR",
        "WANDB_ARTIFACT_DIR",
        "WANDB_MODE",
        "WANDB_API_KEY",
    ):
        # setenv first, so that the undo removes what the writer sets (delenv of an unset variable records
        # nothing, and the writer's defaults would outlive the test, reaching later tests and their ranks).
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    before = _service_children()
    cfg = LoggingConfig(log_interval=1, wandb_project="proj", wandb_exp_name="exp", wandb_save_dir=str(tmp_path / "wb"))
    logger = TrainingLogger(cfg, rank=0, world_size=1, run_config={"lr": 1e-3})
    step(logger, 1, 2.0)
    logger.evaluation_log(1, "validation", {"lm loss": 2.5})
    logger.close()
    logger.close()  # idempotent
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    records = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert records and os.path.getsize(records[0]) > 0
    assert os.environ["WANDB_CACHE_DIR"].startswith(str(tmp_path))
    assert _service_children() == before


def _two_rank_logger(rank, world_size):
    import io
    from contextlib import redirect_stdout

    timers = Timers(log_level=1, log_option="minmax")
    logger = TrainingLogger(LoggingConfig(log_interval=2), rank=rank, world_size=world_size)
    out = io.StringIO()
    with redirect_stdout(out):
        for iteration in (1, 2):
            timers("forward-backward", log_level=1).start()
            timers("forward-backward").stop()
            step(logger, iteration, 1.0 + rank, timers=timers)
    logger.close()
    return out.getvalue()


@pytest.mark.parametrize(
    "flag, blocked, fields",
    [
        ("--tensorboard-dir", ("tensorboard", "torch.utils.tensorboard"), {"tensorboard_dir": "tb"}),
        ("--wandb-project", ("wandb",), {"wandb_project": "proj", "wandb_exp_name": "exp", "wandb_save_dir": "wb"}),
    ],
    ids=["tensorboard", "wandb"],
)
def test_missing_logging_package_warns_naming_the_flag_and_logs_on(
    flag, blocked, fields, tmp_path, monkeypatch, capsys, caplog
):
    """Megatron warns and trains on without TensorBoard; W&B gets the same (it used to kill the last rank)."""
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # ``import name`` now raises ModuleNotFoundError
    cfg = LoggingConfig(
        log_interval=1, **{k: str(tmp_path / v) if k.endswith("_dir") else v for k, v in fields.items()}
    )
    with caplog.at_level(logging.WARNING, logger="megatron.training.log_writers"):
        logger = TrainingLogger(cfg, rank=0, world_size=1)
    assert f"{flag}=" in caplog.text and f"the {blocked[0]} package cannot be imported" in caplog.text
    assert not logger.writers.active
    assert parse_log_line(step(logger, 1, 2.5))["lm loss"] == pytest.approx(2.5)
    logger.close()


def test_two_ranks_print_once_from_the_last_rank():
    rank0, rank1 = run_distributed(_two_rank_logger, 2, timeout=120)
    assert rank0 == ""
    lines = rank1.splitlines()
    assert parse_log_line(lines[0])["lm loss"] == pytest.approx(2.0)  # the last rank's own loss
    assert lines[1] == "(min, max) time across ranks (ms):" and "forward-backward" in lines[2]
