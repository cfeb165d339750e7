"""A placeholder submodule that returns its input (Megatron's ``IdentityOp``)."""

from __future__ import annotations

from typing import Any

import torch


class IdentityOp(torch.nn.Module):
    """Takes any constructor arguments and returns its first forward argument unchanged.

    Used in layer specs where a slot must hold a module but nothing is computed, e.g. the
    pre-norms of a post-LN layer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x
