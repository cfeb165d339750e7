"""Asynchronous saves: the same bytes as a synchronous save, published only after every rank's write.

One 2-rank group runs every check (``_body``):
- a staged save taken from tensors that training then changes writes the bytes a synchronous save of
  the original tensors writes (every file; ``.metadata`` up to DCP's per-save id, see ``checkpoint_content``);
- while one rank's write is held back, no rank publishes (``metadata.json``, the caller's tracker step)
  and a non-blocking finalization returns nothing on both ranks;
- a second request scheduled while the first is in flight starts writing only after the first was
  finalized (who waits before whom, recorded in order);
- a write failing on one rank raises on every rank and its finalize steps never run.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import METADATA_FILE, CheckpointingError, ShardedTensor, read_metadata, save
from megatron.core.dist_checkpointing.async_save import AsyncCallsQueue, AsyncRequest
from tests.dist_harness import run_distributed


def _state(rank: int) -> Dict[str, ShardedTensor]:
    """Row ``rank`` of a [2, 64] weight and a replicated bias written by rank 0."""
    gen = torch.Generator().manual_seed(7 + rank)
    weight = torch.randn(1, 64, generator=gen)
    bias = torch.arange(5, dtype=torch.float32)
    return {
        "w": ShardedTensor.from_global("w", weight, (2, 64), (rank, 0)),
        "b": ShardedTensor.from_global("b", bias, (5,), (0,), replica_id=rank),
    }


def checkpoint_content(directory: str, unequal: tuple = ()) -> Dict[str, object]:
    """Every file's bytes, except that DCP's ``.metadata`` is compared without its ``storage_meta`` (the
    directory's path and a random save id, different for any two saves) and ``metadata.json`` without
    the checksums of ``.metadata`` and of the files named in ``unequal``."""
    out: Dict[str, object] = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    metadata = read_metadata(directory)
    out[".metadata"] = (metadata.state_dict_metadata, metadata.storage_data, metadata.planner_data)
    table = json.loads(out[METADATA_FILE])
    for name in (".metadata", *unequal):
        del table["checksums"]["files"][name]
    out[METADATA_FILE] = table
    return out


def _same_bytes(rank: int, tmp: str) -> None:
    sync_dir, async_dir = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
    save(_state(rank), sync_dir)
    state = _state(rank)
    staged = save(state, async_dir, async_sharded_save=True)
    for spec in state.values():  # the next training step changes the tensors in place
        spec.data.add_(1.0)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(staged.write, [staged.finalize]))
    queue.close()
    if rank == 0:
        assert checkpoint_content(sync_dir) == checkpoint_content(async_dir)


def _publishes_after_every_write(rank: int, tmp: str) -> List[str]:
    directory, events = os.path.join(tmp, "held"), []
    staged = save(_state(rank), directory, async_sharded_save=True)
    gate = threading.Event()

    def write() -> None:
        if rank == 1:
            gate.wait(60)
        staged.write()

    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(AsyncRequest(write, [staged.finalize, lambda: events.append("tracker")]))
    for _ in range(3):  # rank 0's write is long done; rank 1's is held: nobody publishes
        assert queue.maybe_finalize_async_calls(blocking=False) == []
        dist.barrier()
    assert not os.path.exists(os.path.join(directory, METADATA_FILE)) and events == []
    gate.set()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert os.path.exists(os.path.join(directory, METADATA_FILE)) and events == ["tracker"]
    queue.close()
    return events


def _second_waits_for_first(rank: int, tmp: str) -> List[str]:
    events: List[str] = []
    queue = AsyncCallsQueue()
    stages = [save(_state(rank), os.path.join(tmp, f"seq{i}"), async_sharded_save=True) for i in range(2)]

    def slow_write() -> None:
        threading.Event().wait(0.5)
        events.append("write 0")
        stages[0].write()

    def write_second() -> None:
        events.append("write 1")
        stages[1].write()

    queue.schedule_async_request(AsyncRequest(slow_write, [stages[0].finalize, lambda: events.append("publish 0")]))
    queue.schedule_async_request(AsyncRequest(write_second, [stages[1].finalize, lambda: events.append("publish 1")]))
    queue.close()
    return events


def _failure_everywhere(rank: int, tmp: str) -> List[str]:
    events: List[str] = []
    staged = save(_state(rank), os.path.join(tmp, "fail"), async_sharded_save=True)

    def write() -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")
        staged.write()

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(write, [staged.finalize, lambda: events.append("tracker")]))
    with pytest.raises(CheckpointingError, match="No space left"):
        queue.close()
    assert not os.path.exists(os.path.join(tmp, "fail", METADATA_FILE))
    return events


def _body(rank: int, world: int, tmp: str) -> Dict[str, List[str]]:
    _same_bytes(rank, tmp)
    return {
        "held": _publishes_after_every_write(rank, tmp),
        "order": _second_waits_for_first(rank, tmp),
        "failed": _failure_everywhere(rank, tmp),
    }


def test_async_save_bytes_order_and_failures(tmp_path):
    for rank_events in run_distributed(_body, 2, str(tmp_path), timeout=120):
        assert rank_events["held"] == ["tracker"]
        assert rank_events["order"] == ["write 0", "publish 0", "write 1", "publish 1"]
        assert rank_events["failed"] == []
