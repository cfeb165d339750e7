"""Pipeline schedules as data: what each rank computes, in which order, and what it sends.

``schedule_table(p, m, v)`` lists, per pipeline rank, the ordered ``Op(kind, microbatch,
chunk)`` of 1F1B (``v == 1``) or interleaved 1F1B (``v > 1``). ``comm_plan`` derives the
point-to-point messages each rank exchanges before each op. Both are plain lists: they
can be printed, checked (``check_table``, ``check_comm_plan``) and timed
(``simulate``) without any process.

Virtual stages: chunk ``c`` of rank ``r`` is stage ``c * p + r`` of a pipeline of
``p * v`` stages, so activations flow r -> r+1 inside a chunk and from the last rank back
to rank 0 between chunks (Megatron's layout, see ``layer_layout``).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

FORWARD, BACKWARD = "F", "B"


class Op(NamedTuple):
    """One unit of work: forward or backward of ``microbatch`` through model ``chunk``."""

    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class Msg(NamedTuple):
    """A point-to-point transfer posted by one rank: ``send`` to or ``recv`` from ``peer``.

    ``key`` = (kind, microbatch, sending virtual stage) identifies the tensor on both sides.
    """

    action: str
    peer: int
    key: Tuple[str, int, int]


def validate_schedule_args(pp_size: int, num_microbatches: int, vp_size: int = 1) -> None:
    """Raise ValueError unless ``(p, m, v)`` can be scheduled."""
    for name, value in (
        ("pipeline_model_parallel_size", pp_size),
        ("num_microbatches", num_microbatches),
        ("virtual_pipeline_model_parallel_size", vp_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    if vp_size > 1 and num_microbatches % pp_size:
        raise ValueError(
            f"the interleaved pipeline schedule needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"pipeline_model_parallel_size ({pp_size}); change the global batch size or micro batch size"
        )


def _virtual_op(kind: str, k: int, pp_size: int, vp_size: int) -> Op:
    """The ``k``-th forward (or backward) of a rank: groups of ``p`` microbatches per chunk."""
    position = (k // pp_size) % vp_size
    chunk = position if kind == FORWARD else vp_size - 1 - position
    microbatch = (k // (pp_size * vp_size)) * pp_size + k % pp_size
    return Op(kind, microbatch, chunk)


def num_warmup_forwards(rank: int, pp_size: int, num_microbatches: int, vp_size: int = 1) -> int:
    """Forwards a rank runs before its first backward (1F1B: p - rank - 1)."""
    total = num_microbatches * vp_size
    if vp_size == 1:
        return min(pp_size - rank - 1, total)
    return min((pp_size - rank - 1) * 2 + (vp_size - 1) * pp_size, total)


def rank_slots(
    rank: int, pp_size: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False
) -> List[List[Op]]:
    """One rank's ops in communication slots; a slot's inputs are received, and the
    previous slot's outputs sent, in one batch.

    1F1B: one op per slot, so a forward's output leaves before the backward that follows
    it (Megatron's send_forward_recv_backward). Interleaved: warm-up forwards one by one,
    steady-state (forward, backward) pairs, cool-down backwards one by one; per-op slots
    would deadlock there (see the tests).
    """
    validate_schedule_args(pp_size, num_microbatches, vp_size)
    total = num_microbatches * vp_size
    fwd = [_virtual_op(FORWARD, k, pp_size, vp_size) for k in range(total)]
    if forward_only:
        return [[op] for op in fwd]
    bwd = [_virtual_op(BACKWARD, k, pp_size, vp_size) for k in range(total)]
    warmup = num_warmup_forwards(rank, pp_size, num_microbatches, vp_size)
    steady = [[fwd[warmup + k], bwd[k]] for k in range(total - warmup)]
    if vp_size == 1:
        steady = [[op] for pair in steady for op in pair]
    return [[op] for op in fwd[:warmup]] + steady + [[op] for op in bwd[total - warmup :]]


def rank_schedule(
    rank: int, pp_size: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False
) -> List[Op]:
    """The ordered ops of one rank: warm-up forwards, steady 1F1B pairs, cool-down backwards."""
    return [op for slot in rank_slots(rank, pp_size, num_microbatches, vp_size, forward_only) for op in slot]


def schedule_table(pp_size: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False) -> List[List[Op]]:
    """``table[rank]``: the ordered ops of every pipeline rank."""
    return [rank_schedule(r, pp_size, num_microbatches, vp_size, forward_only) for r in range(pp_size)]


def format_table(table: List[List[Op]]) -> str:
    """One line per rank, e.g. ``rank 0: F0 F1 B0 F2 B1 B2``."""
    return "\n".join(f"rank {r}: " + " ".join(str(op) for op in ops) for r, ops in enumerate(table))


# ----------------------------------------------------------------------------------
# Dependencies between ranks.
# ----------------------------------------------------------------------------------
def _stage(rank: int, chunk: int, pp_size: int) -> int:
    return chunk * pp_size + rank


def producer(op: Op, rank: int, pp_size: int, vp_size: int) -> Optional[Tuple[int, Op]]:
    """(rank, op) on another rank whose output ``op`` consumes, or None."""
    stage, last = _stage(rank, op.chunk, pp_size), pp_size * vp_size - 1
    if op.kind == FORWARD:
        return None if stage == 0 else ((stage - 1) % pp_size, Op(FORWARD, op.microbatch, (stage - 1) // pp_size))
    return None if stage == last else ((stage + 1) % pp_size, Op(BACKWARD, op.microbatch, (stage + 1) // pp_size))


def check_table(table: List[List[Op]], num_microbatches: int, vp_size: int = 1, forward_only: bool = False) -> None:
    """Assert every (microbatch, chunk) runs forward (and backward) once, backward after forward.

    Raises:
        AssertionError: naming the rank and the op at fault.
    """
    kinds = (FORWARD,) if forward_only else (FORWARD, BACKWARD)
    expected = {Op(k, mb, c) for k in kinds for mb in range(num_microbatches) for c in range(vp_size)}
    for rank, ops in enumerate(table):
        assert len(ops) == len(set(ops)), f"rank {rank}: an op appears twice"
        assert set(ops) == expected, f"rank {rank}: missing {expected - set(ops)}, extra {set(ops) - expected}"
        position = {op: i for i, op in enumerate(ops)}
        for op in ops:
            if op.kind == BACKWARD:
                assert position[Op(FORWARD, op.microbatch, op.chunk)] < position[op], (
                    f"rank {rank}: {op} before forward"
                )


def max_in_flight(ops: List[Op]) -> int:
    """Most (microbatch, chunk) forwards whose backward has not run yet, at any time."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def simulate(
    table: List[List[Op]], vp_size: int = 1, t_forward: float = 1.0, t_backward: float = 2.0
) -> Tuple[float, List[float]]:
    """Run the table on an ideal machine (no communication cost); each chunk op costs 1/v.

    Returns:
        ``(makespan, busy time per rank)``.

    Raises:
        RuntimeError: the table deadlocks (an op waits for one that cannot run first).
    """
    pp_size = len(table)
    cost = {FORWARD: t_forward / vp_size, BACKWARD: t_backward / vp_size}
    done: Dict[Tuple[int, Op], float] = {}
    pointer, clock = [0] * pp_size, [0.0] * pp_size
    while any(pointer[r] < len(table[r]) for r in range(pp_size)):
        progressed = False
        for rank in range(pp_size):
            while pointer[rank] < len(table[rank]):
                op = table[rank][pointer[rank]]
                dep = producer(op, rank, pp_size, vp_size)
                own_forward = (rank, Op(FORWARD, op.microbatch, op.chunk))
                if (dep is not None and dep not in done) or (op.kind == BACKWARD and own_forward not in done):
                    break
                start = max(clock[rank], done[dep] if dep is not None else 0.0)
                clock[rank] = done[(rank, op)] = start + cost[op.kind]
                pointer[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(table[r][pointer[r]]) for r in range(pp_size) if pointer[r] < len(table[r])}
            raise RuntimeError(f"schedule deadlocks; ranks wait at {stuck}")
    busy = [sum(cost[op.kind] for op in ops) for ops in table]
    return max(clock), busy


# ----------------------------------------------------------------------------------
# Communication plan.
# ----------------------------------------------------------------------------------
def _messages(op: Op, rank: int, pp_size: int, vp_size: int) -> Tuple[List[Msg], List[Msg]]:
    """(sends after ``op``, recvs before ``op``) for one op of ``rank``."""
    stage, last = _stage(rank, op.chunk, pp_size), pp_size * vp_size - 1
    step = 1 if op.kind == FORWARD else -1
    end_of_flow = last if op.kind == FORWARD else 0
    start_of_flow = 0 if op.kind == FORWARD else last
    sends = [] if stage == end_of_flow else [Msg("send", (stage + step) % pp_size, (op.kind, op.microbatch, stage))]
    recvs = (
        []
        if stage == start_of_flow
        else [Msg("recv", (stage - step) % pp_size, (op.kind, op.microbatch, stage - step))]
    )
    return sends, recvs


def comm_plan(slots: List[List[Op]], rank: int, pp_size: int, vp_size: int = 1) -> List[List[Msg]]:
    """``plan[k]``: messages posted together (one batch) before slot ``k``; ``plan[-1]`` after the last.

    A batch holds the sends of slot ``k-1`` and the receives slot ``k`` needs, so a rank's
    sends to a neighbour and its receives from it travel in one batched call, as the
    neighbour's do (Megatron's send_forward_recv_backward and friends).
    """
    plan: List[List[Msg]] = [[] for _ in range(len(slots) + 1)]
    for k, slot in enumerate(slots):
        for op in slot:
            sends, recvs = _messages(op, rank, pp_size, vp_size)
            plan[k] += recvs
            plan[k + 1] += sends
    return plan


def check_comm_plan(pp_size: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False) -> None:
    """Assert the plans of all ranks run to the end with blocking, unbuffered transfers.

    Models the strictest transport: every batch waits until each of its transfers met
    its partner, and transfers between two ranks pair up in posting order without tags
    (NCCL's rule), so the i-th send A -> B must carry the tensor of B's i-th receive from A.

    Raises:
        AssertionError: transfers pair up wrongly. RuntimeError: the plan deadlocks.
    """
    plans = [
        comm_plan(rank_slots(r, pp_size, num_microbatches, vp_size, forward_only), r, pp_size, vp_size)
        for r in range(pp_size)
    ]
    channel: Dict[Tuple[int, int, str], List[Tuple]] = {}
    for rank, plan in enumerate(plans):
        for batch in plan:
            for msg in batch:
                ends = (rank, msg.peer) if msg.action == "send" else (msg.peer, rank)
                channel.setdefault(ends + (msg.action,), []).append(msg.key)
    for (src, dst, action), sent in channel.items():
        received = channel.get((src, dst, "recv"), [])
        assert action != "send" or sent == received, (
            f"rank {src} -> rank {dst}: sends {sent} and receives {received} do not pair up in order"
        )
    _simulate_blocking(plans)


def _simulate_blocking(plans: List[List[List[Msg]]]) -> None:
    """Advance ranks batch by batch; a batch completes once every partner has posted its half."""
    where: Dict[Tuple[int, str, Tuple], int] = {}  # (rank, action, key) -> step
    for rank, plan in enumerate(plans):
        for k, batch in enumerate(plan):
            for msg in batch:
                where[(rank, msg.action, msg.key)] = k
    pointer = [0] * len(plans)
    while any(pointer[r] < len(plans[r]) for r in range(len(plans))):
        progressed = False
        for rank, plan in enumerate(plans):
            while pointer[rank] < len(plan):
                batch = plan[pointer[rank]]
                other = {"send": "recv", "recv": "send"}
                if any(pointer[m.peer] < where[(m.peer, other[m.action], m.key)] for m in batch):
                    break
                pointer[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"communication plan deadlocks at batches {pointer}")
