"""Rotary position embeddings (RoPE): the angles; attention rotates queries and keys with them.

``apply_rotary_pos_emb`` lives in ``megatron.core.transformer.rope_utils`` (attention uses it, and
the transformer never imports models); it is re-exported here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.transformer.rope_utils import apply_rotary_pos_emb, rotary_angles, rotary_inverse_frequencies

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb", "llama3_scaled_frequencies"]


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths slow down by ``factor``, short ones stay.

    Wavelengths below ``original_max_position / high_freq_factor`` keep their frequency,
    those above ``original_max_position / low_freq_factor`` are divided by ``factor``, and
    the band between blends the two linearly in ``original_max_position / wavelength``.
    """
    wavelength = 2 * math.pi / inv_freq  # [dim/2]
    slowed = inv_freq / factor
    blend = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelength > original_max_position / low_freq_factor, slowed, blended)
    return torch.where(wavelength < original_max_position / high_freq_factor, inv_freq, out)


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for the first ``rotary_percent`` of each head's channels.

    Args:
        kv_channels: channels per attention head.
        rotary_percent: fraction of channels that rotate (the rest pass through).
        rotary_interleaved: rotate adjacent pairs (x0,x1),(x2,x3)... instead of halves.
        seq_len_interpolation_factor: divide positions by this (linear position interpolation).
        rotary_base: base of the geometric frequency progression.
        rope_scaling: apply Llama 3.1's frequency scaling (``llama3_scaled_frequencies``).
        rope_scaling_factor: its ``factor`` (8 for Llama 3.1).
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: float = 10000.0,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ) -> None:
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent={rotary_percent}: must be in (0, 1]")
        dim = int(kv_channels * rotary_percent)
        if dim % 2:
            raise ValueError(f"rotary dimension kv_channels x rotary_percent = {dim} must be even")
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = rotary_inverse_frequencies(dim, rotary_base)  # [dim/2]
        if rope_scaling:
            if rope_scaling_factor < 1.0:
                raise ValueError(f"rope_scaling_factor={rope_scaling_factor}: must be >= 1")
            inv_freq = llama3_scaled_frequencies(inv_freq, rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles for positions ``offset .. offset+max_seq_len-1``, shaped ``[s, 1, 1, dim]``."""
        pos = torch.arange(max_seq_len, dtype=torch.float32, device=self.inv_freq.device) + offset  # [s]
        if self.seq_len_interpolation_factor is not None:
            pos = pos / self.seq_len_interpolation_factor
        return rotary_angles(self.inv_freq, pos, self.rotary_interleaved)  # [s, 1, 1, dim]
