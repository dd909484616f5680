"""MXFP4 (E2M1 elements, one E8M0 scale per 1x32 block, as gpt-oss stores its experts) and its
cast to NVFP4 (docs/formats.md#mxfp4-to-nvfp4).

No I/O. Layout: ``packed`` uint8 [..., K/2] (element 2j in the low nibble, sign in bit 3), ``e8m0``
uint8 [..., K/32], value = e2m1 * 2^(e8m0 - 127).

The cast (ModelOpt 0.47's closed form): ``k_max`` is the largest exponent of a nonzero scale (per
tensor, or shared by a fused gate/up pair), ``scale_2 = 2^(k_max - 8)``. A 32-block whose exponent
k has ``d = k - k_max + 8`` in [-9, 8] becomes two NVFP4 blocks with the exactly representable E4M3
scale 2^d and its own nibbles: it decodes to the source values ("lossless"; a -0 nibble is written
+0, as ModelOpt's sign rule gives). Any other block is requantized from its values with the
block amax ``max|e2m1| * 2^k`` (ModelOpt's data-derived amax), the scale clamped to [2^-9, 448],
elements rounded as ModelOpt's NVFP4 quantizer rounds them.

MXFP4 -> MXFP8 (:func:`mxfp4_to_mxfp8`) is lossless for every block: each E2M1 value (0, 0.5 .. 6)
is an E4M3 value, so the elements become E4M3 and the E8M0 byte stays; only the byte 0xFF (NaN in
E8M0) has no value (:func:`nan_scale_blocks`).
"""

from __future__ import annotations

import torch

from .nvfp4 import e2m1_signed_code, e2m1_to_float, unpack_fp4

MXFP4_BLOCK = 32
E8M0_BIAS = 127
#: E4M3 holds 2^d exactly for d in [-9, 8] (2^-9..2^-7 as subnormals)
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8


_TABLES: dict = {}


def _tables(device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte -> its two E2M1 values [256, 2], E8M0 byte -> 2^(byte - 127) [256]; 0xFF -> inf) in
    ``dtype`` (fp32 and BF16 hold every entry exactly)."""
    key = (str(device), dtype)
    if key not in _TABLES:
        codes = torch.arange(256, dtype=torch.int32)
        pairs = torch.stack((e2m1_to_float(codes & 0xF), e2m1_to_float(codes >> 4)), -1).float()
        pow2 = torch.ldexp(torch.ones(256), (torch.arange(256) - E8M0_BIAS).float())
        _TABLES[key] = (pairs.to(device, dtype), pow2.to(device, dtype))
    return _TABLES[key]


def mxfp4_decode_bf16(packed: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """BF16 values, computed in BF16: each E2M1 value (at most two significant bits) times 2^k is
    a BF16 value for every k of E8M0 (BF16 has fp32's exponent range, subnormals to 2^-133), so
    each product is exact, equal to :func:`mxfp4_decode` rounded to BF16, except where it exceeds
    BF16's largest value (inf: byte 253 with |e2m1| >= 4, byte 254 with |e2m1| >= 2); the caller
    refuses those."""
    pairs, pow2 = _tables(packed.device, torch.bfloat16)
    vals = torch.nn.functional.embedding(packed.long(), pairs).view(*e8m0.shape, MXFP4_BLOCK)
    return vals.mul_(pow2[e8m0.long()].unsqueeze(-1)).view(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_decode(packed: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """fp32 values (exact: two significant bits times a power of two): each byte's two elements
    from a 256-entry table, times the block's 2^k (one table lookup per byte and per block)."""
    pairs, pow2 = _tables(packed.device)
    vals = torch.nn.functional.embedding(packed.long(), pairs).view(*e8m0.shape, MXFP4_BLOCK)
    return vals.mul_(pow2[e8m0.long()].unsqueeze(-1)).view(*packed.shape[:-1], packed.shape[-1] * 2)


#: the E8M0 byte that encodes NaN (OCP MX): no block may carry it
E8M0_NAN = 0xFF


def nan_scale_blocks(e8m0: torch.Tensor) -> torch.Tensor:
    """Indices [m, e8m0.dim()] of blocks whose E8M0 byte is 0xFF (NaN: the block has no value)."""
    return (e8m0 == E8M0_NAN).nonzero()


def mxfp4_to_mxfp8(packed: torch.Tensor, e8m0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., K], e8m0 bytes [..., K/32])``: the same values (lossless, the scale byte kept;
    a -0 nibble stays -0). The caller refuses 0xFF scale bytes first (:func:`nan_scale_blocks`)."""
    if packed.shape[:-1] != e8m0.shape[:-1] or packed.shape[-1] * 2 != e8m0.shape[-1] * MXFP4_BLOCK:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scales {tuple(e8m0.shape)}")
    # every E2M1 value is exactly an E4M3 value: the cast rounds nothing
    return e2m1_to_float(unpack_fp4(packed)).to(torch.float8_e4m3fn), e8m0.clone()


def k_max_of(e8m0: torch.Tensor) -> int:
    """Largest exponent of a nonzero E8M0 byte (0 where every block is zero)."""
    nz = e8m0[e8m0 > 0]
    return int(nz.max()) - E8M0_BIAS if nz.numel() else 0


def _pow2_e4m3_byte(d: torch.Tensor) -> torch.Tensor:
    """E4M3 byte of 2^d for d in [-9, 8]: exponent field d + 7 for d >= -6, else mantissa 2^(d + 9)."""
    normal = (d + 7) << 3
    sub = torch.bitwise_left_shift(torch.ones_like(d), (d + 9).clamp(min=0, max=2))
    return torch.where(d >= -6, normal, sub).to(torch.uint8)


def mxfp4_to_nvfp4(packed: torch.Tensor, e8m0: torch.Tensor, k_max: int | None = None):
    """``(packed uint8 [..., K/2], block scales e4m3 [..., K/16], scale_2 fp32 0-dim, lossless
    bool [..., K/32])``. ``k_max``: shared exponent (default: this tensor's, :func:`k_max_of`)."""
    if packed.shape[:-1] != e8m0.shape[:-1] or packed.shape[-1] * 2 != e8m0.shape[-1] * MXFP4_BLOCK:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scales {tuple(e8m0.shape)}")
    if k_max is None:
        k_max = k_max_of(e8m0)
    m = k_max - E4M3_POW2_MAX
    scale_2 = torch.tensor(2.0**m, dtype=torch.float32)
    k = e8m0.to(torch.int32) - E8M0_BIAS
    d = k - m
    lossless = (d >= E4M3_POW2_MIN) & (d <= E4M3_POW2_MAX)

    # lossless blocks: scale 2^d, the source's nibbles (-0 written +0)
    nib = unpack_fp4(packed).view(*e8m0.shape, MXFP4_BLOCK)
    kept_codes = torch.where((nib & 0x7) == 0, torch.zeros_like(nib), nib)
    kept_scale = _pow2_e4m3_byte(d.clamp(E4M3_POW2_MIN, E4M3_POW2_MAX))

    # the others: data-derived amax, clamped E4M3 scale, elements divided and rounded (ModelOpt order)
    x = mxfp4_decode(packed, e8m0).view(*e8m0.shape, MXFP4_BLOCK)
    amax = torch.ldexp(e2m1_to_float(nib & 0x7).amax(dim=-1), k.float())
    s = (amax / (6.0 * scale_2)).clamp(min=2.0**-9, max=448.0).to(torch.float8_e4m3fn)
    div = (s.float() * scale_2).unsqueeze(-1)
    req_codes = e2m1_signed_code(x / div, te_sign=False)

    codes = torch.where(lossless.unsqueeze(-1), kept_codes, req_codes).reshape(*packed.shape[:-1], -1)
    scale = torch.where(lossless, kept_scale, s.view(torch.uint8))
    # an all-zero block (E8M0 byte 0, every nibble +-0) decodes to zero under any scale
    lossless = lossless | ((e8m0 == 0) & ((nib & 0x7) == 0).all(dim=-1))
    scale = scale.repeat_interleave(2, dim=-1).view(torch.float8_e4m3fn)  # two NVFP4 blocks per 32
    out = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return out, scale, scale_2, lossless
