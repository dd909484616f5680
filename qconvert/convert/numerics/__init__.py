"""Pure tensor quantizers. No I/O; the same code runs on CPU and CUDA tensors."""

from .mxfp8 import MXFP8_BLOCK, mxfp8_dequantize, mxfp8_quantize
from .nvfp4 import (
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIV,
    NVFP4_RECIPES,
    e2m1_magnitude_code,
    e2m1_to_float,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_scale_2,
    pack_fp4,
    unpack_fp4,
)

__all__ = [
    "MXFP8_BLOCK",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL_DIV",
    "NVFP4_RECIPES",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_scale_2",
    "e2m1_to_float",
    "e2m1_magnitude_code",
    "pack_fp4",
    "unpack_fp4",
]
