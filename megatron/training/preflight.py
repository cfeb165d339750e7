"""Start-up checks of what the flags name (files, directories, checkpoints, the rendezvous port),
run before the tokenizer and the model are built, and the one-message report of a user's mistake.

A mistake a user can fix (a flag's value, a missing file) is an ``InputError`` (an
``ArgumentsError``, so a ``SystemExit`` with a message: no traceback). ``reported_once`` prints it on
one rank only: rank 0 for a mistake every rank sees alike (flag validation), else the lowest rank
that found it; the other ranks exit 1 silently. ``MEGATRON_TRACEBACK=1`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import time
import traceback
from typing import Iterator, List, Mapping, Optional, Sequence

import torch.distributed as dist

from megatron.training.checkpoint_dirs import (  # noqa: F401 - writable_dir_problem re-exported
    checkpoint_required,
    missing_checkpoint,
    save_dir_problem,
    writable_dir_problem,
)
from megatron.training.flags.registry import flags_with
from megatron.training.validation import ArgumentsError, flag_names_in_errors

TRACEBACK_ENV = "MEGATRON_TRACEBACK"

# Tokenizers whose --tokenizer-model is a local file (HuggingFaceTokenizer also takes a hub name).
_MODEL_FILE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")


class InputError(ArgumentsError):
    """A file, directory, checkpoint or port named by a flag cannot be used.

    ``reporter`` is the rank that prints the message (None: rank 0, the mistake is the same everywhere).
    """

    def __init__(self, message: str, reporter: Optional[int] = None) -> None:
        super().__init__(message)
        self.reporter = reporter


def launch_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's global rank: torch.distributed's once it is up, else torchrun's or Slurm's variable."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    environ = os.environ if environ is None else environ
    for name in ("RANK", "SLURM_PROCID"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


SILENT_RANK_GRACE_S = 3.0  # how long a rank that does not print a start-up error waits before exiting


@contextlib.contextmanager
def reported_once() -> Iterator[None]:
    """Let an ``ArgumentsError`` print on one rank; the others exit with status 1 and say nothing. Any other
    error that names flag-filled settings (the core's ``Config.field=value``) is rewritten with the flags."""
    try:
        with flag_names_in_errors():  # the core names config fields; the user sees the flags
            yield
    except ArgumentsError as err:
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc(file=sys.stderr)
        reporter = getattr(err, "reporter", None) or 0
        if launch_rank() != reporter:
            err.code = 1  # SystemExit prints a non-int code; an int exits silently
            # A launcher (torchrun, Slurm) stops every rank once one exits: give the reporter, which hits the
            # same check, time to print before this rank's exit ends the job.
            time.sleep(SILENT_RANK_GRACE_S)
        raise


# ---------------------------------------------------------------- what one rank can check alone
def data_prefixes(args: argparse.Namespace) -> List[str]:
    """The dataset prefixes of --data-path and --train/valid/test-data-path (weights dropped)."""
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes: List[str] = []
    for dest in flags_with("data_prefixes"):
        blend = get_blend_from_list(getattr(args, dest, None))
        prefixes.extend(blend[0] if blend else [])
    return prefixes


def data_problem(args: argparse.Namespace) -> Optional[str]:
    """The first prefix whose ``.bin`` or ``.idx`` is missing, named with its flag (None: all there)."""
    if getattr(args, "mock_data", False):
        return None
    for prefix in data_prefixes(args):
        if getattr(args, "sft", False):  # --sft reads JSON-lines files directly
            if not os.path.isfile(prefix):
                return f"--data-path {prefix}: no such JSON-lines file (--sft)"
            continue
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
            return f"--data-path {prefix}: {' and '.join(missing)} not found{hint}"
    return None


def tokenizer_problem(args: argparse.Namespace) -> Optional[str]:
    """A tokenizer file flag naming a file that is not there."""
    named = [("--vocab-file", getattr(args, "vocab_file", None)), ("--merge-file", getattr(args, "merge_file", None))]
    if getattr(args, "tokenizer_type", None) in _MODEL_FILE_TOKENIZERS:
        named.append(("--tokenizer-model", getattr(args, "tokenizer_model", None)))
    for flag, path in named:
        if path and not os.path.exists(path):
            return f"{flag} {path}: no such file (--tokenizer-type {args.tokenizer_type})"
    return None


def load_problem(args: argparse.Namespace) -> Optional[str]:
    """``--load`` names no checkpoint although this run needs one, or untracked checkpoints
    (``checkpoint_dirs.missing_checkpoint``)."""
    if not getattr(args, "load", None):
        return None
    why = checkpoint_required(
        getattr(args, "exit_on_missing_checkpoint", False),
        getattr(args, "finetune", False),
        getattr(args, "skip_train", False),
    )
    return missing_checkpoint(args.load, getattr(args, "ckpt_step", None), why)


def local_problems(args: argparse.Namespace, rank: int) -> List[str]:
    """Everything this rank finds wrong with the inputs, first the cheapest to fix."""
    from megatron.training.arguments import checkpoint_config_from_args

    checks = [tokenizer_problem(args), data_problem(args), load_problem(args)]
    if rank == 0:  # rank 0 creates the output directories
        checks.append(save_dir_problem(checkpoint_config_from_args(args)))
        checks.append(writable_dir_problem("--tensorboard-dir", getattr(args, "tensorboard_dir", None)))
    return [c for c in checks if c]


def check_inputs(args: argparse.Namespace) -> None:
    """Collective, after torch.distributed starts and before the tokenizer and model are built.

    Each rank checks its own view of the files; when any rank finds a problem every rank raises
    ``InputError``, reported by the lowest rank that found one.
    """
    rank = dist.get_rank()
    mine = local_problems(args, rank)
    found: Sequence[Optional[str]] = [mine[0] if mine else None]
    if dist.get_world_size() > 1 and dist.get_backend() != "fake":
        gathered: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found[0])
        found = gathered
    elif dist.get_world_size() > 1:
        found = [found[0] if r == rank else None for r in range(dist.get_world_size())]
    failed = [(r, msg) for r, msg in enumerate(found) if msg]
    if failed:
        reporter, message = failed[0]
        raise InputError(message if reporter == 0 else f"rank {reporter}: {message}", reporter=reporter)


def check_port_free(host: str, port: int, rank: int, environ: Optional[Mapping[str, str]] = None) -> None:
    """Rank 0 will listen on the rendezvous port (not when torchrun's agent holds the store): is it free?"""
    environ = os.environ if environ is None else environ
    if rank != 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: TIME_WAIT is no conflict
        try:
            sock.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (e.g. a privileged port): the store reports it
            raise InputError(
                f"the rendezvous port {port} (MASTER_PORT) is already in use on {host}: another job, or an earlier "
                "run that has not exited, listens on it; set MASTER_PORT to a free port",
                reporter=0,
            ) from None
