"""Low-precision (FP8 / FP4) quantization of GEMM operands, testable on CPU.

``QuantizedTensor`` (``tensor.py``) is the one currency: every quantizer returns one, every
quantized GEMM takes two. Recipes (tensorwise, delayed, blockwise, mxfp8, nvfp4) differ only in
how they choose ``scale_inv`` and its block shape.
"""

from megatron.core.quantization.tensor import QuantizedTensor

__all__ = ["QuantizedTensor"]
