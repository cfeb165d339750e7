"""Low-precision (FP8 / FP4) quantization of GEMM operands, testable on CPU.

``QuantizedTensor`` (``tensor.py``) is the one currency: every quantizer returns one, every
quantized GEMM takes two. Recipes (tensorwise, delayed, blockwise, mxfp8, nvfp4) differ only in
how they choose ``scale_inv`` and its block shape. Pure functions, one module per format:
``blockwise.py`` (1x128 / 128x128 fp32 scales), ``mxfp8.py`` (1x32 e8m0 scales), ``nvfp4.py``
(1x16 / 16x16 e4m3 scales times a per-tensor fp32 scale); ``gemm.py`` emulates a quantized GEMM
exactly, ``storage.py`` counts the bytes each format stores.
"""

from megatron.core.quantization.blockwise import quantize_blockwise
from megatron.core.quantization.gemm import emulated_gemm
from megatron.core.quantization.mxfp8 import quantize_mxfp8
from megatron.core.quantization.nvfp4 import NVFP4_LINEAR_RECIPE, quantize_nvfp4
from megatron.core.quantization.storage import storage_bytes
from megatron.core.quantization.tensor import QuantizedTensor

__all__ = [
    "NVFP4_LINEAR_RECIPE",
    "QuantizedTensor",
    "emulated_gemm",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "storage_bytes",
]
