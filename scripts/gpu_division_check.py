#!/usr/bin/env python3
"""Brute-force check, on a CUDA GPU, of the division trick in the NVFP4 ModelOpt Triton kernel
(``numerics/cuda_kernels.py``), with the kernel's own functions: for divisors d and every BF16 x,

    r = RN(1 / d) (``_recip``); q = RN(|x| * r); v = fma(fma(-q, d, |x|), r, q) (``_markstein_quotient``)

against IEEE division RN(x / d) (``div_rn``), for divisors in the kernel's range [2^-60, 2^16]:
random ones (every fp32 mantissa equally likely, exponents spread over the range) and mantissa
edge cases (1.0, 1.5, all ones, one ulp either side of a power of two, 1/3, 2/3). Counts
  - fp32 values z, all 2^32 of them, whose ``_recip(z)`` differs from div_rn(1, z) (claim: none;
    the te kernel takes its reciprocals from it too);
  - finite quotients of at least 2^-3 whose fp32 magnitude bits differ (the kernel's claim: none);
  - pairs whose E2M1 code or ModelOpt sign (v < 0; the kernel's: x < 0) differ (claim: none);
  - overflowing quotients (x / d > FLT_MAX, which the pipeline's divisors never give: there the
    E2M1 code saturates either way).

    python scripts/gpu_division_check.py --divisors 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from qconvert.convert.numerics.cuda_kernels import (  # noqa: E402
    _e2m1_magnitude,
    _launch_options,
    _markstein_quotient,
    _recip,
)


@triton.jit
def _check(x_ptr, d_ptr, out_ptr, N: tl.constexpr):
    d = tl.load(d_ptr + tl.program_id(0))
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    ref = tl.math.div_rn(x, d)
    r = _recip(d)
    a = tl.abs(x)
    q = a * r
    v = _markstein_quotient(a, d, r)  # the kernel quantizes magnitudes; its sign is x < 0
    finite = tl.abs(ref) <= 3.4028234663852886e38
    big = finite & (tl.abs(ref) >= 0.125)
    bits_differ = big & (v.to(tl.int32, bitcast=True) != tl.abs(ref).to(tl.int32, bitcast=True))
    code_differ = (_e2m1_magnitude(v) != _e2m1_magnitude(tl.abs(ref))) | ((x < 0.0) != (ref < 0.0))
    overflow = (ref == ref) & ~finite
    tl.atomic_add(out_ptr, tl.sum(bits_differ.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(code_differ.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 2, tl.sum(overflow.to(tl.int64), axis=0))
    # control: the uncorrected x * RN(1/d) differs often, so the comparison can see a difference
    uncorrected = big & (q.to(tl.int32, bitcast=True) != tl.abs(ref).to(tl.int32, bitcast=True))
    tl.atomic_add(out_ptr + 3, tl.sum(uncorrected.to(tl.int64), axis=0))


@triton.jit
def _check_recip(out_ptr, start, N: tl.constexpr):
    """_recip(z) against div_rn(1, z) on the fp32 bit patterns start .. start + grid * N (NaN
    results only need to be NaN on both)."""
    bits = start + tl.program_id(0).to(tl.int64) * N + tl.arange(0, N)
    z = bits.to(tl.int32).to(tl.float32, bitcast=True)
    r, ref = _recip(z), tl.math.div_rn(1.0, z)
    differ = (r.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True)) & ((r == r) | (ref == ref))
    tl.atomic_add(out_ptr, tl.sum(differ.to(tl.int64), axis=0))
    approx = 1.0 / z  # control: Triton's plain division is approximate, so the check can see a difference
    ctrl = (approx.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True)) & ((approx == approx) | (ref == ref))
    tl.atomic_add(out_ptr + 1, tl.sum(ctrl.to(tl.int64), axis=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--divisors", type=int, default=1 << 20)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = "cuda"
    x = torch.arange(1 << 16, dtype=torch.int32, device=dev).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator(device=dev).manual_seed(0)
    mant = torch.randint(0, 1 << 23, (a.divisors,), generator=g, device=dev, dtype=torch.int32)
    expo = torch.randint(127 - 60, 127 + 16, (a.divisors,), generator=g, device=dev, dtype=torch.int32)
    d = ((expo << 23) | mant).view(torch.float32)
    edges = []
    for e in range(-60, 17):
        for m in (0, 1 << 22, (1 << 23) - 1, 1, (1 << 23) - 2, 0x2AAAAA, 0x555555):
            if e < 16 or m == 0:
                edges.append(((127 + e) << 23) | m)
    d = torch.cat([d, torch.tensor(edges, dtype=torch.int32, device=dev).view(torch.float32)])
    out = torch.zeros(4, dtype=torch.int64, device=dev)
    _check[(d.numel(),)](x, d, out, N=1 << 16, num_warps=8, **_launch_options())
    rec = torch.zeros(2, dtype=torch.int64, device=dev)
    chunk = 1 << 30
    for start in range(0, 1 << 32, chunk):
        _check_recip[(chunk // 4096,)](rec, start, N=4096, num_warps=8, **_launch_options())
    torch.cuda.synchronize()
    res = {
        "divisors": d.numel(),
        "x_values": x.numel(),
        "pairs": d.numel() * x.numel(),
        "fp32_values_whose_reciprocal_differs_from_div_rn": int(rec[0]),
        "control_approximate_reciprocal_differs": int(rec[1]),
        "fp32_bits_differ_finite_quotient_ge_2^-3": int(out[0]),
        "e2m1_code_or_sign_differ": int(out[1]),
        "overflowing_quotients": int(out[2]),
        "control_uncorrected_x_times_reciprocal_differs": int(out[3]),
    }
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if int(out[0]) or int(out[1]) or int(rec[0]) or not int(out[3]) or not int(rec[1]) else 0


if __name__ == "__main__":
    sys.exit(main())
