"""One-pass CUDA kernels (Triton) for the MXFP8 and NVFP4 block quantizers.

The torch op chains in ``mxfp8.py`` / ``nvfp4.py`` define the bytes; on CUDA they run as ~20
separate elementwise kernels, each streaming the tensor through device memory, and
``torch.compile`` of them costs a compile per tensor shape. These kernels read each input
element once and write each output byte once, for any shape, and give the same bytes as the
torch chains (checked on every BF16 bit pattern on an H200: ``tests/test_cuda_kernels.py``,
``scripts/bench_gpu.py``). They are written independently of the torch chains (E2M1 as the
least of three fp32-rounded candidates instead of mantissa-bit arithmetic), so the check is not
a copy checked against itself.

Exactness needs IEEE fp32 division (``div_rn``; Triton's ``/`` is approximate), no
flush-to-zero of fp32 subnormals and no multiply-add contraction: the launch options below.
NVFP4's per-tensor scalars (from the global amax, read from device memory: no host round trip)
are computed in the kernel in the torch code's operation order; as tiny torch kernels they cost
10-20% of a layer's time.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

libdevice = None
if triton is not None:
    try:  # libdevice's correctly rounded reciprocal; where a Triton lacks it, IEEE division by 1
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - depends on the Triton version
        try:
            from triton.language.extra.cuda import libdevice
        except ImportError:
            libdevice = None
    if libdevice is not None and not hasattr(libdevice, "rcp_rn"):  # pragma: no cover
        libdevice = None

#: Quantization blocks and warps per Triton program (from sweeps on an H200: MXFP8 2026-12-02;
#: NVFP4 2026-12-04, fraction of copy bandwidth, one process per measurement, 3 rounds: te 128x1
#: 0.875-0.888, 64x1 0.814-0.822; modelopt 64x1 0.717-0.724, 128x1 0.659-0.668; 128x2 and 32x1
#: slower for both).
MXFP8_PROGRAM_BLOCKS = 128
MXFP8_WARPS = 4
NVFP4_PROGRAM_BLOCKS = {"te": 128, "modelopt": 64}
NVFP4_WARPS = 1
#: 4over6 (one lane per block; not tuned on a GPU yet)
FOUR_OVER_SIX_PROGRAM_BLOCKS = 128
FOUR_OVER_SIX_WARPS = 4


def available(device) -> bool:
    """True where these kernels can run: a CUDA device and an importable Triton."""
    return triton is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


@functools.cache
def _launch_options() -> dict:
    """Triton compile options for IEEE fp32 arithmetic, under the names this Triton knows."""
    opts = {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        fields = set(CUDAOptions.__dataclass_fields__)
    except Exception:  # noqa: BLE001 - an older layout: fall back to the long-standing option
        fields = {"enable_fp_fusion"}
    if "enable_fp_fusion" in fields:
        opts["enable_fp_fusion"] = False
    if "enable_reflect_ftz" in fields:  # libdevice's div_rn would otherwise flush subnormals
        opts["enable_reflect_ftz"] = False
    return opts


if triton is not None:
    FLT_MAX = tl.constexpr(3.4028234663852886e38)
    ONE_SIXTH = tl.constexpr(1.0 / 6.0)  # rounded to fp32 where used, as nvfp4.py's fl32(1/6)

    @triton.jit
    def _abs_bits_max(xf):
        """max|x| over the last axis of fp32 ``xf`` from the bit patterns: non-negative floats order
        like their bits and a NaN's exceed inf's, so a NaN anywhere in the block gives NaN."""
        bits = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.max(bits, axis=1).to(tl.float32, bitcast=True)

    @triton.jit
    def _clamp_nan(v, lo, hi):
        v = tl.maximum(v, lo, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(v, hi, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _mxfp8_kernel(x_ptr, q_ptr, s_ptr, n_blocks, BLOCKS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        cols = tl.arange(0, 32)
        offs = rows[:, None] * 32 + cols[None, :]
        mask = rows[:, None] < n_blocks
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        t = tl.math.div_rn(_abs_bits_max(x), 448.0)
        # E8M0 byte = ceil(log2(t)) + 127: the exponent field of t's bits plus a carry from any
        # nonzero mantissa (unsigned, so a NaN's bits wrap harmlessly before being replaced).
        u = t.to(tl.uint32, bitcast=True)
        byte = (((u + 0x7FFFFF) >> 23) & 0xFF).to(tl.int32)
        byte = tl.where(t != t, 255, byte)
        byte = tl.maximum(byte, 1)
        # 2^-E: biased exponent 254 - byte (0, i.e. multiplier 0.0, for the NaN byte 255)
        mult = ((254 - tl.minimum(byte, 254)) << 23).to(tl.float32, bitcast=True)
        y = _clamp_nan(x * mult[:, None], -448.0, 448.0)
        tl.store(q_ptr + offs, y.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows, byte.to(tl.uint8), mask=rows < n_blocks)

    # Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors) has no libdevice: IEEE division by 1 there
    HAVE_RCP_RN = tl.constexpr(libdevice is not None and os.environ.get("TRITON_INTERPRET", "0") != "1")

    @triton.jit
    def _recip(z):
        """RN(1 / z), IEEE (no flush to zero: the launch options). ``rcp.rn.f32`` is a shorter
        sequence than the general ``div.rn.f32`` with the same correctly rounded result: the te
        kernel's per-block reciprocal was ~5 % of its time."""
        if HAVE_RCP_RN:
            return libdevice.rcp_rn(z)
        else:
            return tl.math.div_rn(1.0, z)

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _e2m1_magnitude(a):
        """E2M1 magnitude code of fp32 ``a >= 0`` (or NaN): round to nearest even, saturate at 6,
        NaN -> 7. Returned in the low 3 bits of an int32 whose other bits are 0x4B000000.

        E2M1's grid has spacing 0.5 below 2, 1 in [2, 4) and 2 from 4 up, so the code is
        rint(2a) below 2, rint(a) + 2 in [2, 4) and rint(a / 2) + 4 above. Each candidate is
        rounded by one fp32 add into [2^23, 2^24), where the fp32 spacing is 1 and rounding is
        RNE (E2M1's ties go to the even mantissa as they do to the even integer); in each binade
        the right candidate is the smallest of the three (the coarser grids give codes at least
        as large there), and 7 caps it. ``min.f32`` returns its non-NaN operand, so NaN and inf
        give 7. The result is the bits of 2^23 + code: callers pack two of them as
        ``(hi << 4) + lo``, whose low byte is the two codes (0x4B000000 has a zero low byte, and
        shifted by 4 still does), so no masking is needed. All fp32 work but the three minima:
        on this hardware the integer/logic pipe has half the fp32 pipe's lanes.
        """
        t0 = tl.fma(a, 2.0, 8388608.0)  # 2^23 + rint(2a): one rounding of the exact 2a + 2^23
        t1 = a + 8388610.0  # 2^23 + 2 + rint(a)
        t2 = tl.fma(a, 0.5, 8388612.0)  # 2^23 + 4 + rint(a / 2)
        m = tl.minimum(tl.minimum(t0, t1), tl.minimum(t2, 8388615.0))
        return m.to(tl.int32, bitcast=True)

    @triton.jit
    def _markstein_quotient(x, d, r):
        """RN(x / d) from r = RN(1 / d) without a division per element: q = RN(x * r) is within an
        ulp of x / d, the residual x - q * d is exact (an fma), and RN(q + residual * r) is the
        correctly rounded quotient, barring underflow and overflow (Markstein). The range in which
        the ModelOpt kernel relies on it is checked by ``scripts/gpu_division_check.py``, which
        calls this function."""
        q = x * r
        return tl.fma(tl.fma(-q, d, x), r, q)

    @triton.jit
    def _nvfp4_kernel(
        x_ptr,
        packed_ptr,
        scale_ptr,
        g_ptr,
        scale_2_ptr,
        n_blocks,
        rows_per_g,
        TE: tl.constexpr,
        BF16_WORDS: tl.constexpr,
        BLOCKS: tl.constexpr,
        STACKED: tl.constexpr,
    ):
        """Blocks of 16 with the global amax at ``g_ptr``; program 0 also writes ``scale_2``.

        ``STACKED``: a stack of tensors, ``rows_per_g`` blocks each, tensor ``i`` with its own
        global amax ``g_ptr[i]``; the first block of each tensor writes its ``scale_2_ptr[i]``.
        Every per-tensor scalar is then computed per block, with the same operations.

        ``BF16_WORDS``: ``x_ptr`` is BF16 data read as int32 words, two elements each (element 2j
        in the low half): fp32 values by a shift and a mask, with full-width loads. Otherwise
        ``x_ptr`` is any float type, read as even and odd elements.
        """
        rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        pairs = tl.arange(0, 8)
        mask = rows[:, None] < n_blocks
        if BF16_WORDS:
            w = tl.load(x_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0)
            xe = (w << 16).to(tl.float32, bitcast=True)
            xo = (w & -65536).to(tl.float32, bitcast=True)  # & 0xFFFF0000
        else:
            base = rows[:, None] * 16 + 2 * pairs[None, :]
            xe = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + base + 1, mask=mask, other=0.0).to(tl.float32)
        # Magnitudes are quantized from |x| (RN is symmetric, so |RN(x * s)| = RN(|x| * s) and the
        # same for the quotient below) and the sign comes from x: measured faster on the H200.
        ae, ao = tl.abs(xe), tl.abs(xo)
        amax = tl.reduce(_max_nan(ae, ao), 1, _max_nan)  # a NaN anywhere gives NaN
        # Per-tensor scalars, computed per program in nvfp4.py's operation order: a handful of
        # instructions, where a dozen tiny torch kernels per tensor cost 10-20% of the time.
        if STACKED:
            item = rows // rows_per_g
            g = tl.load(g_ptr + item, mask=rows < n_blocks, other=1.0)
        else:
            g = tl.load(g_ptr)
        scale_2 = tl.math.div_rn(g, 2688.0)
        if TE:
            s_enc = tl.minimum(tl.math.div_rn(2688.0, g), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
            s_enc = tl.where((g == 0.0) | (s_enc == 0.0), 1.0, s_enc)
            s_dec = _recip(s_enc)
            # TE clamps S_enc at FLT_MAX: the decode scale is then 1 / S_enc
            scale_2 = tl.where((g > 0.0) & (tl.math.div_rn(2688.0, g) > FLT_MAX), _recip(FLT_MAX), scale_2)
            sc = tl.minimum(amax * (s_enc * ONE_SIXTH), 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
            inv = tl.minimum(_recip(sc.to(tl.float32) * s_dec), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
            me = _e2m1_magnitude(ae * inv[:, None])
            mo = _e2m1_magnitude(ao * inv[:, None])
            # TE's sign is x's sign bit (-0.0 gives 8; where inv is NaN, a NaN in the block, the
            # sign is not specified anyway)
            if BF16_WORDS:  # element 2j's sign is bit 15 of the word, element 2j + 1's bit 31
                sign = ((w >> 12) & 8) | ((w >> 24) & 0x80)
            else:
                sign = ((xe.to(tl.int32, bitcast=True) >> 28) & 8) | ((xo.to(tl.int32, bitcast=True) >> 24) & 0x80)
        else:
            g_zero = g == 0.0
            s = tl.math.div_rn(amax, 6.0 * scale_2)
            s = tl.where((s == 0.0) | g_zero, 1.0, s)
            sc = _clamp_nan(s, 0.001953125, 448.0).to(tl.float8e4nv)  # [2^-9, 448]
            div = tl.where(g_zero, 1.0, sc.to(tl.float32) * scale_2)
            # ModelOpt divides every element: v = RN(x / div). div.rn.f32 costs a reciprocal on the
            # special-function unit (a quarter of the FMA lanes) per element; instead one reciprocal
            # per block and Markstein's correction (_markstein_quotient). With every divisor of
            # the program in [2^-60, 2^16] underflow and overflow cannot touch a quotient of 2^-3
            # or more (below that the E2M1 code is 0 whatever the last bits), and no nonzero BF16
            # x (>= 2^-133) has a quotient that rounds to zero (> 2^-150), so ModelOpt's sign
            # (v < 0) is x < 0. Other programs (a global amax above ~4e5 or subnormal, NaN blocks)
            # divide each element. scripts/gpu_division_check.py checks this against div_rn on
            # 2^20 divisors x every BF16.
            safe = tl.where((div >= 8.673617379884035e-19) & (div <= 65536.0), 1, 0)
            if tl.min(safe, axis=0) == 1:
                r = _recip(div)[:, None]
                d = div[:, None]
                me = _e2m1_magnitude(_markstein_quotient(ae, d, r))
                mo = _e2m1_magnitude(_markstein_quotient(ao, d, r))
                sign = tl.where(xe < 0.0, 8, 0) | tl.where(xo < 0.0, 0x80, 0)
            else:
                ve = tl.math.div_rn(xe, div[:, None])
                vo = tl.math.div_rn(xo, div[:, None])
                me = _e2m1_magnitude(tl.abs(ve))
                mo = _e2m1_magnitude(tl.abs(vo))
                sign = tl.where(ve < 0.0, 8, 0) | tl.where(vo < 0.0, 0x80, 0)  # ModelOpt: v < 0
        byte = (mo << 4) + me + sign  # low byte: element 2j's code in the low nibble, signs in bits 3, 7
        tl.store(packed_ptr + rows[:, None] * 8 + pairs[None, :], byte.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + rows, sc, mask=rows < n_blocks)
        if STACKED:
            tl.store(scale_2_ptr + item, scale_2, mask=(rows < n_blocks) & (rows % rows_per_g == 0))
        else:
            if tl.program_id(0) == 0:
                tl.store(scale_2_ptr, scale_2)

    @triton.jit
    def _e2m1_level(code):
        """fp32 value of E2M1 magnitude codes 0..7 (int32): codes 2..7 are the fp32 bits
        (252 + c) << 22 (1, 1.5, 2, 3, 4, 6), codes 0 and 1 are c / 2."""
        return tl.where(code < 2, code.to(tl.float32) * 0.5, ((code + 252) << 22).to(tl.float32, bitcast=True))

    @triton.jit
    def _e4m3_round(s):
        """``s`` (0 <= s <= 448, or NaN) rounded to the nearest E4M3 value, ties to even, as fp32: from
        2^-6 up 3 mantissa bits (round half up plus the kept bit's parity, then truncate), below it
        the subnormal step 2^-9 (one fp32 add at 2^14, where the fp32 step is 2^-9). Spelt out rather
        than a cast: Triton's interpreter truncates fp32 -> fp8, and the 4over6 test runs there too."""
        u = s.to(tl.int32, bitcast=True)
        nor = ((u + 0x7FFFF + ((u >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # & 0xFFF00000
        sub = (s + 16384.0) - 16384.0
        return tl.where(s < 0.015625, sub, tl.where(s == s, nor, s))

    @triton.jit
    def _load_pair(x_ptr, rows, j, live, BF16_WORDS: tl.constexpr):
        """Elements 2j and 2j + 1 of each block ``rows`` as fp32 (zeros past ``n_blocks``)."""
        if BF16_WORDS:
            w = tl.load(x_ptr + rows * 8 + j, mask=live, other=0)
            return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
        else:
            xe = tl.load(x_ptr + rows * 16 + 2 * j, mask=live, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + rows * 16 + 2 * j + 1, mask=live, other=0.0).to(tl.float32)
            return xe, xo

    @triton.jit
    def _four_over_six_error(ae, ao, inv, sf, g):
        """|decoded - x| of elements |x| = ``ae``, ``ao`` quantized with multiplier ``inv`` and block
        scale ``sf``: ((level * sf) * g) / 1536 is the decoded magnitude, and the decoded value has
        x's sign (the code's sign is x's sign bit), so |decoded - x| = |that - |x||."""
        le = _e2m1_level(_e2m1_magnitude(ae * inv) & 7)
        lo = _e2m1_level(_e2m1_magnitude(ao * inv) & 7)
        de = tl.abs(tl.math.div_rn((le * sf) * g, 1536.0) - ae)
        do = tl.abs(tl.math.div_rn((lo * sf) * g, 1536.0) - ao)
        return de, do

    @triton.jit
    def _nvfp4_4over6_kernel(
        x_ptr,
        packed_ptr,
        scale_ptr,
        g_ptr,
        scale_2_ptr,
        n_blocks,
        rows_per_g,
        BF16_WORDS: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        """The 4over6 recipe (nvfp4.py's module docstring) on blocks of 16, the global amax at
        ``g_ptr``; program 0 also writes ``scale_2`` (one tensor: ``rows_per_g`` = ``max(n_blocks, 1)``).
        A stack of tensors of ``rows_per_g`` blocks each: tensor ``i`` has the global amax
        ``g_ptr[i]`` and its first block writes ``scale_2_ptr[i]``. One lane per block, the block read pair by pair
        (``_load_pair``) three times: its amax; both candidates' codes and errors, the errors summed
        in element order as the definition requires (a tree reduction would round differently);
        the kept candidate's codes. Every per-tensor value is a vector of the global amax's lanes."""
        rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        live = rows < n_blocks
        first = live | (rows == 0)  # block 0 writes scale_2 even when there are no blocks
        item = rows // rows_per_g
        g = tl.load(g_ptr + item, mask=first, other=1.0)
        q = tl.math.div_rn(tl.full([BLOCKS], 1536.0, tl.float32), g)
        s_enc = tl.minimum(q, FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
        s_enc = tl.where(g == 0.0, 1.0, tl.where(s_enc == 0.0, 1.0, s_enc))
        s_dec = _recip(s_enc)
        # TE clamps S_enc at FLT_MAX: the decode scale is then 1 / S_enc
        tiny = _recip(tl.full([BLOCKS], FLT_MAX, tl.float32))
        scale_2 = tl.where(g > 0.0, tl.where(q > FLT_MAX, tiny, tl.math.div_rn(g, 1536.0)), tl.math.div_rn(g, 1536.0))
        amax = tl.zeros([BLOCKS], tl.float32)
        for j in tl.static_range(8):
            xe, xo = _load_pair(x_ptr, rows, j, live, BF16_WORDS)
            amax = _max_nan(amax, _max_nan(tl.abs(xe), tl.abs(xo)))  # a NaN anywhere gives NaN
        base = tl.math.div_rn(amax, 6.0) * s_enc
        sf6 = _e4m3_round(tl.minimum(base, 448.0, propagate_nan=tl.PropagateNan.ALL))
        sf4 = _e4m3_round(tl.minimum(base * 1.5, 448.0, propagate_nan=tl.PropagateNan.ALL))
        inv6 = tl.minimum(_recip(sf6 * s_dec), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
        inv4 = tl.minimum(_recip(sf4 * s_dec), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
        err6 = tl.zeros([BLOCKS], tl.float32)
        err4 = tl.zeros([BLOCKS], tl.float32)
        for j in tl.static_range(8):
            xe, xo = _load_pair(x_ptr, rows, j, live, BF16_WORDS)
            ae, ao = tl.abs(xe), tl.abs(xo)
            de, do = _four_over_six_error(ae, ao, inv6, sf6, g)
            err6 = (err6 + de) + do
            de, do = _four_over_six_error(ae, ao, inv4, sf4, g)
            err4 = (err4 + de) + do
        four = err4 < err6  # ties and NaN keep map-to-6
        inv = tl.where(four, inv4, inv6)
        for j in tl.static_range(8):
            xe, xo = _load_pair(x_ptr, rows, j, live, BF16_WORDS)
            me = _e2m1_magnitude(tl.abs(xe) * inv)
            mo = _e2m1_magnitude(tl.abs(xo) * inv)
            # TE's sign: x's sign bit (as the te recipe above)
            sign = ((xe.to(tl.int32, bitcast=True) >> 28) & 8) | ((xo.to(tl.int32, bitcast=True) >> 24) & 0x80)
            byte = (mo << 4) + me + sign
            tl.store(packed_ptr + rows * 8 + j, byte.to(tl.uint8), mask=live)
        tl.store(scale_ptr + rows, tl.where(four, sf4, sf6).to(tl.float8e4nv), mask=live)  # exact: E4M3 values
        tl.store(scale_2_ptr + item, scale_2, mask=first & (rows % rows_per_g == 0))


def _grid(n_blocks: int, per_program: int):
    return (triton.cdiv(n_blocks, per_program),)


def mxfp8_blocks(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`mxfp8.mxfp8_quantize_blocks`: ``xb [n, 32]`` on CUDA ->
    (e4m3 [n, 32], uint8 [n])."""
    xb = xb.contiguous()
    n = xb.shape[0]
    q = torch.empty(xb.shape, dtype=torch.float8_e4m3fn, device=xb.device)
    s = torch.empty(n, dtype=torch.uint8, device=xb.device)
    if n:
        with torch.cuda.device(xb.device):  # Triton launches on the current device
            _mxfp8_kernel[_grid(n, MXFP8_PROGRAM_BLOCKS)](
                xb, q, s, n, BLOCKS=MXFP8_PROGRAM_BLOCKS, num_warps=MXFP8_WARPS, **_launch_options()
            )
    return q, s


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s (nothing to do for the CPU
    tensors of Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def nvfp4_blocks(xb: torch.Tensor, g: torch.Tensor, recipe: str = "te"):
    """Same contract as :func:`nvfp4.nvfp4_quantize_blocks`: ``xb [n, 16]`` on CUDA and the global
    amax ``g`` (fp32 0-dim) -> (packed uint8 [n, 8], block scale e4m3 [n], scale_2 fp32 0-dim).
    One kernel launch, no other device work. Every NVFP4 recipe (``nvfp4_blocks.recipes``)."""
    xb = xb.contiguous()
    n = xb.shape[0]
    g = g.detach().to(device=xb.device, dtype=torch.float32).reshape(1)
    packed = torch.empty(n, 8, dtype=torch.uint8, device=xb.device)
    scale = torch.empty(n, dtype=torch.float8_e4m3fn, device=xb.device)
    scale_2 = torch.empty(1, dtype=torch.float32, device=xb.device)
    words = xb.dtype == torch.bfloat16
    if recipe == "4over6":
        blocks = FOUR_OVER_SIX_PROGRAM_BLOCKS
        with _on_device(xb):
            _nvfp4_4over6_kernel[_grid(max(n, 1), blocks)](
                xb.view(torch.int32) if words else xb,
                packed,
                scale,
                g,
                scale_2,
                n,
                max(n, 1),
                BF16_WORDS=words,
                BLOCKS=blocks,
                num_warps=FOUR_OVER_SIX_WARPS,
                **_launch_options(),
            )
        return packed, scale, scale_2.reshape(())
    blocks = NVFP4_PROGRAM_BLOCKS[recipe]
    with _on_device(xb):
        _nvfp4_kernel[_grid(max(n, 1), blocks)](
            xb.view(torch.int32) if words else xb,
            packed,
            scale,
            g,
            scale_2,
            n,
            1,
            TE=recipe == "te",
            BF16_WORDS=words,
            BLOCKS=blocks,
            STACKED=False,
            num_warps=NVFP4_WARPS,
            **_launch_options(),
        )
    return packed, scale, scale_2.reshape(())


def nvfp4_blocks_stacked(xb: torch.Tensor, g: torch.Tensor, recipe: str = "te"):
    """:func:`nvfp4_blocks` of a stack of tensors in one launch: ``xb [n, 16]`` on CUDA holds
    ``len(g)`` tensors of ``n / len(g)`` blocks each, back to back, tensor ``i`` with the global
    amax ``g[i]`` (fp32). Returns (packed uint8 [n, 8], block scale e4m3 [n], scale_2 fp32
    [len(g)]): each tensor's bytes what :func:`nvfp4_blocks` gives it alone."""
    xb = xb.contiguous()
    n = xb.shape[0]
    items = g.numel()
    if items == 0 or n % items:
        raise ValueError(f"{n} blocks do not split into {items} tensors")
    g = g.detach().to(device=xb.device, dtype=torch.float32).reshape(items).contiguous()
    packed = torch.empty(n, 8, dtype=torch.uint8, device=xb.device)
    scale = torch.empty(n, dtype=torch.float8_e4m3fn, device=xb.device)
    scale_2 = torch.empty(items, dtype=torch.float32, device=xb.device)
    words = xb.dtype == torch.bfloat16
    if n and recipe == "4over6":
        with _on_device(xb):
            _nvfp4_4over6_kernel[_grid(n, FOUR_OVER_SIX_PROGRAM_BLOCKS)](
                xb.view(torch.int32) if words else xb,
                packed,
                scale,
                g,
                scale_2,
                n,
                n // items,
                BF16_WORDS=words,
                BLOCKS=FOUR_OVER_SIX_PROGRAM_BLOCKS,
                num_warps=FOUR_OVER_SIX_WARPS,
                **_launch_options(),
            )
    elif n:
        blocks = NVFP4_PROGRAM_BLOCKS[recipe]
        with _on_device(xb):
            _nvfp4_kernel[_grid(n, blocks)](
                xb.view(torch.int32) if words else xb,
                packed,
                scale,
                g,
                scale_2,
                n,
                n // items,
                TE=recipe == "te",
                BF16_WORDS=words,
                BLOCKS=blocks,
                STACKED=True,
                num_warps=NVFP4_WARPS,
                **_launch_options(),
            )
    return packed, scale, scale_2


#: the NVFP4 recipes nvfp4_blocks_stacked implements
nvfp4_blocks_stacked.recipes = ("te", "modelopt", "4over6")


#: the NVFP4 recipes nvfp4_blocks implements (nvfp4.nvfp4_quantize reads this from the core it is given)
nvfp4_blocks.recipes = ("te", "modelopt", "4over6")
