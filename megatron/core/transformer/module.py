"""MegatronModule: the base of every core module, holding its config."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.state_dict import module_sharded_state_dict
from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` built from a ``TransformerConfig``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: Tuple[Tuple[int, int, int], ...] = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """Megatron-core's sharded state dict of this module, for ``dist_checkpointing.save`` / ``load``.

        Keyed by ``prefix`` + this module's ``state_dict`` names (so the dict ``load`` returns goes into
        ``load_state_dict``); each ShardedTensor's key is layout-free (global layer and expert indices),
        sharded over the process groups the module was built with (``self.pg_collection``).

        Args:
            prefix: prepended to every name and checkpoint key.
            sharded_offsets: not supported yet (Megatron-core's extra leading axes); must be empty.
            metadata: Megatron-core's checkpoint-format switches; none is supported yet, so None or {}.

        Raises:
            NotImplementedError: ``sharded_offsets`` or ``metadata`` given.
            ValueError: the module has no ``pg_collection``.
        """
        if tuple(sharded_offsets) or metadata:
            raise NotImplementedError(
                f"{type(self).__name__}.sharded_state_dict: not supported yet: "
                f"sharded_offsets={sharded_offsets!r}, metadata={metadata!r}"
            )
        return module_sharded_state_dict(self, prefix)

    def set_is_first_microbatch(self) -> None:
        """Hook for kernels that cache weights per step (no-op in the PyTorch path)."""
