"""How a failure while serving a request becomes one HTTP status.

400: the request's fault (``ValueError``, as the engine's own checks raise); 503: out of memory or
overload (retrying later or with less may succeed); 500: anything else (a bug). Every rank classifies
its own failure the same way, and the ranks agree on the worst one (``ranks.agree``).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

BAD_INPUT, OVERLOAD, FAILED = 400, 503, 500
# When ranks disagree, the answer is the most serious failure: a bug over a resource shortage over bad input.
SEVERITY = (FAILED, OVERLOAD, BAD_INPUT)
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class GenerationFailed(Exception):
    """A request that failed on some rank: ``status`` (400/500/503) and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def is_out_of_memory(err: BaseException) -> bool:
    """Python's ``MemoryError``, torch's ``OutOfMemoryError`` or an allocator's "can't allocate memory"."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in OUT_OF_MEMORY_WORDS)


def status_of(err: BaseException) -> int:
    """The HTTP status a failure of serving a request is answered with."""
    if isinstance(err, GenerationFailed):
        return err.status
    if is_out_of_memory(err):
        return OVERLOAD
    if isinstance(err, ValueError):
        return BAD_INPUT
    return FAILED


def describe(err: BaseException, rank: Optional[int] = None) -> str:
    """The client's message: what failed (and where, for an internal error), never a traceback."""
    if isinstance(err, GenerationFailed):  # already described by the rank that failed
        return str(err)
    status = status_of(err)
    where = "" if rank is None else f" on rank {rank}"
    if status == OVERLOAD:
        return f"out of memory{where} while generating; retry later or with fewer or shorter prompts ({err})"
    if status == FAILED:
        return f"internal error{where}: {type(err).__name__}: {err}"
    return str(err)


def worst(statuses_and_messages: Iterable[Tuple[Optional[int], str]]) -> Optional[Tuple[int, str]]:
    """The most serious ``(status, message)`` of the ranks' outcomes (``None`` when all succeeded)."""
    failed = [(s, m) for s, m in statuses_and_messages if s is not None]
    if not failed:
        return None
    return min(failed, key=lambda item: SEVERITY.index(item[0]))
