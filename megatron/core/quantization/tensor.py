"""``QuantizedTensor``: low-precision values plus the scales that map them back to real numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass
class QuantizedTensor:
    """A 2-D GEMM operand ``[rows, cols]`` stored in a low-precision format.

    ``real[i, j] = data[i, j] * scale_inv[i // block[0], j // block[1]]``

    * ``data``: the quantized values ``[rows, cols]``, as ``torch.float8_e4m3fn`` /
      ``torch.float8_e5m2``, or, for FP4 (e2m1), as float32 values that are exactly
      representable in e2m1 (unpacked, so they can be dequantized with one multiply).
    * ``scale_inv``: fp32 dequantization scale per block, ``[ceil(rows / block[0]),
      ceil(cols / block[1])]``; a per-tensor scale is the ``[1, 1]`` case with ``block ==
      (rows, cols)``. Formats whose block scales are themselves low precision (mxfp8's e8m0,
      nvfp4's e4m3 times a per-tensor fp32 scale) store the already-combined fp32 value here;
      the quantizer that made it documents the raw encoding.
    * ``block``: the rows and columns one scale covers.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values ``[rows, cols]`` in ``dtype`` (computed in fp32, exact for every format here)."""
        rows, cols = self.data.shape
        scale = self.scale_inv.float()
        scale = scale.repeat_interleave(self.block[0], dim=0)[:rows]  # [rows, ceil(cols/bc)]
        scale = scale.repeat_interleave(self.block[1], dim=1)[:, :cols]  # [rows, cols]
        return (self.data.float() * scale).to(dtype)
