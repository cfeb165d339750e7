"""Rotating queries and keys by rotary position angles (RoPE); the angles come from ``RotaryEmbedding``
(``rotary_inverse_frequencies`` and ``rotary_angles``, here so that attention can build angles of its own base).

Also YaRN's two scales (they depend only on the config, so attention computes them itself):
``yarn_mscale`` and the cos/sin ``yarn_concentration``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.fusions.jit import jit_fuser


def rotary_inverse_frequencies(dim: int, base: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[dim/2]`` for ``dim`` rotated channels: ``base^(-2i/dim)`` (made on ``device``:
    no host-to-device copy in a forward pass)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rotary_angles(inv_freq: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Angles ``[s, 1, 1, dim]`` of ``positions`` ``[s]``: pairs (f0 f0 f1 f1 ...) or halves (f0 f1 ... f0 f1 ...)."""
    freqs = torch.outer(positions, inv_freq)  # [s, dim/2]
    emb = torch.stack((freqs, freqs), dim=-1).flatten(-2) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]  # [s, 1, 1, dim]


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, mscale: float = 1.0, fused: bool = False
) -> torch.Tensor:
    """Rotate the leading ``freqs.shape[-1]`` channels of ``t`` ``[s, b, n, d]`` by ``freqs`` ``[s, 1, 1, r]``.

    ``mscale`` multiplies cos and sin (YaRN's concentration; 1 otherwise). ``fused``
    (``config.apply_rope_fusion``): the same function as one compiled region (``jit_fuser``: one pass
    forward and one backward instead of about eight).
    """
    if fused:
        return _apply_rotary_pos_emb_fused(t, freqs, interleaved, mscale)
    return apply_rotary_pos_emb_unfused(t, freqs, interleaved, mscale)


def apply_rotary_pos_emb_unfused(
    t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float
) -> torch.Tensor:
    """The reference of ``apply_rotary_pos_emb``."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos(), freqs.sin()
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)


_apply_rotary_pos_emb_fused = jit_fuser(apply_rotary_pos_emb_unfused)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` channels ``x0 x1 x2 x3 ...`` -> ``x0 x2 ... x1 x3 ...``: interleaved pairs become halves."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if scaling_factor <= 1.0 else 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor YaRN multiplies cos and sin by: ``yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)``."""
    return yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)
