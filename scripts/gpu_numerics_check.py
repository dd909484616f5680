#!/usr/bin/env python3
"""Check qconvert's MXFP8 / NVFP4 quantizers on a CUDA GPU (a script, not a test).

Compares byte for byte, on random and adversarial BF16 tensors:

  (a) qconvert on CUDA vs qconvert on CPU (MXFP8; NVFP4 recipes te and modelopt);
  (b) FlashInfer ``mxfp8_quantize`` (linear scales) and ``fp4_quantize`` with
      FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1, when FlashInfer is importable and the GPU is
      SM100+ (its quantize kernels are compiled out below SM100: ``#if __CUDA_ARCH__ >= 1000``);
  (c) vLLM's MXFP8 path on CUDA (``_mxfp8_e4m3_quantize_torch``, what vLLM runs below SM100),
      from an installed vLLM or from ``--vllm-mxfp8-utils PATH`` (vLLM's own
      ``mxfp8_utils.py``, loaded with a stub for its one vLLM import);
  (d) NVIDIA's own conversions on the GPU: a small kernel, built with CuPy/NVRTC, that follows
      TransformerEngine's NVFP4 1-D operation order and the RCEIL MXFP8 rule using
      ``__nv_cvt_float_to_fp8`` / ``__nv_cvt_float_to_e8m0`` / ``__nv_cvt_float_to_fp4``.

MXFP8 comparisons leave out blocks with amax <= 448 * 2^-127, where qconvert writes scale
byte 1 instead of 0 (declared deviation); their count is printed.

Then times each quantizer on a large BF16 tensor with CUDA events and prints GB/s of BF16
input next to a device-to-device copy of the same tensor measured in the same run.
Writes the results as JSON to --json (default $OUT/gpu_numerics.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from qconvert.convert.numerics import mxfp8_quantize, nvfp4_quantize  # noqa: E402

BYTE0_LIMIT = 448.0 * 2.0**-127
RESULTS: dict = {"mismatch": [], "throughput": [], "notes": []}


def note(msg: str) -> None:
    print("NOTE:", msg, flush=True)
    RESULTS["notes"].append(msg)


def record(ref: str, fmt: str, case: str, what: str, n_diff: int, n_total: int, extra=""):
    RESULTS["mismatch"].append(
        dict(ref=ref, fmt=fmt, case=case, what=what, diff=int(n_diff), total=int(n_total), extra=extra)
    )


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ inputs


def make_inputs(rows: int, cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g).float())
    cases = {"random": x.to(torch.bfloat16)}
    try:
        import test_numerics_mxfp8 as t8
        import test_numerics_nvfp4 as t4

        cases["mx_adversarial"] = t8.adversarial_bf16()
        cases["fp4_adversarial"] = t4.adversarial_bf16(0)
        cases["fp4_adv_tiny_global"] = t4.adversarial_bf16(-136)
        cases["fp4_adv_huge_global"] = t4.adversarial_bf16(115)
        for i, v in enumerate(t4._varied_amax_tensors(8)):
            cases[f"varied_amax_{i}"] = v
    except Exception as e:  # the tests need pytest and numpy; the script should still run
        note(f"adversarial generators from tests/ unavailable: {e!r}")
    return cases


def mx_keep(x: torch.Tensor) -> torch.Tensor:
    amax = x.float().reshape(*x.shape[:-1], -1, 32).abs().amax(-1)
    return amax > BYTE0_LIMIT


def compare_mxfp8(ref: str, case: str, x, q, s, rq, rs) -> None:
    keep = mx_keep(x.cpu())
    q, s, rq, rs = (t.cpu() for t in (q, s, rq, rs))
    rs = rs.reshape(s.shape)
    ke = keep.repeat_interleave(32, dim=-1)
    record(
        ref,
        "mxfp8",
        case,
        "scale",
        (u8(s) != u8(rs))[keep].sum(),
        keep.sum(),
        f"{int((~keep).sum())} byte-0 blocks left out",
    )
    record(ref, "mxfp8", case, "elements", (u8(q) != u8(rq))[ke].sum(), ke.sum())


def compare_nvfp4(ref: str, case: str, recipe: str, p, s, rp, rs, s2=None, rs2=None) -> None:
    p, s, rp, rs = (t.cpu() for t in (p, s, rp, rs))
    rs = rs.reshape(s.shape)
    record(ref, f"nvfp4-{recipe}", case, "scale", (u8(s) != u8(rs)).sum(), s.numel())
    record(ref, f"nvfp4-{recipe}", case, "packed", (u8(p) != u8(rp.reshape(p.shape))).sum(), p.numel())
    if s2 is not None:
        record(ref, f"nvfp4-{recipe}", case, "scale_2", int(s2.cpu().item() != rs2.cpu().item()), 1)


# ------------------------------------------------------------------ (a) CPU vs CUDA


def check_cpu_vs_cuda(cases) -> None:
    for name, x in cases.items():
        xc = x.cuda()
        q, s = mxfp8_quantize(xc)
        rq, rs = mxfp8_quantize(x)
        record("qconvert-cpu", "mxfp8", name, "scale", (u8(s.cpu()) != u8(rs)).sum(), rs.numel())
        record("qconvert-cpu", "mxfp8", name, "elements", (u8(q.cpu()) != u8(rq)).sum(), rq.numel())
        for recipe in ("te", "modelopt"):
            p, sc, s2 = nvfp4_quantize(xc, recipe=recipe)
            rp, rsc, rs2 = nvfp4_quantize(x, recipe=recipe)
            compare_nvfp4("qconvert-cpu", name, recipe, p, sc, rp, rsc, s2, rs2)


# ------------------------------------------------------------------ (b) FlashInfer


def check_flashinfer(cases) -> None:
    os.environ["FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"] = "1"
    try:
        import flashinfer
    except Exception as e:
        note(f"FlashInfer not importable here ({e.__class__.__name__}); skipped (b)")
        return
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        note(
            f"FlashInfer {flashinfer.__version__} present but SM{major}{minor}: its MXFP8/FP4 "
            "quantize kernels are compiled out below SM100; skipped (b)"
        )
        return
    for name, x in cases.items():
        try:
            q, s = flashinfer.mxfp8_quantize(x.cuda(), is_sf_swizzled_layout=False)
            mq, ms = mxfp8_quantize(x.cuda())
            compare_mxfp8("flashinfer", name, x, mq, ms, q, s)
        except Exception as e:
            note(f"flashinfer.mxfp8_quantize failed on {name}: {e!r}")
        try:
            xc = x.cuda().reshape(-1, x.shape[-1])
            amax = xc.float().abs().amax()
            gs = (torch.tensor(2688.0, device="cuda") / amax).reshape(1)
            p, s = flashinfer.fp4_quantize(xc, gs, 16, False, False)
            mp, ms, _ = nvfp4_quantize(xc, recipe="te")
            compare_nvfp4("flashinfer", name, "te", mp, ms, p, s)
        except Exception as e:
            note(f"flashinfer.fp4_quantize failed on {name}: {e!r}")


# ------------------------------------------------------------------ (c) vLLM


def load_vllm_mxfp8(path: str | None):
    try:
        from vllm.model_executor.layers.quantization.utils import mxfp8_utils

        return mxfp8_utils, "installed vllm"
    except Exception as e:
        if not path:
            note(f"vLLM not importable ({e.__class__.__name__}) and no --vllm-mxfp8-utils")
            return None, None
    # vLLM's file imports only direct_register_custom_op from vllm; stub that one name.
    stub_root = types.ModuleType("vllm")
    stub_utils = types.ModuleType("vllm.utils")
    stub_tu = types.ModuleType("vllm.utils.torch_utils")
    stub_tu.direct_register_custom_op = lambda *a, **k: None
    stub_root.utils = stub_utils
    stub_utils.torch_utils = stub_tu
    sys.modules.setdefault("vllm", stub_root)
    sys.modules.setdefault("vllm.utils", stub_utils)
    sys.modules.setdefault("vllm.utils.torch_utils", stub_tu)
    spec = importlib.util.spec_from_file_location("vllm_mxfp8_utils_file", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, f"vLLM file {path}"


def check_vllm(cases, path) -> None:
    mod, origin = load_vllm_mxfp8(path)
    if mod is None:
        return
    note(f"vLLM MXFP8 reference from {origin}")
    for name, x in cases.items():
        xc = x.cuda()
        vq, vs = mod._mxfp8_e4m3_quantize_torch(xc)
        q, s = mxfp8_quantize(xc)
        compare_mxfp8("vllm-cuda", name, x, q, s, vq, vs)


# ------------------------------------------------------------------ (d) CUDA conversions

KERNELS = r"""
#include <cuda_fp8.h>
#include <cuda_fp4.h>
#define QC_FLT_MAX 3.402823466e+38f
__device__ __forceinline__ float bf16f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ float e4m3f(unsigned char b) {
  int e = (b >> 3) & 15, m = b & 7;
  return e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m * 0.125f, e - 7);
}
// TransformerEngine NVFP4 1-D order (core_nvfp4.cuh, quantize_transpose_nvfp4.cuh).
extern "C" __global__ void nv_te_nvfp4(const unsigned short* x, long long nblocks, float g,
                                       unsigned char* packed, unsigned char* scales) {
  long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  float s_enc = fminf(448.0f * 6.0f / g, QC_FLT_MAX);
  if (g == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  float s_dec = 1.0f / s_enc;
  const unsigned short* xb = x + b * 16;
  float amax = 0.0f;
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(bf16f(xb[i])));
  float s = fminf(amax * (s_enc * (1.0f / 6.0f)), QC_FLT_MAX);
  __nv_fp8_storage_t sb = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  scales[b] = sb;
  float inv = fminf(1.0f / (e4m3f(sb) * s_dec), QC_FLT_MAX);
  for (int i = 0; i < 16; i += 2) {
    unsigned lo = __nv_cvt_float_to_fp4(bf16f(xb[i]) * inv, __NV_E2M1, cudaRoundNearest);
    unsigned hi = __nv_cvt_float_to_fp4(bf16f(xb[i + 1]) * inv, __NV_E2M1, cudaRoundNearest);
    packed[b * 8 + i / 2] = (unsigned char)((lo & 15u) | ((hi & 15u) << 4));
  }
}
// RCEIL MXFP8 as TE / FlashInfer: e8m0 = round-up(amax * 1/448), elements x * 2^(127-e8m0).
extern "C" __global__ void nv_mxfp8(const unsigned short* x, long long nblocks,
                                    unsigned char* q, unsigned char* scales) {
  long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const unsigned short* xb = x + b * 32;
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(bf16f(xb[i])));
  const float rcp448 = 1.0f / 448.0f;
  __nv_fp8_storage_t e = __nv_cvt_float_to_e8m0(amax * rcp448, __NV_SATFINITE, cudaRoundPosInf);
  scales[b] = e;
  float inv = __uint_as_float((unsigned)(254 - e) << 23);
  for (int i = 0; i < 32; ++i)
    q[b * 32 + i] = __nv_cvt_float_to_fp8(bf16f(xb[i]) * inv, __NV_SATFINITE, __NV_E4M3);
}
"""


def build_cuda_oracle(ftz: bool):
    """Compile KERNELS with NVRTC. TE builds its NVFP4 kernels without fast math (no
    flush-to-zero); FlashInfer's JIT adds -use_fast_math (so -ftz=true) by default, which
    changes results only where fp32 subnormals occur. ``ftz`` picks which to emulate."""
    import cupy

    incs = []
    for c in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", "/usr/local/cuda-13.0"):
        if c and os.path.exists(os.path.join(c, "include", "cuda_fp4.h")):
            incs.append(os.path.join(c, "include"))
    opts = tuple(f"-I{i}" for i in incs) + (
        "--std=c++17",
        "--fmad=false",
        "-prec-div=true",
        f"-ftz={'true' if ftz else 'false'}",
    )
    mod = cupy.RawModule(code=KERNELS, options=opts)
    return cupy, mod.get_function("nv_te_nvfp4"), mod.get_function("nv_mxfp8")


def check_cuda_conversions(cases) -> None:
    for ftz in (False, True):
        check_cuda_conversions_one(cases, ftz)


def check_cuda_conversions_one(cases, ftz: bool) -> None:
    ref = "cuda-conv-ftz" if ftz else "cuda-conv"
    try:
        cupy, te_k, mx_k = build_cuda_oracle(ftz)
    except Exception as e:
        note(f"CuPy/NVRTC oracle ({ref}) unavailable: {e!r}")
        return
    for name, x in cases.items():
        xc = x.cuda().contiguous()
        xi = cupy.asarray(xc.view(torch.int16))
        k = x.shape[-1]
        nb = x.numel() // 16
        g = float(x.float().abs().max())
        packed = cupy.empty(x.numel() // 2, dtype=cupy.uint8)
        scales = cupy.empty(nb, dtype=cupy.uint8)
        te_k(((nb + 255) // 256,), (256,), (xi, cupy.int64(nb), cupy.float32(g), packed, scales))
        mp, ms, _ = nvfp4_quantize(xc, recipe="te")
        compare_nvfp4(
            ref,
            name,
            "te",
            mp,
            ms,
            torch.as_tensor(packed, device="cuda").reshape(*x.shape[:-1], k // 2),
            torch.as_tensor(scales, device="cuda"),
        )
        nb32 = x.numel() // 32
        q = cupy.empty(x.numel(), dtype=cupy.uint8)
        s = cupy.empty(nb32, dtype=cupy.uint8)
        mx_k(((nb32 + 255) // 256,), (256,), (xi, cupy.int64(nb32), q, s))
        mq, msc = mxfp8_quantize(xc)
        compare_mxfp8(
            ref,
            name,
            x,
            mq,
            msc,
            torch.as_tensor(q, device="cuda").view(torch.float8_e4m3fn).reshape(x.shape),
            torch.as_tensor(s, device="cuda"),
        )


# ------------------------------------------------------------------ throughput


def cuda_time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def throughput(rows: int, cols: int, iters: int, vllm_path) -> None:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    dst = torch.empty_like(x)
    t_copy = cuda_time(lambda: dst.copy_(x), iters)
    copy_in = nbytes / t_copy / 1e9
    RESULTS["throughput"].append(dict(name="d2d copy", seconds=t_copy, gbps_input=copy_in, gbps_rw=2 * copy_in))
    fns = {
        "qconvert mxfp8": lambda: mxfp8_quantize(x),
        "qconvert nvfp4 te": lambda: nvfp4_quantize(x, recipe="te"),
        "qconvert nvfp4 modelopt": lambda: nvfp4_quantize(x, recipe="modelopt"),
    }
    mod, _ = load_vllm_mxfp8(vllm_path) if vllm_path or importlib.util.find_spec("vllm") else (None, None)
    if mod is not None:
        fns["vllm mxfp8 (torch path)"] = lambda: mod._mxfp8_e4m3_quantize_torch(x)
    for name, fn in fns.items():
        try:
            t = cuda_time(fn, iters)
            gb = nbytes / t / 1e9
            RESULTS["throughput"].append(dict(name=name, seconds=t, gbps_input=gb, vs_copy=gb / copy_in))
        except Exception as e:
            note(f"timing {name} failed: {e!r}")
    torch.cuda.synchronize()
    RESULTS["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30


# ------------------------------------------------------------------ main


def print_tables() -> None:
    print("\nbyte mismatches (diff / compared); rows with diff 0 are only in the JSON")
    print(f"{'reference':18} {'format':15} {'case':22} {'what':9} {'diff':>9} {'total':>11}  note")
    for r in RESULTS["mismatch"]:
        if r["diff"] == 0:
            continue
        print(f"{r['ref']:18} {r['fmt']:15} {r['case']:22} {r['what']:9} {r['diff']:9d} {r['total']:11d}  {r['extra']}")
    tot = {}
    for r in RESULTS["mismatch"]:
        k = (r["ref"], r["fmt"], r["what"])
        d, n = tot.get(k, (0, 0))
        tot[k] = (d + r["diff"], n + r["total"])
    print("\ntotals")
    for (ref, fmt, what), (d, n) in tot.items():
        print(f"{ref:18} {fmt:15} {what:9} {d:9d} / {n}")
    print("\nthroughput (GB/s of BF16 input; copy also as read+write)")
    for r in RESULTS["throughput"]:
        extra = f"  read+write {r['gbps_rw']:.0f} GB/s" if "gbps_rw" in r else f"  {r['vs_copy']:.3f} x copy"
        print(f"{r['name']:26} {r['seconds'] * 1e3:9.3f} ms {r['gbps_input']:9.1f} GB/s{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--bench-rows", type=int, default=16384)
    ap.add_argument("--bench-cols", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--vllm-mxfp8-utils", default=None, help="path to vLLM's mxfp8_utils.py when vLLM is not installed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["capability"] = torch.cuda.get_device_capability()
    RESULTS["torch"] = torch.__version__
    print(f"device {RESULTS['device']} sm{RESULTS['capability']}, torch {torch.__version__}")
    cases = make_inputs(a.rows, a.cols)
    for step in (
        lambda: check_cpu_vs_cuda(cases),
        lambda: check_cuda_conversions(cases),
        lambda: check_vllm(cases, a.vllm_mxfp8_utils),
        lambda: check_flashinfer(cases),
        lambda: throughput(a.bench_rows, a.bench_cols, a.iters, a.vllm_mxfp8_utils),
    ):
        try:
            step()
        except Exception:
            note("step failed:\n" + traceback.format_exc())
    RESULTS["wall_s"] = time.time() - t0
    print_tables()
    out = a.json or (os.path.join(os.environ["OUT"], "gpu_numerics.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
