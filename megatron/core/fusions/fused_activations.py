"""Fused MLP activations: SwiGLU as one region each way saving only its input, other activations compiled.

SwiGLU's reference (``mlp.py``) splits ``[gate | up]``, runs SiLU and a product, and autograd keeps the
gate, SiLU(gate) and up (three ``[s, b, ffn/tp]`` tensors). The fused function keeps the input
``[s, b, 2 ffn/tp]`` alone and recomputes the sigmoid in backward (in fp32):

    y = silu(g) * u,  du = dy * silu(g),  dg = dy * u * sig(g) * (1 + g * (1 - sig(g)))

The fc1 bias is already added inside fc1's GEMM (``addmm``), so "bias + activation" needs no extra
pass. A non-gated activation (GeLU, its tanh form, squared ReLU) runs as one compiled region; its
backward is the region's derivative, compiled with it.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F

from megatron.core.fusions.jit import jit_fuser


@jit_fuser
def swiglu_forward(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2f]`` (gate, up) -> ``[..., f]``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


@jit_fuser
def swiglu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy`` ``[..., f]``, input ``[..., 2f]`` -> its gradient ``[..., 2f]``."""
    gate, up = torch.chunk(x.float(), 2, dim=-1)
    sig = torch.sigmoid(gate)
    dy32 = dy.float()
    dgate = dy32 * up * sig * (1 + gate * (1 - sig))
    return torch.cat((dgate, dy32 * gate * sig), dim=-1).to(x.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU saving its input only (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return swiglu_forward(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return swiglu_backward(dy.contiguous(), x)


def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` ``[..., 2f]`` -> ``[..., f]``."""
    return SwiGLUFunction.apply(x)


_COMPILED: Dict[Callable, Callable] = {}


def fused_activation(x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``activation(x)`` as one compiled region (one per activation function, compiled once per shape)."""
    if activation not in _COMPILED:
        _COMPILED[activation] = jit_fuser(activation)
    return _COMPILED[activation](x)
