"""Error agreement of a collective save or load, with a deadline.

Before any collective of a save or load, every rank tells the others whether it
failed (``agree_on_error``). A rank that never arrives (it raised earlier, or
hangs) must not leave its peers waiting forever: each rank first announces
itself in the process group's key-value store and waits for the others, at most
the group's collective timeout, then raises naming the ranks that did not come.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointingError

_KEY_PREFIX = "megatron_agreement"
_SEQUENCE: Dict[str, int] = {}  # group name -> agreements this rank has entered on it


def group_timeout(process_group: Optional[dist.ProcessGroup]) -> timedelta:
    """The collective timeout of ``process_group`` (None: the world), as its backend was created with."""
    group = process_group or dist.group.WORLD
    backend = group._get_backend(torch.device(group._device_types[0]))
    return backend.options._timeout


def wait_for_peers(process_group: Optional[dist.ProcessGroup], timeout: Optional[timedelta] = None) -> None:
    """Announce this rank and wait for every rank of the group to do the same.

    Args:
        process_group: the group (None: the world); every member must call in the same order.
        timeout: how long to wait (None: the group's collective timeout).

    Raises:
        CheckpointingError: some ranks did not arrive in time; names them (global ranks).
    """
    group = process_group or dist.group.WORLD
    name = dist.distributed_c10d._get_process_group_name(group)
    sequence = _SEQUENCE.get(name, 0)
    _SEQUENCE[name] = sequence + 1
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group)
    keys = [f"{_KEY_PREFIX}/{name}/{sequence}/{rank}" for rank in ranks]
    me = dist.get_rank()
    store.set(keys[ranks.index(me)], b"1")
    limit = timeout or group_timeout(process_group)
    try:
        store.wait(keys, limit)
    except RuntimeError:  # the store's timeout (DistStoreError, or a plain RuntimeError from FileStore)
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        if not missing:
            raise
        raise CheckpointingError(
            f"rank(s) {missing} did not reach the checkpoint's error agreement within {limit} "
            f"(they failed or hung before it); waiting rank {me}"
        ) from None
    if sequence:  # every rank has arrived here, so none still waits on its previous key
        store.delete_key(f"{_KEY_PREFIX}/{name}/{sequence - 1}/{me}")


def agree_on_error(
    error: Optional[str], process_group: Optional[dist.ProcessGroup], timeout: Optional[timedelta] = None
) -> None:
    """Raise on every rank if any rank found an error (each rank's message is kept).

    Ranks that do not arrive within ``timeout`` (None: the group's collective timeout) are
    named in the error instead of leaving the others waiting (see ``wait_for_peers``).
    """
    if not dist.is_initialized():
        if error:
            raise CheckpointingError(error)
        return
    wait_for_peers(process_group, timeout)
    messages: List[Optional[str]] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(messages, error, group=process_group)
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg]
    if failed:
        raise CheckpointingError(error or f"rank {failed[0][0]} of the group failed: {failed[0][1]}")
