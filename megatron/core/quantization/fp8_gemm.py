"""Quantized GEMMs ``A B^T`` over two ``QuantizedTensor`` operands (``F.linear``'s layout).

Per-tensor scales on both sides go to ``torch._scaled_mm`` (CPU and CUDA: float8 inputs,
fp32 accumulation, output in the activation dtype). Block-scaled operands (blockwise, mxfp8,
nvfp4) are emulated exactly: dequantize to fp32, fp32 matmul. CUDA's kernel wants every
dimension a multiple of 16: the token dimension, which varies (MoE experts), is zero-padded
there; the weight dimensions are checked once when FP8 is switched on (``check_fp8_dims``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.tensor import QuantizedTensor

FP8_GEMM_MULTIPLE = 16


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


def _scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor ``a.real @ b.real^T`` ``[m, n]`` through ``torch._scaled_mm`` (fp32 accumulation)."""
    a_data, b_data = a.data, b.data  # [m, k], [n, k]
    m, n = a_data.size(0), b_data.size(0)
    if a_data.is_cuda:  # the CUDA kernel's rule; zero rows/columns change no sum
        a_data = _pad_cols(_pad_rows(a_data, FP8_GEMM_MULTIPLE), FP8_GEMM_MULTIPLE)
        b_data = _pad_cols(_pad_rows(b_data, FP8_GEMM_MULTIPLE), FP8_GEMM_MULTIPLE)
    out = torch._scaled_mm(
        a_data.contiguous(),
        b_data.contiguous().t(),  # column-major [k, n], as the kernel wants
        scale_a=a.scale_inv.reshape(()).float(),
        scale_b=b.scale_inv.reshape(()).float(),
        out_dtype=out_dtype,
    )  # [m', n']
    return out[:m, :n]


def quantized_matmul(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a.real @ b.real^T``: ``a [m, k]``, ``b [n, k]`` -> ``[m, n]`` in ``out_dtype``."""
    if a.data.size(1) != b.data.size(1):
        raise ValueError(f"quantized_matmul: inner dimensions differ: {tuple(a.data.shape)} x {tuple(b.data.shape)}^T")
    if a.data.size(0) == 0 or b.data.size(0) == 0 or a.data.size(1) == 0:
        return torch.zeros(a.data.size(0), b.data.size(0), dtype=out_dtype, device=a.data.device)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if is_per_tensor(a) and is_per_tensor(b) and a.data.dtype in fp8 and b.data.dtype in fp8:
        return _scaled_mm(a, b, out_dtype)
    return emulated_gemm(a, b, out_dtype)  # [m, n]: dequantize, fp32 matmul
