#!/usr/bin/env python3
"""Per-core throughput of the C quantizer kernels (GB/s of BF16 input, one thread, best of 5) on one
Qwen3-30B-A3B expert-sized tensor block, for the AVX2 loops and the portable ones
(``QCONVERT_NO_AVX2``), MXFP8 and both NVFP4 recipes.

    python scripts/bench_cpu_kernels.py
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qconvert.convert.numerics import cpu_kernels  # noqa: E402


def main():
    lib = cpu_kernels.library()
    if lib is None:
        print("no C kernels:", cpu_kernels.status())
        return 1
    x = torch.randn(4 * 768 * 2048, generator=torch.Generator().manual_seed(0)).bfloat16()  # 4 experts, 12.6 MB
    n = x.numel()
    p = torch.empty(n // 2, dtype=torch.uint8)
    sc = torch.empty(n // 16, dtype=torch.uint8)
    q = torch.empty(n, dtype=torch.uint8)
    s = torch.empty(n // 32, dtype=torch.uint8)
    xp = x.data_ptr()
    calls = {
        "mxfp8": lambda: lib.qc_mxfp8(xp, 0, 0, n // 32, q.data_ptr(), s.data_ptr()),
        "nvfp4 te": lambda: lib.qc_nvfp4(xp, 0, 0, n // 16, 1, 0.01, 0.5, 0, p.data_ptr(), sc.data_ptr()),
        "nvfp4 modelopt": lambda: lib.qc_nvfp4(xp, 0, 0, n // 16, 0, 0.01, 0.5, 0, p.data_ptr(), sc.data_ptr()),
    }
    print(f"# {platform.processor() or platform.machine()}, AVX2 loops built: {cpu_kernels.avx2()}")
    print("| kernel | portable GB/s | AVX2 GB/s | ratio |")
    print("|---|---|---|---|")
    for name, fn in calls.items():
        rates = []
        for path in ("portable", "avx2"):
            if path == "portable":
                os.environ["QCONVERT_NO_AVX2"] = "1"
            else:
                os.environ.pop("QCONVERT_NO_AVX2", None)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                best = min(best, time.perf_counter() - t0)
            rates.append(10 * n * 2 / best / 1e9)
        print(f"| {name} | {rates[0]:.2f} | {rates[1]:.2f} | {rates[1] / rates[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
