#!/usr/bin/env python3
"""Refit cost on a GPU: engines' post-load processing of plain expert tensors into the FlashInfer
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS = 48


def table(d: dict, source: str) -> str:
    L = [f"### Refit: layout processing vs pre-shuffled copy ({d.get('device', '?')}, torch {d.get('torch', '?')})", "",
         "Per MoE layer (128 experts, Qwen3-30B-A3B shapes), vLLM parameter layout, rank 0; medians of CUDA-event timings.", "",
         "| scheme | TP | bytes / layer | floor: copy pre-shuffled d2d | pinned h2d copy | engine per-expert FlashInfer | qconvert batched gathers | engine / floor (d2d) | saving per refit, 48 layers |",
         "|---|---|---|---|---|---|---|---|---|"]
    for key, r in d.get("timing", {}).items():
        scheme, _, tp, _ = key.split("_")
        eng = r.get("engine_per_expert_flashinfer_ms")
        d2d = r["copy_d2d_ms"]
        saving = f"{(eng - d2d) * LAYERS / 1e3:.2f} s" if eng is not None else "-"
        ratio = f"{eng / d2d:.0f}x" if eng is not None else "-"
        L.append(f"| {scheme} | {tp[2:]} | {r['bytes_per_layer'] / 1e6:.0f} MB | {d2d:.3f} ms | {r['copy_h2d_pinned_ms']:.2f} ms | "
                 f"{eng if eng is not None else '-'} ms | {r['ours_batched_gather_ms']:.2f} ms | {ratio} | {saving} |")
    L += ["", f"Source: {source}. Reproduce on a CUDA machine with FlashInfer: "
          "`python scripts/bench_refit.py --run --out DIR` (runs `scripts/gpu_layout_check.py --out DIR`)."]
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", help="gpu_layout_check.json written by scripts/gpu_layout_check.py")
    ap.add_argument("--run", action="store_true", help="run scripts/gpu_layout_check.py first (needs CUDA + FlashInfer)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
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
