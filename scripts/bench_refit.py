#!/usr/bin/env python3
"""Refit cost on a GPU, two benchmarks.

``--stage``: trainer-side staging (``qconvert.refit.Refitter``) of GPU-resident BF16 weights of a
Qwen3-30B-A3B-shaped model (``make_synthetic.py``'s names and shapes; the reference checkpoint is
written as headers over sparse files, since only headers are read), for 4 and 8 layers, MXFP8,
NVFP4 (W4A16, and W4A4 with unit input scales) and pre-shuffled MXFP8 and NVFP4 (``--variants``
picks some): the first refit (area creation, mapping, CUDA registration) and the
refits after it (stage + commit: quantize, device-to-host into the registered shared memory,
xxh3_128 digests, commit.json), each beside the floor measured in the same run: a device-to-host
copy of the same number of output bytes into the same registered mappings. Times are linear in
layers; the script fits ``a + b * layers`` and extrapolates to 48.

    python scripts/bench_refit.py --stage --out $OUT            # on the GPU machine

Without ``--stage``: engines' post-load processing of plain expert tensors into the FlashInfer
TRT-LLM MoE layout vs copying qconvert's pre-shuffled tensors into place, per layer and for the
whole 48-layer Qwen3-30B-A3B.

The measurement itself lives in scripts/gpu_layout_check.py (its ``timing`` step, which also
checks our layouts bit for bit against FlashInfer's own functions before timing them); this script
does not duplicate it. It either runs that script (``--run``, on a CUDA machine with FlashInfer)
or reads a JSON it wrote (``--from``), and prints the comparison table:

- floor: copying the pre-shuffled bytes into existing parameters on the device (and from pinned
  host memory, which a refit from a host-side staging buffer pays anyway);
- engine: FlashInfer's per-expert helpers as vLLM / SGLang call them on plain tensors already on
  the GPU (reorder rows, shuffle_matrix_a / shuffle_matrix_sf_a, block layout);
- batched: qconvert's batched gathers (one per tensor kind) doing the same transform on device.

    python scripts/bench_refit.py --from gpu_layout_check.json
    python scripts/bench_refit.py --run --out $OUT        # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS = 48


def table(d: dict, source: str) -> str:
    L = [
        f"### Refit: layout processing vs pre-shuffled copy ({d.get('device', '?')}, torch {d.get('torch', '?')})",
        "",
        "Per MoE layer (128 experts, Qwen3-30B-A3B shapes), vLLM parameter layout, rank 0; medians of CUDA-event timings.",
        "",
        "| scheme | TP | bytes / layer | floor: copy pre-shuffled d2d | pinned h2d copy | engine per-expert FlashInfer | qconvert batched gathers | engine / floor (d2d) | saving per refit, 48 layers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in d.get("timing", {}).items():
        scheme, _, tp, _ = key.split("_")
        eng = r.get("engine_per_expert_flashinfer_ms")
        d2d = r["copy_d2d_ms"]
        saving = f"{(eng - d2d) * LAYERS / 1e3:.2f} s" if eng is not None else "-"
        ratio = f"{eng / d2d:.0f}x" if eng is not None else "-"
        L.append(
            f"| {scheme} | {tp[2:]} | {r['bytes_per_layer'] / 1e6:.0f} MB | {d2d:.3f} ms | {r['copy_h2d_pinned_ms']:.2f} ms | "
            f"{eng if eng is not None else '-'} ms | {r['ours_batched_gather_ms']:.2f} ms | {ratio} | {saving} |"
        )
    L += [
        "",
        f"Source: {source}. Reproduce on a CUDA machine with FlashInfer: "
        "`python scripts/bench_refit.py --run --out DIR` (runs `scripts/gpu_layout_check.py --out DIR`).",
    ]
    return "\n".join(L)


def _sparse_reference(dst: Path, layers: int) -> Path:
    """config.json and one safetensors file whose data is a hole: the Refitter reads headers only."""
    import struct

    sys.path.insert(0, str(HERE))
    from make_synthetic import qwen3_30b_a3b_config, tensor_specs

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(qwen3_30b_a3b_config(layers), indent=2))
    hdr, off = {}, 0
    for name, shape in tensor_specs(layers):
        n = 2
        for d in shape:
            n *= d
        hdr[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return dst


def _weights(layers: int, device: str) -> list:
    import torch

    sys.path.insert(0, str(HERE))
    from make_synthetic import tensor_specs

    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, shape in tensor_specs(layers):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        out.append((name, t))
    return out


VARIANTS = {
    "mxfp8": dict(scheme="mxfp8"),
    "nvfp4": dict(scheme="nvfp4"),
    "mxfp8+trtllm": dict(scheme="mxfp8", layout="flashinfer-trtllm", engine="vllm"),
    "nvfp4-w4a4": dict(scheme="nvfp4", input_mode="unit"),
    "nvfp4+trtllm": dict(scheme="nvfp4", input_mode="unit", layout="flashinfer-trtllm", engine="vllm"),
}


def _floor(r, torch, repeats: int) -> float:
    """Seconds to copy the area's bytes device-to-host into the Refitter's registered mapping of
    the slot it wrote last (file by file, on one stream): the floor of the same job."""
    from qconvert.formats import staging as fs

    commit = fs.read_commit(r.area, r.spec)
    slot = fs.next_slot(commit) if commit else 0  # the other slot: mapped, registered, not read now
    big = max(f.size for f in r.spec.files)
    src = torch.empty(big, dtype=torch.uint8, device=r._dev)
    dsts = [r._maps.tensor(slot, f.name) for f in r.spec.files]
    best = []
    for _ in range(repeats):
        torch.cuda.synchronize() if r._dev.type == "cuda" else None
        t0 = time.perf_counter()
        for d in dsts:
            d.copy_(src[: d.numel()], non_blocking=True)
        torch.cuda.synchronize() if r._dev.type == "cuda" else None
        best.append(time.perf_counter() - t0)
    return sorted(best)[len(best) // 2]


class _AnonPeak:
    """Peak anonymous resident memory (``RssAnon``: heap and pinned buffers, not the shared-memory
    area's pages) of this process while running, sampled every 5 ms, minus its value at the start."""

    def __init__(self):
        import threading

        self._stop = threading.Event()
        self.base = self.peak = _rss_anon()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_anon())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rss_anon() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stage_bench(a) -> dict:
    import shutil
    import statistics

    import torch

    from qconvert.convert.pipeline import ConvertOptions
    from qconvert.refit import Refitter

    device = a.device
    work = Path(a.work)
    root = Path(a.shm_root)
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "runs": [],
    }
    for layers in a.layers:
        ref = _sparse_reference(work / f"ref{layers}", layers)
        weights = _weights(layers, device)
        bf16 = sum(t.numel() * 2 for _, t in weights)
        for v in a.variants:
            opts = ConvertOptions(device=device, progress=False, **VARIANTS[v])
            name = f"bench-{layers}-{v.replace('+', '-')}"
            shutil.rmtree(root / name, ignore_errors=True)
            t0 = time.perf_counter()
            r = Refitter(ref, opts, name, root=root)
            t_make = time.perf_counter() - t0
            try:
                res = r.refit(weights)
                first = time.perf_counter() - t0
                later, parts = [], []
                cuda = device == "cuda"
                if cuda:
                    torch.cuda.synchronize()
                    gpu0 = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                with _AnonPeak() as host:
                    for _ in range(a.repeat):
                        t1 = time.perf_counter()
                        res = r.refit(weights)
                        later.append(time.perf_counter() - t1)
                        parts.append(res.seconds)
                gpu_extra = torch.cuda.max_memory_allocated() - gpu0 if cuda else 0
                floor = _floor(r, torch, 3)
                out_bytes = sum(f.size for f in r.spec.files)
            finally:
                r.close()
                shutil.rmtree(root / name, ignore_errors=True)
            med = statistics.median(later)
            run = {
                "layers": layers,
                "variant": v,
                "bf16_bytes": bf16,
                "out_bytes": out_bytes,
                "files": len(r.spec.files),
                "first_s": first,
                "construct_s": t_make,
                "later_s": later,
                "later_median_s": med,
                "stage_s": statistics.median(p["stage"] for p in parts),
                "commit_s": statistics.median(p["commit"] for p in parts),
                "floor_s": floor,
                "ratio": med / floor,
                "host_extra_bytes": host.extra,
                "gpu_extra_bytes": gpu_extra,
                "largest_group_out_bytes": max(sum(f.size for f in fs_) for fs_ in r._files_of_group.values()),
            }
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        del weights
        shutil.rmtree(ref, ignore_errors=True)
    (Path(a.out) / "bench_refit_stage.json").write_text(json.dumps(results, indent=1))
    return results


def stage_table(d: dict) -> str:
    runs = d["runs"]
    L = [
        f"### Refit staging ({d['device']}, torch {d['torch']}, {d['cpu_count']} CPUs)",
        "",
        "| variant | layers | output | first refit | refit after the first (median) | floor (d2h into registered shm) "
        "| ratio | stage / commit | peak extra host (anon) / GPU | largest group's output |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        L.append(
            f"| {r['variant']} | {r['layers']} | {r['out_bytes'] / 1e9:.2f} GB | {r['first_s']:.2f} s | "
            f"{r['later_median_s']:.3f} s | {r['floor_s']:.3f} s | **{r['ratio']:.2f}x** | "
            f"{r['stage_s']:.3f} / {r['commit_s']:.3f} s | {r['host_extra_bytes'] / 1e6:.0f} / "
            f"{r['gpu_extra_bytes'] / 1e6:.0f} MB | {r['largest_group_out_bytes'] / 1e6:.0f} MB |"
        )
    L += [
        "",
        "Extrapolated to 48 layers (least squares a + b * layers over the runs above):",
        "",
        "| variant | refit after the first | floor | ratio | first refit |",
        "|---|---|---|---|---|",
    ]
    for v in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == v]
        if len({r["layers"] for r in rs}) < 2:
            continue

        def fit(key):
            xs = [r["layers"] for r in rs]
            ys = [r[key] for r in rs]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            return my + b * (LAYERS - mx)

        t, f, first = fit("later_median_s"), fit("floor_s"), fit("first_s")
        L.append(f"| {v} | {t:.2f} s | {f:.2f} s | {t / f:.2f}x | {first:.1f} s |")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", action="store_true", help="trainer-side staging benchmark (Refitter)")
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shm-root", default="/dev/shm/qconvert-bench")
    ap.add_argument("--work", default="/tmp/qconvert-bench-refit", help="the reference checkpoints (sparse files)")
    ap.add_argument("--from", dest="src", help="gpu_layout_check.json written by scripts/gpu_layout_check.py")
    ap.add_argument(
        "--run", action="store_true", help="run scripts/gpu_layout_check.py first (needs CUDA + FlashInfer)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.stage:
        print(stage_table(stage_bench(a)))
        return
    if a.run:
        subprocess.run([sys.executable, str(HERE / "gpu_layout_check.py"), "--out", a.out], check=True)
        a.src = str(Path(a.out) / "gpu_layout_check.json")
    if not a.src:
        ap.error("give --from FILE or --run")
    d = json.loads(Path(a.src).read_text())
    if not d.get("timing"):
        sys.exit(f"error: {a.src} has no timing section (was it run with --skip-timing?)")
    print(table(d, a.src))


if __name__ == "__main__":
    main()
