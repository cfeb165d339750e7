"""Asynchronous checkpoint saves: a background writer, and publication once every rank is done.

A save is split (``serialization.StagedSave``) into a collective plan taken on the training
thread together with a host snapshot of the tensors, a local ``write`` (the shard files, fsynced
and hashed) and a collective ``finalize`` (DCP's ``.metadata``, ``metadata.json``, then whatever
the caller adds: the tracker). ``AsyncCallsQueue`` (Megatron-core's name) runs each request's
``write`` on a writer thread and its ``finalize`` on the training thread, at a point where every
rank calls ``maybe_finalize_async_calls``: one all-reduce tells whether every rank's write has
finished, so nothing is published before all files of all ranks are durable. The writer thread
runs no collective: the training thread's collectives on the same groups never interleave with it.

A request scheduled while another is in flight first waits for that one (Megatron's behaviour
with its temporal worker): at most one save is written at a time and the order is kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.utils import comm_device

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """One asynchronous save.

    Attributes:
        write: this rank's local part (no collective), run on the writer thread. A failure it raises
            is raised on every rank by the finalization, before ``finalize`` runs.
        finalize: collective steps run on the training thread, in order, once every rank's ``write``
            has finished (publishing ``metadata.json``, then the tracker).
    """

    write: Callable[[], None]
    finalize: Sequence[Callable[[], None]] = ()
    call_idx: int = -1
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    started: float = 0.0
    write_seconds: float = 0.0


class AsyncCallsQueue:
    """Runs requests' writes in the background and finalizes them collectively, in order.

    Args:
        process_group: the ranks that agree on completion (None: the world); every one of them
            schedules the same requests and calls ``maybe_finalize_async_calls`` at the same points.
        persistent: one writer thread for the whole run (``--use-persistent-ckpt-worker``) instead of a
            thread started for each request.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, persistent: bool = False) -> None:
        self.process_group = process_group
        self.persistent = persistent
        self._pending: List[AsyncRequest] = []
        self._next_idx = 0
        self._jobs: Optional[queue.Queue] = None
        self._worker: Optional[threading.Thread] = None
        self.staging_buffers: Dict[Any, torch.Tensor] = {}
        """Host copies reused by the snapshots of successive saves (``serialization.stage_save``)."""

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start ``request.write`` in the background; returns its call index.

        Collective when a request is still in flight: that one is finished first (the new one waits).
        """
        if self._pending:
            logger.warning(
                "starting a checkpoint save while %d earlier one(s) are still being written: waiting for them "
                "(consider saving less often: CheckpointConfig.save_interval)",
                len(self._pending),
            )
            self.maybe_finalize_async_calls(blocking=True)
        request.call_idx, self._next_idx = self._next_idx, self._next_idx + 1
        request.started = time.time()
        self._pending.append(request)
        if self.persistent:
            self._persistent_worker().put(request)
        else:
            threading.Thread(target=_run, args=(request,), name=f"ckpt-writer-{request.call_idx}", daemon=True).start()
        return request.call_idx

    def _persistent_worker(self) -> queue.Queue:
        if self._worker is None:
            self._jobs = queue.Queue()
            self._worker = threading.Thread(target=_serve, args=(self._jobs,), name="ckpt-writer", daemon=True)
            self._worker.start()
        return self._jobs

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not yet finalized."""
        return len(self._pending)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, oldest first, every request whose write has finished on all ranks; returns their indices.

        Collective (one all-reduce per request looked at) unless ``no_dist``; ``blocking`` waits for
        every pending write first. Nothing happens, and no collective runs, when nothing is pending.
        """
        finalized = []
        while self._pending:
            request = self._pending[0]
            if blocking:
                request.done.wait()
            if not no_dist and not self._everyone_done(request):
                break
            if no_dist and not request.done.is_set():
                break
            self._pending.pop(0)
            self._finalize(request)
            finalized.append(request.call_idx)
        return finalized

    def _everyone_done(self, request: AsyncRequest) -> bool:
        flag = torch.tensor([int(request.done.is_set())], dtype=torch.int32, device=comm_device(self.process_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())

    def _finalize(self, request: AsyncRequest) -> None:
        error = None if request.error is None else f"checkpoint writer failed: {request.error!r}"
        agree_on_error(error, self.process_group)
        for step in request.finalize:
            step()

    def close(self) -> None:
        """Wait for every pending save and publish it (collective); stop the persistent writer."""
        self.maybe_finalize_async_calls(blocking=True)
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = self._jobs = None


def _run(request: AsyncRequest) -> None:
    started = time.time()
    try:
        request.write()
    except BaseException as e:  # noqa: BLE001 - raised on every rank when the request is finalized
        request.error = e
    finally:
        request.write_seconds = time.time() - started
        request.done.set()


def _serve(jobs: queue.Queue) -> None:
    while True:
        request = jobs.get()
        if request is None:
            return
        _run(request)
