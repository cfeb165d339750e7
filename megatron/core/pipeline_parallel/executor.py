"""Runs a pipeline schedule table: the ops of ``schedule_table.rank_slots`` with the
point-to-point batches of ``schedule_table.comm_plan`` between them.

``schedules.forward_backward_pipelining_without_interleaving`` (1F1B) and
``schedules.forward_backward_pipelining_with_interleaving`` (one model chunk per virtual
stage) are the same executor on different tables.

With ``config.overlap_p2p_comm`` (Megatron: interleaved schedule only) each batch is posted
before its slot and not waited for: an op waits for its own input when it starts, so in a
steady (forward, backward) slot the backward's gradient arrives during the forward, and a
slot's sends travel during the next slot's compute (waited for before the next batch is posted).
The posting order is the blocking plan's, which ``schedule_table.check_comm_plan`` proves
deadlock-free.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.pipeline_parallel import schedule_table as st
from megatron.core.pipeline_parallel.microbatch import (
    ScheduleArgs,
    as_chunk_list,
    as_iterator_list,
    context_parallel_group,
    deallocate_output,
    finalize_grads,
    get_model_config,
    run_backward,
    run_forward,
)
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, activation_shape, wait_all
from megatron.core.quantization.step import quantized_step

Key = Tuple[str, int, int]


class _GradSyncGate:
    """Holds ``config.no_sync_func`` open until a chunk's last backward.

    A list of functions (one per chunk) is released chunk by chunk; a single function
    for all chunks is released before the rank's last backward.
    """

    def __init__(self, config: Any, num_chunks: int, enabled: bool) -> None:
        funcs = config.no_sync_func if enabled else None
        if funcs is None:
            funcs = []
        elif not isinstance(funcs, (list, tuple)):
            funcs = [funcs]
        self.per_chunk = len(funcs) == num_chunks and num_chunks > 1
        self.stacks = [contextlib.ExitStack() for _ in funcs]
        for stack, func in zip(self.stacks, funcs):
            stack.enter_context(func())

    def before_last_backward(self, chunk: int, last_on_rank: bool) -> None:
        for index, stack in enumerate(self.stacks):
            if (index == chunk) if self.per_chunk else last_on_rank:
                stack.close()


class _InFlight:
    """The works of one posted batch, waited for once."""

    def __init__(self, works: List[Any]) -> None:
        self.works: Optional[List[Any]] = works

    def wait(self) -> None:
        if self.works is not None:
            wait_all(self.works)
            self.works = None


class _PipelineRun:
    """State of one call: tensors in flight, saved activations, reporting store."""

    def __init__(
        self,
        chunks: List[torch.nn.Module],
        iterators: List[Any],
        config: Any,
        comm: P2PCommunicator,
        forward_step_func: Callable,
        num_microbatches: int,
        forward_only: bool,
        collect_non_loss_data: bool,
    ) -> None:
        self.chunks, self.iterators, self.config, self.comm = chunks, iterators, config, comm
        self.forward_step_func, self.num_microbatches = forward_step_func, num_microbatches
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.pp_size, self.rank = len(comm.ranks), comm.rank_in_group
        self.vp_size = len(chunks)
        self.outbox: Dict[Key, torch.Tensor] = {}
        self.inbox: Dict[Key, torch.Tensor] = {}
        self.saved: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.store: List[Any] = []
        self.total_tokens = torch.tensor(0, dtype=torch.int)
        self.released = 0  # stage outputs whose storage was freed after sending
        self.cp_group = None  # the context-parallel group when CP > 1 (set by run_schedule)
        # overlap_p2p_comm (Megatron: the interleaved schedule only): transfers waited for where consumed.
        self.overlap = bool(getattr(config, "overlap_p2p_comm", False)) and self.vp_size > 1
        self.pending: Dict[Key, _InFlight] = {}  # received tensor -> its batch, until an op takes it
        self.sending: Optional[Tuple[_InFlight, List[torch.Tensor]]] = None  # the last batch, its sent outputs

    def exchange(self, batch: List[st.Msg]) -> None:
        """Post one batch of the communication plan and file the received tensors.

        Blocking: wait for the whole batch here. ``overlap``: the previous batch's sends are finished
        first (its receives were consumed by the slot in between), this batch is posted and left in
        flight; each received tensor is waited for where an op takes it (``_take``), its sends at the
        next batch."""
        self.finish_sends()
        send_msgs = [m for m in batch if m.action == "send"]
        sends = [(self.outbox.pop(m.key), self.comm.global_rank(m.peer)) for m in send_msgs]
        recv_msgs = [m for m in batch if m.action == "recv"]
        received, works = self.comm.post(sends, [(self.comm.global_rank(m.peer), None) for m in recv_msgs])
        in_flight = _InFlight(works)
        for msg, tensor in zip(recv_msgs, received):
            self.inbox[msg.key] = tensor
            self.pending[msg.key] = in_flight
        self.sending = (in_flight, [t for m, (t, _) in zip(send_msgs, sends) if m.key[0] == st.FORWARD])
        if not self.overlap:
            self.finish_sends()

    def finish_sends(self) -> None:
        """Wait for the last batch posted; then free the sent outputs' storage (backward only needs
        their graph nodes) when ``deallocate_pipeline_outputs``."""
        if self.sending is None:
            return
        in_flight, forward_outputs = self.sending
        self.sending = None
        in_flight.wait()
        if self.config.deallocate_pipeline_outputs and not self.forward_only:
            for tensor in forward_outputs:
                self.released += deallocate_output(tensor)

    def _take(self, key: Key) -> torch.Tensor:
        """A received tensor, waited for now (under ``overlap`` it may still be in flight)."""
        in_flight = self.pending.pop(key, None)
        if in_flight is not None:
            in_flight.wait()
        return self.inbox.pop(key)

    def _stage(self, op: st.Op) -> Tuple[int, bool, bool]:
        stage = op.chunk * self.pp_size + self.rank
        return stage, stage == 0, stage == self.pp_size * self.vp_size - 1

    def forward(self, op: st.Op) -> None:
        stage, first, last = self._stage(op)
        input_tensor = None
        if not first:
            input_tensor = self._take((st.FORWARD, op.microbatch, stage - 1))  # [s, b, h]
            input_tensor.requires_grad_(not self.forward_only)
        with torch.set_grad_enabled(not self.forward_only):
            output, tokens = run_forward(
                self.forward_step_func,
                self.iterators[op.chunk],
                self.chunks[op.chunk],
                self.num_microbatches,
                input_tensor,
                self.store,
                self.config,
                is_last_stage=last,
                collect_non_loss_data=self.collect_non_loss_data,
                cp_group=self.cp_group,
            )
        self.total_tokens = self.total_tokens + tokens
        if not last:
            self.outbox[(st.FORWARD, op.microbatch, stage)] = output
        if not self.forward_only:
            self.saved[(op.microbatch, op.chunk)] = (input_tensor, output)

    def backward(self, op: st.Op) -> None:
        stage, first, last = self._stage(op)
        input_tensor, output = self.saved.pop((op.microbatch, op.chunk))
        grad = None if last else self._take((st.BACKWARD, op.microbatch, stage + 1))
        input_grad = run_backward(input_tensor, output, grad, self.config)
        if not first:
            self.outbox[(st.BACKWARD, op.microbatch, stage)] = input_grad


def _last_backward_per_chunk(slots: List[List[st.Op]]) -> Dict[st.Op, bool]:
    """Each chunk's last backward op on this rank -> whether it is the rank's last backward."""
    backwards = [op for slot in slots for op in slot if op.kind == st.BACKWARD]
    last: Dict[int, st.Op] = {op.chunk: op for op in backwards}
    return {op: op == backwards[-1] for op in last.values()}


def run_schedule(call: ScheduleArgs) -> List[Any]:
    """Execute this rank's slots of the (interleaved) 1F1B table with p2p transfers between them.

    Returns:
        The reporting dicts of ``loss_func`` (one per microbatch) on the last stage, ``[]`` elsewhere.
    """
    chunks = as_chunk_list(call.model)
    groups = call.groups
    config = get_model_config(chunks)
    pp_size, rank = groups.size_of("pp"), groups.rank_in("pp")
    num_microbatches, forward_only = call.num_microbatches, call.forward_only
    comm = P2PCommunicator(
        groups.pp,
        groups.ranks["pp"],
        activation_shape(call.seq_length, call.micro_batch_size, config, groups),
        config.pipeline_dtype,
        variable_shapes=bool(getattr(config, "variable_seq_lengths", False)),
    )
    run = _PipelineRun(
        chunks,
        as_iterator_list(call.data_iterator, len(chunks)),
        config,
        comm,
        call.forward_step_func,
        num_microbatches,
        forward_only,
        call.collect_non_loss_data,
    )
    run.cp_group = context_parallel_group(config, groups)
    slots = st.rank_slots(rank, pp_size, num_microbatches, len(chunks), forward_only)
    plan = st.comm_plan(slots, rank, pp_size, len(chunks))
    gate = _GradSyncGate(config, len(chunks), enabled=not forward_only)
    last_backward = _last_backward_per_chunk(slots) if not forward_only else {}
    with quantized_step(chunks):  # FP8: weights quantized once, amax reductions batched
        for batch, slot in zip(plan, slots):
            run.exchange(batch)
            for op in slot:
                if op.kind == st.FORWARD:
                    run.forward(op)
                    continue
                if op in last_backward:
                    gate.before_last_backward(op.chunk, last_backward[op])
                run.backward(op)
        run.exchange(plan[-1])
        run.finish_sends()
        if not forward_only:
            finalize_grads(config, chunks, run.total_tokens)
    return run.store if rank == pp_size - 1 else []
