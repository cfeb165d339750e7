"""Serve a GPT checkpoint over HTTP.

``torchrun --nproc-per-node N tools/run_text_generation_server.py <model flags> --load CKPT``:

Rank 0 answers Megatron's ``PUT /api`` and OpenAI's ``POST /v1/completions`` and
``/v1/chat/completions`` (``--host``, default 127.0.0.1; ``--port``, default 5000; ``--port 0`` picks a
free one, printed at start). Each request is checked on rank 0 and queued to the engine loop
(``text_generation/engine_loop.py``), which batches every request in flight (the dynamic engine) and
broadcasts each step so that every rank runs the same collective ``engine.step``; a failure on any rank
is answered (400/503/500) and every rank goes on serving. SIGTERM (or Ctrl-C) on rank 0 stops accepting,
finishes the requests in flight, tells the other ranks to stop, and every rank exits 0; the other ranks
ignore their own SIGTERM and wait for that stop.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repository root holds megatron/ and tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.tensor_parallel.random import use_rng_tracker  # noqa: E402
from megatron.training.initialize import shutdown_distributed  # noqa: E402
from megatron.training.preflight import reported_once  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402
from tools.text_generation.app import BoundedThreadedServer, ServerLimits, create_app  # noqa: E402
from tools.text_generation.engine_loop import EngineLoop, follow_engine  # noqa: E402
from tools.text_generation.model_loading import ServedModel, build_dynamic_engine, load_served_model  # noqa: E402
from tools.text_generation.service import GenerationService  # noqa: E402
from tools.text_generation.validation import PromptContext  # noqa: E402


def sampling_params(sampling: Dict[str, Any]) -> Any:
    """The engine's ``SamplingParams`` (its ``__post_init__`` raises ``ValueError`` on bad values)."""
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(**sampling)


def eod_or_none(tokenizer: Any) -> Optional[int]:
    """The tokenizer's end-of-document id, which ends generations; None when it has none."""
    try:
        return tokenizer.eod
    except NotImplementedError:  # MissingSpecialTokenError
        return None


def heartbeat_seconds(served: ServedModel) -> float:
    """Idle followers must hear from rank 0 well within the process-group timeout."""
    return min(60.0, served.args.distributed_timeout_minutes * 60.0 / 4)


def is_loopback(host: str) -> bool:
    """Whether ``host`` serves this machine only (``localhost`` or a loopback address)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_limits(args) -> ServerLimits:
    return ServerLimits(args.max_request_bytes, args.max_connections, args.request_read_timeout, args.api_key)


def serve(served: ServedModel, engine) -> None:
    """Rank 0: the HTTP server until SIGTERM/SIGINT, then the stop command to every rank."""
    args = served.args
    loop = EngineLoop(engine, heartbeat_seconds(served), args.max_queued_requests)
    tok = served.tokenizer
    ctx = PromptContext(tok, tok.vocab_size, served.max_sequence_length, eod_or_none(tok))
    ctx.max_prompts, ctx.max_request_tokens = args.max_prompts_per_request, args.max_request_tokens
    name = os.path.basename(os.path.normpath(args.load))
    service = GenerationService(loop.generate, ctx, check_sampling=sampling_params, model_name=name, submit=loop.submit)
    limits = server_limits(args)
    server = BoundedThreadedServer(args.host, args.port, create_app(service, None, limits), limits)
    if not is_loopback(args.host) and args.api_key is None:
        print(
            f"WARNING: serving on {args.host}, reachable from other machines, without authentication: anyone who "
            "reaches this port can generate. Set --api-key, or --host 127.0.0.1 for this machine only.",
            flush=True,
        )
    signalled: List[float] = []

    def stop(*_) -> None:
        signalled.append(time.monotonic())
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    loop.start()
    print(f"text generation server listening on http://{args.host}:{server.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        loop.stop()
    after = f" {time.monotonic() - signalled[0]:.1f} s after the signal" if signalled else ""
    print(f"text generation server stopped: every rank told to stop{after}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Training's memory report (optimizer state, activations of a training step) says nothing about serving.
    with reported_once():  # a mistake in the flags or a --load without checkpoint: one message, no traceback
        served = load_served_model(functools.partial(model_provider, report_memory=False), argv)
    engine = build_dynamic_engine(served)
    with use_rng_tracker(served.run.rng_tracker), torch.no_grad():
        if dist.get_rank() == 0:
            serve(served, engine)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 sends the stop
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow_engine(engine)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
