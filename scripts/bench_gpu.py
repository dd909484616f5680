#!/usr/bin/env python3
"""CUDA benchmark (run on the GPU machine): quantize step vs device copy bandwidth, and a whole
``--device cuda`` conversion vs the I/O floor, all measured in one run.

1. Ceiling: a large device-to-device copy, bytes read + written over time (CUDA events, median).
2. Quantize one Qwen3-30B-A3B MoE layer (128 experts: W13 [128, 1536, 2048], W2 [128, 2048, 768],
   1.2 GB BF16) with qconvert's MXFP8 and NVFP4 quantizers, eager and under ``torch.compile``
   (the same pure tensor functions), as bytes read + written over time and as a fraction of the
   copy bandwidth; compiled outputs are checked bit-identical to eager.
3. Whole conversion of a synthetic checkpoint (scripts/make_synthetic.py) with ``--device cuda``
   and on CPU, against the I/O floor process of scripts/bench_convert.py, as ratios.

    python scripts/bench_gpu.py --out $OUT --layers 2

Target (issue 7): quantize step >= 70% of the copy bandwidth; conversion bounded by I/O.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from qconvert.convert.numerics.mxfp8 import mxfp8_quantize  # noqa: E402

E, I, H = 128, 768, 2048


def cuda_ms(fn, reps=10, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def copy_bandwidth(nbytes=4 << 30):
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3), ms


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def quantize_step(results, copy_bw):
    from qconvert.convert.numerics.nvfp4 import nvfp4_quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    n = w13.numel() + w2.numel()
    ga = torch.tensor(0.2, device="cuda")
    variants = {
        "mxfp8": (lambda x: mxfp8_quantize(x), 2 * n + n + n // 32),
        "nvfp4": (lambda x: nvfp4_quantize(x, global_amax=ga), 2 * n + n // 2 + n // 16),
    }
    rows = []
    for scheme, (fn, nbytes) in variants.items():
        eager = [fn(w13), fn(w2)]
        for mode in ("eager", "compile"):
            f = fn if mode == "eager" else torch.compile(fn, dynamic=False)
            t0 = time.time()
            try:
                outs = [f(w13), f(w2)]
            except Exception as err:  # noqa: BLE001 - report, don't die
                rows.append({"scheme": scheme, "mode": mode, "error": f"{type(err).__name__}: {str(err)[:200]}"})
                continue
            compile_s = time.time() - t0
            same = all(torch.equal(_u8(a), _u8(b)) for o1, o2 in zip(eager, outs) for a, b in zip(o1, o2))
            ms = cuda_ms(lambda: (f(w13), f(w2)))
            bw = nbytes / (ms / 1e3)
            rows.append({"scheme": scheme, "mode": mode, "ms_per_layer": round(ms, 3), "x48_s": round(ms * 48 / 1e3, 3),
                         "GBps": round(bw / 1e9, 1), "fraction_of_copy": round(bw / copy_bw, 3),
                         "bit_identical_to_eager": same, "first_call_s": round(compile_s, 1)})
            print(json.dumps(rows[-1]), flush=True)
    results["quantize"] = rows
    del w13, w2
    torch.cuda.empty_cache()


def conversion(results, a):
    import bench_convert as bc

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "synth"
    t0 = time.time()
    subprocess.run([sys.executable, str(HERE / "make_synthetic.py"), str(src), "--layers", str(a.layers),
                    "--shard-gb", str(a.shard_gb)], check=True)
    results["synthetic_make_s"] = round(time.time() - t0, 1)
    sizes_in = bc._shard_sizes(src)
    rows = []
    for scheme in a.schemes.split(","):
        for device in ("cuda", "cpu"):
            if device == "cpu" and not a.cpu_too:
                continue
            dst = work / f"out-{scheme}-{device}"
            cmd = bc._py() + ["_qconvert", scheme, str(src), str(dst), "--device", device]
            m = bc.run_measured(cmd, log=work / "log.txt")
            out_sizes = bc._shard_sizes(dst) if dst.exists() else {}
            shutil.rmtree(dst, ignore_errors=True)
            f = bc.run_measured(bc.cmd_floor(src, work / "out-floor", out_sizes, False), log=work / "log.txt") if out_sizes else None
            shutil.rmtree(work / "out-floor", ignore_errors=True)
            row = {"scheme": scheme, "device": device, "wall": round(m["wall"], 2), "rc": m["rc"],
                   "rss_GiB": round(m["rss"] / 2**30, 2), "bytes_in": sum(sizes_in.values()),
                   "bytes_out": sum(out_sizes.values()),
                   "floor_wall": round(f["wall"], 2) if f else None,
                   "ratio": round(m["wall"] / f["wall"], 2) if f else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    results["conversion"] = rows
    try:
        results["log_tail"] = (work / "log.txt").read_text()[-3000:]
    except OSError:
        pass
    shutil.rmtree(work, ignore_errors=True)


def table(res) -> str:
    L = [f"### CUDA, {res['date']}", "", f"Machine: {res['machine']}.", "",
         f"Device-to-device copy (the ceiling): {res['copy_GBps']:.0f} GB/s read + written.", "",
         "| scheme | mode | ms per MoE layer | x48 layers | GB/s read+written | fraction of copy | target | bit-identical to eager |",
         "|---|---|---|---|---|---|---|---|"]
    for r in res.get("quantize", []):
        if "error" in r:
            L.append(f"| {r['scheme']} | {r['mode']} | - | - | - | - | >= 0.70 | {r['error']} |")
        else:
            L.append(f"| {r['scheme']} | {r['mode']} | {r['ms_per_layer']:.2f} | {r['x48_s']:.2f} s | {r['GBps']:.0f} | "
                     f"{r['fraction_of_copy']:.3f} | >= 0.70 | {r['bit_identical_to_eager']} |")
    if res.get("conversion"):
        L += ["", "| scheme | device | input | output | floor wall | qconvert wall | qconvert / floor | peak RSS | rc |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in res["conversion"]:
            L.append(f"| {r['scheme']} | {r['device']} | {r['bytes_in'] / 1e9:.2f} GB | {r['bytes_out'] / 1e9:.2f} GB | "
                     f"{r['floor_wall']} s | {r['wall']} s | {r['ratio']} | {r['rss_GiB']} GiB | {r['rc']} |")
    L += ["", "Reproduce: `python " + " ".join(["scripts/bench_gpu.py"] + res["argv"][1:]) + "`"]
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/qconvert-bench-gpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--schemes", default="mxfp8,nvfp4")
    ap.add_argument("--cpu-too", action="store_true", help="also convert on this machine's CPUs")
    ap.add_argument("--skip-conversion", action="store_true")
    a = ap.parse_args()
    import datetime
    import platform
    res = {"date": datetime.date.today().isoformat(), "argv": sys.argv,
           "machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                      f"Python {platform.python_version()}"}
    bw, ms = copy_bandwidth()
    res["copy_GBps"] = bw / 1e9
    print(f"copy: {bw / 1e9:.0f} GB/s", flush=True)
    quantize_step(res, bw)
    if not a.skip_conversion:
        conversion(res, a)
    text = table(res)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    (Path(a.out) / "bench_gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
