#!/usr/bin/env python3
"""A GPU server's side of a refit, without vLLM: what qconvert's worker extension spends moving a
committed refit area to the device, against the floor of the same bytes, in one process.

The area is made by the ``Refitter`` (MXFP8, last layer BF16) from GPU-resident BF16 weights of a
Qwen3-30B-A3B-shaped model of ``--layers`` layers (scripts/bench_refit.py's sparse reference and
weights); the Refitter is then closed, as a trainer process would be a separate one. Then, in this
process, standing in for a server worker (``vllm_staged.load_staged`` on a CUDA model, with a
loader that copies every tensor it is handed into a preallocated device tensor: the least any
engine's weight loader does):

- floors (``copy_floor``): ``kept-files``, every file whole from the kept registered mapping to the
  device (docs/reload.md#kept-mappings), and ``fresh-tensors``, the files mapped afresh and copied
  per tensor from pageable memory (the floor before the kept mappings);
- the first load of the area with kept mappings (maps and registers both slots);
- loads alternating with (``keep_maps=True``) and without (``False``) the kept mappings, each
  through the device chunks (docs/reload.md#vllm-staged-load), ``--repeat`` times.

    python scripts/bench_staged_gpu.py --layers 8 --out $OUT        # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shm-root", default="/dev/shm/qconvert-bench-staged")
    ap.add_argument("--work", default="/tmp/qconvert-bench-staged")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    a = ap.parse_args()

    import torch

    sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench_refit, and qconvert from this checkout
    from bench_refit import _sparse_reference, _weights

    from qconvert.convert.options import ConvertOptions
    from qconvert.convert.plan import PlanOptions
    from qconvert.engine import vllm_staged
    from qconvert.trainer.refit import Refitter

    root = Path(a.shm_root)
    shutil.rmtree(root, ignore_errors=True)
    ref = _sparse_reference(Path(a.work) / f"ref{a.layers}", a.layers)
    weights = _weights(a.layers, a.device)
    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), device=a.device, progress=False)
    with Refitter(ref, opts, "area", root=root) as r:
        r.refit(weights)
        r.refit(weights)  # both slots written once; the second is committed
    del weights
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    area = root / "area"
    model = torch.nn.Linear(1, 1, device=a.device)
    dst: dict[str, torch.Tensor] = {}

    def loader(pairs) -> None:
        for name, t in pairs:
            d = dst.get(name)
            if d is None:
                d = dst[name] = torch.empty_like(t)
            d.copy_(t)
        sync()

    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "layers": a.layers,
    }
    # a fresh-maps load first: the destinations are allocated outside the timed loads
    vllm_staged.load_staged(model, area, loader, keep_maps=False)
    t0 = time.perf_counter()
    first = vllm_staged.load_staged(model, area, loader, keep_maps=True)
    res["first_kept_load_s"] = time.perf_counter() - t0
    res["first_kept_map_s"] = first["map_seconds"]
    res["pinned_files"], res["files"] = first["pinned_files"], first["files"]
    res["pin_error"] = first.get("pin_error")
    res["bytes"] = first["bytes"]
    res["floor_kept"] = vllm_staged.copy_floor(model, area, repeat=a.repeat, keep_maps=True)
    res["floor_fresh"] = vllm_staged.copy_floor(model, area, repeat=a.repeat, keep_maps=False)
    runs: dict[str, list] = {"kept": [], "fresh": []}
    for _ in range(a.repeat):
        for keep in (False, True):
            st = vllm_staged.load_staged(model, area, loader, keep_maps=keep)
            runs["kept" if keep else "fresh"].append(st["seconds"])
    res["loads"] = runs
    fk, ff = res["floor_kept"]["seconds"], res["floor_fresh"]["seconds"]
    for k in ("kept", "fresh"):
        med = statistics.median(runs[k])
        res[f"{k}_median_s"] = med
        res[f"{k}_over_floor_kept"] = med / fk
        res[f"{k}_over_floor_fresh"] = med / ff
    res["gb_per_s"] = {
        "floor_kept": res["bytes"] / fk / 1e9,
        "floor_fresh": res["bytes"] / ff / 1e9,
        "load_kept": res["bytes"] / res["kept_median_s"] / 1e9,
        "load_fresh": res["bytes"] / res["fresh_median_s"] / 1e9,
    }
    print(json.dumps(res, indent=1), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"bench_staged_gpu_{a.layers}.json").write_text(json.dumps(res, indent=1))
    vllm_staged.KEPT.release()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
