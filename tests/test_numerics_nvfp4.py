"""NVFP4 numerics (docs/formats.md#nvfp4) against other projects and independent references.

* ``recipe="modelopt"``: bit-exact against ModelOpt's own ``NVFP4QTensor`` (CPU).
* ``recipe="te"``: TransformerEngine needs a Blackwell GPU and FlashInfer's FP4 kernels are
  compiled out below SM100 (``#if __CUDA_ARCH__ >= 1000``), so neither runs here. The oracle is
  a float32 NumPy re-derivation of TE's operation order written in a different form (table
  look-ups with explicit nearest/tie-to-even selection instead of threshold counting and
  PyTorch casts), plus, where a C++ compiler and CUDA's headers exist, a small C++ program that
  uses NVIDIA's own ``__nv_cvt_float_to_fp8`` / ``__nv_cvt_float_to_fp4`` conversions.
* compressed-tensors' FP4 pack/unpack and decompressor read our bytes back to our values.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from qconvert.convert.numerics import (
    NVFP4_BLOCK,
    e2m1_to_float,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_fp4,
    unpack_fp4,
)

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_LEVELS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
FLT_MAX = np.float32(np.finfo(np.float32).max)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------- inputs


def adversarial_bf16(global_exp: int = 0, seed: int = 0) -> torch.Tensor:
    """Rows of 16-element blocks whose scaled values hit E2M1 ties exactly.

    With global amax g = 2688 * 2^k the encode scale is an exact power of two in both recipes;
    a block with amax 6 * 2^(j+k) gets block scale 2^j, so elements t * 2^(j+k) scale to
    exactly t. Also: +-6 edges, values just past 6 after a scale that rounded down, zero and
    negative-zero blocks, tiny blocks (their scale underflows E4M3 in TE and is clamped to
    2^-9 in ModelOpt), and BF16 subnormals.
    """
    g = torch.Generator().manual_seed(seed)
    k = global_exp
    gmax = 2688.0 * 2.0**k
    blocks = []
    first = torch.zeros(NVFP4_BLOCK, dtype=torch.float64)
    first[5] = gmax
    first[6] = -gmax * 0.75
    blocks.append(first)
    for j in range(-9, 9):
        unit = 2.0 ** (j + k)
        pool = [t * unit for t in TIES] + [6 * unit, 0.5 * unit, 3 * unit, 0.0, -0.0]
        for rep in range(3):
            idx = torch.randint(0, len(pool), (NVFP4_BLOCK,), generator=g)
            vals = torch.tensor([pool[i] for i in idx], dtype=torch.float64)
            vals *= torch.where(torch.rand(NVFP4_BLOCK, generator=g) < 0.5, -1.0, 1.0)
            vals[rep] = 6 * unit if rep != 1 else -6 * unit
            blocks.append(vals)
        # block amax 6.375 * 2^(j+k) -> s = 1.0625 * 2^j rounds to 2^j: elements scale past 6.
        over = torch.linspace(-1, 1, NVFP4_BLOCK, dtype=torch.float64) * 6.375 * unit
        blocks.append(over)
    blocks.append(torch.zeros(NVFP4_BLOCK, dtype=torch.float64))
    blocks.append(torch.full((NVFP4_BLOCK,), -0.0, dtype=torch.float64))
    for rel in (1e-6, 2.0**-19, 3e-7, 1e-9):  # block scale below the E4M3 subnormal range
        b = torch.linspace(-1, 1, NVFP4_BLOCK, dtype=torch.float64) * gmax * rel
        b[3] = -0.0
        blocks.append(b)
    sub = torch.arange(NVFP4_BLOCK, dtype=torch.float64) * 2.0**-133
    blocks.append(sub)
    while len(blocks) % 4:
        blocks.append(torch.zeros(NVFP4_BLOCK, dtype=torch.float64))
    x = torch.stack(blocks).to(torch.bfloat16).reshape(-1, 4 * NVFP4_BLOCK)
    assert float(x.float().abs().max()) == gmax  # nothing moved in the BF16 rounding
    return x


def random_bf16(seed: int = 1, shape=(64, 512)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., ::5, :] *= torch.exp2(torch.randint(-12, 4, (1,), generator=g).float())
    x[..., 3::11, :] = x[..., 3::11, :] ** 3
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------- independent TE reference


def _e4m3_table() -> np.ndarray:
    """All non-negative finite E4M3FN values, indexed by their bit pattern 0..126."""
    b = np.arange(127)
    e, m = b >> 3, b & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


E4M3_TABLE = _e4m3_table()


def np_e4m3_satfinite(s: np.ndarray) -> np.ndarray:
    """Byte of the nearest E4M3 value to s >= 0 (ties to even bit pattern), saturating."""
    s = s.astype(np.float64)
    hi = np.clip(np.searchsorted(E4M3_TABLE, s, side="left"), 1, 126)
    lo = hi - 1
    dlo, dhi = s - E4M3_TABLE[lo], E4M3_TABLE[hi] - s
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(s >= 448, 126, pick)
    return pick.astype(np.uint8)


def np_e2m1_code(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 level to |v| (ties to the even code), saturating at 6; sign bit of v."""
    a = np.minimum(np.abs(v.astype(np.float64)), 6.0)[..., None]  # satfinite
    d = np.abs(a - E2M1_LEVELS)
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return (idx | (np.signbit(v).astype(np.int64) << 3)).astype(np.uint8)


def np_te_reference(x: torch.Tensor, global_amax=None):
    """TE NVFP4Quantizer 1-D / FlashInfer exact-math order in NumPy float32 scalar algebra."""
    xf = x.float().numpy()
    blocks = xf.reshape(*xf.shape[:-1], -1, NVFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    g = np.float32(np.abs(xf).max() if global_amax is None else global_amax)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.float32(2688.0) / g
        s_enc = np.minimum(s_enc, FLT_MAX)
        if g == 0 or s_enc == 0:
            s_enc = np.float32(1.0)
        s_dec = np.float32(1.0) / s_enc
        s = amax * (s_enc * np.float32(1.0 / 6.0))
        s = np.minimum(s, FLT_MAX)
        sbyte = np_e4m3_satfinite(s)
        s_q = E4M3_TABLE[sbyte].astype(np.float32)
        inv = np.minimum(np.float32(1.0) / (s_q * s_dec), FLT_MAX).astype(np.float32)
        v = (blocks * inv[..., None]).astype(np.float32)
    codes = np_e2m1_code(v).reshape(xf.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # decode scale g/2688, except where S_enc hit FLT_MAX: then only 1/S_enc decodes the blocks
    # to their values (miles' convention everywhere; qconvert's only there)
    with np.errstate(divide="ignore", over="ignore"):
        clamped = g > 0 and np.float32(2688.0) / g > FLT_MAX
    return packed, sbyte, (s_dec if clamped else g / np.float32(2688.0))


# ---------------------------------------------------------------- optional C++ oracle

C_ORACLE = r"""
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <math.h>
#include <float.h>
extern "C" void te_nvfp4(const float* x, long rows, long k, float g,
                         unsigned char* packed, unsigned char* scales) {
  float s_enc = fminf(448.0f * 6.0f / g, FLT_MAX);
  if (g == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  float s_dec = 1.0f / s_enc;
  const float r6 = 1.0f / 6.0f;
  for (long r = 0; r < rows; ++r) {
    for (long b = 0; b < k / 16; ++b) {
      const float* xb = x + r * k + b * 16;
      float amax = 0.0f;
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(xb[i]));
      float s = fminf(amax * (s_enc * r6), FLT_MAX);
      __nv_fp8_storage_t sb = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
      scales[r * (k / 16) + b] = sb;
      int e = (sb >> 3) & 0xF, m = sb & 7;
      float sq = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
      float inv = fminf(1.0f / (sq * s_dec), FLT_MAX);
      for (int i = 0; i < 16; i += 2) {
        unsigned lo = __nv_cvt_float_to_fp4(xb[i] * inv, __NV_E2M1, cudaRoundNearest);
        unsigned hi = __nv_cvt_float_to_fp4(xb[i + 1] * inv, __NV_E2M1, cudaRoundNearest);
        packed[r * (k / 2) + b * 8 + i / 2] = (unsigned char)((lo & 0xF) | ((hi & 0xF) << 4));
      }
    }
  }
}
"""


def _cuda_include_dir():
    cands = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_fp4.h")):
            return os.path.join(c, "include")
    try:
        import triton  # Triton wheels carry CUDA's FP4/FP8 headers

        inc = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
        if os.path.exists(os.path.join(inc, "cuda_fp4.h")):
            return inc
    except Exception:
        pass
    return None


@pytest.fixture(scope="session")
def c_oracle(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include_dir()
    if not cxx or not inc:
        pytest.skip("needs a C++ compiler and CUDA's cuda_fp4.h (host conversion routines)")
    d = tmp_path_factory.mktemp("fp4oracle")
    src, lib = d / "oracle.cpp", d / "oracle.so"
    src.write_text(C_ORACLE)
    cmd = [cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"could not build the CUDA-header oracle: {res.stderr[-300:]}")
    so = ctypes.CDLL(str(lib))
    so.te_nvfp4.argtypes = [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]

    def run(x: torch.Tensor, global_amax=None):
        xf = x.float().reshape(-1, x.shape[-1]).contiguous()
        rows, k = xf.shape
        g = float(xf.abs().max()) if global_amax is None else float(global_amax)
        packed = torch.empty(rows, k // 2, dtype=torch.uint8)
        scales = torch.empty(rows, k // 16, dtype=torch.uint8)
        so.te_nvfp4(xf.data_ptr(), rows, k, g, packed.data_ptr(), scales.data_ptr())
        return packed.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // 16)

    return run


@pytest.fixture(scope="module")
def modelopt_nvfp4():
    mod = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    return mod.NVFP4QTensor


# ---------------------------------------------------------------- helpers


def test_e2m1_table_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_to_float(codes)
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(vals[8])  # code 8 is -0.0
    # element 2j in the low nibble
    assert pack_fp4(torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)).tolist() == [[0x21, 0xF3]]
    allbytes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    assert torch.equal(pack_fp4(unpack_fp4(allbytes)), allbytes)
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("recipe", ["te", "modelopt"])
def test_e2m1_ties_and_edges(recipe):
    """With both scales powers of two, elements scale to exactly the E2M1 ties."""
    row = [6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
    x = torch.tensor([row], dtype=torch.bfloat16) * 8  # block amax 48: block scale 8
    packed, scale, s2 = nvfp4_quantize(x, global_amax=2688.0, recipe=recipe)  # scale_2 = 1
    assert float(scale.float()[0, 0]) == 8.0 and float(s2) == 1.0
    got = e2m1_to_float(unpack_fp4(packed))[0].tolist()
    assert got == [6, -6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4]


def test_negative_zero_conventions():
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 6.0
    x[0, 1] = -0.0
    x[0, 2] = -0.1  # rounds to zero
    te = unpack_fp4(nvfp4_quantize(x, recipe="te")[0])[0, :3].tolist()
    mo = unpack_fp4(nvfp4_quantize(x, recipe="modelopt")[0])[0, :3].tolist()
    assert te == [7, 8, 8]  # sign bit of the scaled value, as cvt.rn.satfinite.e2m1x2 keeps it
    assert mo == [7, 0, 8]  # ModelOpt: sign = (value < 0)


# ---------------------------------------------------------------- ModelOpt, bit-exact

CASES = {
    "adversarial": lambda: adversarial_bf16(0),
    "adversarial_tiny_global": lambda: adversarial_bf16(-136),  # g = 2688 * 2^-136 ~ 3.1e-38
    "adversarial_huge_global": lambda: adversarial_bf16(115),  # g ~ 1.1e38
    "random": lambda: random_bf16(1),
    "random_3d": lambda: random_bf16(2, shape=(3, 16, 256)),
    "random_fp32": lambda: random_bf16(3).float() * 1.0001,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shared", [False, True], ids=["own_amax", "shared_amax"])
def test_modelopt_recipe_bit_exact(modelopt_nvfp4, case, shared):
    x = CASES[case]()
    gamax = float(x.float().abs().max()) * (3.0 if shared else 1.0)
    ws2 = torch.tensor(gamax, dtype=torch.float32) / 2688.0 if shared else None
    qt, mscale, mws2 = modelopt_nvfp4.quantize(x.clone(), NVFP4_BLOCK, weights_scaling_factor_2=ws2)
    packed, scale, s2 = nvfp4_quantize(x, global_amax=gamax if shared else None, recipe="modelopt")
    assert torch.equal(packed, qt._quantized_data)
    assert torch.equal(_u8(scale), _u8(mscale))
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert _u8(s2.reshape(1)).tolist() == _u8(mws2.float().reshape(1)).tolist()
    deq = qt.dequantize(dtype=torch.float32, scale=mscale, double_scale=mws2, block_sizes={-1: NVFP4_BLOCK})
    assert torch.equal(nvfp4_dequantize(packed, scale, s2), deq)


def test_modelopt_zero_tensor_deviation(modelopt_nvfp4):
    """ModelOpt turns an all-zero tensor into NaN block scales and codes of 6.0 (0/0); qconvert
    writes codes 0, block scale 1.0 and scale_2 0 instead, which decode to zeros."""
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    x[1, 3] = -0.0
    _, mscale, _ = modelopt_nvfp4.quantize(x.clone(), NVFP4_BLOCK)
    assert torch.isnan(mscale.float()).all()
    packed, scale, s2 = nvfp4_quantize(x, recipe="modelopt")
    assert (packed == 0).all() and (scale.float() == 1.0).all() and float(s2) == 0.0
    assert (nvfp4_dequantize(packed, scale, s2) == 0).all()
    packed, scale, s2 = nvfp4_quantize(x, recipe="te")
    assert ((packed & 0x77) == 0).all() and (_u8(scale) == 0).all() and float(s2) == 0.0
    assert (nvfp4_dequantize(packed, scale, s2) == 0).all()


# ---------------------------------------------------------------- TE, independent references


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shared", [False, True], ids=["own_amax", "shared_amax"])
def test_te_recipe_matches_numpy_reference(case, shared):
    x = CASES[case]()
    gamax = float(x.float().abs().max()) * (3.0 if shared else 1.0)
    packed, scale, s2 = nvfp4_quantize(x, global_amax=gamax if shared else None, recipe="te")
    rp, rs, rs2 = np_te_reference(x, gamax if shared else None)
    assert np.array_equal(packed.numpy(), rp)
    assert np.array_equal(_u8(scale).numpy(), rs)
    assert np.float32(s2.item()) == rs2


@pytest.mark.parametrize("case", list(CASES))
def test_te_recipe_matches_cuda_header_conversions(c_oracle, case):
    x = CASES[case]()
    packed, scale, _ = nvfp4_quantize(x, recipe="te")
    cp, cs = c_oracle(x)
    assert torch.equal(_u8(scale), cs)
    assert torch.equal(packed, cp)


def test_te_tiny_block_scale_underflow():
    """TE: a nonzero block whose scale rounds to E4M3 zero gets inv = FLT_MAX, so its codes
    saturate to +-6 with scale byte 0 (decodes to 0). ModelOpt clamps the scale to 2^-9."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 2688.0
    x[0, 16] = 1e-4  # s = 1e-4 * 448 / 2688 ~ 1.7e-5 < 2^-10
    x[0, 17] = -1e-4
    packed, scale, _ = nvfp4_quantize(x, recipe="te")
    assert _u8(scale)[0].tolist() == [0x7E, 0x00]
    assert unpack_fp4(packed)[0, 16:18].tolist() == [7, 15]
    packed, scale, _ = nvfp4_quantize(x, recipe="modelopt")
    assert float(scale.float()[0, 1]) == 2.0**-9
    assert unpack_fp4(packed)[0, 16:18].tolist() == [0, 8]


def _varied_amax_tensors(n: int = 24):
    """Gaussian BF16 tensors with global amax spread over ~0.1 .. 50, some of which make the
    te and modelopt operation orders disagree (see the next test)."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(n):
        x = torch.randn(64, 512, generator=gen) * torch.rand(1, generator=gen) * 10
        yield x.to(torch.bfloat16)


def test_te_recipe_matches_numpy_reference_where_orders_matter():
    """Same check as above on the tensors where operation order changes scale bytes, so a
    reordered formula (e.g. (amax / 6) * S_enc, or ModelOpt's) cannot pass."""
    for x in _varied_amax_tensors():
        packed, scale, _ = nvfp4_quantize(x, recipe="te")
        rp, rs, _ = np_te_reference(x)
        assert np.array_equal(_u8(scale).numpy(), rs)
        assert np.array_equal(packed.numpy(), rp)


def test_te_and_modelopt_differ_on_a_small_fraction():
    """docs/formats.md#nvfp4-block-scale-recipes: the two operation orders pick a different E4M3 block scale on a small
    fraction of blocks (0.14 % in the sample of docs/formats.md#nvfp4-block-scale-recipes). The rate depends on the global amax
    (it is 0 for many values and ~1 % for some, e.g. when 2688/g is a short binary fraction),
    so this aggregates over tensors with varied amax and checks the kind of every difference."""
    n_blocks = n_codes = d_blocks = d_codes = 0
    zero_rate_tensors = 0
    for x in _varied_amax_tensors():
        pt, st, s2t = nvfp4_quantize(x, recipe="te")
        pm, sm, s2m = nvfp4_quantize(x, recipe="modelopt")
        assert torch.equal(s2t, s2m)
        diff = _u8(st) != _u8(sm)
        # Where the scale byte differs it differs by one E4M3 step.
        assert ((_u8(st).int() - _u8(sm).int())[diff].abs() == 1).all()
        n_blocks += st.numel()
        d_blocks += int(diff.sum())
        n_codes += x.numel()
        d_codes += int((unpack_fp4(pt) != unpack_fp4(pm)).sum())
        zero_rate_tensors += int(diff.sum()) == 0
    scale_rate, code_rate = d_blocks / n_blocks, d_codes / n_codes
    assert 2e-4 < scale_rate < 2e-2, scale_rate
    assert 1e-4 < code_rate < 1e-2, code_rate
    assert zero_rate_tensors >= 6


# ---------------------------------------------------------------- compressed-tensors


def test_compressed_tensors_pack_unpack_agree():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    x = adversarial_bf16(0)
    packed, _, _ = nvfp4_quantize(x, recipe="te")
    m, n = x.shape
    ct_vals = helpers.unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32)
    ours = e2m1_to_float(unpack_fp4(packed))
    assert torch.equal(_bits(ct_vals), _bits(ours))  # includes -0.0 for code 8
    assert torch.equal(helpers.pack_fp4_to_uint8(ours), packed)
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    vals = helpers.unpack_fp4_from_uint8(every, 4, 128, dtype=torch.float32)
    assert torch.equal(helpers.pack_fp4_to_uint8(vals), every)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


@pytest.mark.parametrize("recipe", ["te", "modelopt"])
def test_compressed_tensors_dequantize_agrees(recipe):
    """CT decodes ``e2m1 * weight_scale / weight_global_scale`` with the encode-convention
    global scale 2688/amax; that equals our decode within fp32 rounding of the two scale
    conventions, and its BF16 decompressor within one BF16 rounding."""
    fwd = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    base = pytest.importorskip("compressed_tensors.compressors.nvfp4.base")
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    x = random_bf16(4, shape=(32, 256))
    packed, scale, s2 = nvfp4_quantize(x, recipe=recipe)
    amax = x.float().abs().max()
    global_scale = (torch.tensor(2688.0) / amax).reshape(1)
    ours = nvfp4_dequantize(packed, scale, s2)

    m, n = x.shape
    x_q = helpers.unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32)
    ct = fwd.dequantize(x_q, scale.float(), global_scale=global_scale, dtype=torch.float32)
    nz = ours != 0
    assert torch.equal(ct == 0, ~nz)
    rel = ((ct[nz] - ours[nz]) / ours[nz]).abs()
    assert rel.max() <= 2.0**-22

    sd = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    w = base.NVFP4PackedCompressor.decompress(sd, None)["weight"]
    assert w.dtype == torch.bfloat16
    diff = (w.float() - ours.to(torch.bfloat16).float()).abs()
    assert (diff <= ours.abs() * 2.0**-7).all()
    assert (w.float() == ours.to(torch.bfloat16).float()).float().mean() > 0.99


# ---------------------------------------------------------------- API


def test_shapes_dtypes_and_errors():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    packed, scale, s2 = nvfp4_quantize(x)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.uint8
    assert scale.shape == (2, 3, 4) and scale.dtype == torch.float8_e4m3fn
    assert s2.shape == () and s2.dtype == torch.float32
    assert float(s2) == float(torch.tensor(float(x.float().abs().max())) / 2688.0)
    assert nvfp4_dequantize(packed, scale, s2, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.zeros(4, 24))
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.zeros(4, 32), recipe="flashinfer")
    # A tensor global amax works too and is not modified.
    g = torch.tensor([7.0])
    nvfp4_quantize(x, global_amax=g)
    assert g.tolist() == [7.0]


@pytest.mark.parametrize("recipe", ["te", "modelopt"])
def test_dequantize_error_bound(recipe):
    x = random_bf16(5)
    packed, scale, s2 = nvfp4_quantize(x, recipe=recipe)
    deq = nvfp4_dequantize(packed, scale, s2).double()
    xf = x.double()
    blk = xf.reshape(*xf.shape[:-1], -1, NVFP4_BLOCK)
    step = (scale.double() * s2.double()).unsqueeze(-1)  # decoded value of one E2M1 unit
    err = (deq.reshape(blk.shape) - blk).abs()
    # Half of the largest E2M1 gap (2) in block-scale units, plus the E4M3 scale rounding,
    # which can push the block max past 6 (then it saturates; at most 6 * 2^-4 more).
    amax = blk.abs().amax(-1, keepdim=True)
    assert (err <= step * 1.0 + amax * 2.0**-4 + 1e-30).all()


def test_te_tiny_global_amax_decodes_to_its_values():
    """g below 2688/FLT_MAX: TE clamps S_enc at FLT_MAX, so the stored decode scale must be 1/S_enc
    (found by hypothesis: g/2688 made every block decode ~2x too small)."""
    x = (torch.linspace(-1, 1, 64) * 3e-36).to(torch.bfloat16).reshape(2, 32)
    packed, scale, s2 = nvfp4_quantize(x, recipe="te")
    assert float(s2) == pytest.approx(1.0 / torch.finfo(torch.float32).max, rel=1e-6)
    d = nvfp4_dequantize(packed, scale, s2, torch.float64)
    rel = ((d - x.double()).norm() / x.double().norm()).item()
    assert rel < 0.2, rel
