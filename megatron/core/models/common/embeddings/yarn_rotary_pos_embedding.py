"""YaRN rotary angles (context extension by per-frequency interpolation), as DeepSeek-V3 uses them.

Frequencies that turn fewer than ``beta_slow`` times over the original context are divided by the
scaling factor, those turning more than ``beta_fast`` times keep their value, and a linear ramp in
the channel index blends the band between. The cos/sin scale (``yarn_concentration``) and the
softmax temperature (``yarn_mscale``) live in ``transformer/rope_utils.py``: attention applies them.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def _correction_channel(rotations: float, dim: int, base: float, original_max_position: int) -> float:
    """The (fractional) channel pair whose frequency turns ``rotations`` times over the original context."""
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_range(
    dim: int, base: float, original_max_position: int, beta_fast: float, beta_slow: float
) -> Tuple[int, int]:
    """Channel pairs ``[low, high]`` between which YaRN blends, rounded outwards and clipped to the dims."""
    low = math.floor(_correction_channel(beta_fast, dim, base, original_max_position))
    high = math.ceil(_correction_channel(beta_slow, dim, base, original_max_position))
    return max(low, 0), min(high, dim - 1)


def yarn_inverse_frequencies(
    dim: int,
    base: float,
    scaling_factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """``[dim/2]`` inverse frequencies: the kept ones (``extrapolated``) and the divided ones blended by the ramp."""
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    interpolated = extrapolated / scaling_factor
    low, high = yarn_ramp_range(dim, base, original_max_position, beta_fast, beta_slow)
    span = (high - low) or 1e-3  # a single-channel band: a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)  # [dim/2], 0 -> keep
    return interpolated * ramp + extrapolated * (1 - ramp)


class YarnRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` over ``kv_channels`` channels with YaRN's frequencies (same ``forward``)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
    ) -> None:
        super().__init__(
            kv_channels, rotary_base=rotary_base, seq_len_interpolation_factor=seq_len_interpolation_factor
        )
        inv_freq = yarn_inverse_frequencies(
            kv_channels, rotary_base, scaling_factor, original_max_position_embeddings, beta_fast, beta_slow
        )  # [dim/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
