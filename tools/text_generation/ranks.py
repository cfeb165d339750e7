"""Rank 0 leads, the other ranks follow: every generation is a broadcast command then a collective call.

Commands are plain dicts sent with ``broadcast_object_list`` over the world group:
``{"op": "generate", "prompts": ..., "sampling": ...}``, ``{"op": "noop"}`` (a heartbeat that keeps
idle followers inside the process-group timeout) and ``{"op": "stop"}`` (every rank leaves its loop).
The engine's ``ValueError`` is raised on every rank alike: followers log it and wait for the next command.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

GENERATE, NOOP, STOP = "generate", "noop", "stop"


def broadcast_command(command: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Rank 0 sends ``command``; every other rank receives and returns it. Without torch.distributed, a no-op."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return command or {"op": NOOP}
    box: List[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        """Called with ``lock`` held (by the app): tells the followers, then generates alongside them."""
        broadcast_command({"op": GENERATE, "prompts": prompts, "sampling": sampling})
        return self.run_generation(prompts, sampling)

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
            try:
                run_generation(command["prompts"], command["sampling"])
            except ValueError as err:  # rank 0 raised the same error and answered 400
                logger.info("generation refused on this rank too: %s", err)
