"""Training logs: Megatron's log line, model FLOPs, and TensorBoard / W&B scalars.

Three layers, each usable alone:

* ``num_floating_point_operations`` counts a GPT's model FLOPs per iteration;
* ``format_log_line`` / ``parse_log_line`` write and read Megatron's ``|``-separated
  line (the shape log scrapers expect), ``format_evaluation_block`` the validation block;
* ``TrainingLogger`` is what the training loop calls: it accumulates an interval of
  iterations, prints the line on the last rank every ``log_interval`` iterations and
  writes scalars through ``ScalarWriters`` (TensorBoard and W&B, last rank only).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple

from megatron.training.flops import FlopsConfig as FlopsConfig  # the FLOPs live in flops.py; re-exported
from megatron.training.flops import mla_attention_flops as mla_attention_flops
from megatron.training.flops import num_floating_point_operations as num_floating_point_operations
from megatron.training.log_writers import (
    ScalarWriters,
    device_memory_scalars,
    open_or_warn,
    open_tensorboard,
    open_wandb,
)

# ====================================================================== the log line


def _format_fields(fields: List[Tuple[str, str]]) -> str:
    return "".join(f" {name}: {value} |" for name, value in fields)


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms_per_iter: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: Optional[float] = None,
    skipped_iters: int = 0,
    nan_iters: int = 0,
    tflops_per_gpu: Optional[float] = None,
    tokens_per_sec_per_gpu: Optional[float] = None,
    decoupled_lr: Optional[float] = None,
    params_norm: Optional[float] = None,
    num_zeros: Optional[float] = None,
    timestamp: Optional[datetime] = None,
) -> str:
    """Megatron's training line; optional fields appear only when given (not None).

    Example: ``[2026-01-01 12:00:00] iteration      100/   10000 | consumed samples:         3200 |
    elapsed time per iteration (ms): 812.3 | ... | number of nan iterations:   0 |``
    """
    stamp = (timestamp or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    fields: List[Tuple[str, str]] = [
        ("consumed samples", f"{consumed_samples:12d}"),
        ("elapsed time per iteration (ms)", f"{elapsed_ms_per_iter:.1f}"),
    ]
    if tflops_per_gpu is not None:
        fields.append(("throughput per GPU (TFLOP/s/GPU)", _tflops_text(tflops_per_gpu)))
    if tokens_per_sec_per_gpu is not None:
        fields.append(("tokens per second per GPU", f"{tokens_per_sec_per_gpu:.1f}"))
    fields.append(("learning rate", f"{learning_rate:.6E}"))
    if decoupled_lr is not None:
        fields.append(("decoupled learning rate", f"{decoupled_lr:.6E}"))
    fields.append(("global batch size", f"{global_batch_size:5d}"))
    fields += [(name, f"{value:.6E}") for name, value in losses.items()]
    fields.append(("loss scale", f"{loss_scale:.1f}"))
    if grad_norm is not None:
        fields.append(("grad norm", f"{grad_norm:.3f}"))
    if num_zeros is not None:
        fields.append(("num zeros", f"{int(num_zeros)}"))
    if params_norm is not None:
        fields.append(("params norm", f"{params_norm:.3f}"))
    fields += [("number of skipped iterations", f"{skipped_iters:3d}"), ("number of nan iterations", f"{nan_iters:3d}")]
    return f"[{stamp}] iteration {iteration:8d}/{train_iters:8d} |" + _format_fields(fields)


_LINE_HEAD = re.compile(r"^\s*\[(?P<time>[^\]]+)\]\s+iteration\s+(?P<it>\d+)/\s*(?P<total>\d+)\s*\|(?P<rest>.*)$")
_INT = re.compile(r"^[+-]?\d+$")


def _value(text: str) -> Any:
    """'  3200' -> 3200, '6.5E+00' -> 6.5, 'nan' -> nan; anything else stays text."""
    text = text.strip()
    if _INT.match(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _parse_fields(rest: str) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for piece in rest.split("|"):
        if ":" in piece:
            name, _, value = piece.rpartition(":")
            result[name.strip()] = _value(value)
    return result


def parse_log_line(line: str) -> Optional[Dict[str, Any]]:
    """Fields of a training line keyed as printed (``'lm loss'``, ``'grad norm'`` ...).

    Adds ``'timestamp'``, ``'iteration'`` and ``'train_iters'``; None when ``line``
    is not a training line (so a whole log can be filtered through it).
    """
    match = _LINE_HEAD.match(line.rstrip("\n"))
    if match is None:
        return None
    result = _parse_fields(match["rest"])
    result.update(timestamp=match["time"], iteration=int(match["it"]), train_iters=int(match["total"]))
    return result


def _tflops_text(tflops: float) -> str:
    """Megatron's one decimal; three significant digits below 1 (a CPU's rate, which would print 0.0)."""
    return f"{tflops:.1f}" if tflops >= 1.0 or tflops == 0.0 else f"{tflops:.3g}"


def format_evaluation_block(prefix: str, label: str, losses: Mapping[str, float]) -> str:
    """Megatron's evaluation report: a ``{prefix} loss at {label}`` line framed by dashes.

    Perplexity is ``exp(min(20, loss))``: the cap keeps a diverged run's PPL finite.
    """
    line = f" {prefix} loss at {label} | "
    for name, value in losses.items():
        line += f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E} | "
    rule = "-" * (len(line) + 1)
    return "\n".join([rule, line, rule])


_EVAL_HEAD = re.compile(r"^\s*(?P<prefix>.+?) loss at (?P<label>[^|]+?)\s*\|(?P<rest>.*)$")


def parse_evaluation_line(line: str) -> Optional[Dict[str, Any]]:
    """Fields of an evaluation line (``'lm loss value'``, ``'lm loss PPL'``, plus ``'prefix'``,
    ``'label'`` and ``'iteration'`` when the label is ``iteration N``; the end-of-training report's
    ``iteration N on test set`` gives ``prefix`` test and ``final`` True); None otherwise."""
    match = _EVAL_HEAD.match(line.rstrip("\n"))
    if match is None or parse_log_line(line) is not None:
        return None
    result = _parse_fields(match["rest"])
    result.update(prefix=match["prefix"].strip(), label=match["label"])
    number = re.fullmatch(r"iteration (\d+)(?: on (\w+) set)?", match["label"])
    if number:
        result["iteration"] = int(number[1])
        if number[2]:  # the end-of-training report: "validation loss at iteration N on test set"
            result.update(prefix=number[2], final=True)
    return result


# ====================================================================== configuration

# Megatron's timer names reported after the line (those a run never creates are skipped).
DEFAULT_TIMERS_TO_LOG: Tuple[str, ...] = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggingConfig:
    """What the training logger prints and writes; one field per Megatron logging flag."""

    log_interval: int = 100
    log_throughput: bool = False  # adds tokens/s per GPU to the line
    log_params_norm: bool = False  # the loop computes the norm; the line shows it
    log_num_zeros_in_grad: bool = False
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    barrier_with_L1_time: bool = True  # level-1 timers wait for every rank before they start
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_entity: Optional[str] = None
    wandb_mode: str = "offline"  # this project's machines have no network; WANDB_MODE=online opts in
    timers_to_log: Tuple[str, ...] = field(default=DEFAULT_TIMERS_TO_LOG)

    def __post_init__(self) -> None:
        for name in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if self.timing_log_level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level={self.timing_log_level} must be 0, 1 or 2")
        if self.timing_log_option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option={self.timing_log_option!r} must be max, minmax or all")
        if self.wandb_project and not self.wandb_exp_name:
            raise ValueError(f"--wandb-project={self.wandb_project!r} needs --wandb-exp-name")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb mode {self.wandb_mode!r} (WANDB_MODE) must be one of {WANDB_MODES}")


# ====================================================================== the logger


@dataclass(frozen=True)
class IterationStats:
    """One training iteration's figures, as the loop hands them to ``TrainingLogger.training_log``.

    ``elapsed_ms_per_iter`` is this iteration's wall time; ``flops_per_iter`` the model FLOPs of its
    whole global batch, summed over all ranks (``num_floating_point_operations``; None leaves the
    TFLOP/s field out), divided by the world size for the per-GPU figure (context-parallel ranks each
    compute 1/cp of every sequence, so this is their share too). ``nan`` None counts the iteration as
    a NaN iteration when a reported (reduced) loss is nan or inf, skipped or not: with
    ``--no-check-for-nan-in-loss-and-grad`` an fp32 step with a NaN loss is applied, and the line
    prints that loss (Megatron counts skipped ones only). ``memory`` None reads the device's.
    """

    iteration: int
    train_iters: int
    losses: Mapping[str, Any]
    learning_rate: float
    consumed_samples: int
    global_batch_size: int
    elapsed_ms_per_iter: float
    seq_length: int
    loss_scale: float = 1.0
    decoupled_lr: Optional[float] = None
    grad_norm: Optional[float] = None
    params_norm: Optional[float] = None
    num_zeros: Optional[float] = None
    skipped: bool = False
    nan: Optional[bool] = None
    flops_per_iter: Optional[float] = None
    memory: Optional[Mapping[str, float]] = None


@dataclass
class _Interval:
    """Totals since the last printed line."""

    loss_sums: Dict[str, float] = field(default_factory=dict)
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    elapsed_ms: float = 0.0
    flops: float = 0.0
    tokens: int = 0
    flops_known: bool = True

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped


def _to_float(value: Any) -> float:
    # Losses may arrive as 0-d tensors or numbers; the line and the writers need numbers.
    return float(value)


class TrainingLogger:
    """Prints Megatron's training and evaluation logs and writes TensorBoard / W&B scalars.

    Call ``training_log`` on every rank after every iteration: the timer report it
    makes every ``log_interval`` iterations is a collective. The line is printed and
    scalars written on the last rank only (it holds the last pipeline stage, so the loss).

    Interval semantics follow Megatron: the printed losses average the iterations that
    were not skipped since the last line; skipped and NaN counts are totals since the
    last line; elapsed time and throughput average every iteration of the interval.
    """

    def __init__(
        self, config: LoggingConfig, rank: int, world_size: int, run_config: Optional[Mapping[str, Any]] = None
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.is_logging_rank = rank == world_size - 1
        self._interval = _Interval()
        self.writers = ScalarWriters()
        if self.is_logging_rank:
            self.writers = self._open_writers(run_config)

    def _open_writers(self, run_config: Optional[Mapping[str, Any]]) -> ScalarWriters:
        cfg = self.config
        tensorboard = wandb_run = None
        if cfg.tensorboard_dir:
            tensorboard = open_or_warn(
                "--tensorboard-dir",
                cfg.tensorboard_dir,
                "tensorboard",
                lambda: open_tensorboard(cfg.tensorboard_dir, cfg.tensorboard_queue_size),
            )
        if cfg.wandb_project and cfg.wandb_mode != "disabled":
            wandb_run = open_or_warn(
                "--wandb-project",
                cfg.wandb_project,
                "wandb",
                lambda: open_wandb(
                    cfg.wandb_project,
                    cfg.wandb_exp_name,
                    cfg.wandb_save_dir or "wandb",
                    cfg.wandb_entity,
                    cfg.wandb_mode,
                    run_config,
                ),
            )
        writers = ScalarWriters(tensorboard, wandb_run)
        for key, value in (run_config or {}).items():
            writers.add_text(str(key), str(value))
        return writers

    # ------------------------------------------------------------------ training
    def training_log(self, stats: IterationStats, timers: Any = None) -> Optional[str]:
        """Account one iteration; every ``log_interval`` iterations print the line (returned there).

        ``timers`` (the loop's ``Timers``) are reported after the line; the report is a collective.
        """
        losses = {name: _to_float(value) for name, value in stats.losses.items()}
        tokens = stats.global_batch_size * stats.seq_length
        self._accumulate(losses, stats.skipped, stats.nan, stats.elapsed_ms_per_iter, stats.flops_per_iter, tokens)
        if self.writers.active and stats.iteration % self.config.tensorboard_log_interval == 0:
            self._write_iteration_scalars(stats, losses)
        if stats.iteration % self.config.log_interval != 0:
            self.writers.commit()
            return None
        line = self._log_interval(stats, timers)
        self.writers.commit()
        return line

    def _accumulate(
        self,
        losses: Dict[str, float],
        skipped: bool,
        nan: Optional[bool],
        elapsed_ms: float,
        flops: Optional[float],
        tokens: int,
    ) -> None:
        acc = self._interval
        if skipped:
            acc.skipped += 1
        else:
            acc.advanced += 1
            for name, value in losses.items():
                acc.loss_sums[name] = acc.loss_sums.get(name, 0.0) + value
        if nan is None:
            nan = any(not math.isfinite(v) for v in losses.values())
        acc.nan += int(bool(nan))
        acc.elapsed_ms += elapsed_ms
        acc.tokens += tokens
        acc.flops_known = acc.flops_known and flops is not None
        acc.flops += flops or 0.0

    def _write_iteration_scalars(self, stats: IterationStats, losses: Dict[str, float]) -> None:
        cfg, w = self.config, self.writers
        iteration, samples = stats.iteration, stats.consumed_samples
        w.add_scalar("learning-rate", stats.learning_rate, iteration, samples)
        if stats.decoupled_lr is not None:
            w.add_scalar("decoupled-learning-rate", stats.decoupled_lr, iteration, samples)
        w.add_scalar("batch-size", stats.global_batch_size, iteration, samples)
        for name, value in losses.items():
            w.add_scalar(name, value, iteration, samples)
        optional = {
            "loss-scale": stats.loss_scale if cfg.log_loss_scale_to_tensorboard else None,
            "world-size": self.world_size if cfg.log_world_size_to_tensorboard else None,
            "grad-norm": stats.grad_norm,
            "num-zeros": stats.num_zeros,
            "params-norm": stats.params_norm,
        }
        for tag, value in optional.items():
            if value is not None:
                w.add_scalar(tag, value, iteration, samples)
        if cfg.log_memory_to_tensorboard:
            memory = stats.memory if stats.memory is not None else device_memory_scalars()
            for tag, value in memory.items():
                w.add_scalar(tag, value, iteration)

    def _log_interval(self, stats: IterationStats, timers: Any) -> Optional[str]:
        acc, self._interval = self._interval, _Interval()
        iterations = max(1, acc.iterations)
        elapsed_s = acc.elapsed_ms / 1000.0
        tflops = acc.flops / (elapsed_s * self.world_size * 1e12) if acc.flops_known and elapsed_s > 0 else None
        tokens_per_s = (
            acc.tokens / (elapsed_s * self.world_size) if self.config.log_throughput and elapsed_s > 0 else None
        )
        self._write_interval_scalars(stats.iteration, elapsed_s / iterations, tflops, tokens_per_s, timers, iterations)
        line = None
        if self.is_logging_rank:
            line = format_log_line(
                iteration=stats.iteration,
                train_iters=stats.train_iters,
                consumed_samples=stats.consumed_samples,
                elapsed_ms_per_iter=acc.elapsed_ms / iterations,
                learning_rate=stats.learning_rate,
                global_batch_size=stats.global_batch_size,
                losses={name: total / max(1, acc.advanced) for name, total in acc.loss_sums.items()},
                loss_scale=stats.loss_scale,
                grad_norm=stats.grad_norm,
                skipped_iters=acc.skipped,
                nan_iters=acc.nan,
                tflops_per_gpu=tflops,
                tokens_per_sec_per_gpu=tokens_per_s,
                decoupled_lr=stats.decoupled_lr,
                params_norm=stats.params_norm if self.config.log_params_norm else None,
                num_zeros=stats.num_zeros if self.config.log_num_zeros_in_grad else None,
            )
            print(line, flush=True)
        if timers is not None:
            timers.log(self.config.timers_to_log, normalizer=iterations)
        return line

    def _write_interval_scalars(
        self,
        iteration: int,
        seconds_per_iter: float,
        tflops: Optional[float],
        tokens_per_s: Optional[float],
        timers: Any,
        iterations: int,
    ) -> None:
        cfg, w = self.config, self.writers
        if timers is not None and cfg.log_timers_to_tensorboard:
            # A collective: every rank gathers, only the logging rank has a writer.
            timers.write(cfg.timers_to_log, w if w.active else None, iteration, normalizer=iterations)
        if not w.active:
            return
        if cfg.log_timers_to_tensorboard:
            w.add_scalar("iteration-time", seconds_per_iter, iteration)
        if tflops is not None:
            w.add_scalar("throughput", tflops, iteration)
        if tokens_per_s is not None:
            w.add_scalar("tokens-per-second-per-gpu", tokens_per_s, iteration)

    # ------------------------------------------------------------------ evaluation
    def evaluation_log(
        self,
        iteration: int,
        prefix: str,
        loss_dict: Mapping[str, Any],
        consumed_samples: Optional[int] = None,
        label: Optional[str] = None,
        final: bool = False,
    ) -> Optional[str]:
        """Print the ``{prefix} loss at iteration N`` block (last rank) and write its scalars.

        ``prefix`` is ``"validation"`` or ``"test"``; tags are ``<loss> <prefix>`` and, with
        ``--log-validation-ppl-to-tensorboard``, ``<loss> <prefix> ppl``. ``label``
        replaces ``iteration N`` in the text. ``final``: the end-of-training report, which Megatron
        labels ``validation loss at iteration N on validation set`` (``... on test set``).
        """
        if not self.is_logging_rank:
            return None
        losses = {name: _to_float(value) for name, value in loss_dict.items()}
        if final:
            label = f"iteration {iteration} on {prefix} set"
        block = format_evaluation_block("validation" if final else prefix, label or f"iteration {iteration}", losses)
        print(block, flush=True)
        for name, value in losses.items():
            self.writers.add_scalar(f"{name} {prefix}", value, iteration, consumed_samples)
            if self.config.log_validation_ppl_to_tensorboard:
                ppl = math.exp(min(20.0, value))
                self.writers.add_scalar(f"{name} {prefix} ppl", ppl, iteration, consumed_samples)
        self.writers.commit()
        return block

    # ------------------------------------------------------------------ lifetime
    def flush(self) -> None:
        self.writers.flush()

    def close(self) -> None:
        """Flush and close the writers (W&B's ``finish``); safe to call twice."""
        self.writers.close()

    def __enter__(self) -> TrainingLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
