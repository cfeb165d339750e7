"""Error agreement of a collective save or load, bounded by the group's timeout.

Before any collective of a save or load, every rank tells the others whether it
failed (``agree_on_error``: one ``all_gather_object``). A rank that never arrives
(it raised earlier, or hangs) must not leave its peers waiting forever: the gather
ends with the group's collective timeout (or at once when the peer's process is
gone), and the error then names the ranks that did not arrive. For that each rank
announces itself in the key-value store before the gather. The announcement is
advisory: a rank whose store write fails (a full disk under a file store) still
takes part in the gather, so the agreement itself never depends on the store.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointingError

logger = logging.getLogger(__name__)
_KEY_PREFIX = "megatron_agreement"
_SEQUENCE: Dict[str, int] = {}  # group name -> agreements this rank has entered on it


def group_timeout(process_group: Optional[dist.ProcessGroup]) -> timedelta:
    """The collective timeout of ``process_group`` (None: the world), as its backend was created with."""
    group = process_group or dist.group.WORLD
    backend = group._get_backend(torch.device(group._device_types[0]))
    return backend.options._timeout


def _announce(group: dist.ProcessGroup) -> Tuple[List[int], List[str]]:
    """Mark this rank as arrived at the group's next agreement; returns the group's ranks and their keys."""
    name = dist.distributed_c10d._get_process_group_name(group)
    sequence = _SEQUENCE.get(name, 0)
    _SEQUENCE[name] = sequence + 1
    ranks = dist.get_process_group_ranks(group)
    keys = [f"{_KEY_PREFIX}/{name}/{sequence}/{rank}" for rank in ranks]
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    try:
        store.set(keys[ranks.index(me)], b"1")
        if sequence:  # every rank finished the previous agreement, so nobody reads its key any more
            store.delete_key(f"{_KEY_PREFIX}/{name}/{sequence - 1}/{me}")
    except (RuntimeError, OSError) as e:
        logger.warning("rank %d could not announce itself for the checkpoint agreement: %s", me, e)
    return ranks, keys


def _absent(ranks: List[int], keys: List[str], limit: timedelta) -> List[int]:
    """The ranks that have not announced themselves, after waiting for them at most ``limit``."""
    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait(keys, limit)
    except RuntimeError:  # the store's timeout (DistStoreError, or a plain RuntimeError from FileStore)
        pass  # those still missing are the answer
    return [rank for rank, key in zip(ranks, keys) if not store.check([key])]


def agree_on_error(error: Optional[str], process_group: Optional[dist.ProcessGroup]) -> None:
    """Raise on every rank if any rank found an error (each rank's message is kept).

    Raises:
        CheckpointingError: a rank reported an error; or the gather failed (a rank did not
            arrive within the group's timeout, or its process ended): names the absent ranks.
    """
    if not dist.is_initialized():
        if error:
            raise CheckpointingError(error)
        return
    group = process_group or dist.group.WORLD
    ranks, keys = _announce(group)
    messages: List[Optional[str]] = [None] * dist.get_world_size(process_group)
    try:
        dist.all_gather_object(messages, error, group=process_group)
    except RuntimeError as e:
        limit = group_timeout(process_group)
        missing = _absent(ranks, keys, limit)
        who = f"rank(s) {missing} did not reach it within {limit} (they failed or hung before it)"
        raise CheckpointingError(
            f"the checkpoint's error agreement failed on rank {dist.get_rank()}: "
            f"{who if missing else 'every rank had arrived'}: {e}"
        ) from e
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg]
    if failed:
        raise CheckpointingError(error or f"rank {failed[0][0]} of the group failed: {failed[0][1]}")
