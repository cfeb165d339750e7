"""Rotating queries and keys by rotary position angles (RoPE); the angles come from ``RotaryEmbedding``."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the leading ``freqs.shape[-1]`` channels of ``t`` ``[s, b, n, d]`` by ``freqs`` ``[s, 1, 1, r]``."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
