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
    """The server's own flags (Megatron's ``--port``; where to listen, who may ask, and how much)."""
    group = parser.add_argument_group(title="text generation server")
    group.add_argument("--port", type=int, default=5000, help="Port the HTTP server listens on (rank 0).")
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address the HTTP server listens on (rank 0). The default serves this machine only; 0.0.0.0 serves "
        "every interface, and anyone who reaches it may generate unless --api-key is set (a warning says so).",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' (as OpenAI clients send) on every request; others get 401.",
    )
    group.add_argument(
        "--inference-max-seq-length",
        type=int,
        default=None,
        help="Longest prompt + generation served (default: --max-position-embeddings, else --seq-length).",
    )
    engine = parser.add_argument_group(title="dynamic batching (the paged KV cache of the engine)")
    engine.add_argument(
        "--inference-dynamic-batching-buffer-size-gb",
        type=float,
        default=1.0,
        help="Memory of the KV-cache block pool on each rank (every layer of its stage, keys and values).",
    )
    engine.add_argument(
        "--inference-dynamic-batching-block-size", type=int, default=256, help="Positions per KV-cache block."
    )
    engine.add_argument(
        "--inference-dynamic-batching-max-requests",
        type=int,
        default=64,
        help="Requests generating at once; more wait in the queue.",
    )
    engine.add_argument(
        "--inference-dynamic-batching-max-tokens",
        type=int,
        default=16384,
        help="Tokens one forward step holds (prompt chunks plus one per decoding request).",
    )
    limits = parser.add_argument_group(title="text generation server limits (per request unless stated)")
    limits.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="Prompts accepted and not yet finished, over all requests; more are answered 503.",
    )
    limits.add_argument(
        "--max-prompts-per-request", type=int, default=128, help="Prompts in one request (Megatron's limit: 128)."
    )
    limits.add_argument(
        "--max-request-tokens",
        type=int,
        default=65536,
        help="Prompt tokens plus tokens to generate, summed over the prompts of one request.",
    )
    limits.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="Request body size; a larger Content-Length is answered 413 before the body is read.",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="Connections served at once (reading, queued for generation or generating); more are answered "
        "503 at once.",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=float,
        default=10.0,
        help="Seconds a connection may stay silent while its request is read; then it is closed (408 or dropped).",
    )
    parser.set_defaults(skip_train=True)  # nothing is trained: no --train-iters needed
    return parser


def check_server_args(args: argparse.Namespace) -> None:
    """Each limit flag must be positive; errors name the flag, the value and the rule."""
    for flag in (
        "max_prompts_per_request",
        "max_request_tokens",
        "max_request_bytes",
        "max_connections",
        "max_queued_requests",
        "inference_dynamic_batching_block_size",
        "inference_dynamic_batching_max_requests",
        "inference_dynamic_batching_max_tokens",
    ):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be at least 1")
    if not 0 < args.inference_dynamic_batching_buffer_size_gb < float("inf"):
        raise SystemExit(
            f"--inference-dynamic-batching-buffer-size-gb={args.inference_dynamic_batching_buffer_size_gb}: "
            "must be a positive number"
        )
    if args.inference_dynamic_batching_max_requests > args.inference_dynamic_batching_max_tokens:
        raise SystemExit(
            f"--inference-dynamic-batching-max-requests={args.inference_dynamic_batching_max_requests}: must be at "
            f"most --inference-dynamic-batching-max-tokens={args.inference_dynamic_batching_max_tokens}"
        )
    if not 0 < args.request_read_timeout < float("inf"):
        raise SystemExit(f"--request-read-timeout={args.request_read_timeout}: must be a positive number of seconds")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key is empty: give a key, or leave the flag out to serve without one")


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
    check_server_args(args)
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


def build_dynamic_engine(served: ServedModel) -> Any:
    """The continuous-batching engine over the served chunks and a KV-cache pool sized by the flags."""
    from megatron.core.inference.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.dynamic_engine import DynamicInferenceEngine
    from megatron.core.utils import unwrap_model

    args = served.args
    config = unwrap_model(served.chunks[0]).config
    context = DynamicInferenceContext(
        config.params_dtype,
        config.num_layers,
        config.kv_channels,
        config.num_query_groups or config.num_attention_heads,
        served.max_sequence_length,
        args.inference_dynamic_batching_buffer_size_gb,
        max_requests=args.inference_dynamic_batching_max_requests,
        max_tokens=args.inference_dynamic_batching_max_tokens,
        block_size_tokens=args.inference_dynamic_batching_block_size,
        pg_collection=served.groups,
    )
    model = served.chunks[0] if len(served.chunks) == 1 else served.chunks
    return DynamicInferenceEngine(model, context, pg_collection=served.groups, vocab_size=served.tokenizer.vocab_size)
