"""MXFP8: E4M3 elements with one E8M0 scale byte per 1x32 block along the last axis.

Scale rule (formats.md §3): RCEIL, ``E = ceil(log2(amax / 448))`` computed in fp32, elements
``e4m3_RNE(x * 2^-E)``. This is what SGLang's and vLLM's online quantizers, FlashInfer,
TransformerEngine and ModelOpt compute, so a checkpoint written here holds the same bytes an
engine would produce by quantizing the BF16 weight itself.

One declared deviation: an E8M0 byte of 0 (scale 2^-127) is never written, because the
FlashInfer TRT-LLM MoE kernels reject it. The exponent is clamped to at least -126 (byte 1),
as NeMo-RL does. This changes only blocks whose amax is below 448 * 2^-127 (about 2.5e-36):
all-zero blocks (elements are zero whatever the scale) and blocks of subnormal magnitudes.
"""

from __future__ import annotations

import torch

MXFP8_BLOCK = 32
E4M3_MAX = 448.0
#: Smallest scale byte qconvert writes (2^-126). See the module docstring.
MIN_SCALE_BYTE = 1


def mxfp8_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (int32 tensor) for fp32 block maxima under RCEIL, at least 1.

    A non-finite amax (NaN or inf in the block) gives 255, E8M0's NaN: callers that must refuse
    non-finite weights check for it instead of making another pass over the data.

    ceil(log2(t)) for t = amax/448 is read off the fp32 bit pattern: adding 0x7FFFFF to the
    bits carries into the exponent field unless the mantissa is zero, so the exponent field of
    ``bits + 0x7FFFFF`` is the biased exponent of the smallest power of two >= t, which is the
    E8M0 byte itself. Exhaustively equal to the exact ceil for BF16 inputs (formats.md §3.3).
    """
    t = amax.float() / E4M3_MAX
    bits = t.view(torch.int32)
    byte = ((bits + 0x7FFFFF) >> 23) & 0xFF
    # A NaN amax's bits overflow the int32 add above (byte 1): map it to 255 as documented.
    byte = torch.where(torch.isnan(t), 255, byte)
    return byte.clamp_(min=MIN_SCALE_BYTE)


def _pow2_from_biased(biased: torch.Tensor) -> torch.Tensor:
    """fp32 power of two whose biased exponent field is ``biased`` (1..254)."""
    return (biased.to(torch.int32) << 23).view(torch.float32)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last axis. Returns (float8_e4m3fn [..., K], uint8 [..., K/32])."""
    if x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {MXFP8_BLOCK}")
    k = x.shape[-1]
    xb = x.reshape(*x.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK).float()
    amax = xb.abs().amax(dim=-1, keepdim=True)
    byte = mxfp8_scale_bytes(amax)
    # 2^-E has biased exponent 127 - E = 254 - byte; byte <= 254 keeps it a normal fp32 >= 1.
    # For the bytes BF16 can produce (<= 247) it is always a normal number.
    inv_scale = _pow2_from_biased(254 - byte.clamp(max=254))
    scaled = xb.mul_(inv_scale) if xb.data_ptr() != x.data_ptr() else xb * inv_scale
    # RCEIL guarantees |scaled| <= 448 for BF16 inputs; the clamp protects wider inputs from
    # PyTorch's non-saturating CUDA cast (formats.md §3.4).
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    return q, byte.squeeze(-1).to(torch.uint8)


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize`: ``q * 2^(byte - 127)``."""
    k = q.shape[-1]
    qb = q.reshape(*q.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK).float()
    b = scale.to(torch.int32)
    # byte 0 (2^-127) is an fp32 subnormal and 255 is NaN: handle both for foreign checkpoints.
    mult = _pow2_from_biased(b.clamp(1, 254))
    mult = torch.where(b == 0, torch.full_like(mult, 2.0**-127), mult)
    mult = torch.where(b == 255, torch.full_like(mult, float("nan")), mult).unsqueeze(-1)
    return (qb * mult).reshape(q.shape).to(dtype)
