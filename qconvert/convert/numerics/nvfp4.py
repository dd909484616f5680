"""NVFP4: E2M1 elements, one E4M3 block scale per 1x16 block along the last axis, one fp32
global scale per tensor (docs/formats.md#nvfp4).

Layout: codes are 4-bit (sign in bit 3, magnitude index in bits 2..0 of
{0, 0.5, 1, 1.5, 2, 3, 4, 6}); element 2j goes in the low nibble of byte j. Block scales are
``float8_e4m3fn [..., K/16]``; the global scale is returned in the *decode* convention
(``scale_2 = global_amax / 2688``, ModelOpt's ``weight_scale_2``). compressed-tensors stores
the reciprocal, ``2688 / global_amax``, as ``weight_global_scale``.

Every producer computes "block scale = block_amax / 6 relative to the global scale, rounded
to E4M3; element = x / (block scale * global decode scale), rounded to E2M1", but in a
different fp32 operation order, so the bytes differ on a small fraction of blocks
(docs/formats.md#nvfp4-block-scale-recipes). "Bit-exact" therefore has to name a reference; two are implemented:

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

``recipe="4over6"``
    TransformerEngine 2.17 ``NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
    nvfp4_4over6_err_mode="MAE")`` without fast math, as its reference quantizer defines it
    (docs/formats.md#nvfp4-4over6)::

        S_enc = min(1536 / g, FLT_MAX), or 1 if g == 0 or that quotient is 0   (1536 = 6 * 256)
        S_dec = 1 / S_enc
        base  = (amax_blk / 6) * S_enc
        s6    = e4m3(min(base, 448));        s4 = e4m3(min(base * 1.5, 448))
        inv_k = min(1 / (s_k * S_dec), FLT_MAX)
        c_k   = e2m1_rn_satfinite(x * inv_k)                 (sign as in "te")
        err_k = sum over the 16 elements in order, from 0.0, of |((e2m1(c_k) * s_k) * g) / 1536 - x|
        keep (s4, c4) if err_4 < err_6, else (s6, c6)        (ties and NaN: map-to-6)

    ``scale_2 = g / 1536`` (``1 / FLT_MAX`` where S_enc was clamped). The C kernel
    (``qc_nvfp4_4over6``) and the Triton kernel (``_nvfp4_4over6_kernel``) implement it; the
    compiled chain (``QCONVERT_CUDA_QUANTIZER=compile``) is not used for it (the eager chain runs).

``g`` is the global amax: ``max|x|`` unless the caller passes ``global_amax`` (the max over a
fused group such as q/k/v or gate/up, docs/formats.md#nvfp4-shared-global-scales; it must be >= max|x| of this tensor). All
arithmetic is IEEE fp32 (tensor ops, no host round trips, except the per-tensor scalars of the
CPU C-kernel path, which are numpy fp32 scalars with the same operations), so CPU and CUDA give
the same bytes. NaN inputs give magnitude code 7; their sign is not specified.
"""

from __future__ import annotations

import numpy as np
import torch

from ...formats.schemes import NVFP4_BLOCK, NVFP4_RECIPES  # noqa: F401 (re-exported by numerics)
from . import cpu_kernels
from .pool import run_all

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: 6 * 448: global amax that maps to the largest block scale times the largest element.
NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX
#: 4over6: the E4M3 value the global scale maps the largest block to (TE ``nvfp4_e4m3_max``), so
#: that the map-to-4 scale (1.5x) of the largest block still fits E4M3.
FOUR_OVER_SIX_E4M3_MAX = 256.0
FOUR_OVER_SIX_EXPAND = 1.5


def global_div(recipe: str) -> float:
    """The per-recipe numerator of the global scale: ``scale_2 = g / global_div``, encode
    ``S_enc = global_div / g`` (2688 = 6 * 448; 1536 = 6 * 256 for 4over6)."""
    return E2M1_MAX * FOUR_OVER_SIX_E4M3_MAX if recipe == "4over6" else NVFP4_GLOBAL_DIV


def encode_global_scale(g, recipe: str) -> np.float32:
    """compressed-tensors' ``weight_global_scale`` (encode convention) from the group amax ``g``:
    ``global_div / g`` in fp32, clamped at FLT_MAX as TE does for tiny ``g``; 1 for ``g == 0``."""
    gf = np.float32(float(g))
    with np.errstate(all="ignore"):
        return np.minimum(np.float32(global_div(recipe)) / gf, _NP_FLT_MAX) if gf > 0 else np.float32(1.0)


def encode_global_scale_tensor(g: torch.Tensor, recipe: str) -> torch.Tensor:
    """:func:`encode_global_scale` on ``g``'s device, as a 1-element fp32 tensor (one element per
    group for the amaxes ``g [N]`` of a stack): the same fp32
    division (tensor by tensor, IEEE round to nearest; ``scalar / tensor`` would be a reciprocal
    and a product), clamp and zero rule, with no host sync (a GPU refit has one per fused group)."""
    g = g.reshape(-1).float()  # 0-dim -> [1]; one per group of a stack -> [N]
    q = torch.full_like(g, float(global_div(recipe))) / g
    return torch.where(g > 0, torch.clamp(q, max=_FLT_MAX), torch.ones_like(g))


_FLT_MAX = torch.finfo(torch.float32).max
_NP_FLT_MAX = np.float32(_FLT_MAX)
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# E2M1 rounding on the fp32 bit pattern (integer ops, no comparison passes):
# * |v| >= 1 (codes 2..7): RNE to one mantissa bit; (biased exponent << 1 | mantissa bit) - 252
#   is the code (1.0 -> 2, 6.0 -> 7). Saturation and NaN: |bits| clamped at bits(6.0) first.
# * |v| < 1 (codes 0..2, step 0.5): one fp32 add to 2^22, where the fp32 spacing is 0.5, rounds
#   |v| to a multiple of 0.5 with the hardware's RNE; the low bits of the sum are the code.
# Both are evaluated on clamped copies (|v| >= 1 resp. <= 1) and combined as lo + hi - 2, so
# there is no select. Ties: 0.25, 1.25, 2.5, 5 go down and 0.75, 1.75, 3.5 up, as RNE requires.
_ONE_BITS = 0x3F800000
_SIX_BITS = 0x40C00000
_TWO22 = 4194304.0  # 2^22
_HI_BIAS = 0x1FFFFF - (252 << 22)  # round-half-up term of the 22 dropped bits, minus code offset
_LO_BIAS = -((149 << 23) + 2)  # bits(2^22), and the "- 2" of lo + hi - 2


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of 4-bit E2M1 codes (any integer tensor; only the low nibble is read).

    Code 8 decodes to -0.0, so re-encoding the result with a sign-bit rule gives the code back.
    """
    levels = torch.tensor(_E2M1_LEVELS, dtype=torch.float32, device=codes.device)
    table = torch.cat([levels, -levels])
    return table[(codes.to(torch.int64) & 0xF)].to(dtype)


def _int(value: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Cached 0-dim integer constant: a Python int in a bitwise op is wrapped and converted on
    every call, which costs as much as the op itself on a cache-sized chunk."""
    key = (value, dtype, str(device))
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return t


def _e2m1_code_i32(v: torch.Tensor, te_sign: bool, bufs=None) -> torch.Tensor:
    """Signed E2M1 codes (int32, 0..15) of contiguous fp32 ``v``, whose storage is scratch.

    ``te_sign``: the sign is the sign bit of ``v`` (TE / CUDA ``cvt``); otherwise ``v < 0``
    (ModelOpt: -0.0 and NaN give 0). ``bufs``: optional three int32 buffers shaped like ``v``
    (the result is the first).
    """
    dev = v.device

    def c(value):
        return _int(value, torch.int32, dev)

    bits = v.view(torch.int32)
    a, sign, odd = bufs if bufs is not None else (torch.empty_like(bits) for _ in range(3))
    if te_sign:
        torch.bitwise_right_shift(bits, c(28), out=sign).bitwise_and_(c(8))
    else:
        sign.copy_(torch.lt(v, 0)).bitwise_left_shift_(c(3))
    torch.bitwise_and(bits, c(0x7FFFFFFF), out=a).clamp_(max=c(_SIX_BITS))
    # |v| < 1: clamp at 1.0, add 2^22 (in v's storage: its bits are no longer needed)
    lo = torch.clamp(a.view(torch.float32), max=1.0, out=v).add_(_TWO22).view(torch.int32)
    # |v| >= 1: clamp at 1.0, RNE to one mantissa bit
    a.clamp_(min=c(_ONE_BITS))
    torch.bitwise_right_shift(a, c(22), out=odd).bitwise_and_(c(1))
    a.add_(odd).add_(_HI_BIAS).bitwise_right_shift_(c(22))
    return a.add_(lo).add_(_LO_BIAS).bitwise_or_(sign)


def e2m1_signed_code(v: torch.Tensor, te_sign: bool) -> torch.Tensor:
    """Signed E2M1 codes (uint8, 0..15) of fp32 ``v`` (not modified): RNE, saturating at 6; the
    sign as ``_e2m1_code_i32`` takes it (``te_sign``: the sign bit; else ``v < 0``)."""
    return _e2m1_code_i32(v.float().contiguous().clone(), te_sign).to(torch.uint8)


def e2m1_magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude index (uint8, 0..7) of ``a >= 0``: round to nearest even, saturate at 6.

    Read off the fp32 bit pattern (see ``_e2m1_code_i32``); NaN maps to 7 like the references.
    """
    return _e2m1_code_i32(a.float().abs(), te_sign=True).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., K] (K even) into uint8 [..., K/2], element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension {codes.shape[-1]} is odd; FP4 packs two per byte")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _pack_i32_into(code: torch.Tensor, out: torch.Tensor, tmp64: torch.Tensor | None = None) -> None:
    """Pack contiguous int32 codes (0..15) [m] into uint8 ``out`` [m/2]: one int64 view, one
    shift, one or, one narrowing copy (little-endian: element 2j is the low word)."""
    p = code.view(torch.int64)
    t = torch.bitwise_right_shift(p, _int(28, torch.int64, p.device), out=tmp64)
    out.copy_(t.bitwise_or_(p))  # int64 -> uint8 keeps the low byte


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


_CONSTS: dict = {}


def _f32(value, device) -> torch.Tensor:
    """fp32 0-dim constant; cached (never written to), since building one costs more than an op
    on a cache-sized chunk."""
    key = (float(value), str(device))
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    return t


def nvfp4_scale_2(global_amax: torch.Tensor, div: float = NVFP4_GLOBAL_DIV) -> torch.Tensor:
    """Decode-convention global scale ``global_amax / 2688`` (fp32, 0-dim; ``div`` 1536 for 4over6).
    A ``global_amax`` of several elements (one per tensor or block of a stack) gives one each."""
    g = global_amax.float()
    return (g.reshape(()) if g.numel() == 1 else g) / _f32(div, global_amax.device)


def _te_s_enc(g: torch.Tensor, div: float) -> torch.Tensor:
    dev = g.device
    s_enc = torch.minimum(_f32(div, dev) / g, _f32(_FLT_MAX, dev))
    # g == 0 gives inf -> FLT_MAX above; g == inf gives 0. TE falls back to 1 for both.
    return torch.where((g == 0) | (s_enc == 0), _f32(1.0, dev), s_enc)


def te_tensor_scalars(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's per-tensor factors from the global amax ``g``: ``(S_enc * fl32(1/6), S_dec)``, fp32
    0-dim on ``g``'s device. The per-block part multiplies the block amax by the first."""
    dev = g.device
    s_enc = _te_s_enc(g, NVFP4_GLOBAL_DIV)
    s_dec = _f32(1.0, dev) / s_enc
    # fl32(1/6) times S_enc first, as TE folds it (core_nvfp4.cuh), then the block amax.
    return s_enc * _f32(1.0 / E2M1_MAX, dev), s_dec


def four_over_six_tensor_scalars(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4over6 recipe's per-tensor factors from the global amax ``g``: ``(S_enc, S_dec)`` of
    ``1536 / g``, fp32 0-dim on ``g``'s device."""
    s_enc = _te_s_enc(g, E2M1_MAX * FOUR_OVER_SIX_E4M3_MAX)
    return s_enc, _f32(1.0, g.device) / s_enc


def cpu_tensor_scalars(g: np.float32, recipe: str) -> tuple[np.float32, np.float32, np.float32]:
    """``(scale_2, k0, k1)`` for the C kernel from the global amax ``g``, as numpy fp32 scalars: the
    IEEE fp32 operations of :func:`recipe_scale_2` and :func:`te_tensor_scalars` (te: ``k0 = S_enc *
    fl32(1/6)``, ``k1 = S_dec``; 4over6: ``k0 = S_enc``, ``k1 = S_dec`` of ``1536 / g``) or
    :func:`modelopt_tensor_divisor` (modelopt: ``k0 = 6 * scale_2``, ``k1 = scale_2``), without the two dozen torch dispatches they cost per tensor (a quarter of a
    3 MB expert's time on a 2-core machine)."""
    f = np.float32
    div = f(global_div(recipe))
    with np.errstate(all="ignore"):  # g == 0 divides by zero, as the tensor code does
        scale_2 = g / div
        if recipe == "modelopt":
            return scale_2, f(E2M1_MAX) * scale_2, scale_2
        q = div / g
        if g > 0 and q > _NP_FLT_MAX:
            scale_2 = f(1.0) / _NP_FLT_MAX
        s_enc = np.minimum(q, _NP_FLT_MAX)  # NaN propagates, as torch.minimum
        if g == 0 or s_enc == 0:
            s_enc = f(1.0)
        if recipe == "4over6":
            return scale_2, s_enc, f(1.0) / s_enc
        return scale_2, s_enc * f(1.0 / E2M1_MAX), f(1.0) / s_enc


def _block_scales_te(blk_amax: torch.Tensor, g: torch.Tensor):
    """E4M3 block scales and fp32 element multipliers in TE's operation order."""
    dev = blk_amax.device
    flt_max = _f32(_FLT_MAX, dev)
    s_enc6, s_dec = te_tensor_scalars(g)
    s = blk_amax * s_enc6
    # CUDA's E4M3 conversion saturates; PyTorch's CUDA cast does not (docs/formats.md#cuda-e4m3-cast-does-not-saturate).
    scale = torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)
    inv = torch.minimum(_f32(1.0, dev) / (scale.float() * s_dec), flt_max)
    return scale, inv


def modelopt_tensor_divisor(scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor divisor of the block amax, ``6 * scale_2`` (fp32 0-dim)."""
    return _f32(E2M1_MAX, scale_2.device) * scale_2


def _block_scales_modelopt(blk_amax: torch.Tensor, g: torch.Tensor, scale_2: torch.Tensor):
    """E4M3 block scales and fp32 element divisors in ModelOpt's operation order."""
    dev = blk_amax.device
    s = blk_amax / modelopt_tensor_divisor(scale_2)
    # ModelOpt maps zero scales to 1.0. For g == 0 the quotient is 0/0 = NaN there; treat it
    # as a zero block too (declared deviation, see the module docstring).
    s = torch.where((s == 0) | (g == 0), _f32(1.0, dev), s)
    scale = torch.clamp(s, min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    div = scale.float() * scale_2
    # g == 0: divide by 1 instead of 0 so that the (all-zero) elements stay zero.
    div = torch.where(g == 0, _f32(1.0, dev), div)
    return scale, div


def _global_amax(x: torch.Tensor, global_amax) -> torch.Tensor:
    dev = x.device
    if global_amax is None:
        if not x.numel():
            return _f32(0.0, dev)
        lo, hi = torch.aminmax(x)  # one pass, exact, NaN propagates (= max|x|)
        return torch.maximum(lo.abs(), hi.abs()).float()
    if torch.is_tensor(global_amax):
        return global_amax.detach().to(device=dev, dtype=torch.float32).reshape(())
    return _f32(global_amax, dev)


def recipe_scale_2(g: torch.Tensor, recipe: str) -> torch.Tensor:
    dev = g.device
    div = global_div(recipe)
    scale_2 = nvfp4_scale_2(g, div)
    if recipe != "modelopt":
        # TE clamps S_enc = 2688/g at FLT_MAX (g below ~7.9e-36): the decode scale is then
        # 1/S_enc, not g/2688, or the stored blocks would decode too small.
        s_enc = _f32(div, dev) / g
        scale_2 = torch.where((g > 0) & (s_enc > _f32(_FLT_MAX, dev)), _f32(1.0, dev) / _f32(_FLT_MAX, dev), scale_2)
    return scale_2


_INT_OF = {2: torch.int16, 4: torch.int32}


def _block_amax(xb: torch.Tensor, fbuf: torch.Tensor | None = None) -> torch.Tensor:
    """max|x| per block of ``xb [n, 16]`` as fp32 [n], exact. For 2- and 4-byte floats on the
    bit pattern: clearing the sign bit gives |x|, and non-negative floats order like their bits
    (a NaN's bits exceed inf's, so NaN propagates as a NaN); about 4x cheaper on CPU for BF16."""
    if fbuf is not None:  # CPU chunks: |x| in fp32 scratch, then a 16-wide max pool (about 2x
        # cheaper again than the integer amax; max pooling propagates NaN like amax)
        f = fbuf.copy_(xb).abs_()
        return torch.nn.functional.max_pool1d(f.view(1, 1, -1), NVFP4_BLOCK).view(xb.shape[0])
    it = _INT_OF.get(xb.element_size())
    if it is None or xb.device.type != "cpu":
        return xb.abs().amax(dim=-1).float()
    mask = 0x7FFF if it is torch.int16 else 0x7FFFFFFF
    return (xb.view(it) & mask).amax(dim=-1).view(xb.dtype).float()


def _quantize_blocks(
    xb: torch.Tensor,
    g: torch.Tensor,
    scale_2: torch.Tensor,
    recipe: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bufs=None,
) -> None:
    """Quantize blocks ``xb [n, 16]`` into ``packed`` (uint8 [n, 8]) and ``scale`` (e4m3 [n]).

    ``bufs``: optional (fp32 [m, 16], int32 [m, 16] x 3, int64 [m, 8]) scratch with m >= n; the CPU
    path passes cache-sized ones. The pure tensor chain is the same on every device.
    """
    n = xb.shape[0]
    if recipe == "4over6":
        _quantize_blocks_4over6(xb, g, packed, scale)
        return
    blk_amax = _block_amax(xb, None if bufs is None else bufs[0][:n])
    if recipe == "te":
        sc, inv = _block_scales_te(blk_amax, g)
        v = torch.mul(xb, inv.unsqueeze(-1), out=None if bufs is None else bufs[0][:n])
    else:
        sc, div = _block_scales_modelopt(blk_amax, g, scale_2)
        v = torch.div(xb, div.unsqueeze(-1), out=None if bufs is None else bufs[0][:n])
    scale.copy_(sc)
    if bufs is None:
        code = _e2m1_code_i32(v, recipe == "te")
        packed.copy_((code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8))
    else:
        code = _e2m1_code_i32(v, recipe == "te", tuple(b[:n] for b in bufs[1:4]))
        _pack_i32_into(code.view(-1), packed.view(-1), bufs[4][:n].view(-1))


def _quantize_blocks_4over6(xb: torch.Tensor, g: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """The 4over6 recipe (module docstring) on blocks ``xb [n, 16]``: both candidates quantized
    in TE's order, the one with the smaller summed absolute error kept."""
    dev = xb.device
    flt_max = _f32(_FLT_MAX, dev)
    div = _f32(E2M1_MAX * FOUR_OVER_SIX_E4M3_MAX, dev)
    s_enc, s_dec = four_over_six_tensor_scalars(g)
    x = xb.float()
    g_col = g.unsqueeze(-1) if g.dim() else g  # one global amax per block (a stack) or for all
    base = (_block_amax(xb) / _f32(E2M1_MAX, dev)) * s_enc
    best_err = best_code = best_scale = None
    # map-to-6 first: it is kept unless map-to-4 is strictly better (ties and NaN keep map-to-6)
    for factor in (None, FOUR_OVER_SIX_EXPAND):
        s = base if factor is None else base * _f32(factor, dev)
        sc = torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)
        sf = sc.float()
        inv = torch.minimum(_f32(1.0, dev) / (sf * s_dec), flt_max)
        code = _e2m1_code_i32((x * inv.unsqueeze(-1)).contiguous(), True)
        deq = ((e2m1_to_float(code) * sf.unsqueeze(-1)) * g_col) / div
        diff = (deq - x).abs_()
        err = torch.zeros_like(sf)
        for i in range(NVFP4_BLOCK):  # fp32 sum in element order, as TE accumulates it
            err = err + diff[:, i]
        if best_err is None:
            best_err, best_code, best_scale = err, code, sc
        else:
            pick = err < best_err
            best_code = torch.where(pick.unsqueeze(-1), code, best_code)
            best_scale = torch.where(pick, sc.view(torch.uint8), best_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    scale.copy_(best_scale)
    packed.copy_((best_code[:, 0::2] | (best_code[:, 1::2] << 4)).to(torch.uint8))


#: Blocks per CPU work item: 8192 blocks of 16 are 512 KB of fp32 per scratch buffer (five of
#: them, 2.5 MB per worker), so no temporary the size of the whole tensor is ever made.
CPU_CHUNK_BLOCKS = 8192
#: Tensors of at most this many blocks are quantized in one pass in the calling thread.
SMALL_BLOCKS = 1024


def quantize_cpu_chain(xb, g, scale_2, recipe, packed, scale, workers: int) -> None:
    """The op chain on CPU blocks ``xb [n, 16]``: chunks of CPU_CHUNK_BLOCKS handed out to
    ``workers`` threads of the shared pool (``pool.py``), single-threaded in torch, as mxfp8.py
    does. What the C kernel's self-check compares with."""
    import threading

    n = xb.shape[0]
    chunk = CPU_CHUNK_BLOCKS
    if n <= SMALL_BLOCKS:
        _quantize_blocks(xb, g, scale_2, recipe, packed, scale)
        return
    starts = iter(range(0, n, chunk))
    lock = threading.Lock()

    def work():
        bufs = (
            torch.empty(chunk, NVFP4_BLOCK),
            *(torch.empty(chunk, NVFP4_BLOCK, dtype=torch.int32) for _ in range(3)),
            torch.empty(chunk, NVFP4_BLOCK // 2, dtype=torch.int64),
        )
        while True:
            with lock:
                i = next(starts, None)
            if i is None:
                return
            _quantize_blocks(xb[i : i + chunk], g, scale_2, recipe, packed[i : i + chunk], scale[i : i + chunk], bufs)

    workers = max(1, workers)
    run_all(workers, [(work,)] * min(workers, -(-n // chunk)))  # every chunk has ended when this returns


def nvfp4_quantize_blocks(xb: torch.Tensor, g: torch.Tensor, recipe: str = "te"):
    """Pure tensor core of :func:`nvfp4_quantize` on blocks ``xb [n, 16]`` with the global amax
    ``g`` (fp32 0-dim tensor): ``(packed uint8 [n, 8], block_scale e4m3 [n], scale_2)``.

    No Python branches on values and one flat shape, so ``torch.compile`` (see
    :func:`compiled_nvfp4_blocks`) specializes it once per distinct block count, a handful per
    model (q/o, k/v, each expert matrix).
    """
    scale_2 = recipe_scale_2(g, recipe)
    n = xb.shape[0]
    packed = torch.empty(n, NVFP4_BLOCK // 2, dtype=torch.uint8, device=xb.device)
    scale = torch.empty(n, dtype=torch.float8_e4m3fn, device=xb.device)
    _quantize_blocks(xb, g, scale_2, recipe, packed, scale)
    return packed, scale, scale_2


def nvfp4_quantize(
    x: torch.Tensor,
    global_amax=None,
    recipe: str = "te",
    workers: int | None = None,
    blocks_fn=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K % 16 == 0) along the last axis.

    Returns ``(packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16],
    scale_2 fp32 0-dim = global_amax / 2688)``. ``global_amax`` (float or tensor) overrides
    ``max|x|`` so that fused shards can share one global scale. ``recipe``: ``"te"`` or
    ``"modelopt"`` (see the module docstring for the exact formulas).

    On CPU the one-pass C kernel (cpu_kernels.py) runs where it could be built, else the op chain
    in cache-sized chunks, on ``workers`` threads (default: torch's intra-op thread count);
    elsewhere in one pass, through ``blocks_fn`` if given (the Triton kernel or a compiled
    :func:`nvfp4_quantize_blocks`). Every path gives the same bytes.
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
    xb = x.reshape(-1, NVFP4_BLOCK)
    w = torch.get_num_threads() if workers is None else workers
    if xb.shape[0] and cpu_kernels.usable(xb):  # per-tensor scalars in numpy fp32: see cpu_tensor_scalars
        if global_amax is None:
            g = cpu_kernels.abs_max_f32(xb, w)
        elif torch.is_tensor(global_amax):
            g = np.float32(global_amax.detach().float().item())
        else:
            g = np.float32(global_amax)
        scale_2, k0, k1 = cpu_tensor_scalars(g, recipe)
        packed = torch.empty(*lead, k // 2, dtype=torch.uint8)
        scale = torch.empty(*lead, k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn)
        pv, sv = packed.view(-1, NVFP4_BLOCK // 2), scale.view(-1)
        if recipe == "4over6":
            cpu_kernels.nvfp4_4over6_into(xb, float(k0), float(k1), float(g), pv, sv, w)
        else:
            cpu_kernels.nvfp4_into(xb, recipe == "te", float(k0), float(k1), bool(g == 0), pv, sv, w)
        return packed, scale, torch.tensor(scale_2, dtype=torch.float32)
    g = _global_amax(x, global_amax)
    if dev.type == "cpu" or blocks_fn is None or xb.shape[0] == 0:
        scale_2 = recipe_scale_2(g, recipe)
        packed = torch.empty(*lead, k // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(*lead, k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=dev)
        if xb.shape[0]:
            pv, sv = packed.view(-1, NVFP4_BLOCK // 2), scale.view(-1)
            if dev.type == "cpu":
                quantize_cpu_chain(xb, g, scale_2, recipe, pv, sv, w)
            else:
                _quantize_blocks(xb, g, scale_2, recipe, pv, sv)
        return packed, scale, scale_2
    if recipe not in getattr(blocks_fn, "recipes", ("te", "modelopt")):
        # a core that does not declare this recipe (the compiled chain has not been checked on 4over6)
        return nvfp4_quantize(x, global_amax, recipe, workers)
    packed, scale, scale_2 = blocks_fn(xb, g, recipe)
    return packed.reshape(*lead, k // 2), scale.reshape(*lead, k // NVFP4_BLOCK), scale_2


def nvfp4_quantize_stacked(
    x: torch.Tensor,
    global_amax: torch.Tensor,
    recipe: str = "te",
    workers: int | None = None,
    stacked_fn=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_quantize` of each ``x[i]`` of a stack ``x [N, ..., K]`` with its own global amax
    ``global_amax[i]`` (fp32 [N], on any device): ``(packed [N, ..., K/2], block_scale [N, ..., K/16],
    scale_2 fp32 [N])``, each item's bytes what ``nvfp4_quantize(x[i], global_amax[i])`` gives.

    On CUDA one call: ``stacked_fn`` (the Triton kernel, cuda_kernels.nvfp4_blocks_stacked) or the
    op chain with the global amax repeated per block (every per-tensor scalar of the chain is an
    elementwise operation, so it is computed per block with the same operations). On CPU the C
    kernel runs item by item (its per-tensor factors are numpy fp32 scalars), else that chain.
    """
    if recipe not in NVFP4_RECIPES:
        raise ValueError(f"unknown NVFP4 recipe {recipe!r}; expected one of {NVFP4_RECIPES}")
    if not x.is_floating_point():
        raise TypeError(f"NVFP4 input must be a floating tensor, got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"stack of shape {tuple(x.shape)}: need [N, ..., K] with K a multiple of 16")
    items, k = x.shape[0], x.shape[-1]
    dev = x.device
    g = global_amax.detach().to(device=dev, dtype=torch.float32).reshape(items)
    xb = x.reshape(-1, NVFP4_BLOCK)
    n = xb.shape[0]
    rows = n // items if items else 0
    packed = torch.empty(*x.shape[:-1], k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(*x.shape[:-1], k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=dev)
    pv, sv = packed.view(-1, NVFP4_BLOCK // 2), scale.view(-1)
    if n == 0:
        return packed, scale, recipe_scale_2(g, recipe).reshape(items)
    w = torch.get_num_threads() if workers is None else workers
    if dev.type == "cpu" and cpu_kernels.usable(xb):
        gs = g.numpy()
        s2s = np.empty(items, dtype=np.float32)
        for i in range(items):
            s2s[i], k0, k1 = cpu_tensor_scalars(gs[i], recipe)
            r = slice(i * rows, (i + 1) * rows)
            if recipe == "4over6":
                cpu_kernels.nvfp4_4over6_into(xb[r], float(k0), float(k1), float(gs[i]), pv[r], sv[r], w)
            else:
                cpu_kernels.nvfp4_into(xb[r], recipe == "te", float(k0), float(k1), bool(gs[i] == 0), pv[r], sv[r], w)
        return packed, scale, torch.from_numpy(s2s)
    if recipe not in getattr(stacked_fn, "recipes", ()):
        stacked_fn = None  # a core that does not declare this recipe: the op chain runs
    if stacked_fn is not None and dev.type != "cpu":
        p, s, scale_2 = stacked_fn(xb, g, recipe)
        return p.view(packed.shape), s.view(scale.shape), scale_2
    g_rows = g.repeat_interleave(rows)
    _quantize_blocks(xb, g_rows, recipe_scale_2(g_rows, recipe), recipe, pv, sv)
    return packed, scale, recipe_scale_2(g, recipe).reshape(items)


_compiled: dict = {}


def inductor_exact_options() -> dict | None:
    """Inductor settings under which compiled fp32 arithmetic equals eager bit for bit: IEEE
    division (Triton's ``/`` is the approximate ``div.full.f32``; Inductor also lowers
    ``1 / x`` to it) and no flush of fp32 subnormals. None if this torch has no such switch."""
    import torch._inductor.config as cfg

    keys = set(cfg.get_config_copy())
    opts = {}
    for k in ("eager_numerics.division_rounding", "emulate_division_rounding"):
        if k in keys:
            opts[k] = True
    if not opts:
        return None
    if "eager_numerics.disable_ftz" in keys:
        opts["eager_numerics.disable_ftz"] = True
    return opts


def compiled_nvfp4_blocks():
    """``torch.compile`` of :func:`nvfp4_quantize_blocks` (static shapes: with a dynamic block
    count the kernels ran about 10x slower on an H200, 2026-12-02) with
    :func:`inductor_exact_options`, or None where this torch cannot promise eager's bytes."""
    if "fn" not in _compiled:
        opts = inductor_exact_options()
        _compiled["fn"] = None if opts is None else torch.compile(nvfp4_quantize_blocks, dynamic=False, options=opts)
    return _compiled["fn"]


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
