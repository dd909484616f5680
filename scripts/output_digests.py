#!/usr/bin/env python3
"""Print the sha256 of every file qconvert writes, for the demo models (and optionally a synthetic
Qwen3-30B-A3B-shaped checkpoint), across schemes, dialects, recipes and layouts.

A change that should not change bytes (a refactor) must leave this output identical:

    SOURCE_DATE_EPOCH=0 python scripts/output_digests.py > before.txt
    ... change ...
    SOURCE_DATE_EPOCH=0 python scripts/output_digests.py > after.txt && diff before.txt after.txt

``SOURCE_DATE_EPOCH`` fixes the manifest's timestamp (set to 0 if unset), and the scratch directory
is a fixed path (``--work``, emptied first), since the manifest names the source's path: compare
runs made with the same ``--work``. ``--synthetic-layers N`` adds a synthetic checkpoint of N layers
(~1.9 GB for 1) made by ``scripts/make_synthetic.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (label, argv after SRC DST); "unshuffle:<label>" unshuffles that label's output.
VARIANTS = [
    ("mxfp8-auto", ["mxfp8"]),
    ("mxfp8-auto-last1", ["mxfp8", "--last-n-bf16", "1"]),
    ("mxfp8-sglang", ["mxfp8", "--dialect", "sglang"]),
    ("mxfp8-modelopt", ["mxfp8", "--dialect", "modelopt", "--first-n-bf16", "1"]),
    ("nvfp4-modelopt-te", ["nvfp4"]),
    ("nvfp4-modelopt-recipe", ["nvfp4", "--recipe", "modelopt", "--input-scale", "unit"]),
    ("nvfp4-ct-weight-only", ["nvfp4", "--dialect", "compressed-tensors", "--weight-only"]),
    ("nvfp4-ct-experts-only", ["nvfp4", "--dialect", "compressed-tensors", "--experts-only", "--input-scale", "unit"]),
    ("mxfp8-layout-vllm", ["mxfp8", "--layout", "flashinfer-trtllm", "--engine", "vllm"]),
    ("mxfp8-layout-sglang-ep2", ["mxfp8", "--layout", "flashinfer-trtllm", "--engine", "sglang", "--ep", "2"]),
    (
        "nvfp4-layout-vllm-tp2",
        ["nvfp4", "--layout", "flashinfer-trtllm", "--engine", "vllm", "--tp", "2", "--input-scale", "unit"],
    ),
    (
        "nvfp4-ct-layout-vllm-ep2",
        [
            "nvfp4",
            "--dialect",
            "compressed-tensors",
            "--layout",
            "flashinfer-trtllm",
            "--engine",
            "vllm",
            "--ep",
            "2",
            "--input-scale",
            "unit",
        ],
    ),
    ("bf16-layout-vllm", ["bf16", "--layout", "flashinfer-trtllm", "--engine", "vllm"]),
    ("unshuffle:mxfp8-layout-vllm", None),
]
MOE_ONLY = ("layout", "unshuffle", "experts-only")


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def qconvert(*args: str) -> None:
    cmd = [sys.executable, "-c", "from qconvert.cli import main; main()", *args, "--no-progress"]
    if args[0] == "unshuffle":
        cmd.remove("--no-progress")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed: qconvert {' '.join(args)}\n{r.stderr.strip()[-2000:]}")


def run(model: str, src: Path, work: Path) -> None:
    moe = "moe" in model or "synth" in model
    for label, argv in VARIANTS:
        if not moe and any(k in label for k in MOE_ONLY):
            continue
        dst = work / f"{model}-{label.replace(':', '-')}"
        if argv is None:
            qconvert("unshuffle", str(work / f"{model}-{label.split(':', 1)[1]}"), str(dst))
        else:
            qconvert(argv[0], str(src), str(dst), *argv[1:])
        for p in sorted(dst.rglob("*")):
            if p.is_file():
                print(f"{model}/{label}/{p.relative_to(dst)} {sha256(p)}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic-layers", type=int, default=0)
    ap.add_argument(
        "--work",
        default="/tmp/qconvert-digests",
        help="scratch directory, emptied first (the manifests name paths in it)",
    )
    a = ap.parse_args(argv)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
    from qconvert.convert.demo import build_demo_model

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        for arch, model in (("qwen3-moe", "demo-moe"), ("qwen3", "demo-dense")):
            run(model, build_demo_model(work / f"src-{model}", arch=arch), work)
        if a.synthetic_layers:
            synth = work / "src-synth"
            subprocess.run(
                [
                    sys.executable,
                    str(HERE / "make_synthetic.py"),
                    str(synth),
                    "--layers",
                    str(a.synthetic_layers),
                    "--shard-gb",
                    "1",
                ],
                check=True,
                capture_output=True,
            )
            run("synth", synth, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
