"""Data-parallel gradient buffers, the end-of-step gradient reductions, and the FSDP2 wrapper."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, NonFiniteGradientError
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)

__all__ = [
    "DistributedDataParallel",
    "NonFiniteGradientError",
    "DistributedDataParallelConfig",
    "finalize_model_grads",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
]
