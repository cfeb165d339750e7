"""Quantized GEMM emulated exactly on any device: dequantize both operands, multiply in fp32."""

from __future__ import annotations

import torch

from megatron.core.quantization.tensor import QuantizedTensor


def emulated_gemm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T`` in fp32, cast to ``out_dtype``: ``[m, k] x [n, k] -> [m, n]``.

    The reference for every block-scaled format (blockwise, mxfp8, nvfp4) where no kernel exists:
    dequantization is exact (nvfp4: one fp32 rounding for the per-tensor factor), so the result
    differs from a hardware kernel by fp32 accumulation order only.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"emulated_gemm computes a @ b.T over the shared last dim; got a {tuple(a.data.shape)}, "
            f"b {tuple(b.data.shape)}"
        )
    out = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T  # [m, n] fp32
    return out.to(out_dtype)
