"""DistributedDataParallelConfig: how gradients are buffered and reduced over data parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel gradient settings (Megatron Core field names).

    ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``) keeps the gradient
    buffer in fp32; otherwise it has the parameters' dtype. ``bucket_size`` is in elements;
    None picks ``max(40_000_000, 1_000_000 * dp)`` when ``overlap_grad_reduce`` is set and a
    single bucket otherwise. ``average_in_collective`` divides after the sum instead of
    before it (same result up to rounding; gloo has no averaging all-reduce).
    ``check_for_nan_in_grad`` raises, naming the rank, before a bucket with inf/NaN is reduced.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"

    def __post_init__(self) -> None:
        if self.bucket_size is not None and (isinstance(self.bucket_size, bool) or self.bucket_size < 1):
            raise ValueError(f"bucket_size={self.bucket_size!r}: must be a positive number of elements or None")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True requires use_distributed_optimizer=True")
        if self.num_distributed_optimizer_instances != 1:
            raise ValueError(
                f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}: "
                "not supported yet (only 1)"
            )
        if self.fp8_param_gather:
            raise ValueError("fp8_param_gather=True: not supported yet")
        if self.use_custom_fsdp or self.data_parallel_sharding_strategy != "no_shard":
            raise ValueError("use_custom_fsdp / data_parallel_sharding_strategy: not supported yet")
