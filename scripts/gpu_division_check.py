#!/usr/bin/env python3
"""Brute-force check, on a CUDA GPU, of the division trick in the NVFP4 ModelOpt Triton kernel
(``numerics/cuda_kernels.py``): for divisors d in [2^-60, 2^60] and every BF16 x,

    r = RN(1 / d); q = RN(x * r); v = fma(fma(-q, d, x), r, q)

against IEEE division RN(x / d) (``div_rn``), for divisors in the kernel's range [2^-60, 2^16]:
random ones (every fp32 mantissa equally likely, exponents spread over the range) and mantissa
edge cases (1.0, 1.5, all ones, one ulp either side of a power of two, 1/3, 2/3). Counts
  - finite quotients of at least 2^-3 whose fp32 bits differ (the kernel's claim: none);
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
from qconvert.convert.numerics.cuda_kernels import _e2m1_magnitude, _launch_options  # noqa: E402


@triton.jit
def _check(x_ptr, d_ptr, out_ptr, N: tl.constexpr):
    d = tl.load(d_ptr + tl.program_id(0))
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    ref = tl.math.div_rn(x, d)
    r = tl.math.div_rn(1.0, d)
    q = x * r
    v = tl.fma(tl.fma(-q, d, x), r, q)
    finite = tl.abs(ref) <= 3.4028234663852886e38
    big = finite & (tl.abs(ref) >= 0.125)
    bits_differ = big & (v.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True))
    code_differ = (_e2m1_magnitude(v) != _e2m1_magnitude(ref)) | ((x < 0.0) != (ref < 0.0))
    overflow = (ref == ref) & ~finite
    tl.atomic_add(out_ptr, tl.sum(bits_differ.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(code_differ.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 2, tl.sum(overflow.to(tl.int64), axis=0))
    # control: the uncorrected x * RN(1/d) differs often, so the comparison can see a difference
    uncorrected = big & (q.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True))
    tl.atomic_add(out_ptr + 3, tl.sum(uncorrected.to(tl.int64), axis=0))


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
    torch.cuda.synchronize()
    res = {"divisors": d.numel(), "x_values": x.numel(), "pairs": d.numel() * x.numel(),
           "fp32_bits_differ_finite_quotient_ge_2^-3": int(out[0]), "e2m1_code_or_sign_differ": int(out[1]),
           "overflowing_quotients": int(out[2]), "control_uncorrected_x_times_reciprocal_differs": int(out[3])}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if int(out[0]) or int(out[1]) or not int(out[3]) else 0


if __name__ == "__main__":
    sys.exit(main())
