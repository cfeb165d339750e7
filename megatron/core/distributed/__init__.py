"""Data-parallel gradient buffers and the end-of-step gradient reductions."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, NonFiniteGradientError
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "NonFiniteGradientError", "DistributedDataParallelConfig", "finalize_model_grads"]
