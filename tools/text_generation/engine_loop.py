"""Continuous batching behind the server: HTTP handler threads queue requests, one thread steps the engine.

Rank 0's ``EngineLoop`` owns the ``DynamicInferenceEngine``. A handler ``submit``s its prompts (checked
first, so no rank ever refuses them) and reads the progress of each from its ``Submission``; no lock is
held around generation. The loop thread takes what arrived, broadcasts one ``{"op": "step", "add": ...,
"abort": ...}`` command, and every rank (``follow_engine`` on the others) adds and aborts the same
requests and runs the same collective ``engine.step()``. After each step the ranks agree on the outcome
(``ranks.run_and_agree``): a failure on any rank fails every request in flight with that status, and
every rank drops them (``engine.reset``). While idle the loop sends heartbeats (``noop``) as the
one-request-at-a-time leader did; ``stop`` finishes what is in flight, then stops the followers.

The k-th prompt of a submission samples with ``seed + k`` (no seed: a random one), so ``n`` copies of a
prompt differ while a seeded request is reproducible.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from megatron.core.inference.sampling_params import SamplingParams
from tools.text_generation.errors import OVERLOAD, GenerationFailed
from tools.text_generation.ranks import NOOP, STOP, broadcast_command, run_and_agree

STEP = "step"
MAX_SEED = 2**63
StopCheck = Callable[[int, List[int]], bool]  # (prompt index, generated tokens so far) -> stop now


def request_sampling(sampling: Dict[str, Any], k: int) -> Dict[str, Any]:
    """The sampling keywords of the k-th prompt of a submission (its own seed)."""
    seed = sampling.get("seed")
    return dict(sampling, seed=None if seed is None else (seed + k) % MAX_SEED)


@dataclass
class Submission:
    """The prompts of one HTTP request in flight; ``events`` yields ``(index, result, finished)`` as they
    progress (``result``: a ``GenerationResult``), or raises ``GenerationFailed``."""

    prompts: List[List[int]]
    sampling: Dict[str, Any]
    should_stop: Optional[StopCheck] = None
    request_ids: List[int] = field(default_factory=list)
    cancelled: bool = False
    progress: queue.Queue[Tuple[Any, ...]] = field(default_factory=queue.Queue)  # what the loop publishes

    def cancel(self) -> None:
        """The client left (or its stream ended): unfinished prompts are aborted at the next step."""
        self.cancelled = True

    def events(self) -> Iterator[Tuple[int, Any, bool]]:
        remaining = len(self.prompts)
        while remaining:
            event = self.progress.get()
            if event[0] == "error":
                raise GenerationFailed(event[1], event[2])
            remaining -= event[2]
            yield event

    def results(self) -> List[Any]:
        """Every prompt's final result, in order (waits for the last one)."""
        final: Dict[int, Any] = {}
        for index, result, finished in self.events():
            if finished:
                final[index] = result
        return [final[i] for i in range(len(self.prompts))]


def apply_step(engine: Any, command: Dict[str, Any]) -> Dict[int, Any]:
    """What every rank does with a step command: abort, add, one forward step. Returns the added requests."""
    for request_id in command["abort"]:
        engine.abort_request(request_id)
    added = {}
    for request_id, prompt, sampling in command["add"]:
        added[request_id] = engine.add_request(request_id, prompt, SamplingParams(**sampling))
    engine.step()
    return added


def follow_engine(engine: Any) -> int:
    """A follower rank's loop: every step command until the stop. Returns how many steps it ran."""
    steps = 0
    while True:
        command = broadcast_command()
        if command["op"] == STOP:
            return steps
        if command["op"] == STEP:
            steps += 1
            _, failure = run_and_agree(functools.partial(apply_step, engine, command))
            if failure is not None:
                engine.reset()


class EngineLoop:
    """Rank 0's engine thread and the queue in front of it.

    Args:
        engine: the ``DynamicInferenceEngine`` (``add_request``/``abort_request``/``step``/``reset``).
        heartbeat_s: longest silence towards the followers while idle.
        max_queued_requests: prompts accepted and not finished, at most; more are answered 503.
    """

    def __init__(self, engine: Any, heartbeat_s: float, max_queued_requests: int) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.max_queued_requests = max_queued_requests
        self.inbox: queue.Queue[Submission] = queue.Queue()
        self.in_flight: Dict[int, Tuple[Submission, int, Any]] = {}  # request id -> (submission, index, request)
        self._accepted = 0
        self._count = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Refuse new requests, finish those in flight, stop the followers."""
        self._stopping.set()
        self._thread.join()

    def submit(self, prompts: List[List[int]], sampling: Dict[str, Any], should_stop: Optional[StopCheck] = None):
        """Queue ``prompts``. Raises ValueError for a request the engine refuses, ``GenerationFailed`` (503)
        when the queue is full or the server is stopping."""
        for k, prompt in enumerate(prompts):
            self.engine.check_request(-1, prompt, SamplingParams(**request_sampling(sampling, k)))
        with self._count:
            if self._stopping.is_set():
                raise GenerationFailed(OVERLOAD, "the server is stopping")
            if self._accepted + len(prompts) > self.max_queued_requests:
                raise GenerationFailed(
                    OVERLOAD,
                    f"the server holds {self._accepted} prompts in flight; {len(prompts)} more would exceed "
                    f"--max-queued-requests={self.max_queued_requests}; retry later",
                )
            self._accepted += len(prompts)
        submission = Submission([list(p) for p in prompts], dict(sampling), should_stop)
        self.inbox.put(submission)
        return submission

    def generate(self, prompts: List[List[int]], sampling: Dict[str, Any]) -> List[Any]:
        """Queue and wait: the service's ``generate``."""
        return self.submit(prompts, sampling).results()

    def _run(self) -> None:
        while not (self._stopping.is_set() and not self.in_flight and self.inbox.empty()):
            command = self._next_command()
            if command is None:
                broadcast_command({"op": NOOP})
                continue
            broadcast_command(command)
            added, failure = run_and_agree(functools.partial(apply_step, self.engine, command))
            if failure is not None:
                self.engine.reset()
                self._fail_all(*failure)
            else:
                self._publish(added)
        broadcast_command({"op": STOP})

    def _arrivals(self) -> List[Submission]:
        """What is queued; while nothing is in flight, waits for it up to ``heartbeat_s`` (or the stop)."""
        arrived: List[Submission] = []
        deadline = time.monotonic() + self.heartbeat_s
        while not arrived and not self.in_flight:
            try:
                arrived.append(self.inbox.get(timeout=0.2))
            except queue.Empty:
                if self._stopping.is_set() or time.monotonic() >= deadline:
                    return arrived
        while not self.inbox.empty():
            arrived.append(self.inbox.get_nowait())
        return arrived

    def _next_command(self) -> Optional[Dict[str, Any]]:
        """The next step's command (new requests, requests to abort), or None after an idle heartbeat period."""
        add = []
        for submission in self._arrivals():
            for k, prompt in enumerate(submission.prompts):
                request_id = next(self._ids)
                submission.request_ids.append(request_id)
                self.in_flight[request_id] = (submission, k, None)
                add.append((request_id, prompt, request_sampling(submission.sampling, k)))
        if not self.in_flight:
            return None
        return {"op": STEP, "add": add, "abort": self._to_abort()}

    def _to_abort(self) -> List[int]:
        """Requests to stop: a stop string appeared, or the client left."""
        aborted = []
        for request_id, (submission, index, request) in self.in_flight.items():
            if request is None or request.finished:
                continue
            stop = submission.should_stop is not None and submission.should_stop(index, request.generated_tokens)
            if stop or submission.cancelled:
                aborted.append(request_id)
        return aborted

    def _publish(self, added: Dict[int, Any]) -> None:
        """Every in-flight request's progress to its submission; finished ones leave."""
        for request_id, (submission, index, request) in list(self.in_flight.items()):
            request = request or added[request_id]
            self.in_flight[request_id] = (submission, index, request)
            submission.progress.put((index, request.result(), request.finished))
            if request.finished:
                del self.in_flight[request_id]
                with self._count:
                    self._accepted -= 1

    def _fail_all(self, status: int, message: str) -> None:
        for submission, _, _ in {id(s): (s, i, r) for s, i, r in self.in_flight.values()}.values():
            submission.progress.put(("error", status, message))
        with self._count:
            self._accepted -= len(self.in_flight)
        self.in_flight.clear()
