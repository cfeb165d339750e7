"""Fused RMSNorm: one forward and one backward region that keep only the input and per-row statistics.

The reference (``transformer/norms.py``, unfused) runs about six fp32 kernels and autograd keeps an fp32
copy of the input for backward (4 extra bytes per element under bf16). Here forward saves the input in
its own dtype and ``rstd`` ``[..., 1]`` (fp32), and backward recomputes the normalised input:

    n = x * rstd,  y = n.to(dtype) * gamma
    dgamma = sum_rows(dy * n),  dn = dy * gamma,  dx = rstd * (dn - n * mean(dn * n))

(the rounding ``.to(dtype)`` passes gradients straight through, as autograd does). All statistics and the
backward run in fp32; the gradients return in their tensors' dtypes. LayerNorm needs nothing here:
torch's ``layer_norm`` already is one fused kernel each way saving the input, mean and rstd.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron.core.fusions.jit import jit_fuser


@jit_fuser
def rms_norm_forward(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., h]``, ``gamma`` ``[h]`` -> (``y`` ``[..., h]``, ``rstd`` ``[..., 1]`` fp32)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    return (x32 * rstd).to(x.dtype) * gamma, rstd


@jit_fuser
def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``dx`` ``[..., h]`` in x's dtype, ``dgamma`` ``[h]`` in gamma's dtype); fp32 inside."""
    n = x.float() * rstd  # [..., h]
    dy32 = dy.float()
    dgamma = (dy32 * n).reshape(-1, n.size(-1)).sum(0)  # [h]
    dn = dy32 * gamma.float()  # [..., h]
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


class FusedRMSNormFunction(torch.autograd.Function):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` saving ``x`` and ``rstd`` only (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = rms_norm_forward(x, gamma, eps)
        ctx.save_for_backward(x, rstd, gamma)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, gamma = ctx.saved_tensors
        dx, dgamma = rms_norm_backward(dy.contiguous(), x, rstd, gamma)
        return dx, (dgamma if ctx.needs_input_grad[1] else None), None


def fused_rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., h]`` over its last dimension with gain ``gamma`` ``[h]`` (module doc)."""
    return FusedRMSNormFunction.apply(x, gamma, eps)
