"""Megatron-compatible command line: parse, validate, and turn flags into core configs.

This is the only module that reads argparse results on behalf of the library:
``parse_args`` builds the parser from the flag table (``megatron_flags.tsv``),
``validate_args`` refuses unsupported flags, fills derived defaults and builds
the configs once so their rules run before any heavy work. Which config field a
flag fills is part of the flag's record (``flags/``); the functions below only
call the generated mapping.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import validation
from megatron.training.checkpoint_config import CheckpointConfig
from megatron.training.data import VocabularyCheck
from megatron.training.flags.registry import (
    RECORDS,
    config_from_args,
    config_kwargs,
    flag_specs,
    transformer_config_class,
)
from megatron.training.flags_table import build_parser
from megatron.training.straggler import StragglerConfig
from megatron.training.theoretical_memory_params import LanguageModelShape
from megatron.training.training_config import RunConfigs, TrainingConfig
from megatron.training.training_log import FlopsConfig, LoggingConfig
from megatron.training.validation import (  # noqa: F401 - re-exported for callers
    ArgumentsError,
    UnsupportedFlagError,
    vocab_size_with_padding,
)

ENTRY_POINT_TOKENIZERS = {
    "gpt": "GPT2BPETokenizer",
    "mamba": "GPT2BPETokenizer",
    "bert": "BertWordPieceLowerCase",
    "t5": "BertWordPieceLowerCase",
}


def build_megatron_parser(entry_point: str = "gpt") -> argparse.ArgumentParser:
    """The full parser, grouped like Megatron's, for ``pretrain_<entry_point>.py``."""
    return build_parser(
        flag_specs(),
        RECORDS,
        prog=f"pretrain_{entry_point}.py",
        description="Megatron-LM compatible arguments",
    )


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
    ignore_unknown_args: bool = False,
    defaults: Optional[Mapping[str, Any]] = None,
    entry_point: str = "gpt",
) -> argparse.Namespace:
    """Parse Megatron flags (``argv`` defaults to ``sys.argv[1:]``); no validation yet.

    ``defaults`` fill flags the user left unset (value None), as Megatron's
    ``args_defaults`` do; the entry point picks the default tokenizer.
    """
    if entry_point not in ENTRY_POINT_TOKENIZERS:
        raise ValueError(f"entry_point={entry_point!r}: must be one of {sorted(ENTRY_POINT_TOKENIZERS)}")
    parser = build_megatron_parser(entry_point)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    for dest, value in (defaults or {}).items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    if args.tokenizer_type is None:
        args.tokenizer_type = ENTRY_POINT_TOKENIZERS[entry_point]
    # pretrain_mamba.py builds a hybrid model whether or not --is-hybrid-model is given: its checkpoints,
    # FLOPs and memory report must say so.
    args.is_hybrid_model = args.is_hybrid_model or entry_point == "mamba"
    # Megatron keeps the launcher's view of the job on args as well.
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check the flags once, before heavy work, and fill derived defaults (in place).

    Raises:
        UnsupportedFlagError: a flag of a feature we do not implement yet has a non-default value.
        ArgumentsError: a rule between flags is broken; the message names the flags and values.
    """
    return validation.validate_args(args, args.world_size if world_size is None else world_size, flag_specs())


# ----------------------------------------------------------------------------------
# Flags -> configs: generated from the flag records (``flags/registry.py``).
# ----------------------------------------------------------------------------------
def core_transformer_config_from_args(
    args: argparse.Namespace, config_class: type = TransformerConfig, **overrides: Any
) -> TransformerConfig:
    """A ``TransformerConfig`` (or subclass) from validated args; ``overrides`` win over the flags.

    The default class becomes ``HeterogeneousTransformerConfig`` with --heterogeneous-layers-config-path
    or --heterogeneous-layers-config-encoded-json."""
    if config_class is TransformerConfig:
        config_class = transformer_config_class(args)
    return config_class(**{**config_kwargs(config_class, args), **overrides})


def optimizer_param_scheduler_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments of ``OptimizerParamScheduler`` (without the optimizer), counted in samples.

    Iteration-based runs convert iterations to samples with the global batch
    size; the loop then calls ``step(increment=global_batch_size)``.
    """
    return config_kwargs(OptimizerParamScheduler, args)


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The data-parallel wrapper's config from validated args."""
    return config_from_args(DistributedDataParallelConfig, args)


def data_parallel_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The data-parallel wrapper's config the run builds: with ``--use-torch-fsdp2`` FSDP2's, which (as
    Megatron's) carries only ``reshard_after_forward`` (``--torch-fsdp2-no-reshard-after-forward``)."""
    if getattr(args, "use_torch_fsdp2", False):
        return TorchFullyShardedDataParallelConfig(reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
    return ddp_config_from_args(args)


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """The optimizer's config from validated args."""
    return config_from_args(OptimizerConfig, args)


def checkpoint_config_from_args(args: argparse.Namespace) -> CheckpointConfig:
    """What to save and load, and how strictly, from parsed args."""
    return config_from_args(CheckpointConfig, args)


def straggler_config_from_args(args: argparse.Namespace) -> StragglerConfig:
    """``--log-straggler`` and its flags (reports every ``--log-interval``), from parsed args."""
    return config_from_args(StragglerConfig, args)


def flops_config_from_args(args: argparse.Namespace) -> FlopsConfig:
    """A ``FlopsConfig`` from validated args (``padded_vocab_size`` must be set by then)."""
    if getattr(args, "padded_vocab_size", None) is None:
        raise ValueError("padded_vocab_size is not set: build the tokenizer (which pads the vocabulary) first")
    return config_from_args(FlopsConfig, args)


def logging_config_from_args(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> LoggingConfig:
    """The logging config from args; the W&B mode is ``WANDB_MODE`` when set, else offline (not a flag)."""
    env = os.environ if environ is None else environ
    return config_from_args(LoggingConfig, args, wandb_mode=env.get("WANDB_MODE", "offline"))


def training_config_from_args(args: argparse.Namespace) -> TrainingConfig:
    """The training loop's settings from validated args."""
    return config_from_args(TrainingConfig, args)


def run_configs_from_args(args: argparse.Namespace, saved_args: Dict[str, Any]) -> RunConfigs:
    """Every config the training loop reads, built once after start-up (the tokenizer has padded the vocabulary).

    ``saved_args`` is what checkpoints store of the flags (``checkpointing.args_to_plain_data(args)``).
    """
    return RunConfigs(
        training=training_config_from_args(args),
        checkpoint=checkpoint_config_from_args(args),
        logging=logging_config_from_args(args),
        flops=flops_config_from_args(args),
        saved_args=saved_args,
    )


def vocabulary_check_from_args(args: argparse.Namespace) -> Optional[VocabularyCheck]:
    """The data's token-id check against the padded vocabulary, naming the flags that sized it; None for mock data."""
    if getattr(args, "mock_data", False):
        return None
    origin = (
        f"--tokenizer-type {args.tokenizer_type}"
        + (f" --vocab-size {args.vocab_size}" if getattr(args, "vocab_size", None) else "")
        + f", padded to a multiple of --make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}"
        f" x --tensor-model-parallel-size {args.tensor_model_parallel_size}"
    )
    return VocabularyCheck(args.padded_vocab_size, origin)


def language_model_shape_from_args(args: argparse.Namespace) -> LanguageModelShape:
    """What the theoretical memory needs of the model besides its ``TransformerConfig`` (vocabulary padded by then)."""
    return config_from_args(LanguageModelShape, args)
