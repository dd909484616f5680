#!/usr/bin/env python3
"""``qconvert bf16`` of an MXFP4 (gpt-oss) checkpoint vs the I/O floor, as ratios measured in one run.

Builds a synthetic gpt-oss MXFP4 checkpoint with gpt-oss-20b's expert shapes (hidden 2880,
intermediate 2880; ``--experts`` per layer, ``--layers`` layers, small attention and vocabulary) and
runs ``scripts/bench_convert.py`` on it with scheme ``bf16``: the decode (docs/formats.md#quantized-sources-decoded-to-bf16)
against the floor process that reads the same input and writes the same output bytes without
compute, floor and qconvert alternating, each ratio pair by pair.

    python scripts/bench_decode.py --work /tmp/qconvert-bench-decode --layers 2 --experts 8 --repeat 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/qconvert-bench-decode")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="default,no-checksums")
    a = ap.parse_args()
    work = Path(a.work)
    src = work / f"gptoss-{a.layers}L-{a.experts}e"
    if not src.exists():
        sys.path.insert(0, str(HERE.parent))
        from qconvert.convert.demo import build_gpt_oss_mxfp4

        sizes = {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_local_experts": a.experts,
            "num_hidden_layers": a.layers,
            "layer_types": ["sliding_attention", "full_attention"] * ((a.layers + 1) // 2),
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
        }
        sizes["layer_types"] = sizes["layer_types"][: a.layers]
        build_gpt_oss_mxfp4(src, overrides=sizes, n_shards=a.shards, exponents=(-12, 2))
    cmd = [sys.executable, str(HERE / "bench_convert.py"), "--work", str(work), "--src", str(src), "--schemes", "bf16"]
    cmd += ["--repeat", str(a.repeat), "--variants", a.variants]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
