"""Contiguous gradient (and, for the distributed optimizer, parameter) buffers split into buckets.

Layout is data first: ``plan_buckets`` decides, from parameter sizes alone, where each
parameter lives in the flat buffer and which bucket it belongs to; ``ParamAndGradBuffer``
allocates the storage and rebinds parameters to views of it.

Parameters are laid out in reverse registration order, because backward produces the
last layers' gradients first: the first bucket fills first and its reduction can start
while backward continues. With the distributed optimizer every bucket is padded to a
multiple of the data-parallel size and DP rank r owns the r-th equal slice of each bucket. A buffer of
parameters marked ``keep_whole_in_dp_shard`` (Muon's matrices, whose update needs the whole matrix) is
laid out by ``plan_whole_buckets`` instead: each parameter lies inside one rank's slice.

Megatron-FSDP's sharded strategies keep persistent shards beside the buffers: with ``shard_grads``
``grad_shard`` (``[numel / dp]``, bucket b's slice at ``b.offset / dp``) receives the reduced slices
and the full gradient buffer's storage is freed until the next step zeroes it; with
``shard_params`` ``param_shard`` is the parameters' only persistent copy and each bucket's full
parameters live in a storage of their own, gathered (``Bucket.unshard``) and freed (``reshard``)
around their use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.utils import all_gather_into_tensor

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# A parameter attribute: with the distributed optimizer the parameter must lie whole in one DP rank's slice.
KEEP_WHOLE_ATTR = "keep_whole_in_dp_shard"


@dataclass
class BucketPlan:
    """Which parameters a bucket holds and where: ``[start, end)`` of the flat buffer (padded)."""

    param_indices: List[int]
    start: int
    end: int


def plan_buckets(
    numels: Sequence[int],
    bucket_size: Optional[int],
    pad_to: int,
    own_bucket: Set[int] = frozenset(),
    starts: Set[int] = frozenset(),
) -> Tuple[List[Tuple[int, int]], List[BucketPlan]]:
    """Place parameters (in the given order) into buckets.

    Args:
        numels: element count of each parameter, in layout order.
        bucket_size: close a bucket once it holds at least this many elements (None: one bucket).
        pad_to: each bucket's size is rounded up to a multiple of this.
        own_bucket: indices that must sit alone in a bucket (the tied embedding under the
            distributed optimizer, so that its shard ranges match on first and last stage).
        starts: indices that open a new bucket (the first parameter of each Megatron-FSDP unit).

    Returns:
        ``[(start, end)]`` per parameter and the bucket plans.
    """
    ranges: List[Tuple[int, int]] = [(0, 0)] * len(numels)
    buckets: List[BucketPlan] = []
    current: List[int] = []
    offset = bucket_start = 0

    def close() -> None:
        nonlocal offset, bucket_start, current
        if not current:
            return
        end = bucket_start + -(-(offset - bucket_start) // pad_to) * pad_to
        buckets.append(BucketPlan(current, bucket_start, end))
        offset = bucket_start = end
        current = []

    for i, numel in enumerate(numels):
        if i in own_bucket or i in starts:
            close()
        ranges[i] = (offset, offset + numel)
        offset += numel
        current.append(i)
        if i in own_bucket or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close()
    close()
    return ranges, buckets


def plan_whole_buckets(
    numels: Sequence[int], bucket_size: Optional[int], dp_size: int
) -> Tuple[List[Tuple[int, int]], List[BucketPlan]]:
    """Like ``plan_buckets`` (same buckets of consecutive parameters), but every parameter lies whole inside
    one of its bucket's ``dp_size`` equal slices, so DP rank r's reduce-scatter slice holds r's parameters
    entirely and its all-gather hands them to the others.

    Within a bucket the parameters are dealt largest first (ties: layout order) to the least-filled slice
    (ties: lowest rank), each slice is packed from its start in that order, and every slice is padded to
    the fullest one (the bucket is ``dp_size`` times that long).
    """
    _, chunks = plan_buckets(numels, bucket_size, 1)
    ranges: List[Tuple[int, int]] = [(0, 0)] * len(numels)
    buckets: List[BucketPlan] = []
    offset = 0
    for chunk in chunks:
        loads, members = [0] * dp_size, [[] for _ in range(dp_size)]
        for i in sorted(chunk.param_indices, key=lambda j: (-numels[j], j)):
            rank = min(range(dp_size), key=lambda r: (loads[r], r))
            members[rank].append(i)
            loads[rank] += numels[i]
        size = max(loads)
        for rank, indices in enumerate(members):
            at = offset + rank * size
            for i in indices:
                ranges[i] = (at, at + numels[i])
                at += numels[i]
        buckets.append(BucketPlan(chunk.param_indices, offset, offset + dp_size * size))
        offset += dp_size * size
    return ranges, buckets


@dataclass
class Bucket:
    """A slice of the buffers whose gradients are reduced by one collective."""

    index: int
    params: List[torch.nn.Parameter]
    grad_data: torch.Tensor  # [numel] view of the gradient buffer
    param_data: Optional[torch.Tensor]  # [numel] view of the parameter buffer (distributed optimizer)
    offset: int  # start of this bucket inside the buffer
    pending: Set[int] = field(default_factory=set)  # ids of params whose grads are not ready yet
    handle: Optional[dist.Work] = None
    dispatched: bool = False
    # The distributed optimizer's pending all-gather of ``param_data`` (``reset`` leaves it alone).
    param_gather_handle: Optional[dist.Work] = None
    grad_shard: Optional[torch.Tensor] = None  # [numel / dp] persistent reduced slice (shard_grads)
    param_shard: Optional[torch.Tensor] = None  # [numel / dp] persistent parameter slice (shard_params)
    gathered: bool = True  # param_data holds the full parameters (always, unless shard_params)

    def unshard(self, group: dist.ProcessGroup) -> bool:
        """Allocate ``param_data`` and start all-gathering it from the shards (shard_params);
        False when it is already gathered or gathering."""
        if self.gathered:
            return False
        _alloc(self.param_data)
        self.param_gather_handle = all_gather_into_tensor(self.param_data, self.param_shard, group=group, async_op=True)
        self.gathered = True
        return True

    def reshard(self) -> None:
        """Free the full parameters (shard_params); the shard stays."""
        if self.param_shard is None or not self.gathered:
            return
        self.finish_param_gather()
        self.param_data.untyped_storage().resize_(0)
        self.gathered = False

    def finish_param_gather(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is running."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def shard(self, tensor: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
        """DP rank ``dp_rank``'s equal slice of ``tensor`` (grad_data or param_data)."""
        size = tensor.numel() // dp_size
        return tensor[dp_rank * size : (dp_rank + 1) * size]


def _alloc(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (``resize_(0)``) its storage back, contents undefined."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() < nbytes:
        tensor.untyped_storage().resize_(nbytes)


@dataclass
class BucketGroup:
    """Buckets whose collectives are issued together (Megatron-core's ``bucket_groups`` entries).

    Here every group holds one bucket, as upstream does without fp8 parameters.
    """

    buckets: List[Bucket]

    @property
    def params(self) -> Set[torch.nn.Parameter]:
        """The parameters of the group's buckets."""
        return {p for bucket in self.buckets for p in bucket.params}


class ParamAndGradBuffer:
    """One flat gradient buffer (and optional parameter buffer) for params of one dtype pair.

    Every parameter gets ``param.main_grad``, a view of its slice of the gradient buffer.
    With ``with_param_data`` the parameters' storage is moved into a flat buffer too, so the
    distributed optimizer can all-gather updated parameters bucket by bucket. ``dp_group`` is
    the group its gradients are reduced (and sharded) over: ``dp_cp``, or ``expt_dp`` for an
    expert buffer (``is_expert``). ``starts``, ``shard_grads``, ``shard_params``: Megatron-FSDP
    (module docstring); both shardings need ``with_param_data``. ``whole``: every parameter lies whole in
    one DP rank's slice (``plan_whole_buckets``; with ``with_param_data``, not with ``starts``).
    """

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
        dp_group: dist.ProcessGroup,
        with_param_data: bool,
        own_bucket: Set[int] = frozenset(),
        is_expert: bool = False,
        starts: Set[int] = frozenset(),
        shard_grads: bool = False,
        shard_params: bool = False,
        whole: bool = False,
    ) -> None:
        self.params = params
        self.is_expert = is_expert
        self.grad_dtype = grad_dtype
        self.param_dtype = params[0].dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.shard_grads, self.shard_params = shard_grads, shard_params
        pad_to = self.dp_size if with_param_data else 1
        numels = [p.numel() for p in params]
        if whole and with_param_data and not starts:
            ranges, plans = plan_whole_buckets(numels, bucket_size, self.dp_size)
        else:
            ranges, plans = plan_buckets(numels, bucket_size, pad_to, own_bucket, starts)
        numel = plans[-1].end if plans else 0
        device = params[0].device
        self.grad_data = torch.zeros(numel, dtype=grad_dtype, device=device)
        flat_params = with_param_data and not shard_params
        self.param_data = torch.zeros(numel, dtype=self.param_dtype, device=device) if flat_params else None
        self.grad_shard = torch.zeros(numel // self.dp_size, dtype=grad_dtype, device=device) if shard_grads else None
        self.param_shard = (
            torch.zeros(numel // self.dp_size, dtype=self.param_dtype, device=device) if shard_params else None
        )
        self.buckets = [self._make_bucket(i, plan, params, with_param_data) for i, plan in enumerate(plans)]
        self.param_range: Dict[int, Tuple[int, int]] = {}
        for param, (start, end) in zip(params, ranges):
            self.param_range[id(param)] = (start, end)
            param.main_grad = self.grad_data[start:end].view(param.shape)
        for bucket in self.buckets:
            for param in bucket.params if bucket.param_data is not None else ():
                start, end = self.param_range[id(param)]
                view = bucket.param_data[start - bucket.offset : end - bucket.offset].view(param.shape)
                view.copy_(param.data)
                param.data = view
        self.refresh_param_shards()
        self.bucket_of: Dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self.reset()

    def _make_bucket(self, index: int, plan: BucketPlan, params: List[torch.nn.Parameter], with_param: bool) -> Bucket:
        """Bucket ``index`` over ``[plan.start, plan.end)``: views of the flat buffers and shards, or, with
        shard_params, a parameter storage of its own (gathered: it holds the initial parameters)."""
        size = (plan.end - plan.start) // self.dp_size
        lo = plan.start // self.dp_size
        if self.param_shard is not None:
            param_data = torch.zeros(plan.end - plan.start, dtype=self.param_dtype, device=self.grad_data.device)
        else:
            param_data = None if not with_param else self.param_data[plan.start : plan.end]
        return Bucket(
            index=index,
            params=[params[j] for j in plan.param_indices],
            grad_data=self.grad_data[plan.start : plan.end],
            param_data=param_data,
            offset=plan.start,
            grad_shard=None if self.grad_shard is None else self.grad_shard[lo : lo + size],
            param_shard=None if self.param_shard is None else self.param_shard[lo : lo + size],
        )

    def refresh_param_shards(self) -> None:
        """Copy this rank's slice of every gathered bucket's parameters into its shard (shard_params:
        after the parameters were written whole, at construction or by a broadcast)."""
        for bucket in self.buckets:
            if bucket.param_shard is not None and bucket.gathered:
                bucket.finish_param_gather()
                bucket.param_shard.copy_(bucket.shard(bucket.param_data, self.dp_rank, self.dp_size))

    def release_grads(self) -> None:
        """shard_grads: keep this rank's reduced slice of each bucket in ``grad_shard`` and free the full
        gradient buffer (after ``finish_grad_sync`` and the reductions that follow it)."""
        if self.grad_shard is None or self.grad_data.untyped_storage().nbytes() == 0:
            return
        for bucket in self.buckets:
            bucket.grad_shard.copy_(bucket.shard(bucket.grad_data, self.dp_rank, self.dp_size))
        self.grad_data.untyped_storage().resize_(0)

    def zero_grads(self) -> None:
        """Zero the gradient buffer, first giving it its storage back if ``release_grads`` freed it."""
        _alloc(self.grad_data)
        self.grad_data.zero_()

    def shard_piece(self, shard: torch.Tensor, param: torch.nn.Parameter, flat_range: Tuple[int, int]) -> torch.Tensor:
        """The elements ``flat_range`` of ``param`` (inside this rank's slice) as a view of ``shard``
        (``grad_shard`` or ``param_shard``)."""
        bucket = self.bucket_of[id(param)]
        shard_start = bucket.offset + self.dp_rank * (bucket.grad_data.numel() // self.dp_size)
        lo = self.param_range[id(param)][0] + flat_range[0] - shard_start + bucket.offset // self.dp_size
        return shard[lo : lo + flat_range[1] - flat_range[0]]

    def reset(self) -> None:
        """Forget readiness and handles: a new iteration starts."""
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params if p.requires_grad}
            bucket.handle, bucket.dispatched = None, False

    def scale_gradients(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiply the grads by ``factor``; a tensor factor is read on the host for half-precision grads.

        A device 0-dim operand is cast to the grads' dtype, where 1/tokens rounds badly (an fp16
        subnormal beyond ~16k tokens); a Python float is applied in fp32 by the kernel.
        """
        if isinstance(factor, torch.Tensor) and self.grad_data.dtype in (torch.float16, torch.bfloat16):
            factor = float(factor)
        self.grad_data.mul_(factor)

    def start_param_gather(self) -> None:
        """All-gather every bucket's parameters from the DP shards (asynchronously), last bucket first.

        Buckets are laid out in backward order, so the last one holds the first layers: the order
        in which the next forward needs them (the same on every rank). Distributed optimizer only.
        """
        if self.param_data is None or self.dp_size == 1:
            return  # shard_params: gathered layer by layer in forward instead
        for bucket in reversed(self.buckets):
            data = bucket.param_data
            if data.dtype in _FP8_DTYPES:  # FP8 weights (fp8_param_gather): their bytes, 1 per element
                data = data.view(torch.uint8)
            shard = bucket.shard(data, self.dp_rank, self.dp_size)
            bucket.param_gather_handle = all_gather_into_tensor(data, shard, group=self.dp_group, async_op=True)

    def local_range(self, param: torch.nn.Parameter) -> Optional[Tuple[int, int]]:
        """The part of ``param.view(-1)`` inside this DP rank's shard, or None."""
        start, end = self.param_range[id(param)]
        bucket = self.bucket_of[id(param)]
        size = bucket.grad_data.numel() // self.dp_size
        lo = bucket.offset + self.dp_rank * size
        hi = lo + size
        s, e = max(start, lo), min(end, hi)
        return (s - start, e - start) if s < e else None
