"""Run a test body on N CPU ranks (gloo) inside one pytest test.

``run_distributed(body, world_size, *args)`` spawns ``world_size`` processes, sets
up ``torch.distributed`` over a file store (no ports to race for), calls
``body(rank, world_size, *args)`` on each, and waits. It fails the calling test
with every failing rank's traceback; a rank that does not finish within
``timeout`` has its Python stack dumped (faulthandler) and is killed, and the
error names it. Every collective inside the body inherits the timeout, so a rank
waiting on a dead peer errors out rather than hanging.

``body`` must be a module-level function (it is pickled by reference).
Return values of ``body`` come back as a list indexed by rank.

Ranks start from a fork server that has imported torch once per pytest process (``forkserver`` with
``torch`` preloaded): a rank is a fresh fork of a process that has only imported modules, so no test's
state reaches it, and it skips the 3-8 s import of torch (and of megatron) a ``spawn`` start pays on the
2-core machine.
The caller's environment and working directory travel with every start, as they would with ``spawn``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

# A hang detector, not a speed bound: the slowest rank groups take about 100 s on 2 loaded cores here, and CI's
# machine may be slower and busier. A passing test never waits on it.
DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_TEST_TIMEOUT", "600"))
# Imported once by the fork server; every rank forks from it with these already loaded. Importing
# megatron.training.training loads nearly all of megatron (about 190 modules, 0.7 s of CPU a rank would
# otherwise pay again when it unpickles its body's module), transformers the 1.3 s each rank of the 14 files
# comparing against Hugging Face paid. Importing runs no test code.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "megatron.training.training"]
_PRELOAD += ["transformers"]
# torch._dynamo (imported by the first optimizer a rank makes, or any torch function torch keeps dynamo away
# from), with torch.onnx and numpy.random: 213 modules, measured 0.93 CPU-s a rank paid after the fork.
_PRELOAD += ["torch._dynamo", "torch.onnx", "numpy.random"]


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung; the message holds every rank's report."""


def _child(
    rank: int,
    world_size: int,
    store_path: str,
    stack_path: str,
    timeout_s: float,
    body: Callable[..., Any],
    args: tuple,
    results: mp.Queue,
    environ: Dict[str, str],
) -> None:
    # The fork server's environment is the one it started with: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = body(rank, world_size, *args)
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory file
        # descriptors, which the parent cannot receive once this process has exited.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must travel to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass


def _collect(procs: List[mp.Process], results: mp.Queue, deadline: float, grace: float) -> Dict[int, tuple]:
    """Gather (status, payload) per rank until all report, ``grace`` seconds after one fails, or time runs out."""
    reports: Dict[int, tuple] = {}
    first_error_at = None
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.2)
            reports[rank] = (status, payload)
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in reports and not proc.is_alive() and proc.exitcode not in (None, 0):
                reports[rank] = ("error", f"process exited with code {proc.exitcode} before reporting")
        # Peers of a failed rank usually block on a collective: give them a grace period.
        if first_error_at is not None and time.monotonic() - first_error_at > grace:
            break
    return reports


def _dump_and_kill(proc: mp.Process, stack_path: str) -> str:
    """Ask a stuck rank for its Python stack, then kill it; return the stack text."""
    if proc.is_alive():
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
        except ProcessLookupError:
            pass
        proc.kill()
    proc.join(5)
    try:
        with open(stack_path) as f:
            return f.read().strip() or "(no stack captured)"
    except OSError:
        return "(no stack captured)"


def _context() -> mp.context.BaseContext:
    """The fork-server context, with torch preloaded (``spawn`` where fork servers do not exist)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    body: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    peer_grace: float = 10.0,
) -> List[Any]:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    After a rank fails, the others have ``peer_grace`` seconds to report (a test whose peers stop only after a
    timeout of their own gives room for it); then they count as hung.

    Returns:
        ``body``'s return value per rank.

    Raises:
        DistributedTestError: a rank raised, crashed or hung; the message holds
            each failing rank's traceback or stack dump.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mtest-") as tmp:
        store = os.path.join(tmp, "store")
        stacks = [os.path.join(tmp, f"stack{r}") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store, stacks[r], timeout, body, args, results, dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        reports = _collect(procs, results, time.monotonic() + timeout, peer_grace)
        problems = []
        for rank, proc in enumerate(procs):
            if rank not in reports:
                stack = _dump_and_kill(proc, stacks[rank])
                problems.append(
                    f"--- rank {rank} hung (killed after {timeout:.0f}s or after a peer failed); its stack:\n{stack}"
                )
            elif reports[rank][0] == "error":
                problems.append(f"--- rank {rank} failed:\n{reports[rank][1]}")
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        if problems:
            raise DistributedTestError(f"{body.__name__} on {world_size} ranks:\n" + "\n".join(problems))
    return [pickle.loads(reports[r][1]) for r in range(world_size)]
