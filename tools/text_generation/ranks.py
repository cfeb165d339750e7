"""Rank 0 leads, the other ranks follow: every generation is a broadcast command then a collective call.

Commands are plain dicts sent with ``broadcast_object_list`` over the world group:
``{"op": "generate", "prompts": ..., "sampling": ...}``, ``{"op": "noop"}`` (a heartbeat that keeps
idle followers inside the process-group timeout) and ``{"op": "stop"}`` (every rank leaves its loop).
After each generation every rank, failed or not, sends its outcome to all (``agree``: one
``all_gather_object``), so a follower's failure reaches rank 0, which answers with the most serious
one (``errors.worst``), and every rank leaves the request in step, ready for the next command.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tools.text_generation.errors import OVERLOAD, GenerationFailed, describe, is_out_of_memory, status_of, worst

logger = logging.getLogger(__name__)

GENERATE, NOOP, STOP = "generate", "noop", "stop"


def broadcast_command(command: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Rank 0 sends ``command``; every other rank receives and returns it. Without torch.distributed, a no-op."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return command or {"op": NOOP}
    box: List[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


Outcome = Tuple[Optional[int], str]  # (HTTP status of the failure or None, message)


def run_and_agree(run: Callable[[], Any]) -> Tuple[Any, Optional[Outcome]]:
    """``run()`` on this rank, then every rank's outcome exchanged: (this rank's result, worst failure or None)."""
    result, outcome = None, (None, "")
    try:
        result = run()
    except Exception as err:  # noqa: BLE001 - every failure must reach the other ranks, not end this one
        rank = dist.get_rank() if dist.is_initialized() else None
        logger.warning("generation failed on rank %s: %s: %s", rank, type(err).__name__, err)
        outcome = (status_of(err), describe(err, rank))
        if is_out_of_memory(err) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed request's cached blocks, back for the next one
    return result, worst(agree(outcome))


def agree(outcome: Outcome) -> List[Outcome]:
    """Every rank's outcome, in rank order (a collective: every rank calls it after each generation)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome]
    outcomes: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    return [tuple(o) for o in outcomes]


class Leader:
    """Rank 0's side: generate on all ranks, heartbeats while idle, the final stop.

    Args:
        run_generation: ``(prompts, sampling kwargs) -> results``, the collective engine call.
        lock: the lock requests hold; heartbeats and the stop take it too.
        heartbeat_s: seconds between heartbeats (well under the process-group timeout).
    """

    def __init__(self, run_generation: Callable[[List[List[int]], Dict[str, Any]], Sequence[Any]], lock, heartbeat_s):
        self.run_generation = run_generation
        self.lock = lock
        self.heartbeat_s = heartbeat_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._heartbeats, name="generation-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def generate(self, prompts: List[List[int]], sampling: Dict[str, Any]) -> Sequence[Any]:
        """Called with ``lock`` held (by the app): tells the followers, then generates alongside them.

        Raises :class:`GenerationFailed` with the most serious failure of any rank (every rank is past
        the request by then), or with 503 once the server is stopping.
        """
        if self._stopped.is_set():
            raise GenerationFailed(OVERLOAD, "the server is stopping")
        broadcast_command({"op": GENERATE, "prompts": prompts, "sampling": sampling})
        results, failure = run_and_agree(lambda: self.run_generation(prompts, sampling))
        if failure is not None:
            raise GenerationFailed(*failure)
        return results

    def stop(self) -> None:
        """Stops the heartbeats and tells the followers to leave their loop."""
        self._stopped.set()
        with self.lock:
            broadcast_command({"op": STOP})
        self._thread.join(timeout=self.heartbeat_s + 5)

    def _heartbeats(self) -> None:
        while not self._stopped.wait(self.heartbeat_s):
            with self.lock:
                if not self._stopped.is_set():
                    broadcast_command({"op": NOOP})


def follow(run_generation: Callable[[List[List[int]], Dict[str, Any]], Sequence[Any]]) -> int:
    """A follower rank's loop: run each broadcast generation until the stop command. Returns how many ran."""
    served = 0
    while True:
        command = broadcast_command()
        if command["op"] == STOP:
            return served
        if command["op"] == GENERATE:
            served += 1
            run_and_agree(functools.partial(run_generation, command["prompts"], command["sampling"]))
