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

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.quantization.formats import expand_blocks
from megatron.core.quantization.fp4 import pack_e2m1, unpack_e2m1
from megatron.core.quantization.tensor import QuantizedTensor
from megatron.core.utils import all_gather_into_tensor


def pieces_align(tokens_per_rank: int, token_block: Optional[int]) -> bool:
    """Whether blocks of ``token_block`` tokens (None: none along the tokens) stay on one rank."""
    return token_block is None or tokens_per_rank % token_block == 0


class PendingGather:
    """A started gather: ``wait()`` waits for its collectives, then completes its result in place."""

    def __init__(self, works: List[Optional[dist.Work]], finish: Callable[[], None]) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()
        self.finish()


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> Tuple[torch.Tensor, Optional[dist.Work]]:
    """Start concatenating every rank's ``x [rows, cols]`` along ``dim``; the buffer is along dim 0
    (``_along(buffer, dim)`` once done)."""
    src = (x if dim == 0 else x.t()).contiguous()  # [pieces along dim 0]
    world = dist.get_world_size(group)
    out = torch.empty((world * src.size(0), src.size(1)), dtype=src.dtype, device=src.device)
    return out, all_gather_into_tensor(out, src, group=group, async_op=True)


def _along(buffer: torch.Tensor, dim: int) -> torch.Tensor:
    return buffer if dim == 0 else buffer.t().contiguous()


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


def start_all_gather_quantized(
    q: QuantizedTensor, group: dist.ProcessGroup, dim: int
) -> Tuple[QuantizedTensor, PendingGather]:
    """Start gathering this rank's quantized piece ``q`` with the others' along ``dim`` (0: rows,
    1: columns). The returned tensor's ``data`` and scales are None until the handle's ``wait()``.

    Every block must lie inside one piece (``pieces_align``) and a per-tensor factor
    (``global_scale_inv``) must be equal on all ranks. Values of a non-finite block come back NaN.
    """
    if q.block[dim] > q.data.size(dim) or q.data.size(dim) % q.block[dim]:
        raise ValueError(f"blocks {q.block} cross the pieces: a piece has {q.data.size(dim)} along dim {dim}")
    scales = q.scale_raw if q.scale_raw is not None else q.scale_inv  # storage encoding when there is one
    scale_buf, scale_work = _start_gather(
        scales.view(torch.uint8) if scales.element_size() == 1 else scales, group, dim
    )
    value_buf, value_work = _start_gather(_wire_values(q), group, dim)
    out = QuantizedTensor(None, None, q.block, None, q.global_scale_inv, q.element_format)

    def finish() -> None:
        raw = _along(scale_buf, dim)
        raw = raw.view(q.scale_raw.dtype) if q.scale_raw is not None else raw
        out.scale_inv = raw.float()  # exact: e8m0 / e4m3 / fp32
        out.scale_raw = raw if q.scale_raw is not None else None
        out.data = _values(_along(value_buf, dim), q, out.scale_inv, q.block)

    return out, PendingGather([scale_work, value_work], finish)


def all_gather_quantized(q: QuantizedTensor, group: dist.ProcessGroup, dim: int) -> QuantizedTensor:
    """``start_all_gather_quantized`` waited for."""
    out, pending = start_all_gather_quantized(q, group, dim)
    pending.wait()
    return out
