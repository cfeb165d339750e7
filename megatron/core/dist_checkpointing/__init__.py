"""Sharded checkpoints: every tensor knows its global shape and this rank's slice.

Megatron-core's vocabulary (nested sharded state dicts with ``ShardedObject``,
``ShardedTensorFactory``, ``LocalNonpersistentObject`` and common state; ``load`` returning
loaded values) is a thin layer over the same files, see ``nested.py``.

``sharded_state_dict(model_chunk)`` describes a model; ``save`` / ``load`` write and
read it with torch.distributed.checkpoint, so a checkpoint written under one
TP/PP/DP layout loads under any other.
"""

from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    sharded_tensor_for,
    tensor_parallel_geometry,
)
from megatron.core.dist_checkpointing.serialization import (
    BACKEND_METADATA,
    METADATA_FILE,
    CheckpointingError,
    StagedSave,
    check_is_distributed_checkpoint,
    check_sharded_checkpoint,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_tensors_metadata,
    read_metadata,
    save,
    verify_checksums,
)
from megatron.core.dist_checkpointing.state_dict import (
    OPTIMIZER_STATE_PREFIX,
    TIED_EMBEDDING_KEY,
    is_empty_extra_state,
    load_extra_states,
    load_sharded_parameters,
    model_process_groups,
    model_sharded_state_dict,
    model_state_to_save,
    optimizer_sharded_state_dict,
    optimizer_state_key,
    sharded_state_dict,
    sharded_tensors_by_param_name,
    split_optimizer_state,
)

__all__ = [
    "BACKEND_METADATA",
    "METADATA_FILE",
    "OPTIMIZER_STATE_PREFIX",
    "TIED_EMBEDDING_KEY",
    "CheckpointingError",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StagedSave",
    "check_is_distributed_checkpoint",
    "check_sharded_checkpoint",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_tensors_metadata",
    "is_empty_extra_state",
    "load_extra_states",
    "load_sharded_parameters",
    "model_process_groups",
    "model_sharded_state_dict",
    "model_state_to_save",
    "optimizer_sharded_state_dict",
    "optimizer_state_key",
    "read_metadata",
    "save",
    "sharded_state_dict",
    "sharded_tensor_for",
    "sharded_tensors_by_param_name",
    "split_optimizer_state",
    "tensor_parallel_geometry",
    "verify_checksums",
]
