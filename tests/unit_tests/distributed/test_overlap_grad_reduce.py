"""``overlap_grad_reduce``: each bucket's reduction is issued during backward, not in ``finish_grad_sync``.

Two gloo ranks run two microbatches (the first under ``no_sync()``) of a 2-layer GPT wrapped in DDP
with several buckets, plain (all-reduce) and for the distributed optimizer (reduce-scatter). The
reduction collectives of ``torch.distributed`` are wrapped to log which bucket's gradient buffer
they carry; a post-accumulate hook on every parameter logs when its gradient is ready; markers
log the end of backward and the call of ``finish_grad_sync``. With overlap, every bucket must be
issued once, asynchronously, in bucket order, before backward ends, and every bucket but the last
before some gradient of a later bucket is ready (the reduction runs under the rest of backward);
nothing may be issued during the ``no_sync`` microbatch. Without overlap nothing is issued before
``finish_grad_sync``. Experts (MoE, EP=1) have a buffer of their own, checked the same way.

Through ``get_forward_backward_func()`` (no pipelining with DP=4; 1F1B and interleaved with PP=2,
DP=2, four ranks): each chunk's buckets must be issued after the chunk's last forward and before
``finalize_model_grads_func``, i.e. the schedule keeps ``no_sync`` for the earlier microbatches and
lifts it for the last backward. A DDP whose hooks never launch a bucket, or a schedule that keeps
``no_sync`` on or never uses it, fails these tests.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style
from tests.unit_tests.pipeline_parallel.pipeline_parity import MICRO, build_chunks, run_pipeline

Event = Tuple[str, object]
Key = Tuple[int, int]  # (buffer, bucket) of DDP.all_buffers: dense first, then expert
BUCKET_SIZE = 3000  # several buckets in the tiny model
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0])
# torch.distributed's reductions DDP may use, by kind (utils.reduce_scatter_tensor takes the first
# reduce-scatter name torch has, looked up at call time).
REDUCTIONS = {
    "all_reduce": "all_reduce",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


@contextlib.contextmanager
def recorded_reductions(events: List[Event], bucket_of: Dict[tuple, Key]) -> Iterator[None]:
    """Log ``("issue", (bucket, async_op, collective))`` for each reduction of a bucket's gradient buffer.

    ``bucket_of`` maps (data pointer, element count, group) of each bucket's ``grad_data`` and its
    buffer's group to the bucket's key: a bucket holding one parameter shares pointer and size with
    that parameter's ``main_grad``, which finalize_model_grads may reduce over another group (the
    tied embedding over the embedding group).
    """

    def recording(name: str, real: Callable) -> Callable:
        def wrapped(*args, group=None, async_op=False, **kwargs):
            carried = args[0] if name == "all_reduce" else args[1]  # reduce-scatter: (output, input)
            bucket = bucket_of.get((carried.data_ptr(), carried.numel(), group))
            if bucket is not None:
                events.append(("issue", (bucket, async_op, REDUCTIONS[name])))
            return real(*args, group=group, async_op=async_op, **kwargs)

        return wrapped

    originals = {name: getattr(dist, name) for name in REDUCTIONS if hasattr(dist, name)}
    for name, real in originals.items():
        setattr(dist, name, recording(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


def _bucket_keys(buffers: List) -> Dict[tuple, Key]:
    """(data pointer, size, group) of each bucket -> (index of its buffer in ``buffers``, bucket)."""
    return {
        (b.grad_data.data_ptr(), b.grad_data.numel(), buf.dp_group): (i, b.index)
        for i, buf in enumerate(buffers)
        for b in buf.buckets
    }


def _wrapped_model(groups, model_kwargs: Dict, overlap: bool, distributed_optimizer: bool, events: List[Event]):
    """A DDP-wrapped GPT whose parameters log ``("grad", (buffer, bucket))`` when their gradient is ready.

    The logging hooks are registered before DDP's, so they run first: a bucket's collective, issued
    by DDP's hook on its last parameter, comes after that parameter's event.
    """
    model = build_gpt(model_kwargs, groups)
    key_of_param: Dict[int, Key] = {}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: events.append(("grad", key_of_param[id(p)])))
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, use_distributed_optimizer=distributed_optimizer, bucket_size=BUCKET_SIZE
    )
    ddp = DistributedDataParallel(model.config, config, model, pg_collection=groups)
    for i, buffer in enumerate(ddp.all_buffers):
        if overlap:
            assert len(buffer.buckets) >= 2, f"want several buckets in buffer {i}, got {len(buffer.buckets)}"
        key_of_param.update({id(p): (i, b.index) for b in buffer.buckets for p in b.params})
    return ddp


def _step_events(groups, model_kwargs: Dict, overlap: bool, distributed_optimizer: bool):
    """The events of one step of two microbatches, and the buckets' keys in bucket order."""
    events: List[Event] = []
    ddp = _wrapped_model(groups, model_kwargs, overlap, distributed_optimizer, events)
    keys = _bucket_keys(ddp.all_buffers)
    tokens, labels = batch(seed=7 + groups.rank_in("dp"), b=4)  # each DP rank its own data
    ddp.zero_grad_buffer()
    with recorded_reductions(events, keys):
        for m in range(2):
            ctx = ddp.no_sync() if m == 0 else contextlib.nullcontext()
            with ctx:
                ddp(tokens[2 * m : 2 * m + 2], None, None, labels=labels[2 * m : 2 * m + 2]).mean().backward()
            events.append(("backward_end", m))
        events.append(("finish_grad_sync", None))
        ddp.finish_grad_sync()
    return events, sorted(keys.values())


def _issues(events: List[Event], buffer: int) -> List[Tuple[int, int, bool]]:
    """``(position in events, bucket, async_op)`` of every recorded reduction of ``buffer``."""
    return [(i, key[1], async_op) for i, (_, (key, async_op, _)) in _of_kind(events, "issue") if key[0] == buffer]


def _collectives(events: List[Event]) -> set:
    """The kinds of collective that carried the buckets."""
    return {collective for _, (_, (_, _, collective)) in _of_kind(events, "issue")}


def _of_kind(events: List[Event], kind: str) -> List[Tuple[int, Event]]:
    return [(i, e) for i, e in enumerate(events) if e[0] == kind]


def _check_overlapped(where: str, events: List[Event], buffer: int, num_buckets: int) -> None:
    """Issued once each, async, in bucket order, during the last backward, under later gradients."""
    where = f"{where}, buffer {buffer}"
    issues = _issues(events, buffer)
    assert [b for _, b, _ in issues] == list(range(num_buckets)), f"{where}: buckets issued {issues}"
    first_end = events.index(("backward_end", 0))
    last_end = events.index(("backward_end", 1))
    for pos, bucket, _ in issues:
        assert first_end < pos < last_end, f"{where}: bucket {bucket} issued outside the last backward: {events}"
    assert all(async_op for _, _, async_op in issues), f"{where}: a bucket was reduced synchronously: {issues}"
    grads = [(i, key[1]) for i, (_, key) in _of_kind(events, "grad") if key[0] == buffer]
    for pos, bucket, _ in issues[:-1]:
        later = [i for i, b in grads if i > pos and b > bucket]
        assert later, f"{where}: bucket {bucket} issued only after every later gradient was ready: {events}"


def _check_not_overlapped(where: str, events: List[Event], buffer: int, num_buckets: int) -> None:
    """Nothing issued before ``finish_grad_sync``; then every bucket once, in order."""
    where = f"{where}, buffer {buffer}"
    finish = events.index(("finish_grad_sync", None))
    issues = _issues(events, buffer)
    early = [(pos, b) for pos, b, _ in issues if pos < finish]
    assert not early, f"{where}: reductions issued before finish_grad_sync: {events}"
    assert [b for _, b, _ in issues] == list(range(num_buckets)), f"{where}: buckets issued {issues}"


def _check(where: str, model_kwargs: Dict, groups, distributed_optimizer: bool, buffers: int) -> None:
    """Both settings of ``overlap_grad_reduce`` for one model and optimizer kind."""
    collective = "reduce_scatter" if distributed_optimizer else "all_reduce"
    for overlap, check in ((True, _check_overlapped), (False, _check_not_overlapped)):
        events, keys = _step_events(groups, model_kwargs, overlap, distributed_optimizer)
        assert len({buffer for buffer, _ in keys}) == buffers, f"{where}: buffers {keys}"
        for buffer in range(buffers):
            check(f"{where}, overlap={overlap}", events, buffer, sum(1 for k in keys if k[0] == buffer))
        assert _collectives(events) == {collective}, f"{where}: buckets carried by {_collectives(events)}"


def _body(rank: int, world_size: int) -> None:
    groups = ps.initialize_model_parallel()
    _check("plain DDP", gpt2_style(num_layers=2), groups, False, buffers=1)
    _check("distributed optimizer", gpt2_style(num_layers=2), groups, True, buffers=1)
    # Experts (EP=1: expt_dp is the DP group) get a buffer of their own, overlapped the same way.
    _check("MoE, plain DDP", gpt2_style(num_layers=2, **MOE), groups, False, buffers=2)


def test_buckets_are_reduced_during_backward_only_with_overlap():
    run_distributed(_body, 2)


# ----------------------------------------------------------------------------------
# Through the schedules: no_sync until a chunk's last backward, then overlapped buckets.
# ----------------------------------------------------------------------------------
NUM_MICRO = 4


def _loss(output: torch.Tensor):
    """(sum of token losses, token count, report) from the per-token loss ``[b, s]``."""
    total, count = output.sum(), torch.tensor(output.numel())
    return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}


def _schedule_events(groups, vp: int) -> Tuple[List[Event], List[Key]]:
    """One schedule call of DDP-wrapped chunks (overlap): forward starts, reductions, finalize."""
    events: List[Event] = []
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=BUCKET_SIZE)
    chunks = [
        DistributedDataParallel(c.config, config, c, pg_collection=groups)
        for c in build_chunks(gpt2_style(num_layers=4), groups, vp)
    ]
    chunk_of = {id(c): i for i, c in enumerate(chunks)}
    assert all(len(c.buffers) == 1 for c in chunks)
    keys = _bucket_keys([c.buffers[0] for c in chunks])  # key: (chunk, bucket)

    def forward_step(data_iterator, model):
        events.append(("forward", chunk_of[id(model)]))
        tokens, labels = next(data_iterator)
        return model(tokens, None, None, labels=labels), _loss

    def finalize(model_chunks, num_tokens=None):
        events.append(("finalize", None))
        finalize_model_grads(model_chunks, num_tokens, pg_collection=groups)

    for chunk in chunks:
        chunk.module.config.no_sync_func = [c.no_sync for c in chunks] if vp > 1 else chunk.no_sync
        chunk.module.config.finalize_model_grads_func = finalize
    tokens, labels = batch(seed=3, b=MICRO * NUM_MICRO * groups.size_of("dp"))  # sliced per DP rank
    with recorded_reductions(events, keys):
        run_pipeline(chunks, groups, tokens, labels, NUM_MICRO, forward_step_func=forward_step)
    return events, sorted(keys.values())


def _check_schedule(where: str, events: List[Event], keys: List[Key]) -> None:
    """Each chunk's buckets: issued once, async, after its last forward, before finalize."""
    finalize = events.index(("finalize", None))
    for chunk in sorted({c for c, _ in keys}):
        issues = _issues(events, chunk)
        last_forward = max(i for i, (_, c) in _of_kind(events, "forward") if c == chunk)
        expected = [b for c, b in keys if c == chunk]
        assert [b for _, b, _ in issues] == expected, f"{where} chunk {chunk}: buckets issued {issues}: {events}"
        early = [b for pos, b, _ in issues if pos < last_forward]
        assert not early, f"{where} chunk {chunk}: buckets {early} issued before its last microbatch: {events}"
        late = [b for pos, b, _ in issues if pos > finalize]
        assert not late, f"{where} chunk {chunk}: buckets {late} issued only in finalize: {events}"
        assert all(async_op for _, _, async_op in issues), f"{where} chunk {chunk}: synchronous: {issues}"


def _schedule_body(rank: int, world_size: int) -> None:
    for pp, vp in ((1, 1), (2, 1), (2, 2)):
        layout = ParallelLayout(world_size=world_size, pipeline_model_parallel_size=pp)
        groups = build_process_groups(layout)
        events, keys = _schedule_events(groups, vp)
        _check_schedule(f"pp={pp} vp={vp} dp={groups.size_of('dp')}", events, keys)


def test_schedules_let_the_last_microbatch_overlap_its_buckets():
    run_distributed(_schedule_body, 4)
