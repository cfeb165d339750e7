"""``overlap_p2p_comm`` in the interleaved schedule: transfers posted ahead, waited for where consumed.

On 2 pipeline ranks with 2 virtual stages each and 4 microbatches, a GPT-2-style model runs one
step with the overlap and one without. A recorder logs, in order, each batch of sends and receives
posted, the first wait on it and each forward / backward compute: with the overlap some batches
(the steady (forward, backward) slots') are waited for only after a compute that started after
they were posted; without it none is (the negative control: the test fails if the overlap is
removed). Loss and every gradient are bitwise the blocking run's (the same arithmetic).
"""

from __future__ import annotations

import torch

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.pipeline_parallel import executor
from megatron.core.pipeline_parallel import schedule_table as st
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from tests.dist_harness import run_distributed
from tests.model_utils import batch, gpt2_style
from tests.unit_tests.pipeline_parallel.pipeline_parity import MICRO, build_chunks, make_finalize, run_pipeline

NUM_MB, VP = 4, 2


class _Recorder:
    """Logs ("post", n), ("wait", n) (the first wait on batch n) and ("compute", kind) in order."""

    def __init__(self):
        self.events, self.saved = [], (P2PCommunicator.post, executor.run_forward, executor.run_backward)

    def __enter__(self):
        post, forward, backward = self.saved
        log = self.events

        def recorded_post(comm, sends, recvs):
            number = sum(e[0] == "post" for e in log)
            log.append(("post", number))
            buffers, works = post(comm, sends, recvs)
            return buffers, [_Work(w, number, log) for w in works]

        def compute(kind, function):
            def run(*args, **kwargs):
                log.append(("compute", kind))
                return function(*args, **kwargs)

            return run

        P2PCommunicator.post = recorded_post
        executor.run_forward, executor.run_backward = compute("F", forward), compute("B", backward)
        return self

    def __exit__(self, *exc):
        P2PCommunicator.post, executor.run_forward, executor.run_backward = self.saved

    def overlapped_batches(self) -> int:
        """Batches first waited for after a compute that started after they were posted."""
        posted, computed_since, count = {}, set(), 0
        for kind, what in self.events:
            if kind == "post":
                posted[what] = False
            elif kind == "compute":
                computed_since.update(n for n, waited in posted.items() if not waited)
            elif kind == "wait" and not posted[what]:
                posted[what] = True
                count += what in computed_since
        return count


class _Work:
    def __init__(self, work, number, log):
        self.work, self.number, self.log = work, number, log

    def wait(self):
        if ("wait", self.number) not in self.log:
            self.log.append(("wait", self.number))
        return self.work.wait()


def _body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    tokens, labels = batch(seed=3, b=MICRO * NUM_MB)
    runs = {}
    for overlap in (False, True):
        chunks = build_chunks(gpt2_style(num_layers=4, overlap_p2p_comm=overlap), groups, VP)
        for chunk in chunks:
            chunk.config.finalize_model_grads_func = make_finalize(groups)
        with _Recorder() as log:
            loss = run_pipeline(chunks, groups, tokens, labels, NUM_MB)
        grads = {f"{c}.{n}": p.grad for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
        runs[overlap] = (loss, grads, log.overlapped_batches())
    (loss, grads, blocking_overlaps), (overlap_loss, overlap_grads, overlaps) = runs[False], runs[True]
    assert (loss is None) == (overlap_loss is None)
    assert loss is None or torch.equal(loss, overlap_loss), (loss, overlap_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, overlap_grads[name]), name
    return blocking_overlaps, overlaps


def _expected_overlaps(rank: int, pp: int) -> int:
    """Batches whose slot's first op takes none of their receives: waited for only after that op ran
    (by the slot's later op, e.g. a steady slot's backward, or for its sends at the next batch)."""
    slots = st.rank_slots(rank, pp, NUM_MB, VP)
    plan = st.comm_plan(slots, rank, pp, VP)
    count = 0
    for posted, slot in zip(plan, slots):
        first_needs = {m.key for m in st._messages(slot[0], rank, pp, VP)[1]}
        count += bool(posted) and not first_needs & {m.key for m in posted if m.action == "recv"}
    return count


def test_interleaved_overlap_posts_ahead_and_equals_the_blocking_schedule():
    expected = [_expected_overlaps(rank, 2) for rank in range(2)]
    assert sum(expected) > 0  # rank 0's steady slots: the backward's gradient arrives during the forward
    for rank, (blocking, overlapped) in enumerate(run_distributed(_body, 2)):
        assert blocking == 0, f"rank {rank}: the blocking schedule waits for every batch where it posts it"
        assert overlapped == expected[rank], f"rank {rank}: {overlapped} batches overlapped, {expected[rank]=}"
