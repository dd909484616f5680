#!/usr/bin/env python3
"""`qconvert verify SRC DST` against a read floor measured in the same run.

The floor reads every tensor of both checkpoints the way verify does (each mapped, then copied
into one reused buffer: every byte touched once, no compute), in a fresh process that imports
torch as verify does. Each round runs the floor, then verify (and, with ``--baseline DIR``, the
verify of another unpacked tree holding ``qconvert/``, for an A/B), with the page cache warm.

    python scripts/bench_verify.py SRC DST [--rounds 3] [--baseline OLD_TREE]

Prints one row per run and a table of medians with the command line to reproduce.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_convert as bc  # noqa: E402


def floor_main(paths: list[str]) -> None:
    import numpy as np
    import torch

    from qconvert.convert.safetensors_io import ShardReader, read_header

    buf = np.empty(64 << 20, dtype=np.uint8)
    for root in paths:
        for p in sorted(Path(root).glob("*.safetensors")):
            h = read_header(p)
            with ShardReader(h, hash_file=False, mapped=True) as r:
                for e in h.entries.values():
                    t = r.read(e.name)
                    if not e.nbytes:
                        continue
                    b = t.reshape(-1).view(torch.uint8).numpy()
                    for i in range(0, b.size, buf.size):
                        n = min(buf.size, b.size - i)
                        buf[:n] = b[i : i + n]


def _verify_cmd(tree: Path, src: str, dst: str) -> tuple[list[str], dict]:
    code = "import sys; from qconvert.cli import main; sys.exit(main())"
    # -P: the working directory (this checkout) must not shadow the tree on the import path
    return [sys.executable, "-P", "-c", code, "verify", src, dst, "--no-progress"], {"PYTHONPATH": str(tree)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_floor":
        floor_main(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="an unpacked tree (holding qconvert/) whose verify to time as well")
    a = ap.parse_args(argv)
    runs = {"floor": ([sys.executable, str(HERE / "bench_verify.py"), "_floor", a.src, a.dst], {})}
    runs["verify"] = _verify_cmd(HERE.parent, a.src, a.dst)
    if a.baseline:
        runs["verify (baseline)"] = _verify_cmd(Path(a.baseline).resolve(), a.src, a.dst)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_verify.log"
    rows: dict[str, list[dict]] = {k: [] for k in runs}
    for rnd in range(1, a.rounds + 1):
        for name, (cmd, env) in runs.items():
            m = bc.run_measured(cmd, env=env, log=log)
            rows[name].append(m)
            print(
                f"round {rnd} {name}: wall {m['wall']:.2f} s, CPU {m['cpu']:.1f} s, peak RSS "
                f"{m['rss'] / 2**30:.2f} GiB, rc {m['rc']}",
                flush=True,
            )
    floor = statistics.median(m["wall"] for m in rows["floor"])
    print("\n| run | wall (median) | / floor | CPU s | peak RSS | rc |\n|---|---|---|---|---|---|")
    for name, ms in rows.items():
        wall = statistics.median(m["wall"] for m in ms)
        print(
            f"| {name} | {wall:.2f} s | {wall / floor:.2f} | {statistics.median(m['cpu'] for m in ms):.1f} | "
            f"{max(m['rss'] for m in ms) / 2**30:.2f} GiB | {','.join(str(m['rc']) for m in ms)} |"
        )
    print("\nReproduce: `python " + " ".join(["scripts/bench_verify.py"] + argv) + "`")
    return 0 if all(m["rc"] == 0 for ms in rows.values() for m in ms) else 1


if __name__ == "__main__":
    sys.exit(main())
