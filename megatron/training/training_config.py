"""``TrainingConfig``: what the training loop itself reads, and ``RunConfigs``, every config one run's loop uses.

The fields are filled from the flag records (``flags/training.py``, ``flags/data.py``) like every
other config; values ``validate_args`` used to write back into the flags (the total number of
iterations a ``--train-samples`` run takes, Megatron's default ``--eval-interval``) are derived by the
records' named functions (``flags/derive.py``). ``pretrain()`` builds a ``RunConfigs`` once after
start-up; from then on the loop, logging, FLOPs, checkpoint scheduling and data setup read only it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Dict, Optional

from megatron.training.checkpoint_config import CheckpointConfig
from megatron.training.flops import FlopsConfig
from megatron.training.training_log import LoggingConfig


@dataclass(frozen=True)
class TrainingConfig:
    """The loop's settings: batch shape, length, evaluation, exit conditions and data loading.

    Attributes:
        micro_batch_size: samples per microbatch per data-parallel rank (``--micro-batch-size``).
        global_batch_size: samples per optimizer step over all ranks, without ramp-up (``--global-batch-size``).
        seq_length: tokens per sample (``--seq-length``; T5: the encoder's).
        decoder_seq_length: T5's decoder tokens per sample (``--decoder-seq-length``), else None.
        train_iters: the iterations of the whole run: ``--train-iters``, or what ``--train-samples`` takes
            (batch ramp-up included); 0 when neither is given (``--skip-train``).
        train_samples: ``--train-samples`` as given (None for an iteration-based run).
        eval_iters / eval_interval: global batches per evaluation, iterations between evaluations.
        skip_train: only evaluate (``--skip-train``).
        exit_interval / exit_duration_in_mins: stop after this iteration multiple / these minutes.
        exit_signal_handler / exit_signal: stop (and save) when this signal arrives.
        dataloader_type / num_workers / seed: how the data loaders sample and shuffle.
    """

    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    train_iters: int = 0
    train_samples: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    eval_iters: int = 100
    eval_interval: int = 1000
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    exit_signal: int = signal.SIGTERM
    dataloader_type: Optional[str] = None
    num_workers: int = 2
    seed: int = 1234


@dataclass(frozen=True)
class RunConfigs:
    """Every config the training loop reads, built once by ``pretrain()`` after start-up.

    ``saved_args`` is the flags as plain data, what a checkpoint stores beside the weights (Megatron's
    layout keeps the command line there); the loop hands it to ``save_checkpoint`` and never reads it.
    """

    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    flops: FlopsConfig
    saved_args: Dict[str, Any]
