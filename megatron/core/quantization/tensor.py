"""``QuantizedTensor``: low-precision values plus the scales that map them back to real numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class QuantizedTensor:
    """A 2-D GEMM operand ``[rows, cols]`` stored in a low-precision format.

    ``real[i, j] = data[i, j] * scale_inv[i // block[0], j // block[1]] (* global_scale_inv)``

    * ``data``: the quantized values ``[rows, cols]``, as ``torch.float8_e4m3fn`` /
      ``torch.float8_e5m2``, or, for FP4 (e2m1), as float32 values that are exactly
      representable in e2m1 (unpacked, so they can be dequantized with one multiply).
    * ``scale_inv``: fp32 dequantization scale per block, ``[ceil(rows / block[0]),
      ceil(cols / block[1])]``; a per-tensor scale is the ``[1, 1]`` case with ``block ==
      (rows, cols)``. Formats whose block scales are themselves low precision store their exact
      fp32 value here (mxfp8: the e8m0 power of two; nvfp4: the e4m3 block scale, with the
      per-tensor factor kept apart in ``global_scale_inv`` so that ``data * scale_inv`` stays exact).
    * ``block``: the rows and columns one scale covers.
    * ``scale_raw`` (optional): the block scales in their storage encoding, same shape as
      ``scale_inv`` (``torch.float8_e8m0fnu`` for mxfp8, ``torch.float8_e4m3fn`` for nvfp4).
    * ``global_scale_inv`` (optional): a per-tensor fp32 factor ``[]`` applied after the block
      scale (nvfp4's second level).
    * ``element_format`` (optional): names the element format when ``data``'s dtype does not
      (``"e2m1"`` for FP4 values held in float32).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Tuple[int, int]
    scale_raw: Optional[torch.Tensor] = None
    global_scale_inv: Optional[torch.Tensor] = None
    element_format: Optional[str] = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values ``[rows, cols]`` in ``dtype``, computed in fp32.

        Exact for every format here (unless a result lands in fp32's subnormal range) except nvfp4,
        whose per-tensor factor costs one fp32 rounding.
        """
        rows, cols = self.data.shape
        scale = self.scale_inv.float()
        scale = scale.repeat_interleave(self.block[0], dim=0)[:rows]  # [rows, ceil(cols/bc)]
        scale = scale.repeat_interleave(self.block[1], dim=1)[:, :cols]  # [rows, cols]
        real = self.data.float() * scale  # [rows, cols]
        if self.global_scale_inv is not None:
            real = real * self.global_scale_inv.float()
        return real.to(dtype)
