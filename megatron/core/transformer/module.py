"""MegatronModule: the base of every core module, holding its config."""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` built from a ``TransformerConfig``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def set_is_first_microbatch(self) -> None:
        """Hook for kernels that cache weights per step (no-op in the PyTorch path)."""
