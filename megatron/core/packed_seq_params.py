"""Packed sequences (Megatron's "THD" layout): several sequences laid end to end in one row.

A packed micro batch is ``[1, t]`` tokens; ``cu_seqlens`` ``[n + 1]`` (int32, starting at 0) are the
cumulative sequence lengths, so sequence ``i`` is tokens ``cu[i] .. cu[i+1]-1``. Attention computes
each sequence separately (``megatron.core.transformer.packed_attention``) and positions restart at 0
in every sequence, so a packed row gives each sequence exactly what it would get alone.

Under context parallelism every sequence is cut into ``2 * cp`` chunks (load balanced as the
unpacked layout: rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of *each* sequence), which needs every
length divisible by ``2 * cp``: ``cu_seqlens_q_padded`` gives the padded boundaries then, and
``cu_seqlens_q`` the real ones (the padding tokens are the tail of their sequence, loss-masked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class PackedSeqParams:
    """Megatron-core's fields for the ``thd`` format; only self-attention (``q == kv``) is packed here.

    ``qkv_format`` must be ``"thd"``; ``cu_seqlens_q`` / ``cu_seqlens_kv`` ``[n + 1]`` the real
    boundaries, ``*_padded`` the boundaries the tokens are laid out by (None: the real ones);
    ``max_seqlen_q`` / ``max_seqlen_kv`` the longest (padded) sequence. ``local_cp_size`` and
    ``cp_group`` are Megatron's hybrid-CP fields and must stay None: the model's CP group is used.
    """

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: Optional[dist.ProcessGroup] = None

    def layout_cu_seqlens(self) -> torch.Tensor:
        """The boundaries ``[n + 1]`` the tokens are laid out by (padded ones when given); checked."""
        if self.qkv_format != "thd":
            raise NotImplementedError(f"PackedSeqParams.qkv_format={self.qkv_format!r}: only 'thd' is supported")
        if self.local_cp_size is not None or self.cp_group is not None:
            raise NotImplementedError("PackedSeqParams.local_cp_size / cp_group (hybrid CP): not supported")
        q = self.cu_seqlens_q if self.cu_seqlens_q_padded is None else self.cu_seqlens_q_padded
        kv = self.cu_seqlens_kv if self.cu_seqlens_kv_padded is None else self.cu_seqlens_kv_padded
        if q is None or (kv is not None and not torch.equal(q, kv)):
            raise NotImplementedError("PackedSeqParams: cu_seqlens_q must be given and equal cu_seqlens_kv")
        return q

    def max_seqlen(self) -> int:
        """The longest sequence in the layout (``max_seqlen_q`` when given)."""
        return int(self.max_seqlen_q or sequence_lengths(self.layout_cu_seqlens()).max())


def sequence_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[n + 1]`` cumulative lengths -> ``[n]`` lengths."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def packed_seq_params_from_lengths(lengths: Sequence[int], divisible_by: int = 1) -> PackedSeqParams:
    """``PackedSeqParams`` for sequences of ``lengths`` laid out each padded up to a multiple of
    ``divisible_by`` (``2 * cp`` under context parallelism, times TP with sequence parallelism)."""
    real = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)  # [n + 1]
    padded_lengths = [-(-n // divisible_by) * divisible_by for n in lengths]
    padded = torch.tensor([0, *padded_lengths], dtype=torch.int32).cumsum(0).to(torch.int32)  # [n + 1]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max(padded_lengths),
        max_seqlen_kv=max(padded_lengths),
    )


def packed_position_ids(cu_seqlens: torch.Tensor, token_indices: torch.Tensor) -> torch.Tensor:
    """Position of each token within its sequence: ``token_indices`` ``[t]`` (indices into the packed
    row) -> ``[t]`` (index minus its sequence's start)."""
    cu = cu_seqlens.to(token_indices.device, torch.long)
    sequence = torch.searchsorted(cu, token_indices, right=True) - 1  # [t] sequence of each token
    return token_indices - cu[sequence]
