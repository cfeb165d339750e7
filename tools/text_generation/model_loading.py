"""The served model: built from Megatron's flags like training builds it, ``--load`` restored, eval mode."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel.random import use_rng_tracker
from megatron.core.transformer.enums import ModelType
from megatron.training.arguments import checkpoint_config_from_args, core_transformer_config_from_args
from megatron.training.checkpointing import args_to_plain_data, load_checkpoint
from megatron.training.initialize import RunState, initialize_run
from megatron.training.model_setup import build_model_chunks
from megatron.training.tokenizer import build_tokenizer_from_args

# Megatron's server defaults: the optimizer and RNG states are not needed, a missing checkpoint is an error.
SERVER_ARG_DEFAULTS: Dict[str, Any] = {
    "no_load_rng": True,
    "no_load_optim": True,
    "micro_batch_size": 1,
    "exit_on_missing_checkpoint": True,
}


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's own flags (Megatron's ``--port``, and where to listen)."""
    group = parser.add_argument_group(title="text generation server")
    group.add_argument("--port", type=int, default=5000, help="Port the HTTP server listens on (rank 0).")
    group.add_argument("--host", default="0.0.0.0", help="Address the HTTP server listens on (rank 0).")
    group.add_argument(
        "--inference-max-seq-length",
        type=int,
        default=None,
        help="Longest prompt + generation served (default: --max-position-embeddings, else --seq-length).",
    )
    parser.set_defaults(skip_train=True)  # nothing is trained: no --train-iters needed
    return parser


@dataclass
class ServedModel:
    """The model chunks of this rank, its groups, tokenizer and flags."""

    args: argparse.Namespace
    run: RunState
    chunks: List[torch.nn.Module]
    tokenizer: Any

    @property
    def groups(self) -> ProcessGroupCollection:
        return self.run.groups

    @property
    def max_sequence_length(self) -> int:
        args = self.args
        return args.inference_max_seq_length or args.max_position_embeddings or args.seq_length


def load_served_model(model_provider, argv: Optional[Sequence[str]] = None) -> ServedModel:
    """Initialize the ranks, build the model from the flags, restore ``--load`` (required) and set eval mode."""
    args, run = initialize_run(argv, add_server_args, SERVER_ARG_DEFAULTS, "gpt")
    if not args.load:
        raise SystemExit("--load is required: the checkpoint to serve")
    limit = args.max_position_embeddings
    if args.inference_max_seq_length and limit and args.inference_max_seq_length > limit:
        raise SystemExit(
            f"--inference-max-seq-length={args.inference_max_seq_length} exceeds --max-position-embeddings={limit}"
        )
    tokenizer = build_tokenizer_from_args(args)
    config = core_transformer_config_from_args(args)
    with use_rng_tracker(run.rng_tracker):  # TP layers initialise from the run's model-parallel stream
        chunks = build_model_chunks(model_provider, ModelType.encoder_or_decoder, args, config, run.groups)
    load_checkpoint(
        chunks,
        None,
        None,
        checkpoint_config_from_args(args),
        pg_collection=run.groups,
        run_args=args_to_plain_data(args),
        rng_tracker=run.rng_tracker,
    )
    for chunk in chunks:
        chunk.eval()
    return ServedModel(args, run, chunks, tokenizer)


def build_engine(served: ServedModel) -> Any:
    """The generation engine over the served chunks (one model, or the list of pipeline chunks)."""
    from megatron.core.inference.engine import InferenceEngine

    model = served.chunks[0] if len(served.chunks) == 1 else served.chunks
    # The tokenizer's size: the padded vocabulary rows (zero weights, logit 0) must never be sampled.
    return InferenceEngine(
        model, served.groups, max_sequence_length=served.max_sequence_length, vocab_size=served.tokenizer.vocab_size
    )
