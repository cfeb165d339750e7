"""Start the text-generation server (and its in-process reference) from a trained checkpoint, with hard timeouts.

The ranks are started directly with torchrun's environment variables (not under torchrun), so that
a test can signal each rank and read each rank's exit code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tests.functional_tests.gpt_runs import (
    REPO,
    assert_ok,
    build_corpus,
    built_once,
    data_flags,
    free_port,
    run_gpt,
    tiny_gpt_flags,
    with_flags,
)

SERVER = os.path.join(REPO, "tools", "run_text_generation_server.py")
REFERENCE = os.path.join(REPO, "tests", "functional_tests", "text_generation_reference.py")
START_TIMEOUT_S = 300  # a hang detector: fresh interpreters import torch, load the checkpoint (slow when loaded)
REQUEST_TIMEOUT_S = 120
SEQ_LENGTH = 64
TRAIN_ITERS = 30  # enough for greedy continuations that are not all one token


def model_flags(corpus: Dict[str, str]) -> List[str]:
    """The tiny GPT of the functional tests, with 64-token sequences (room for prompts and generations)."""
    changes = {"--seq-length": str(SEQ_LENGTH), "--max-position-embeddings": str(SEQ_LENGTH)}
    return with_flags(tiny_gpt_flags(TRAIN_ITERS), changes) + data_flags(corpus)


def train_checkpoint(tmp_dir: str) -> Tuple[List[str], str]:
    """The tiny GPT trained for ``TRAIN_ITERS`` iterations (once per process, copied into ``tmp_dir``: the server
    tests of every module serve the same checkpoint); its flags and the checkpoint directory."""
    paths = built_once("served_checkpoint", _train_checkpoint, tmp_dir)
    return model_flags(paths), paths["ckpt"]


def _train_checkpoint(tmp_dir: str) -> Dict[str, str]:
    corpus = build_corpus(tmp_dir)
    ckpt = os.path.join(tmp_dir, "ckpt")
    result = run_gpt(1, model_flags(corpus) + ["--save", ckpt, "--save-interval", str(TRAIN_ITERS)], tmp_dir)
    assert_ok(result, "training the checkpoint to serve")
    return {**corpus, "ckpt": ckpt}


def rank_env(rank: int, world: int, port: int) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


class ServerRanks:
    """The server's ranks, started on ``__enter__``; every rank is killed on ``__exit__`` if still alive."""

    def __init__(self, flags: Sequence[str], log_dir: str, world: int = 1, script: str = SERVER):
        self.flags, self.world = list(flags) + ["--port", "0", "--host", "127.0.0.1"], world
        self.script = script
        self.logs = [os.path.join(log_dir, f"server_rank{r}.log") for r in range(world)]
        self.procs: List[subprocess.Popen] = []
        self.url = ""

    def __enter__(self) -> ServerRanks:
        port = free_port()
        for rank, path in enumerate(self.logs):
            with open(path, "w") as log:
                cmd = [sys.executable, self.script, *self.flags]
                env = rank_env(rank, self.world, port)
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        try:
            self.url = self._wait_for_url()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def output(self, rank: int = 0) -> str:
        with open(self.logs[rank]) as f:
            return f.read()

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"listening on (http://\S+)", self.output(0))
            if found:
                return found.group(1)
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            assert not dead, f"server rank(s) {dead} exited before serving:\n{self.output(dead[0])[-4000:]}"
            time.sleep(0.2)
        raise AssertionError(f"the server did not start in {START_TIMEOUT_S}s:\n{self.output(0)[-4000:]}")

    def terminate_all(self, timeout: float = 60) -> List[int]:
        """SIGTERM to every rank (as a scheduler does); their exit codes."""
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        return [proc.wait(timeout=timeout) for proc in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def call(
    url: str, method: str, body: Any = None, raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None
) -> Tuple[int, Any]:
    """(HTTP status, parsed JSON answer) of one request."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def run_reference(flags: Sequence[str], wanted: Dict[str, Any], tmp_dir: str) -> Dict[str, Any]:
    """The reference script's answer (one rank, under torchrun, with a timeout)."""
    paths = {
        "REFERENCE_IN": os.path.join(tmp_dir, "ref_in.json"),
        "REFERENCE_OUT": os.path.join(tmp_dir, "ref_out.json"),
    }
    with open(paths["REFERENCE_IN"], "w") as f:
        json.dump(wanted, f)
    result = run_gpt(1, list(flags), tmp_dir, env=paths, script=[REFERENCE])
    assert_ok(result, "the reference script")
    with open(paths["REFERENCE_OUT"]) as f:
        return json.load(f)
