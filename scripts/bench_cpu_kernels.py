#!/usr/bin/env python3
"""Per-core throughput of the C quantizer kernels (GB/s of BF16 input, one thread, best of 5) on one
Qwen3-30B-A3B expert-sized tensor block, for the AVX2 loops and the portable ones
(``QCONVERT_NO_AVX2``), MXFP8 and the three NVFP4 recipes; with ``--chain``, also the torch op chain
of each NVFP4 recipe (what runs without the C kernels).

The last column is each row's time as a ratio to the floor measured in the same run: NVFP4 ``te``
(the default recipe) through the AVX2 loops, or the portable ones where AVX2 is not built.

    python scripts/bench_cpu_kernels.py [--chain]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qconvert.convert.numerics import cpu_kernels, nvfp4  # noqa: E402


def best_of(fn, rounds: int = 5, calls: int = 10) -> float:
    """Seconds per call: the best of ``rounds`` timings of ``calls`` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", action="store_true", help="also time the torch op chains of the NVFP4 recipes")
    args = ap.parse_args()
    lib = cpu_kernels.library()
    if lib is None:
        print("no C kernels:", cpu_kernels.status())
        return 1
    torch.set_num_threads(1)
    x = torch.randn(4 * 768 * 2048, generator=torch.Generator().manual_seed(0)).bfloat16()  # 4 experts, 12.6 MB
    n = x.numel()
    p = torch.empty(n // 2, dtype=torch.uint8)
    sc = torch.empty(n // 16, dtype=torch.uint8)
    q = torch.empty(n, dtype=torch.uint8)
    s = torch.empty(n // 32, dtype=torch.uint8)
    xp = x.data_ptr()
    g = cpu_kernels.abs_max_f32(x, 1)
    k = {r: nvfp4.cpu_tensor_scalars(g, r) for r in nvfp4.NVFP4_RECIPES}
    calls = {
        "mxfp8": lambda: lib.qc_mxfp8(xp, 0, 0, n // 32, q.data_ptr(), s.data_ptr()),
        "nvfp4 te": lambda: lib.qc_nvfp4(
            xp, 0, 0, n // 16, 1, float(k["te"][1]), float(k["te"][2]), 0, p.data_ptr(), sc.data_ptr()
        ),
        "nvfp4 modelopt": lambda: lib.qc_nvfp4(
            xp, 0, 0, n // 16, 0, float(k["modelopt"][1]), float(k["modelopt"][2]), 0, p.data_ptr(), sc.data_ptr()
        ),
        "nvfp4 4over6": lambda: lib.qc_nvfp4_4over6(
            xp, 0, 0, n // 16, float(k["4over6"][1]), float(k["4over6"][2]), float(g), p.data_ptr(), sc.data_ptr()
        ),
    }
    rows = []
    for name, fn in calls.items():
        times = []
        for path in ("portable", "avx2"):
            if path == "portable":
                os.environ["QCONVERT_NO_AVX2"] = "1"
            else:
                os.environ.pop("QCONVERT_NO_AVX2", None)
            times.append(best_of(fn))
        rows.append((name, times[0], times[1]))
    if args.chain:
        xb = x.view(-1, 16)
        gt = torch.tensor(np.float32(g))
        pk = torch.empty(n // 16, 8, dtype=torch.uint8)
        s8 = torch.empty(n // 16, dtype=torch.float8_e4m3fn)
        for r in nvfp4.NVFP4_RECIPES:
            s2 = nvfp4.recipe_scale_2(gt, r)
            t = best_of(lambda r=r, s2=s2: nvfp4.quantize_cpu_chain(xb, gt, s2, r, pk, s8, 1), rounds=3, calls=1)
            rows.append((f"nvfp4 {r} (torch chain)", t, None))
    te = next(r for r in rows if r[0] == "nvfp4 te")
    floor = te[2] if cpu_kernels.avx2() else te[1]
    print(
        f"# {platform.processor() or platform.machine()}, AVX2 loops built: {cpu_kernels.avx2()}, {n * 2 / 1e6:.1f} MB BF16"
    )
    print("| kernel | portable GB/s | AVX2 GB/s | AVX2 / portable | time / NVFP4 te |")
    print("|---|---|---|---|---|")
    for name, tp, ta in rows:
        gbs = [f"{n * 2 / t / 1e9:.2f}" if t else "-" for t in (tp, ta)]
        speed = f"{tp / ta:.2f}" if ta else "-"
        t = ta if ta and cpu_kernels.avx2() else tp  # what the converter runs
        print(f"| {name} | {gbs[0]} | {gbs[1]} | {speed} | {t / floor:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
