"""Launch an entry point (``pretrain_gpt.py`` and its test wrappers) on N local ranks without paying
Python's and torch's start-up for every rank: a torchrun stand-in for the end-to-end tests.

A server process (``python -m tests.entry_launcher``, one per pytest process, started on first use)
imports torch, ``torch.distributed.checkpoint`` and the three entry points' modules once, then forks
one process per rank for every run. Each rank gets what ``torchrun --standalone`` gives its workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and the elastic
variables; rank 0 hosts the rendezvous store, as after ``torchrun --no-agent-store``), the caller's
environment and working directory, its ``sys.argv``, and stdout and stderr each in a file shared by the
ranks (as torchrun's workers share its two streams), then runs
the script as ``__main__`` and exits as Python would: ``sys.exit``'s code, or ``sys.excepthook``'s
report and 1 for an exception, after the ``atexit`` handlers. As torchrun does, the run fails
(exit 1) when any rank fails, and the other ranks are then terminated.

Nothing a test imports, patches or sets reaches a rank: the server imports modules and runs nothing.
A wrapper script that patches a module attribute still works (the patch lands in the imported module
before the entry point runs); one that replaces a module before its first import cannot, and must
use real torchrun (``run_gpt(..., launcher="torchrun")``), as the tests of torchrun's own behaviour do.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the server imports once; a rank forks with all of it loaded (torch.distributed.checkpoint pulls
# in sympy, about 2 s on its own). No optional package (tensorboard, wandb, Transformer Engine) is here.
# torch._dynamo (which torch.optim imports when the first optimizer is made), torch.onnx and numpy.random are
# what every run imported after the fork: measured 1.4 -> 0.65 CPU-s per rank of a 3-iteration run.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "pretrain_gpt", "pretrain_bert")
PRELOAD += ("pretrain_t5", "torch._dynamo", "torch.onnx", "numpy.random")
# Variables torch's compiler reads when imported (so in the server, not in a rank): a run that sets them
# differently from the server cannot be forked from it and fails saying so. (TORCHINDUCTOR_CACHE_DIR is left
# out: torch sets it in the process that compiles.)
IMPORT_TIME_ENV_PREFIXES = ("TORCH_COMPILE", "TORCHDYNAMO", "TORCH_DYNAMO", "TORCH_LOGS")
STOP_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL when it stops the workers


class LaunchTimeout(AssertionError):
    """A run did not finish in time (its ranks were killed); the message holds the output's tail."""


# ---------------------------------------------------------------- server (the forking process)


def rank_environment(base: Dict[str, str], rank: int, nproc: int, port: int) -> Dict[str, str]:
    """``base`` plus what ``torchrun --standalone --nproc-per-node nproc`` sets for worker ``rank``."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        ROLE_NAME="default",
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=env.get("TORCHELASTIC_RUN_ID", uuid.uuid4().hex),
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _exit_code(code: object) -> int:
    """The process exit status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _as_main(script: str) -> int:
    """Run ``script`` as ``__main__`` and return the exit status ``python script`` would have."""
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # join non-daemon threads, as interpreter exit does
    atexit._run_exitfuncs()
    return code


def _text_stream(fd: int) -> io.TextIOWrapper:
    """A line-buffered text stream on ``fd``: each printed line reaches the shared file in one ``write``, so
    ranks' lines never interleave mid-line (an unbuffered stream writes a line and its newline apart, and CI saw
    one rank's report glued into another's line)."""
    raw = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
    return io.TextIOWrapper(raw, encoding="utf-8", line_buffering=True)


def _run_rank(request: Dict, rank: int, protocol_fds: Tuple[int, ...]) -> int:
    """In the forked child: become rank ``rank`` of ``request`` and run its script (a ``None`` stdout or
    stderr path keeps the stream the launcher has)."""
    for fd in protocol_fds:
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    env = rank_environment(request["env"], rank, request["nproc"], request["port"])
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path is None:  # the launcher's own stream, inherited (tests/torchrun_standin.py)
            continue
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout, sys.stderr = _text_stream(1), _text_stream(2)
    _check_import_time_env(request["env"], _IMPORTED_WITH)
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    # sys.path as ``python script`` builds it: the script's folder, then PYTHONPATH's entries.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:1] = [os.path.dirname(script), *extra]
    return _as_main(script)


def _check_import_time_env(env: Dict[str, str], launcher_env: Dict[str, str]) -> None:
    """Refuse a run whose import-time variables differ from the launcher's (its modules read them already)."""
    names = {k for k in (*env, *launcher_env) if k.startswith(IMPORT_TIME_ENV_PREFIXES)}
    differ = sorted(k for k in names if env.get(k) != launcher_env.get(k))
    if differ:
        raise RuntimeError(
            f"{differ} differ from the launcher's, which imported torch with them: run it with real torchrun "
            "(run_gpt(..., launcher='torchrun'))"
        )


def fork_rank(request: Dict, rank: int, protocol_fds: Tuple[int, ...] = ()) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run_rank(request, rank, protocol_fds)
    except BaseException:  # noqa: BLE001 - a failure to start the rank must still end this process
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_ranks(pids: List[int]) -> int:
    """torchrun's rule: 0 when every rank exits 0; at the first failure stop the others (SIGTERM, then SIGKILL)."""
    alive, failed, stop_deadline = set(pids), False, None
    while alive:
        pid, status = os.waitpid(-1, os.WNOHANG if stop_deadline else 0)
        if pid == 0:
            if time.monotonic() > stop_deadline:
                for other in alive:
                    _signal(other, signal.SIGKILL)
                stop_deadline = float("inf")
            time.sleep(0.05)
            continue
        if pid not in alive:
            continue
        alive.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, stop_deadline = True, time.monotonic() + STOP_GRACE_S
            for other in alive:
                _signal(other, signal.SIGTERM)
    return 1 if failed else 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_IMPORTED_WITH: Dict[str, str] = {}  # the import-time variables as ``preload`` found them


def preload() -> None:
    """Import ``PRELOAD`` (what every forked rank then starts with)."""
    _IMPORTED_WITH.update((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES))
    for name in PRELOAD:
        importlib.import_module(name)


def serve() -> None:
    """Read one JSON request per line on stdin; answer ``{"pids": ...}``, then ``{"returncode": ...}``."""
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray prints of the imports go to the server's stderr, never into the replies
    os.close(devnull)
    preload()
    reader = os.fdopen(requests, "r")
    writer = os.fdopen(replies, "w", buffering=1)
    for line in reader:
        request = json.loads(line)
        pids = [fork_rank(request, rank, (requests, replies)) for rank in range(request["nproc"])]
        writer.write(json.dumps({"pids": pids}) + "\n")
        writer.write(json.dumps({"returncode": wait_ranks(pids)}) + "\n")
    os._exit(0)  # the client closed the pipe: no need for the interpreter's slow teardown of torch


# ---------------------------------------------------------------- client (in the pytest process)


class _Server:
    """The pytest process's one server, started on first use and stopped at exit."""

    proc: Optional[subprocess.Popen] = None
    pending = b""  # reply bytes read but not yet consumed

    @classmethod
    def get(cls) -> subprocess.Popen:
        if cls.proc is None or cls.proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
            if cls.proc is None:
                atexit.register(cls.stop)
            cls.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.entry_launcher"],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
            )
            cls.pending = b""
        return cls.proc

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.kill()
            cls.proc.wait()

    @classmethod
    def reply(cls, deadline: float) -> Optional[Dict]:
        """The server's next reply line, or None when ``deadline`` passes first."""
        fd = cls.proc.stdout.fileno()
        while b"\n" not in cls.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the entry-point launcher exited ({cls.proc.wait()}); see its stderr above")
            cls.pending += chunk
        line, cls.pending = cls.pending.split(b"\n", 1)
        return json.loads(line)


def launch(
    nproc: int, argv: Sequence[str], cwd: str, env: Dict[str, str], port: int, timeout: float
) -> Tuple[int, str, str]:
    """Run ``argv`` (a script and its arguments) on ``nproc`` ranks; return (exit status, stdout, stderr).

    Raises:
        LaunchTimeout: the ranks had not all exited after ``timeout`` seconds (they are killed).
    """
    proc = _Server.get()
    with tempfile.TemporaryDirectory(prefix="entry-launch-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(nproc=nproc, argv=list(argv), cwd=cwd, env=env, port=port, stdout=out, stderr=err)
        pids: List[int] = []
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            # The server's own start (its imports) does not count against the run's timeout.
            started = _Server.reply(time.monotonic() + max(timeout, 300))
            if started is None:
                raise LaunchTimeout("the entry-point launcher did not start the ranks within its timeout")
            pids = started["pids"]
            done = _Server.reply(time.monotonic() + timeout)
            if done is None:
                tail = (_read(out) + _read(err))[-8000:]
                raise LaunchTimeout(f"{argv[0]} on {nproc} ranks did not finish in {timeout}s:\n{tail}")
        except BaseException:
            # A run left unfinished would leave its reply in the pipe: kill it and start a new server next time.
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            _Server.stop()
            raise
        return done["returncode"], _read(out), _read(err)


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


if __name__ == "__main__":
    serve()
