"""Contiguous gradient (and, for the distributed optimizer, parameter) buffers split into buckets.

Layout is data first: ``plan_buckets`` decides, from parameter sizes alone, where each
parameter lives in the flat buffer and which bucket it belongs to; ``ParamAndGradBuffer``
allocates the storage and rebinds parameters to views of it.

Parameters are laid out in reverse registration order, because backward produces the
last layers' gradients first: the first bucket fills first and its reduction can start
while backward continues. With the distributed optimizer every bucket is padded to a
multiple of the data-parallel size and DP rank r owns the r-th equal slice of each bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.utils import all_gather_into_tensor

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class BucketPlan:
    """Which parameters a bucket holds and where: ``[start, end)`` of the flat buffer (padded)."""

    param_indices: List[int]
    start: int
    end: int


def plan_buckets(
    numels: Sequence[int], bucket_size: Optional[int], pad_to: int, own_bucket: Set[int] = frozenset()
) -> Tuple[List[Tuple[int, int]], List[BucketPlan]]:
    """Place parameters (in the given order) into buckets.

    Args:
        numels: element count of each parameter, in layout order.
        bucket_size: close a bucket once it holds at least this many elements (None: one bucket).
        pad_to: each bucket's size is rounded up to a multiple of this.
        own_bucket: indices that must sit alone in a bucket (the tied embedding under the
            distributed optimizer, so that its shard ranges match on first and last stage).

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
        if i in own_bucket:
            close()
        ranges[i] = (offset, offset + numel)
        offset += numel
        current.append(i)
        if i in own_bucket or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close()
    close()
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

    def finish_param_gather(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is running."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def shard(self, tensor: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
        """DP rank ``dp_rank``'s equal slice of ``tensor`` (grad_data or param_data)."""
        size = tensor.numel() // dp_size
        return tensor[dp_rank * size : (dp_rank + 1) * size]


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
    expert buffer (``is_expert``).
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
    ) -> None:
        self.params = params
        self.is_expert = is_expert
        self.grad_dtype = grad_dtype
        self.param_dtype = params[0].dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        pad_to = self.dp_size if with_param_data else 1
        ranges, plans = plan_buckets([p.numel() for p in params], bucket_size, pad_to, own_bucket)
        numel = plans[-1].end if plans else 0
        device = params[0].device
        self.grad_data = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.param_data = torch.zeros(numel, dtype=self.param_dtype, device=device) if with_param_data else None
        self.param_range: Dict[int, Tuple[int, int]] = {}
        for param, (start, end) in zip(params, ranges):
            self.param_range[id(param)] = (start, end)
            if self.param_data is not None:
                view = self.param_data[start:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.buckets = [
            Bucket(
                index=i,
                params=[params[j] for j in plan.param_indices],
                grad_data=self.grad_data[plan.start : plan.end],
                param_data=None if self.param_data is None else self.param_data[plan.start : plan.end],
                offset=plan.start,
            )
            for i, plan in enumerate(plans)
        ]
        self.bucket_of: Dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self.reset()

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
            return
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
