"""Rank 0 leads, the other ranks follow: every engine step is a broadcast command then a collective call.

Commands are plain dicts sent with ``broadcast_object_list`` over the world group (``engine_loop.py`` sends
them): ``{"op": "step", ...}``, ``{"op": "noop"}`` (a heartbeat that keeps idle followers inside the
process-group timeout) and ``{"op": "stop"}`` (every rank leaves its loop). After each step every rank,
failed or not, sends its outcome to all (``agree``: one ``all_gather_object``), so a follower's failure
reaches rank 0, which answers with the most serious one (``errors.worst``), and every rank leaves the step
in step, ready for the next command.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from tools.text_generation.errors import describe, is_out_of_memory, status_of, worst

logger = logging.getLogger(__name__)

NOOP, STOP = "noop", "stop"


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
