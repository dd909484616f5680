"""NVFP4: E2M1 elements, one E4M3 block scale per 1x16 block along the last axis, one fp32
global scale per tensor (formats.md §5).

Layout: codes are 4-bit (sign in bit 3, magnitude index in bits 2..0 of
{0, 0.5, 1, 1.5, 2, 3, 4, 6}); element 2j goes in the low nibble of byte j. Block scales are
``float8_e4m3fn [..., K/16]``; the global scale is returned in the *decode* convention
(``scale_2 = global_amax / 2688``, ModelOpt's ``weight_scale_2``). compressed-tensors stores
the reciprocal, ``2688 / global_amax``, as ``weight_global_scale``.

Every producer computes "block scale = block_amax / 6 relative to the global scale, rounded
to E4M3; element = x / (block scale * global decode scale), rounded to E2M1", but in a
different fp32 operation order, so the bytes differ on a small fraction of blocks
(formats.md §5.3). "Bit-exact" therefore has to name a reference; two are implemented:

``recipe="te"``
    TransformerEngine's ``NVFP4Quantizer`` (1-D, no RHT, no stochastic rounding), which
    miles uses, and FlashInfer ``nvfp4_quantize`` with
    ``FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1``::

        S_enc = min(2688 / g, FLT_MAX), or 1 if g == 0 or that quotient is 0
        S_dec = 1 / S_enc
        s     = e4m3_satfinite(min(amax_blk * (S_enc * fl32(1/6)), FLT_MAX))
        inv   = min(1 / (s * S_dec), FLT_MAX)
        code  = e2m1_rn_satfinite(x * inv)

    The E2M1 sign is the sign bit of ``x * inv`` (so -0.0 and negatives that round to zero
    give 0x8), as in CUDA's ``cvt.rn.satfinite.e2m1x2.f32`` / ``__nv_cvt_float_to_fp4``.
    A nonzero block whose scale rounds to E4M3 zero gets ``inv = FLT_MAX``, so its codes
    saturate to +-6 while its scale byte is 0 (it decodes to zero, as in TE).

``recipe="modelopt"``
    ModelOpt ``NVFP4QTensor.quantize`` (dynamic path)::

        ws2  = g / 2688
        s    = amax_blk / (6 * ws2); s == 0 -> 1.0; clamp to [2^-9, 448]; to E4M3 (RNE)
        code = e2m1_rne_sat(x / (s * ws2))

    The sign is ``x / (s * ws2) < 0``: -0.0 gives 0x0, a negative value that rounds to zero
    gives 0x8. Declared deviation: for ``g == 0`` ModelOpt produces NaN block scales and
    codes of 6.0 (0/0); here such a tensor (necessarily all zeros) gets codes 0, block
    scales 1.0 (ModelOpt's own zero-block value) and ``scale_2 = 0``, which decodes to zeros.

``g`` is the global amax: ``max|x|`` unless the caller passes ``global_amax`` (the max over a
fused group such as q/k/v or gate/up, §5.4; it must be >= max|x| of this tensor). All
arithmetic is fp32 tensor arithmetic (no host round trips), so the same code gives the same
bytes on CPU and CUDA. NaN inputs give magnitude code 7; their sign is not specified.
"""

from __future__ import annotations

import torch

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: 6 * 448: global amax that maps to the largest block scale times the largest element.
NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX
NVFP4_RECIPES = ("te", "modelopt")

_FLT_MAX = torch.finfo(torch.float32).max
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision points between neighbouring magnitudes. At a tie RNE goes to the even code: the
# lower neighbour at 0.25, 1.25, 2.5, 5 (codes 0, 2, 4, 6), the upper one at 0.75, 1.75, 3.5.
# Each entry is (threshold, tie goes up).
_E2M1_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of 4-bit E2M1 codes (any integer tensor; only the low nibble is read).

    Code 8 decodes to -0.0, so re-encoding the result with a sign-bit rule gives the code back.
    """
    levels = torch.tensor(_E2M1_LEVELS, dtype=torch.float32, device=codes.device)
    table = torch.cat([levels, -levels])
    return table[(codes.to(torch.int64) & 0xF)].to(dtype)


def e2m1_magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude index (uint8, 0..7) of ``a >= 0``: round to nearest even, saturate at 6.

    Counting the thresholds that ``a`` does *not* exceed and subtracting from 7 is exact RNE
    and about 4x faster on CPU than ``searchsorted`` (seven fused compare passes, no binary
    search). Written as "not exceeded" so that NaN, which fails every comparison, maps to 7
    like the references do.
    """
    below = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        below += (a < threshold) if tie_up else (a <= threshold)
    return 7 - below  # stays uint8


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., K] (K even) into uint8 [..., K/2], element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension {codes.shape[-1]} is odd; FP4 packs two per byte")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _f32(value, device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())


def nvfp4_scale_2(global_amax: torch.Tensor) -> torch.Tensor:
    """Decode-convention global scale ``global_amax / 2688`` (fp32, 0-dim)."""
    return global_amax.float().reshape(()) / _f32(NVFP4_GLOBAL_DIV, global_amax.device)


def _block_scales_te(blk_amax: torch.Tensor, g: torch.Tensor):
    """E4M3 block scales and fp32 element multipliers in TE's operation order."""
    dev = blk_amax.device
    flt_max = _f32(_FLT_MAX, dev)
    s_enc = torch.minimum(_f32(NVFP4_GLOBAL_DIV, dev) / g, flt_max)
    # g == 0 gives inf -> FLT_MAX above; g == inf gives 0. TE falls back to 1 for both.
    s_enc = torch.where((g == 0) | (s_enc == 0), _f32(1.0, dev), s_enc)
    s_dec = _f32(1.0, dev) / s_enc
    # fl32(1/6) times S_enc first, as TE folds it (core_nvfp4.cuh), then the block amax.
    s = blk_amax * (s_enc * _f32(1.0 / E2M1_MAX, dev))
    # CUDA's E4M3 conversion saturates; PyTorch's CUDA cast does not (formats.md §3.4).
    scale = torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)
    inv = torch.minimum(_f32(1.0, dev) / (scale.float() * s_dec), flt_max)
    return scale, inv


def _block_scales_modelopt(blk_amax: torch.Tensor, g: torch.Tensor, scale_2: torch.Tensor):
    """E4M3 block scales and fp32 element divisors in ModelOpt's operation order."""
    dev = blk_amax.device
    s = blk_amax / (_f32(E2M1_MAX, dev) * scale_2)
    # ModelOpt maps zero scales to 1.0. For g == 0 the quotient is 0/0 = NaN there; treat it
    # as a zero block too (declared deviation, see the module docstring).
    s = torch.where((s == 0) | (g == 0), _f32(1.0, dev), s)
    scale = torch.clamp(s, min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    div = scale.float() * scale_2
    # g == 0: divide by 1 instead of 0 so that the (all-zero) elements stay zero.
    div = torch.where(g == 0, _f32(1.0, dev), div)
    return scale, div


def nvfp4_quantize(
    x: torch.Tensor, global_amax=None, recipe: str = "te"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K % 16 == 0) along the last axis.

    Returns ``(packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16],
    scale_2 fp32 0-dim = global_amax / 2688)``. ``global_amax`` (float or tensor) overrides
    ``max|x|`` so that fused shards can share one global scale. ``recipe``: ``"te"`` or
    ``"modelopt"`` (see the module docstring for the exact formulas).
    """
    if recipe not in NVFP4_RECIPES:
        raise ValueError(f"unknown NVFP4 recipe {recipe!r}; expected one of {NVFP4_RECIPES}")
    if not x.is_floating_point():
        raise TypeError(f"NVFP4 input must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"last dimension of shape {tuple(x.shape)} is not a multiple of 16")
    k = x.shape[-1]
    lead = x.shape[:-1]
    dev = x.device
    # |x| in the input dtype is exact, and so is its max; only then widen (half the traffic
    # for BF16 input).
    blk_amax = x.reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK).abs().amax(dim=-1).float()
    if global_amax is None:
        g = blk_amax.amax() if blk_amax.numel() else _f32(0.0, dev)
    else:
        g = _f32(global_amax, dev) if not torch.is_tensor(global_amax) else (
            global_amax.detach().to(device=dev, dtype=torch.float32).reshape(())
        )
    scale_2 = nvfp4_scale_2(g)
    if recipe == "te":
        # TE clamps S_enc = 2688/g at FLT_MAX (g below ~7.9e-36): the decode scale is then
        # 1/S_enc, not g/2688, or the stored blocks would decode too small.
        s_enc = _f32(NVFP4_GLOBAL_DIV, dev) / g
        scale_2 = torch.where((g > 0) & (s_enc > _f32(_FLT_MAX, dev)), _f32(1.0, dev) / _f32(_FLT_MAX, dev), scale_2)

    xb = x.reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    owned = xb.dtype != torch.float32  # .float() made a copy we may overwrite
    xb = xb.float()
    if recipe == "te":
        scale, inv = _block_scales_te(blk_amax, g)
        v = xb.mul_(inv.unsqueeze(-1)) if owned else xb * inv.unsqueeze(-1)
        sign = torch.signbit(v)
    else:
        scale, div = _block_scales_modelopt(blk_amax, g, scale_2)
        v = xb.div_(div.unsqueeze(-1)) if owned else xb / div.unsqueeze(-1)
        sign = v < 0
    code = e2m1_magnitude_code(v.abs_())
    code |= sign.to(torch.uint8) << 3
    packed = pack_fp4(code.reshape(*lead, k))
    return packed, scale, scale_2


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    scale_2,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``e2m1 * (block_scale * scale_2)``, the operation order of ModelOpt's dequantize.

    ``scale_2`` is the decode-convention global scale (ModelOpt ``weight_scale_2``); for a
    compressed-tensors ``weight_global_scale`` pass its reciprocal.
    """
    codes = unpack_fp4(packed)
    k = codes.shape[-1]
    vals = e2m1_to_float(codes).reshape(*codes.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=packed.device).reshape(())
    mult = block_scale.float() * s2
    return (vals * mult.unsqueeze(-1)).reshape(codes.shape).to(dtype)
