"""LayerNorm and RMSNorm with Megatron's options (zero-centred gamma, sequence-parallel marking)."""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions.fused_norm import fused_rms_norm
from megatron.core.transformer.transformer_config import TransformerConfig


class _Norm(torch.nn.Module):
    """Shared parameters of both norms.

    With ``zero_centered_gamma`` the stored weight is ``gamma - 1`` (starts at 0), so
    weight decay pulls the effective gain towards 1 rather than 0.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, with_bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.fused = config.persist_layer_norm  # --no-persist-layer-norm: the unfused reference (RMSNorm)
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)) if with_bias else None
        # With sequence parallelism every TP rank sees a different part of the sequence,
        # so the gradients of these replicated weights must be summed over TP.
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return self._normalize(x, self.gamma(), self.bias)
        # An fp32 residual stream (fp32_residual_connection) under bf16/fp16 weights: normalise in
        # fp32 and hand the layer after us its own dtype.
        bias = None if self.bias is None else self.bias.float()
        return self._normalize(x.float(), self.gamma().float(), bias).to(self.weight.dtype)


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dimension."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config, hidden_size, eps, with_bias=True)

    def _normalize(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], gamma, beta, self.eps)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last dimension, computed in fp32.

    With ``config.persist_layer_norm`` (on unless ``--no-persist-layer-norm``) the fused form
    (``fusions.fused_norm``: saves the input in its dtype and per-row ``rstd``); else this reference.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config, hidden_size, eps, with_bias=False)

    def _normalize(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fused:
            return fused_rms_norm(x, gamma, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * gamma


def build_norm(config: TransformerConfig, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """The norm named by ``config.normalization``."""
    cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return cls(config, hidden_size, config.layernorm_epsilon if eps is None else eps)


class Norm:
    """Spec entry for "the norm ``config.normalization`` names": building it returns a LayerNorm or RMSNorm.

    A class, not a function, because ``build_module`` returns a function spec uncalled (Megatron-core's
    rule for activation specs); Megatron-core's local spec uses a class of this kind the same way.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: Optional[float] = None) -> torch.nn.Module:
        return build_norm(config, hidden_size, eps)
