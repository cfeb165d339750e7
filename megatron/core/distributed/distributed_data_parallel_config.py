"""DistributedDataParallelConfig: how gradients are buffered and reduced over data parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core import compatibility

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel gradient settings (Megatron Core field names).

    ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``) keeps the gradient
    buffer in fp32; otherwise it has the parameters' dtype. ``bucket_size`` is in elements;
    None picks ``max(40_000_000, 1_000_000 * dp)`` when ``overlap_grad_reduce`` is set and a
    single bucket otherwise. ``average_in_collective`` divides after the sum instead of
    before it (same result up to rounding; gloo has no averaging all-reduce).
    ``check_for_nan_in_grad`` raises, naming the rank, before a bucket with inf/NaN is reduced.
    ``fp8_param_gather`` stores the FP8 linears' weights in FP8 and all-gathers their bytes
    (``quantization/fp8_params.py``); it needs the distributed optimizer.

    Every field of megatron-core 0.16 exists with its default. Kernel, NCCL-buffer and FSDP-tuning
    switches (``gradient_reduce_div_fusion``, ``nccl_ub``, ``suggested_communication_unit_size``,
    ``preserve_fp32_weights``, ``keep_fp8_transpose_cache``, ``fsdp_double_buffer``,
    ``disable_symmetric_registration``, ``fsdp_manual_registration``) have no effect here; the
    features not built yet (the mxfp8 buffer reuse, fp32-accumulating reduce-scatter, delayed weight
    gradients, an outer sharding strategy) raise ``ValueError`` when switched on.

    ``num_distributed_optimizer_instances`` = N > 1 (hybrid sharding) splits the data-parallel ranks into
    N instances of dp / N consecutive ranks: the distributed optimizer (and Megatron-FSDP's strategies)
    shard within an instance (``ProcessGroupCollection.intra_dp_cp``), gradients are reduce-scattered
    within it and the reduced slices all-reduced across instances (``inter_dist_opt``) before the
    step; parameters are all-gathered within an instance. It needs the distributed optimizer; the
    process groups must be built for the same N (``ParallelLayout``, which checks dp % N).

    Megatron-FSDP (``use_megatron_fsdp``) picks what is sharded over data parallelism with
    ``data_parallel_sharding_strategy``: ``no_shard`` (plain DDP), ``optim`` (the distributed
    optimizer), ``optim_grads`` (also: only the local gradient shard is kept after the reduction) and
    ``optim_grads_params`` (also: parameters are stored sharded and all-gathered per transformer layer
    around its forward and backward, the next layer's gather issued before this layer's compute ends).
    The three sharded strategies run on the distributed optimizer's buffers and need it.
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
    reduce_scatter_with_fp32_accumulation: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        if self.bucket_size is not None and (isinstance(self.bucket_size, bool) or self.bucket_size < 1):
            raise ValueError(f"bucket_size={self.bucket_size!r}: must be a positive number of elements or None")
        if self.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r}: "
                f"must be one of {SHARDING_STRATEGIES}"
            )
        instances = self.num_distributed_optimizer_instances
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ValueError(f"num_distributed_optimizer_instances={instances!r}: must be a positive integer")
        # Overlapped / FP8 parameter gathers and instances need the distributed optimizer; Megatron-FSDP's pairings.
        compatibility.check(self)
        switched_on = [
            name
            for name in (
                "reuse_grad_buf_for_mxfp8_param_ag",
                "reduce_scatter_with_fp32_accumulation",
                "use_custom_fsdp",
                "delay_wgrad_compute",
            )
            if getattr(self, name)
        ]
        if switched_on:
            raise ValueError(f"{', '.join(f'{name}=True' for name in switched_on)}: not supported yet")
        if self.outer_dp_sharding_strategy != "no_shard":
            raise ValueError(
                f"outer_dp_sharding_strategy={self.outer_dp_sharding_strategy!r}: not supported yet (only 'no_shard')"
            )

    @property
    def shard_grads(self) -> bool:
        """Only the local gradient shard outlives the reduction (``optim_grads`` and ``optim_grads_params``)."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shard_params(self) -> bool:
        """Parameters are stored sharded and gathered per layer (``optim_grads_params``)."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads_params"
