#!/usr/bin/env python3
"""Converting fused-expert tensors (docs/formats.md#fused-expert-tensors) against converting the
same weights split per expert, in the same run: the floor is the split conversion.

SRC is a split checkpoint (``scripts/make_synthetic.py``: Qwen3-30B-A3B names and shapes, 128
experts of 768x2048). A fused copy is written beside it, one shard per source shard, each layer's
experts stacked as transformers 5 holds them (``experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]; ``--transposed``: [E, H, 2I] / [E, I, H]). Both are converted ``--repeat`` times,
alternating, with ``--no-checksums``; the script prints each wall and CPU time (CPU time is the
figure to read on a shared machine), the median ratios fused / split and their range, and checks that both outputs hold the same tensors byte for byte.

    python scripts/make_synthetic.py DIR/synth2 --layers 2 --shard-gb 2
    python scripts/bench_fused.py --src DIR/synth2 --work DIR --scheme mxfp8 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qconvert.convert.demo import write_sharded  # noqa: E402
from qconvert.convert.pipeline import ConvertOptions, convert  # noqa: E402
from qconvert.convert.plan import PlanOptions  # noqa: E402


def make_fused(src: Path, dst: Path, transposed: bool) -> None:
    cfg = json.loads((src / "config.json").read_text())
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, dst / f.name)
    t = {}
    for f in sorted(src.glob("*.safetensors")):
        t.update(load_file(f))
    e = cfg["num_experts"]
    out = {}
    for n in list(t):
        if ".experts." not in n:
            out[n] = t.pop(n)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gu = torch.stack(
            [torch.cat([t.pop(f"{p}{x}.gate_proj.weight"), t.pop(f"{p}{x}.up_proj.weight")]) for x in range(e)]
        )
        dn = torch.stack([t.pop(f"{p}{x}.down_proj.weight") for x in range(e)])
        if transposed:
            gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        out[p + "gate_up_proj"], out[p + "down_proj"] = gu, dn
    write_sharded(dst, out, max(1, len(list(src.glob("*.safetensors")))))


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def run(src: Path, dst: Path, scheme: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one conversion."""
    if dst.exists():
        shutil.rmtree(dst)
    opts = ConvertOptions(
        scheme=scheme,
        plan=PlanOptions(scheme=scheme),
        progress=False,
        fsync=False,
        source_checksums=False,
        output_checksums=False,
        **({"input_mode": "weight-only"} if scheme == "nvfp4" else {}),
    )
    t0, c0 = time.perf_counter(), _cpu()
    convert(str(src), dst, opts=opts)
    return time.perf_counter() - t0, _cpu() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="split checkpoint (scripts/make_synthetic.py)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--scheme", default="mxfp8", choices=["mxfp8", "nvfp4"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transposed", action="store_true")
    a = ap.parse_args()
    src, work = Path(a.src), Path(a.work)
    fused = work / "bench-fused-src"
    make_fused(src, fused, a.transposed)
    split_t, fused_t, split_c, fused_c = [], [], [], []
    for k in range(a.repeat):
        for t, c, d, name in ((split_t, split_c, src, "split"), (fused_t, fused_c, fused, "fused")):
            w, cpu = run(d, work / f"bench-out-{name}", a.scheme)
            t.append(w)
            c.append(cpu)
        print(
            f"round {k + 1}: split {split_t[-1]:.2f} s ({split_c[-1]:.1f} CPU-s), fused {fused_t[-1]:.2f} s "
            f"({fused_c[-1]:.1f} CPU-s), wall ratio {fused_t[-1] / split_t[-1]:.2f}, "
            f"CPU ratio {fused_c[-1] / split_c[-1]:.2f}"
        )
    ta, tb = {}, {}
    for d, acc in ((work / "bench-out-split", ta), (work / "bench-out-fused", tb)):
        for f in sorted(d.glob("*.safetensors")):
            acc.update(load_file(f))
    same = ta.keys() == tb.keys() and all(
        torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)) for n in ta
    )
    for what, f_, s_ in (("wall", fused_t, split_t), ("CPU", fused_c, split_c)):
        ratios = [f / s for f, s in zip(f_, s_)]
        print(
            f"{a.scheme}{' transposed' if a.transposed else ''}: fused / split {what} time median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) over {a.repeat} rounds"
        )
    print(f"same output tensors: {same}")
    for d in (fused, work / "bench-out-split", work / "bench-out-fused"):
        shutil.rmtree(d, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
