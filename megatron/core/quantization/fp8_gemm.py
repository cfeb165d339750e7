"""Quantized GEMMs ``A B^T`` over two ``QuantizedTensor`` operands (``F.linear``'s layout).

Per-tensor scales on both sides go to ``torch._scaled_mm`` (CPU and CUDA: float8 inputs,
fp32 accumulation, output in the activation dtype). Block-scaled operands (blockwise, mxfp8,
nvfp4) are emulated exactly: dequantize to fp32, fp32 matmul.

The operands handed to ``torch._scaled_mm`` follow the CUDA kernel's rules on every device, so
that a CPU run exercises the layout a GPU gets (``scaled_mm_operands``): the first operand
row-major ``[m, k]``, the second column-major ``[k, n]``, every dimension a multiple of 16
(zero rows/columns are appended and cut off again: they change no sum), fp32 one-element scales
on the operands' device. Where the kernel has no variant (both operands e5m2, or an output dtype
other than bf16 / fp16 / fp32) the GEMM is emulated instead (``scaled_mm_supported``).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.tensor import QuantizedTensor

FP8_GEMM_MULTIPLE = 16
SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_per_tensor(q: QuantizedTensor) -> bool:
    """One scale for the whole tensor (``scale_inv`` is ``[1, 1]``)."""
    return q.scale_inv.numel() == 1 and tuple(q.block) == tuple(max(n, 1) for n in q.data.shape)


def transpose(q: QuantizedTensor) -> QuantizedTensor:
    """The exact transpose ``[cols, rows]`` (data, block scales and block shape transposed)."""
    return QuantizedTensor(q.data.t().contiguous(), q.scale_inv.t().contiguous(), (q.block[1], q.block[0]))


def check_fp8_dims(name: str, out_features: int, in_features: int) -> None:
    """FP8 GEMM kernels need both weight dimensions divisible by 16 (Transformer Engine's rule too)."""
    for what, n in (("output", out_features), ("input", in_features)):
        if n % FP8_GEMM_MULTIPLE:
            raise ValueError(
                f"{name}: FP8 GEMMs need the weight's {what} size divisible by {FP8_GEMM_MULTIPLE}, "
                f"got [{out_features}, {in_features}] (per tensor-parallel rank)"
            )


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.size(0)) % multiple
    return x if pad == 0 else F.pad(x.view(torch.uint8), (0, 0, 0, pad)).view(x.dtype)


def _pad_cols(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.size(1)) % multiple
    return x if pad == 0 else F.pad(x.view(torch.uint8), (0, pad)).view(x.dtype).contiguous()


def scaled_mm_supported(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` has a kernel for ``a @ b^T``: per-tensor float8 operands, not both
    e5m2 (cuBLASLt has no e5m2 x e5m2 FP8 GEMM), an output dtype among ``SCALED_MM_OUT_DTYPES``."""
    if not (is_per_tensor(a) and is_per_tensor(b)):
        return False
    if a.data.dtype not in _FP8_DTYPES or b.data.dtype not in _FP8_DTYPES:
        return False
    both_e5m2 = a.data.dtype == b.data.dtype == torch.float8_e5m2
    return not both_e5m2 and out_dtype in SCALED_MM_OUT_DTYPES


def scaled_mm_operands(
    a: QuantizedTensor, b: QuantizedTensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch._scaled_mm``'s ``(mat1, mat2, scale_a, scale_b)`` for ``a @ b^T`` in the CUDA kernel's layout.

    ``mat1`` ``[m', k']`` row-major, ``mat2`` ``[k', n']`` column-major (the transpose view of a
    contiguous ``[n', k']``), the primed sizes rounded up to multiples of 16 with zeros; ``scale_a`` /
    ``scale_b`` 0-dim fp32 on the operands' device.
    """
    device = a.data.device
    mat1 = _pad_cols(_pad_rows(a.data, FP8_GEMM_MULTIPLE), FP8_GEMM_MULTIPLE).contiguous()  # [m', k']
    b_rows = _pad_cols(_pad_rows(b.data, FP8_GEMM_MULTIPLE), FP8_GEMM_MULTIPLE).contiguous()  # [n', k']
    scale_a = a.scale_inv.reshape(()).to(device=device, dtype=torch.float32)
    scale_b = b.scale_inv.reshape(()).to(device=device, dtype=torch.float32)
    return mat1, b_rows.t(), scale_a, scale_b  # mat2: [k', n'] column-major, as the kernel wants


def _scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor ``a.real @ b.real^T`` ``[m, n]`` through ``torch._scaled_mm`` (fp32 accumulation)."""
    m, n = a.data.size(0), b.data.size(0)
    out = torch._scaled_mm(*scaled_mm_operands(a, b), out_dtype=out_dtype)  # [m', n']
    return out[:m, :n]


def quantized_matmul(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a.real @ b.real^T``: ``a [m, k]``, ``b [n, k]`` -> ``[m, n]`` in ``out_dtype``."""
    if a.data.size(1) != b.data.size(1):
        raise ValueError(f"quantized_matmul: inner dimensions differ: {tuple(a.data.shape)} x {tuple(b.data.shape)}^T")
    if a.data.size(0) == 0 or b.data.size(0) == 0 or a.data.size(1) == 0:
        return torch.zeros(a.data.size(0), b.data.size(0), dtype=out_dtype, device=a.data.device)
    if scaled_mm_supported(a, b, out_dtype):
        return _scaled_mm(a, b, out_dtype)
    return emulated_gemm(a, b, out_dtype)  # [m, n]: dequantize, fp32 matmul
