"""Checks and derived defaults of the parsed flags, run once before any heavy work.

``validate_args`` is a list of small steps, each owning one concern; every
error names the flags, their values and the rule. Errors are ``ArgumentsError``
(a ``SystemExit`` with a message): a run with bad flags stops with that message
and a non-zero exit code, and ``except Exception`` blocks do not swallow it.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.context_parallel import local_sequence_length
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.process_groups import ParallelLayout
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpoint_config import CheckpointConfig
from megatron.training.checkpoint_formats.base import TORCH_DIST
from megatron.training.flags import compatibility
from megatron.training.flags.derive import global_batch_size
from megatron.training.flags.record import Fill
from megatron.training.flags.registry import (
    CONFIG_TARGETS,
    RECORDS,
    bounded_flags,
    config_from_args,
    fills_of,
    flag_names,
    flag_specs,
    flags_with,
    not_supported_yet,
    transformer_config_class,
)
from megatron.training.flags_table import FlagSpec
from megatron.training.training_config import TrainingConfig
from megatron.training.training_log import LoggingConfig


class ArgumentsError(SystemExit):
    """Invalid flags; ``str(error)`` is the message, the exit code is non-zero."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UnsupportedFlagError(ArgumentsError):
    """A flag whose feature is not implemented yet was given a non-default value."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentsError(message)


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Round the vocabulary up to a multiple of ``make_vocab_size_divisible_by x tp_size``
    so every TP rank holds an equal, aligned slice of the embedding."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-orig_vocab_size // multiple) * multiple


# ----------------------------------------------------------------------------------
# Flags we do not implement yet.
# ----------------------------------------------------------------------------------
def check_not_supported(args: argparse.Namespace, specs: Sequence[FlagSpec]) -> None:
    """Stop on the first flag whose record says not supported yet and whose value is not a harmless one."""
    names = {spec.dest: spec.name for spec in specs}
    for dest, status in not_supported_yet().items():
        value = getattr(args, dest)
        if not status.accepts(value):
            allowed = f" (supported: {', '.join(map(repr, status.harmless))})" if len(status.harmless) > 1 else ""
            raise UnsupportedFlagError(f"not supported yet: {names[dest]}={value!r}{allowed}")


def check_bounds(args: argparse.Namespace) -> None:
    """Every flag whose record gives ``bounds`` holds a value within them (each element of a list flag);
    run first, so no later step divides by, reshapes with or counts down from a bad value."""
    names = flag_names()
    for dest, bounds in bounded_flags().items():
        value = getattr(args, dest)
        for v in value if isinstance(value, list) else [value]:
            _require(v is None or bounds.accepts(v), f"{names[dest]}={v!r} {bounds.rule(v)}")


def check_deprecated(args: argparse.Namespace) -> None:
    """Flags Megatron removed (their records' ``replaced_by``): name the replacement instead of guessing."""
    names = flag_names()
    for dest, record in RECORDS.items():
        if record.replaced_by is None:
            continue
        value = getattr(args, dest)
        _require(value in (None, False), f"{names[dest]}={value!r} is no longer valid: use {record.replaced_by}")
    if args.use_dist_ckpt_deprecated:
        args.ckpt_format = TORCH_DIST


def set_encoder_decoder(args: argparse.Namespace) -> None:
    """Megatron's rule: ``--encoder-num-layers`` / ``--encoder-seq-length`` stand for ``--num-layers`` /
    ``--seq-length`` (records' ``stands_for``; one of each pair); the decoder defaults to the encoder's layer count."""
    names = flag_names()
    for encoder, record in RECORDS.items():
        plain = record.stands_for
        if plain is None:
            continue
        given = getattr(args, encoder)
        if given is None:
            setattr(args, encoder, getattr(args, plain))
            continue
        _require(
            getattr(args, plain) is None,
            f"{names[encoder]}={given} and {names[plain]}={getattr(args, plain)}: give one of the two",
        )
        setattr(args, plain, given)
    if args.decoder_num_layers is None:
        args.decoder_num_layers = args.encoder_num_layers


def check_required(args: argparse.Namespace) -> None:
    """The flags whose records say ``required``: given, and positive."""
    names = flag_names()
    for dest in flags_with("required"):
        _require(getattr(args, dest) is not None, f"{names[dest]} is required")
        _require(getattr(args, dest) > 0, f"{names[dest]}={getattr(args, dest)} must be positive")


# ----------------------------------------------------------------------------------
# Parallel layout and batch sizes.
# ----------------------------------------------------------------------------------
def set_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    """World = TP x PP x CP x DP (sequence parallelism under TP 1 is disabled by the config, with a warning)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--context-parallel-size", cp),
    ):
        _require(value >= 1, f"{name}={value} must be positive")
    model = tp * pp * cp
    _require(
        world_size % model == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {model}",
    )
    args.world_size = world_size
    args.data_parallel_size = world_size // model


def set_virtual_pipeline(args: argparse.Namespace) -> None:
    """Virtual stages from --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank
    or the chunks of --pipeline-model-parallel-layout."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if args.pipeline_model_parallel_layout is not None:
        _require(
            per_stage is None and per_rank is None,
            "--pipeline-model-parallel-layout sets the virtual chunks itself: leave out "
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank",
        )
        layout = args.pipeline_model_parallel_layout
        try:
            chunks = PipelineParallelLayerLayout.from_str(layout, args.pipeline_model_parallel_size)
        except ValueError as err:
            raise ArgumentsError(flag_message(None, str(err))) from err
        vp = chunks.virtual_pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
        return
    if per_stage is None and per_rank is None:
        return
    _require(
        per_stage is None or per_rank is None,
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are exclusive",
    )
    pp = args.pipeline_model_parallel_size  # > 1: the compatibility matrix's rule (check_compatibility)
    if per_stage is not None:
        layers_per_rank = args.num_layers // pp
        _require(
            per_stage > 0 and layers_per_rank % per_stage == 0,
            f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) = {layers_per_rank} "
            f"layers per stage is not divisible by --num-layers-per-virtual-pipeline-stage ({per_stage})",
        )
        per_rank = layers_per_rank // per_stage
    args.virtual_pipeline_model_parallel_size = per_rank


def check_pipeline_layers(args: argparse.Namespace) -> None:
    """Layers split evenly over stages (after any uneven first / last stage) and virtual chunks.

    A --pipeline-model-parallel-layout or --account-for-{embedding,loss}-in-pipeline-split split is
    checked where it is applied, by ``TransformerConfig`` (``check_configs``).
    """
    slots = args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    if args.pipeline_model_parallel_layout is not None or slots:
        return
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle_layers, middle_stages = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if first is not None or last is not None:
        _require(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        _require(
            middle_layers >= 0 and (middle_stages > 0 or middle_layers == 0),
            f"--num-layers ({layers}) does not cover --decoder-first-pipeline-num-layers ({first}) and "
            f"--decoder-last-pipeline-num-layers ({last}) on {pp} pipeline stages",
        )
    if middle_stages > 0:
        _require(
            middle_layers % middle_stages == 0,
            f"--num-layers ({middle_layers} outside uneven stages) is not divisible by the "
            f"{middle_stages} pipeline stages of --pipeline-model-parallel-size ({pp})",
        )
    vp = args.virtual_pipeline_model_parallel_size
    if vp is not None and middle_stages > 0:
        _require(
            (middle_layers // middle_stages) % vp == 0,
            f"{middle_layers // middle_stages} layers per pipeline stage are not divisible by {vp} "
            "virtual stages per pipeline rank",
        )


def check_batch_sizes(args: argparse.Namespace) -> None:
    """The global batch (left out: micro batch x DP, ``derive.global_batch_size``) is a multiple of micro batch x DP."""
    step, batch = args.micro_batch_size * args.data_parallel_size, global_batch_size(args)
    if args.rampup_batch_size is None and not args.decrease_batch_size_if_needed:
        _require(
            batch % step == 0,
            f"--global-batch-size ({batch}) is not divisible by --micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size}) = {step}",
        )
    vp = args.virtual_pipeline_model_parallel_size
    if vp is not None and args.rampup_batch_size is None:
        num_micro = batch // step
        pp = args.pipeline_model_parallel_size
        _require(
            num_micro % pp == 0,
            f"the interleaved schedule needs the number of microbatches ({num_micro} = --global-batch-size "
            f"{batch} / ({args.micro_batch_size} x DP {args.data_parallel_size})) to be a "
            f"multiple of --pipeline-model-parallel-size ({pp})",
        )


# ----------------------------------------------------------------------------------
# Model shape, precision, recomputation.
# ----------------------------------------------------------------------------------
def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's SwiGLU width: 2/3 of 4h (same parameter count as a 4h GeLU MLP), down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def set_model_shape(args: argparse.Namespace) -> None:
    """The FFN size under --swiglu, query groups only with --group-query-attention, position embeddings.

    Head size and the divisibility rules of heads, groups and TP are TransformerConfig's (``check_configs``).
    """
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = swiglu_ffn_hidden_size(args.hidden_size) if args.swiglu else 4 * args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    set_position_embeddings(args)


def set_position_embeddings(args: argparse.Namespace) -> None:
    """Legacy position flags, and a learned table long enough for --seq-length."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.max_position_embeddings >= args.seq_length,
            f"--max-position-embeddings ({args.max_position_embeddings}) is smaller than --seq-length "
            f"({args.seq_length})",
        )


def set_moe(args: argparse.Namespace) -> None:
    """One load-balancing type and coefficient (Megatron takes lists); experts default to --ffn-hidden-size."""
    for dest in flags_with("one_value"):  # Megatron takes a list here
        value = getattr(args, dest)
        if isinstance(value, list):
            _require(len(value) == 1, f"{flag_names()[dest]}={value!r}: several values are not supported yet; give one")
            setattr(args, dest, value[0])
    # --num-experts, --moe-router-topk, --moe-layer-freq and the expert FFN size: TransformerConfig's rules.


def set_precision(args: argparse.Namespace) -> None:
    """fp16 or bf16 decide the parameter dtype (both at once: the configs' rule, ``check_configs``)."""
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.float16
        if args.loss_scale is None:
            # Dynamic loss scaling skips steps with inf/nan grads itself.
            args.check_for_nan_in_loss_and_grad = False
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bf16 gradients are accumulated and all-reduced in fp32 (Megatron's rule), unless
        # --grad-reduce-in-bf16 asks for half the communication volume.
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16


def set_recompute(args: argparse.Namespace) -> None:
    """--recompute-activations means selective (the rules of full recomputation are TransformerConfig's)."""
    if args.recompute_activations:
        args.recompute_granularity = "selective"


# ----------------------------------------------------------------------------------
# Training length, learning rate, weight decay, data.
# ----------------------------------------------------------------------------------
def check_training_length(args: argparse.Namespace) -> None:
    """Exactly one of --train-iters / --train-samples, with matching lr units."""
    iters, samples = args.train_iters, args.train_samples
    _require(iters is None or samples is None, "--train-iters and --train-samples are exclusive: give one")
    _require(
        iters is not None or samples is not None or args.skip_train,
        "give --train-iters or --train-samples (or --skip-train)",
    )
    if iters is not None:
        for dest, unset in (
            ("lr_decay_samples", None),
            ("lr_warmup_samples", 0),
            ("lr_wsd_decay_samples", None),
            ("rampup_batch_size", None),
        ):
            _require(
                getattr(args, dest) == unset,
                f"--{dest.replace('_', '-')}={getattr(args, dest)!r} needs "
                "sample-based training (--train-samples), not --train-iters",
            )
    if samples is not None:
        for dest, unset in (("lr_decay_iters", None), ("lr_warmup_iters", 0), ("lr_wsd_decay_iters", None)):
            _require(
                getattr(args, dest) == unset,
                f"--{dest.replace('_', '-')}={getattr(args, dest)!r} needs "
                "iteration-based training (--train-iters), not --train-samples",
            )


def check_learning_rate(args: argparse.Namespace) -> None:
    """Warmup given one way only (the decay length left out is the training length: ``derive.decay_steps``)."""
    if args.lr_warmup_fraction is not None:
        _require(
            args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0,
            f"--lr-warmup-fraction ({args.lr_warmup_fraction}) and --lr-warmup-iters "
            f"({args.lr_warmup_iters}) / --lr-warmup-samples ({args.lr_warmup_samples}) are exclusive",
        )
    if not args.skip_train:
        _require(args.lr is not None, "--lr is required for training")
        _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be at most --lr ({args.lr})")
    if args.lr_decay_style == "WSD":
        _require(
            args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
            "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples",
        )
    _require(
        not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
        "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive",
    )


def check_weight_decay(args: argparse.Namespace) -> None:
    """Constant style uses --weight-decay; a schedule needs --start- and --end-weight-decay."""
    if args.weight_decay_incr_style == "constant":
        _require(
            args.start_weight_decay is None and args.end_weight_decay is None,
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine",
        )
    else:
        _require(
            args.start_weight_decay is not None and args.end_weight_decay is not None,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
            "--end-weight-decay",
        )


def check_data(args: argparse.Namespace) -> None:
    """One way of naming the data (the split left out is derived: ``derive.split``)."""
    per_split = args.train_data_path or args.valid_data_path or args.test_data_path
    _require(
        not (args.data_path and per_split),
        "--data-path and --train-data-path / --valid-data-path / --test-data-path are exclusive",
    )


def check_optimizer_instances(args: argparse.Namespace) -> None:
    """--num-distributed-optimizer-instances divides the data-parallel sizes (dense x CP, and expert):
    the layout's own rule (``ParallelLayout``), said with flags, before any group is built."""
    try:
        ParallelLayout(
            world_size=args.world_size,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        )
    except (ValueError, AssertionError) as err:
        raise ArgumentsError(flag_message(None, str(err))) from err


def check_expert_parallel(args: argparse.Namespace) -> None:
    """--expert-model-parallel-size / --expert-tensor-parallel-size: the expert grid ETP x EP x expert-DP x PP
    covers the world (Megatron's rule: world divisible by ETP x EP x PP); expert-TP defaults to TP."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if etp is not None and etp != args.tensor_model_parallel_size:
        _require(args.num_experts is not None, f"--expert-tensor-parallel-size={etp} needs --num-experts")
    if ep <= 1 and etp is None:  # a size below 1: TransformerConfig's rule
        return
    _require(ep == 1 or args.num_experts is not None, f"--expert-model-parallel-size={ep} needs --num-experts")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    etp_flag = "--expert-tensor-parallel-size" if etp is not None else "--tensor-model-parallel-size"
    etp = tp if etp is None else etp
    _require(
        etp >= 1 and args.world_size % (etp * ep * pp) == 0,
        f"world size {args.world_size} is not divisible by {etp_flag} ({etp}) x "
        f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp}) = {etp * ep * pp}",
    )


# ----------------------------------------------------------------------------------
# The configs' own rules, with flag names.
# ----------------------------------------------------------------------------------
# ``field=value``, optionally ``Config.field=value``; and a bare ``Config.field`` (how the core names its settings).
_SETTING = re.compile(r"(?<![\w.-])(?:([A-Z]\w*)\.)?([a-z][a-z0-9_]*)=(\([^)]*\)|\[[^\]]*\]|'[^']*'|[^\s,:;]+)")
_FIELD = re.compile(r"(?<![\w.-])([A-Z]\w*)\.([a-z][a-z0-9_]*)(?![\w=])")


def _config_class(name: str) -> Optional[type]:
    """The config built from flags that is, or derives from, the class called ``name`` (None: no such config)."""
    return next((t for t in CONFIG_TARGETS if any(base.__name__ == name for base in t.__mro__)), None)


def _source(target: Optional[type], name: str, specs: Dict[str, FlagSpec]) -> Optional[Tuple[str, Optional[Fill]]]:
    """(flag dest, fill) behind field ``name`` of ``target`` (a flag destination when None); None if no flag."""
    if target is not None:
        return fills_of(target).get(name)
    return (name, None) if name in specs else None


def _as_flag(target: Optional[type], name: str, value: Optional[str], specs: Dict[str, FlagSpec]) -> Optional[str]:
    """``field=value`` (``value`` None: the bare field) as the user wrote it; None if no flag fills it."""
    source = _source(target, name, specs)
    if source is None:
        return None
    dest, fill = source
    spec = specs[dest]
    if fill is not None and fill.derive is not None:
        return f"{name} (from {spec.name})" if value is None else f"{name}={value} (from {spec.name})"
    if value is None or (spec.action, value) in (("storetrue", "True"), ("storefalse", "False")):
        return spec.name
    return f"{spec.name} {value}" if spec.action == "store" else f"{spec.name} ({name}={value})"


def flag_message(target: Optional[type], message: str) -> str:
    """An error of the core with each setting it names rewritten as the flag the user typed: the one place
    where config field names become flags.

    ``field=value`` of ``target`` (flag destinations when None) becomes ``--flag value``; ``Config.field=value``
    and a bare ``Config.field`` name the field of that config, whatever ``target``.
    """
    specs = {spec.dest: spec for spec in flag_specs()}

    def rewrite(match: re.Match) -> str:
        owner = _config_class(match.group(1)) if match.group(1) else target
        flag = None if match.group(1) and owner is None else _as_flag(owner, match.group(2), match.group(3), specs)
        return match.group(0) if flag is None else flag

    def rewrite_field(match: re.Match) -> str:
        owner = _config_class(match.group(1))
        flag = None if owner is None else _as_flag(owner, match.group(2), None, specs)
        return match.group(0) if flag is None else flag

    text = _FIELD.sub(rewrite_field, _SETTING.sub(rewrite, message))
    for name in re.findall(r" \((--[a-z0-9-]+)\)", text):  # the core's own hint, now said once
        if text.count(name) > 1:
            text = text.replace(f" ({name})", "", 1)
    return text


@contextlib.contextmanager
def flag_names_in_errors() -> Iterator[None]:
    """Let an error of the core that names flag-filled settings reach the user with the flags instead
    (same exception and traceback, its text rewritten by ``flag_message``)."""
    try:
        yield
    except ArgumentsError:
        raise  # already said with flags
    except Exception as err:
        if err.args and isinstance(err.args[0], str):
            text = flag_message(None, err.args[0])
            if text != err.args[0]:
                err.args = (text, *err.args[1:])
        raise


CHECKED_CONFIGS = (
    TransformerConfig,
    DistributedDataParallelConfig,
    OptimizerConfig,
    CheckpointConfig,
    LoggingConfig,
    TrainingConfig,
)


def check_configs(args: argparse.Namespace) -> None:
    """Build each config once so that its ``__post_init__`` rules run now, before any heavy work.

    A rule is written once, on the config owning the field; its errors and warnings reach the user
    with flag names. What the config derives or corrects (head size, expert FFN size, sequence
    parallelism off under TP 1) is read back into ``args``.
    """
    for target in CHECKED_CONFIGS:
        if target is TransformerConfig:
            target = transformer_config_class(args)  # heterogeneous layers: the per-layer config
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                config = config_from_args(target, args)
            except ValueError as err:
                raise ArgumentsError(flag_message(target, str(err))) from err
        for warning in caught:
            warnings.warn(flag_message(target, str(warning.message)), warning.category, stacklevel=2)
        if isinstance(config, TransformerConfig):
            args.kv_channels, args.moe_ffn_hidden_size = config.kv_channels, config.moe_ffn_hidden_size
            args.sequence_parallel = config.sequence_parallel
        if getattr(config, "heterogeneous_block_specs", False):  # the JSON read from the path: checkpoints keep it
            args.heterogeneous_layers_config_encoded_json = config.heterogeneous_layers_config_encoded_json


def check_sequence_split(args: argparse.Namespace) -> None:
    """--seq-length splits into 2 x CP equal chunks, each split over TP under --sequence-parallel (the core's rule).

    Runs after ``check_configs``, which turns sequence parallelism off under TP 1.
    """
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    try:
        local_sequence_length(args.seq_length, cp, tp, args.sequence_parallel)
    except ValueError as err:
        raise ArgumentsError(flag_message(None, str(err))) from err


def check_compatibility(args: argparse.Namespace) -> None:
    """Refuse a pair of features the compatibility matrix (``megatron/core/compatibility.py``) refuses.

    Runs before the configs are built, so the message names both flags rather than config fields.
    """
    message = compatibility.refused_message(args)
    _require(message is None, flag_message(None, message or ""))


STEPS: List[Callable[[argparse.Namespace], None]] = [
    check_deprecated,
    set_encoder_decoder,
    check_required,
    set_virtual_pipeline,
    check_pipeline_layers,
    check_batch_sizes,
    set_model_shape,
    set_moe,
    check_expert_parallel,
    check_optimizer_instances,
    set_precision,
    set_recompute,
    check_compatibility,
    check_training_length,
    check_learning_rate,
    check_weight_decay,
    check_data,
    check_configs,
    check_sequence_split,
]


def validate_args(args: argparse.Namespace, world_size: int, specs: Sequence[FlagSpec]) -> argparse.Namespace:
    """Refuse unsupported flags, fill derived defaults and check every cross-flag rule, in place."""
    check_not_supported(args, specs)
    check_bounds(args)
    set_parallel_sizes(args, world_size)
    for step in STEPS:
        step(args)
    return args
