"""All-gathering block-quantized pieces of a sequence-parallel operand (bytes and scales, not bf16).

Under sequence parallelism each TP rank holds ``[t/tp, h]`` of a GEMM input. Blocks of 1xN along
``h`` never cross ranks, and blocks along the tokens (the weight gradient's ``[h, t]``) do not
either when ``t/tp`` is a multiple of N; nvfp4's one per-tensor scale is shared once its amax is
reduced over the group. Then quantizing each piece and gathering the pieces equals quantizing the
gathered tensor bit for bit, and what crosses the wire is the format's bytes: FP8 values as bytes,
FP4 values packed two per byte, block scales in their storage encoding (e8m0 / e4m3 bytes; fp32
for ``blockwise``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.quantization.formats import expand_blocks
from megatron.core.quantization.fp4 import pack_e2m1, unpack_e2m1
from megatron.core.quantization.tensor import QuantizedTensor
from megatron.core.utils import all_gather_into_tensor


def pieces_align(tokens_per_rank: int, token_block: Optional[int]) -> bool:
    """Whether blocks of ``token_block`` tokens (None: none along the tokens) stay on one rank."""
    return token_block is None or tokens_per_rank % token_block == 0


def _gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x [rows, cols]`` along ``dim`` (0 or 1), in rank order."""
    src = x if dim == 0 else x.t()  # [pieces along dim 0]
    world = dist.get_world_size(group)
    out = torch.empty((world * src.size(0), src.size(1)), dtype=src.dtype, device=src.device)
    all_gather_into_tensor(out, src.contiguous(), group=group)
    return out if dim == 0 else out.t().contiguous()


def _wire_values(q: QuantizedTensor) -> torch.Tensor:
    """The values as bytes: FP8 as is, e2m1 packed (NaN, only in blocks whose scale is NaN, sent as 0)."""
    if q.element_format == "e2m1":
        finite = torch.where(torch.isfinite(q.data), q.data, torch.zeros_like(q.data))  # from round_e2m1
        return pack_e2m1(finite, check=False)  # [r, c/2], no host read
    return q.data.view(torch.uint8)  # [r, c]


def _values(raw: torch.Tensor, like: QuantizedTensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    if like.element_format != "e2m1":
        return raw.view(like.data.dtype)
    values = unpack_e2m1(raw)  # [r, c] float32
    nan_block = torch.isnan(expand_blocks(scale_inv, block, tuple(values.shape)))
    return torch.where(nan_block, torch.full_like(values, float("nan")), values)


def all_gather_quantized(q: QuantizedTensor, group: dist.ProcessGroup, dim: int) -> QuantizedTensor:
    """Gather this rank's quantized piece ``q`` with the others' along ``dim`` (0: rows, 1: columns).

    Every block must lie inside one piece (``pieces_align``) and a per-tensor factor
    (``global_scale_inv``) must be equal on all ranks. Values of a non-finite block come back NaN.
    """
    if q.block[dim] > q.data.size(dim) or q.data.size(dim) % q.block[dim]:
        raise ValueError(f"blocks {q.block} cross the pieces: a piece has {q.data.size(dim)} along dim {dim}")
    scales = q.scale_raw if q.scale_raw is not None else q.scale_inv  # storage encoding when there is one
    scales = _gather(scales.view(torch.uint8) if scales.element_size() == 1 else scales, group, dim)
    scales = scales.view(q.scale_raw.dtype) if q.scale_raw is not None else scales
    scale_inv = scales.float()  # exact: e8m0 / e4m3 / fp32
    values = _values(_gather(_wire_values(q), group, dim), q, scale_inv, q.block)
    return QuantizedTensor(
        data=values,
        scale_inv=scale_inv,
        block=q.block,
        scale_raw=scales if q.scale_raw is not None else None,
        global_scale_inv=q.global_scale_inv,
        element_format=q.element_format,
    )
