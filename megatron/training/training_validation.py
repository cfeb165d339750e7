"""Start-up rules that hold for training only: layouts Megatron serves (text generation) but does not train.

``validate_args`` is shared by the training entry points, the text-generation server and the tools, so a
rule that only a training run must meet lives here; ``initialize_run(..., training=True)`` (what
``pretrain`` calls for every ``pretrain_*.py``) runs ``validate_training_args`` right after
``validate_args``, before any process group starts. The rules themselves are the core's; this module
only runs them on the flags and reports them with flag names.
"""

from __future__ import annotations

import argparse
from typing import Callable, List

from megatron.core.transformer.moe_fields import check_moe_training_layout
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.validation import ArgumentsError, flag_message


def check_moe_training(args: argparse.Namespace) -> None:
    """--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel to train (the core's rule);
    a run with --skip-train only evaluates, which the layout can."""
    if args.skip_train:
        return
    try:
        check_moe_training_layout(args.num_experts, args.tensor_model_parallel_size, args.sequence_parallel)
    except ValueError as err:
        raise ArgumentsError(flag_message(TransformerConfig, str(err))) from err


TRAINING_STEPS: List[Callable[[argparse.Namespace], None]] = [check_moe_training]


def validate_training_args(args: argparse.Namespace) -> None:
    """Refuse what ``validate_args`` accepts for serving but a training run cannot do (``TRAINING_STEPS``)."""
    for step in TRAINING_STEPS:
        step(args)
