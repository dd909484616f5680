"""Pure tensor quantizers. No I/O; the same code runs on CPU and CUDA tensors."""

from .mxfp8 import MXFP8_BLOCK, mxfp8_dequantize, mxfp8_quantize

__all__ = ["MXFP8_BLOCK", "mxfp8_quantize", "mxfp8_dequantize"]
