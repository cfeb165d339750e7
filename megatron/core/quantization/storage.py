"""Bytes a quantized operand occupies (values plus scales), for reporting measured memory savings.

Per element, with compact (unpadded) scale tensors:

=====================  ==========  =======================  =================
format                 data bytes  scale bytes              total per element
=====================  ==========  =======================  =================
bf16 (reference)       2           0                        2
fp8 tensorwise         1           4 per tensor             ~1
fp8 blockwise 1x128    1           4 / 128                  1.03125
fp8 blockwise 128x128  1           4 / 16384                ~1.00024
mxfp8 1x32 (e8m0)      1           1 / 32                   1.03125
nvfp4 1x16 (e4m3)      0.5         1 / 16 (+4 per tensor)   0.5625
nvfp4 16x16 (e4m3)     0.5         1 / 256 (+4 per tensor)  ~0.50391
=====================  ==========  =======================  =================

Kernels may pad scale tensors (TE swizzles mxfp8/nvfp4 scales into 128x4 tiles) and training keeps
a row-wise and a column-wise copy of some operands; neither is counted here.
"""

from __future__ import annotations

from megatron.core.quantization.tensor import QuantizedTensor

ELEMENT_BITS = {"e2m1": 4}  # formats held unpacked in a wider dtype: their stored width


def storage_bytes(q: QuantizedTensor) -> int:
    """Bytes to store ``q`` packed: its values, its block scales in their raw encoding, any global scale."""
    numel = q.data.numel()
    if q.element_format is not None:
        if q.element_format not in ELEMENT_BITS:
            raise ValueError(f"element_format={q.element_format!r} has no known width; known: {list(ELEMENT_BITS)}")
        data_bytes = -(-numel * ELEMENT_BITS[q.element_format] // 8)
    else:
        data_bytes = numel * q.data.element_size()
    scales = q.scale_raw if q.scale_raw is not None else q.scale_inv
    scale_bytes = scales.numel() * scales.element_size()
    global_bytes = 0 if q.global_scale_inv is None else q.global_scale_inv.numel() * q.global_scale_inv.element_size()
    return data_bytes + scale_bytes + global_bytes
