#!/usr/bin/env python3
"""CUDA benchmark (run on the GPU machine): quantize step vs device copy bandwidth, and a whole
``--device cuda`` conversion vs the I/O floor, all measured in one run.

1. Ceiling: a large device-to-device copy, bytes read + written over time (CUDA events, median).
2. Quantize one Qwen3-30B-A3B MoE layer (128 experts: W13 [128, 1536, 2048], W2 [128, 2048, 768],
   1.2 GB BF16) with qconvert's MXFP8 and NVFP4 quantizers: the one-pass Triton kernels (the
   pipeline's CUDA default), the eager torch chains and their ``torch.compile``, as bytes read +
   written over time and as a fraction of the copy bandwidth; every output is checked
   bit-identical to eager, and exhaustively (every BF16 pattern) against eager and the CPU.
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
# the subprocesses (make_synthetic, the converter, the floor) import qconvert from this checkout
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

import torch  # noqa: E402

from qconvert.convert.numerics.mxfp8 import mxfp8_quantize  # noqa: E402

E, I, H = 128, 768, 2048
#: Only for trying this script's logic on a machine without a GPU (QCONVERT_BENCH_DEVICE=cpu).
DEV = os.environ.get("QCONVERT_BENCH_DEVICE", "cuda")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn, reps=10, warm=2, windows=5):
    """Median over ``windows`` of the mean time of ``reps`` back-to-back calls (CUDA events).

    Calls are queued back to back, as the pipeline queues work, so the host's launch cost of one
    call overlaps the device work of the previous one; a window per call would count the idle
    device during each launch (about 0.1 ms per NVFP4 call: 20% of a layer)."""
    for _ in range(warm):
        fn()
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ts = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return statistics.median(ts)


def copy_bandwidth(nbytes=4 << 30):
    nbytes = nbytes if DEV == "cuda" else 1 << 26
    x = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x))
    del x, y
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3), ms


def _same(o1, o2):
    """Byte equality (a NaN global scale equals itself)."""
    return all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(o1, o2))


def quantize_step(results, copy_bw):
    """Quantize step on CUDA: the one-pass Triton kernels (the pipeline's default), the eager torch
    chains, their torch.compile (static shapes, Inductor with IEEE division), and plain
    torch.compile (default Inductor division: shows why it cannot be used)."""
    from qconvert.convert.numerics import nvfp4 as nv
    from qconvert.convert.numerics.mxfp8 import compiled_mxfp8_blocks

    results["inductor_exact_options"] = nv.inductor_exact_options()
    e = E if DEV == "cuda" else 2
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(e, 2 * I, H, device=DEV, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, H, I, device=DEV, generator=g) * 0.02).bfloat16()
    n = w13.numel() + w2.numel()
    ga = torch.tensor(0.2, device=DEV)
    mx_c, nv_c = compiled_mxfp8_blocks(), nv.compiled_nvfp4_blocks()
    nv_plain = torch.compile(nv.nvfp4_quantize_blocks, dynamic=False)
    mx_b, nv_b = 2 * n + n + n // 32, 2 * n + n // 2 + n // 16
    from qconvert.convert.numerics import cuda_kernels as ck

    tk = ck.available(DEV)

    def nv_with_amax(x, recipe):  # the pipeline's whole NVFP4 step: global amax pass, then the kernel
        from qconvert.convert.kernels import abs_max as _abs_max

        return nv.nvfp4_quantize(x, global_amax=_abs_max(x).float(), recipe=recipe, blocks_fn=ck.nvfp4_blocks)

    comp = "compile (QCONVERT_CUDA_QUANTIZER=compile)"
    trit = "triton (pipeline default)"
    variants = [  # scheme, mode, fn, bytes
        ("mxfp8", "eager", lambda x: mxfp8_quantize(x), mx_b),
        ("mxfp8", trit, (lambda x: mxfp8_quantize(x, blocks_fn=ck.mxfp8_blocks)) if tk else None, mx_b),
        ("mxfp8", comp, (lambda x: mxfp8_quantize(x, blocks_fn=mx_c)) if mx_c else None, mx_b),
        ("nvfp4 te", "eager", lambda x: nv.nvfp4_quantize(x, global_amax=ga), nv_b),
        (
            "nvfp4 te",
            trit,
            (lambda x: nv.nvfp4_quantize(x, global_amax=ga, blocks_fn=ck.nvfp4_blocks)) if tk else None,
            nv_b,
        ),
        (
            "nvfp4 te",
            "triton + its global amax pass (input bytes counted once)",
            (lambda x: nv_with_amax(x, "te")) if tk else None,
            nv_b,
        ),
        ("nvfp4 te", comp, (lambda x: nv.nvfp4_quantize(x, global_amax=ga, blocks_fn=nv_c)) if nv_c else None, nv_b),
        (
            "nvfp4 te",
            "compile, default Inductor division",
            lambda x: nv.nvfp4_quantize(x, global_amax=ga, blocks_fn=nv_plain),
            nv_b,
        ),
        ("nvfp4 modelopt", "eager", lambda x: nv.nvfp4_quantize(x, global_amax=ga, recipe="modelopt"), nv_b),
        (
            "nvfp4 modelopt",
            trit,
            (lambda x: nv.nvfp4_quantize(x, global_amax=ga, recipe="modelopt", blocks_fn=ck.nvfp4_blocks))
            if tk
            else None,
            nv_b,
        ),
        (
            "nvfp4 modelopt",
            comp,
            (lambda x: nv.nvfp4_quantize(x, global_amax=ga, recipe="modelopt", blocks_fn=nv_c)) if nv_c else None,
            nv_b,
        ),
    ]
    rows = []
    eager = {}
    for scheme, mode, fn, nbytes in variants:
        if fn is None:
            rows.append(
                {
                    "scheme": scheme,
                    "mode": mode,
                    "error": "not available here (Triton, or Inductor's IEEE division switch)",
                }
            )
            continue
        t0 = time.time()
        try:
            outs = [fn(w13), fn(w2)]
            _sync()
        except Exception as err:  # noqa: BLE001 - report, don't die
            rows.append({"scheme": scheme, "mode": mode, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        first_s = time.time() - t0
        if mode == "eager":
            eager[scheme] = outs
        # the global-amax row quantizes with the tensor's own amax, not eager's fixed one
        same = None if "amax" in mode else all(_same(o1, o2) for o1, o2 in zip(eager[scheme], outs))
        ms = cuda_ms(lambda: (fn(w13), fn(w2)))
        bw = nbytes / (ms / 1e3)
        rows.append(
            {
                "scheme": scheme,
                "mode": mode,
                "ms_per_layer": round(ms, 3),
                "x48_s": round(ms * 48 / 1e3, 3),
                "GBps": round(bw / 1e9, 1),
                "fraction_of_copy": round(bw / copy_bw, 3),
                "bit_identical_to_eager": same,
                "first_call_s": round(first_s, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    results["quantize"] = rows
    del w13, w2, eager
    if DEV == "cuda":
        torch.cuda.empty_cache()

    # Exhaustive: every finite and non-finite BF16 pattern (shuffled into blocks) x global scales,
    # compiled (pipeline) vs CUDA eager vs CPU, both NVFP4 recipes and MXFP8.
    allbf = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    perm = torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))
    cpu_inputs = [allbf.reshape(-1, 256), allbf[perm].reshape(-1, 256)]
    # NaN inputs: code 7 / E4M3 NaN with an unspecified sign (nvfp4.py docstring), and CUDA
    # arithmetic returns a canonical NaN where x86 keeps the operand's sign, so CUDA-vs-CPU is
    # counted separately for inputs with and without NaN/Inf.
    checks = {
        "cases": 0,
        "compiled_vs_eager_mismatch": 0,
        "cuda_vs_cpu_mismatch_finite_input": 0,
        "cuda_vs_cpu_mismatch_nan_inf_input": 0,
        "triton_vs_eager_mismatch_finite_input": 0,
        "triton_vs_eager_mismatch_nan_inf_input": 0,
        "triton_vs_cpu_mismatch_finite_input": 0,
        "triton_vs_cpu_mismatch_nan_inf_input": 0,
        "first": [],
    }
    for x in cpu_inputs:
        finite = x.clone()
        finite[~torch.isfinite(finite)] = 0
        for kind, src in (("nan_inf_input", x), ("finite_input", finite)):
            xc = src.to(DEV)
            cases = (
                [("mxfp8", None, None)]
                + [(r, None, None) for r in ("te", "modelopt")]
                + [(r, gsc, None) for r in ("te", "modelopt") for gsc in [2.0**e for e in range(-140, 130, 9)] + [0.0]]
            )
            for recipe, gsc, _ in cases:
                checks["cases"] += 1
                if recipe == "mxfp8":
                    cpu = mxfp8_quantize(src)
                    eg = mxfp8_quantize(xc)
                    cp = mxfp8_quantize(xc, blocks_fn=mx_c) if mx_c is not None else eg
                    tr = mxfp8_quantize(xc, blocks_fn=ck.mxfp8_blocks) if tk else eg
                else:
                    cpu = nv.nvfp4_quantize(src, global_amax=gsc, recipe=recipe)
                    eg = nv.nvfp4_quantize(xc, global_amax=gsc, recipe=recipe)
                    cp = (
                        nv.nvfp4_quantize(xc, global_amax=gsc, recipe=recipe, blocks_fn=nv_c)
                        if nv_c is not None
                        else eg
                    )
                    tr = nv.nvfp4_quantize(xc, global_amax=gsc, recipe=recipe, blocks_fn=ck.nvfp4_blocks) if tk else eg
                if not _same(eg, cp):
                    checks["compiled_vs_eager_mismatch"] += 1
                    checks["first"].append(f"compiled {recipe} {gsc} {kind}")
                if not _same(eg, tr):
                    checks[f"triton_vs_eager_mismatch_{kind}"] += 1
                    checks["first"].append(f"triton-vs-eager {recipe} {gsc} {kind}")
                if not _same([t.cpu() for t in tr], cpu):
                    checks[f"triton_vs_cpu_mismatch_{kind}"] += 1
                    if kind == "finite_input":
                        checks["first"].append(f"triton-vs-cpu {recipe} {gsc} {kind}")
                if not _same([t.cpu() for t in eg], cpu):
                    checks[f"cuda_vs_cpu_mismatch_{kind}"] += 1
                    if kind == "finite_input":
                        checks["first"].append(f"cuda-vs-cpu {recipe} {gsc} {kind}")
    checks["first"] = checks["first"][:10]
    results["exhaustive"] = checks
    print(json.dumps(checks), flush=True)


def _manifest_sha(dst: Path):
    """Output shard digests: the manifest's, or hashed here (outside the timing) under --no-checksums."""
    from qconvert.formats.manifest import MANIFEST_NAME

    try:
        got = json.loads((dst / MANIFEST_NAME).read_text())["outputs"]["sha256"]
    except (OSError, ValueError, KeyError):
        return None
    if not got:
        from qconvert.convert.safetensors_io import sha256_file

        got = {p.name: sha256_file(p) for p in sorted(dst.glob("*.safetensors"))}
    return got


def conversion(results, a, save):
    import bench_convert as bc

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "synth"
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            str(HERE / "make_synthetic.py"),
            str(src),
            "--layers",
            str(a.layers),
            "--shard-gb",
            str(a.shard_gb),
        ],
        check=True,
    )
    results["synthetic_make_s"] = round(time.time() - t0, 1)
    sizes_in = bc._shard_sizes(src)
    rows = []
    results["conversion"] = rows
    # cuda with each quantizer core (QCONVERT_CUDA_QUANTIZER; "compile" only with --compile-too: it
    # pays a compile per tensor shape), then cpu; a floor process right after each.
    runs = [(DEV, "triton (default)", {"QCONVERT_CUDA_QUANTIZER": "triton"})]
    if not a.no_eager:
        runs.append((DEV, "eager", {"QCONVERT_CUDA_QUANTIZER": "eager"}))
    if a.compile_too:
        runs.append((DEV, "compile", {"QCONVERT_CUDA_QUANTIZER": "compile"}))
    if a.cpu_too:
        runs.append(("cpu", "eager", {}))
    for scheme in a.schemes.split(","):
        ref_sha = None
        for (device, mode, env), (variant, flags) in [(r, v) for r in runs for v in bc.variants(a)]:
            dst = work / f"out-{scheme}-{device}"
            cmd = bc._py() + ["_qconvert", scheme, str(src), str(dst), "--device", device] + flags
            m = bc.run_measured(cmd, log=work / "log.txt", env=env)
            out_sizes = bc._shard_sizes(dst) if dst.exists() else {}
            sha = _manifest_sha(dst)
            ref_sha = ref_sha or sha
            shutil.rmtree(dst, ignore_errors=True)
            f = (
                bc.run_measured(bc.cmd_floor(src, work / "out-floor", out_sizes, False), log=work / "log.txt")
                if out_sizes
                else None
            )
            shutil.rmtree(work / "out-floor", ignore_errors=True)
            row = {
                "scheme": scheme,
                "device": device,
                "mode": mode,
                "options": variant,
                "wall": round(m["wall"], 2),
                "rc": m["rc"],
                "cpu_s": round(m["cpu"], 1),
                "rss_GiB": round(m["rss"] / 2**30, 2),
                "bytes_in": sum(sizes_in.values()),
                "bytes_out": sum(out_sizes.values()),
                "floor_wall": round(f["wall"], 2) if f else None,
                "ratio": round(m["wall"] / f["wall"], 2) if f else None,
                "same_bytes_as_first": (sha == ref_sha) if sha else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    try:
        results["log_tail"] = (work / "log.txt").read_text()[-3000:]
    except OSError:
        pass
    shutil.rmtree(work, ignore_errors=True)


def table(res) -> str:
    L = [
        f"### CUDA, {res['date']}",
        "",
        f"Machine: {res['machine']}.",
        "",
        f"Device-to-device copy (the ceiling): {res['copy_GBps']:.0f} GB/s read + written.",
        "",
        "| scheme | mode | ms per MoE layer | x48 layers | GB/s read+written | fraction of copy | target | bit-identical to eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("quantize", []):
        if "error" in r:
            L.append(f"| {r['scheme']} | {r['mode']} | - | - | - | - | >= 0.70 | {r['error']} |")
        else:
            L.append(
                f"| {r['scheme']} | {r['mode']} | {r['ms_per_layer']:.2f} | {r['x48_s']:.2f} s | {r['GBps']:.0f} | "
                f"{r['fraction_of_copy']:.3f} | >= 0.70 | {'n/a' if r['bit_identical_to_eager'] is None else r['bit_identical_to_eager']} |"
            )
    if res.get("exhaustive"):
        L += [
            "",
            f"Exhaustive check (every BF16 pattern x global scales, both NVFP4 recipes and MXFP8): {res['exhaustive']}",
        ]
    if res.get("conversion"):
        L += [
            "",
            "| scheme | device | mode | qconvert options | input | output | floor wall | qconvert wall | qconvert / floor | CPU s | peak RSS | same bytes as first row | rc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["conversion"]:
            L.append(
                f"| {r['scheme']} | {r['device']} | {r['mode']} | {r.get('options', 'default')} | {r['bytes_in'] / 1e9:.2f} GB | {r['bytes_out'] / 1e9:.2f} GB | "
                f"{r['floor_wall']} s | {r['wall']} s | {r['ratio']} | {r['cpu_s']} | {r['rss_GiB']} GiB | "
                f"{r['same_bytes_as_first']} | {r['rc']} |"
            )
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
    ap.add_argument("--compile-too", action="store_true", help="also convert with the torch.compile cores")
    ap.add_argument("--skip-conversion", action="store_true")
    ap.add_argument("--skip-quantize", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="conversions: skip the eager torch-chain CUDA core")
    ap.add_argument(
        "--variants",
        default="default",
        help="comma list of qconvert option sets per conversion: "
        "default, no-source-checksums, no-checksums (as bench_convert.py --variants)",
    )
    a = ap.parse_args()
    import datetime
    import platform

    res = {
        "date": datetime.date.today().isoformat(),
        "argv": sys.argv,
        "machine": f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'no GPU (logic test)'}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)

    def save():  # after every phase, so that a run cut short still leaves its numbers
        (Path(a.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    bw, ms = copy_bandwidth()
    res["copy_GBps"] = bw / 1e9
    print(f"copy: {bw / 1e9:.0f} GB/s", flush=True)
    if not a.skip_quantize:
        quantize_step(res, bw)
        save()
    if not a.skip_conversion:
        conversion(res, a, save)
    save()
    text = table(res)
    print(text)
    (Path(a.out) / "bench_gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
