"""Say why a checkpoint write failed: a full disk, a quota, the file-size limit, or another I/O error.

torch's serializer reports a failed write as ``[enforce fail at inline_container.cc] unexpected
pos``; DCP wraps it again in a ``CheckpointException`` (a ``BaseException``) and drops the
``OSError`` behind it. ``describe_write_failure`` looks through the whole chain for an errno and
adds what the file system and the process limits say, so the message names the cause and the
directory instead.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from typing import Iterator, Optional, Set

from torch.distributed.checkpoint.api import CheckpointException

DISK_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full
WRITE_FAILURES = (OSError, RuntimeError, CheckpointException)  # what a failed save raises


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and every rank's failure inside a DCP ``CheckpointException``."""
    seen: Set[int] = set()
    todo = [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            todo += [failure[0] for failure in current.failures.values()]


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path or "."


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(_existing(os.path.abspath(path))).free
    except OSError:
        return None


def describe_write_failure(err: BaseException, directory: str) -> str:
    """One line: which checkpoint directory could not be written, and the likeliest cause."""
    codes = {e.errno for e in exception_chain(err) if isinstance(e, OSError) and e.errno is not None}
    free = _free_bytes(directory)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    space = f"{free} bytes free on its file system" if free is not None else "free space unknown"
    if errno.ENOSPC in codes or (free is not None and free < DISK_FULL_BYTES):
        cause = f"the disk is full (ENOSPC; {space})"
    elif errno.EDQUOT in codes:
        cause = f"the disk quota is exceeded (EDQUOT; {space})"
    elif errno.EFBIG in codes or limit != resource.RLIM_INFINITY:
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        cause = f"a file reached the maximum file size (EFBIG; ulimit -f / RLIMIT_FSIZE is {shown}; {space})"
    else:
        cause = f"a write failed ({space})"
    return f"cannot write checkpoint {directory}: {cause}: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    """The most telling error of the chain: an OSError, else the first that is not DCP's wrapper."""
    chain = list(exception_chain(err))
    shown = next((e for e in chain if isinstance(e, OSError)), None) or next(
        (e for e in chain if not isinstance(e, CheckpointException)), err
    )
    text = str(shown).strip()
    return f"{type(shown).__name__}: {text.splitlines()[0] if text else ''}"
