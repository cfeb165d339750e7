"""Fused bias + dropout + residual add: ``residual + dropout(x + bias)`` as one region.

The reference (``TransformerLayer._bias_dropout_add``) makes up to three passes over ``[s, b, h]``
(bias add, dropout, residual add) and keeps dropout's mask. Fused: without dropout (evaluation or
``p = 0``) one pass whose backward is the identity; with dropout the keep mask is drawn as bytes
(``bernoulli_``, from the same RNG stream, so activation recomputation under the RNG tracker
redraws it identically) and one pass applies bias, mask, scale and the add; backward keeps the mask only.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions.jit import jit_fuser


@jit_fuser
def _bias_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    out = x if bias is None else x + bias
    return residual + out


@jit_fuser
def _bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    out = x if bias is None else x + bias
    return residual + out * keep * scale


def fused_bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)``; ``x``, ``residual`` ``[s, b, h]``, ``bias`` ``[h]`` or None."""
    if not training or prob == 0.0:
        return _bias_add(x, bias, residual)
    if prob == 1.0:  # nothing kept: the reference's zeros (no 1 / (1 - p))
        out = x if bias is None else x + bias
        return residual + torch.nn.functional.dropout(out, p=1.0, training=True)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - prob)  # [s, b, h]
    return _bias_dropout_add(x, bias, residual, keep, 1.0 / (1.0 - prob))
