"""Megatron-core's ``StrategyAction``: which of the four checkpoint actions a strategy performs.

Only the names exist here: ``save`` and ``load`` use one format (torch.distributed.checkpoint for
tensors, JSON for common state and objects) and refuse other strategies with CheckpointingError.
"""

from enum import Enum


class StrategyAction(Enum):
    """Save or load, of the sharded tensors or of the common (replicated) state."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"
