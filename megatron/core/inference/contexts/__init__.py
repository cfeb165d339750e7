"""The per-layer key/value cache of one generation batch (megatron-core's ``StaticInferenceContext``).

A context is passed as ``inference_context`` down ``GPTModel`` -> ``TransformerBlock`` ->
``TransformerLayer`` -> ``SelfAttention``. Every forward call covers the positions
``sequence_len_offset .. sequence_len_offset + s - 1`` of every sequence in the batch: attention
writes this call's keys and values (after RoPE) there and attends over positions ``0 ..
sequence_len_offset + s - 1``. The caller advances ``sequence_len_offset`` after the call.

A Mamba layer (``megatron/core/ssm``) keeps no keys and values but two states per sequence, which
``ssm_cache_for`` hands it: the last ``d_conv - 1`` inputs of its convolution and the scan's state. The
layer continues from them and replaces them, so each call must cover the next positions of every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch


@dataclass
class MambaStates:
    """One Mamba layer's states: ``conv_state`` ``[b, conv channels/tp, d_conv - 1]`` and ``ssm_state``
    ``[b, heads/tp, head dim, state dim]`` (fp32); None before the layer's first call."""

    conv_state: Optional[torch.Tensor] = None
    ssm_state: Optional[torch.Tensor] = None


class StaticInferenceContext:
    """KV cache for ``max_batch_size`` sequences of up to ``max_sequence_length`` tokens.

    ``key_value_memory_dict[layer_number]`` (global, 1-based layer numbers: each pipeline stage
    holds its own layers) is a pair of key and value buffers ``[max_sequence_length,
    max_batch_size, groups/tp, d]``, allocated on the layer's first call with its dtype and device.
    ``materialize_only_last_token_logits``: the model computes logits for the last position only.
    """

    def __init__(
        self, max_batch_size: int, max_sequence_length: int, materialize_only_last_token_logits: bool = False
    ) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"StaticInferenceContext(max_batch_size={max_batch_size}, max_sequence_length={max_sequence_length}):"
                " both must be >= 1"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        # Encoder-decoder models: each cross-attention layer's keys and values of the encoder output.
        self.cross_key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.ssm_states: Dict[int, MambaStates] = {}  # by global 1-based layer number

    def is_static_batching(self) -> bool:
        """Every sequence of the batch at the same positions (``DynamicInferenceContext``: False)."""
        return True

    def is_decode_only(self) -> bool:
        """Whether the cache already holds positions (later calls add one token per sequence)."""
        return self.sequence_len_offset > 0

    def increment_sequence_len_offset(self, length: int) -> None:
        """Advance past the ``length`` positions the last forward call wrote."""
        self.sequence_len_offset += length

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for the next batch)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.cross_key_value_memory_dict.clear()
        self.ssm_states.clear()

    def ssm_cache_for(self, layer: Any) -> MambaStates:
        """The states of Mamba layer ``layer`` (by its ``layer_number``), empty on its first call."""
        if self.sequence_len_offset == 0:
            self.ssm_states.pop(layer.layer_number, None)  # a new batch: start from nothing
        return self.ssm_states.setdefault(layer.layer_number, MambaStates())

    def append_key_value(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``[s, b, groups/tp, d]`` at the current offset of ``layer_number``'s cache.

        Returns:
            Keys and values of positions ``0 .. sequence_len_offset + s - 1``, ``[offset + s, b, groups/tp, d]``.
        """
        s, b = key.shape[:2]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s
        if end > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(
                f"KV cache overflow: positions {start}..{end - 1} of batch {b}; the context holds "
                f"max_sequence_length={self.max_sequence_length}, max_batch_size={self.max_batch_size}"
            )
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, self.max_batch_size, *key.shape[2:])
            self.key_value_memory_dict[layer_number] = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=value.dtype, device=value.device),
            )
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        key_cache[start:end, :b] = key
        value_cache[start:end, :b] = value
        return key_cache[:end, :b], value_cache[:end, :b]

    def query_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """Positions ``[s]`` of the ``length`` tokens of the current call."""
        return torch.arange(self.sequence_len_offset, self.sequence_len_offset + length, device=device)
