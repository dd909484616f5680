"""FP8 block-scaled sources (DeepSeek-V3 / Qwen3-FP8 style, docs/formats.md#fp8-block-sources):
``weight`` E4M3 [N, K] and ``weight_scale_inv`` fp32 [ceil(N/bn), ceil(K/bk)], one *decode*
multiplier per bn x bk block (``w = e4m3 * scale``, despite the name).

No I/O. Decoding is one fp32 multiplication per element (the product of an E4M3 value and an
fp32 scale, rounded once), as the engines' block-FP8 dequantization computes it.

MXFP8 from such a source: a block whose scale is a power of two 2^k (fp32 normal) is already an
MXFP8 block family: its E4M3 bytes are kept and each 1x32 sub-block gets the E8M0 byte k + 127, so
the output decodes exactly to the source values. Every other block is dequantized and quantized
with RCEIL like a BF16 tensor (:func:`mxfp8_patch_lossless` leaves those bytes as the caller's RCEIL
pass made them).
"""

from __future__ import annotations

import torch

from .mxfp8 import MXFP8_BLOCK


def scale_grid(shape, block) -> tuple[int, int]:
    """Shape of the scale tensor of a weight ``shape`` [N, K] with ``block`` (bn, bk)."""
    n, k = shape
    bn, bk = block
    return -(-n // bn), -(-k // bk)


def expand_blocks(t: torch.Tensor, shape, block) -> torch.Tensor:
    """Per-block values ``t [gn, gk]`` repeated over their bn x bk elements, cut to ``shape``."""
    bn, bk = block
    return t.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[: shape[0], : shape[1]]


def bad_scale_blocks(scale: torch.Tensor) -> torch.Tensor:
    """Indices [m, 2] of scales that are not finite or are negative (a decode multiplier must be
    a finite non-negative number)."""
    s = scale.float()
    return (~torch.isfinite(s) | (s < 0)).nonzero()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """fp32 values of E4M3 ``weight [N, K]`` with per-block decode scales ``scale``."""
    return weight.float() * expand_blocks(scale.float(), weight.shape, block)


def pow2_blocks(scale: torch.Tensor) -> torch.Tensor:
    """bool [gn, gk]: the block's scale is 2^k, an fp32 normal (k in -126..127), so its E4M3
    bytes are MXFP8 elements under the E8M0 scale byte k + 127 (the fp32 exponent field)."""
    bits = scale.float().contiguous().view(torch.int32)
    expo = (bits >> 23) & 0xFF
    return ((bits & 0x807FFFFF) == 0) & (expo > 0) & (expo < 255)


def mxfp8_patch_lossless(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block
) -> tuple[int, int]:
    """Overwrite, in the MXFP8 output ``q`` (E4M3 [N, K]) and ``s`` (E8M0 bytes [N, K/32]) of the
    dequantized tensor, every block with a power-of-two scale by the source's E4M3 bytes and the
    scale's exponent byte. Returns (lossless blocks, blocks). ``bk`` must be a multiple of 32."""
    bn, bk = block
    if bk % MXFP8_BLOCK:
        raise ValueError(f"block width {bk} is not a multiple of {MXFP8_BLOCK}")
    mask = pow2_blocks(scale)
    n_lossless, n_blocks = int(mask.sum()), mask.numel()
    if n_lossless:
        shape = tuple(weight.shape)
        elem = expand_blocks(mask.to(q.device), shape, block)
        qv, wv = q.view(torch.uint8), weight.view(torch.uint8).to(q.device)
        qv.copy_(torch.where(elem, wv, qv))
        expo = ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).to(s.device)
        sub = (bn, bk // MXFP8_BLOCK)
        sshape = (shape[0], shape[1] // MXFP8_BLOCK)
        sv = s.view(torch.uint8)
        sv.copy_(torch.where(expand_blocks(mask.to(s.device), sshape, sub), expand_blocks(expo, sshape, sub), sv))
    return n_lossless, n_blocks
