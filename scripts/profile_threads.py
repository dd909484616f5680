#!/usr/bin/env python3
"""Where each thread of a conversion spends its wall time: a sampling probe.

Runs one conversion in this process and, every few milliseconds, records the line each thread is
on (with the innermost qconvert frames that led there), then prints the most frequent lines per
thread. A thread's samples add up to its lifetime, so the table shows which thread is busy from
first to last sample (the critical path: the writer on 2 cores, the source digests on 16 with
checksums on) and what the others wait on (``wait@threading.py`` lines: queue or lock waits).

    python scripts/profile_threads.py nvfp4 SRC DST [--no-checksums] [--top 7]

Python-level only: a thread inside a C call (quantizer kernel, pwrite, sha256) shows as the line
that called it. For where the CPU goes inside those calls, use ``perf`` (docs/benchmarks-history.md#latest-run-2026-12-04-a-floor-that-reads-every-input-page-todays-vm).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qconvert.convert.pipeline import ConvertOptions, convert  # noqa: E402
from qconvert.convert.plan import PlanOptions  # noqa: E402

POOLS = ("qconvert-job", "qconvert-mxfp8", "qconvert-nvfp4", "qconvert-input-sha")


def _key(frame) -> str:
    stack = traceback.extract_stack(frame)
    top = stack[-1]
    ours = [f for f in reversed(stack) if "qconvert" in f.filename and f is not top][:2]
    return f"{top.name}@{Path(top.filename).name}:{top.lineno}" + "".join(f" <- {f.name}:{f.lineno}" for f in ours)


def _thread_name(t: threading.Thread) -> str:
    # pool threads are named prefix_N: one row per pool
    return t.name.rsplit("_", 1)[0] if t.name.startswith(POOLS) else t.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scheme", choices=["mxfp8", "nvfp4", "bf16"])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--no-checksums", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline's --device)")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=7)
    a = ap.parse_args(argv)
    opts = ConvertOptions(
        scheme=a.scheme,
        plan=PlanOptions(scheme=a.scheme),
        force=True,
        progress=False,
        fsync=False,
        device=a.device,
        source_checksums=not a.no_checksums,
        output_checksums=not a.no_checksums,
    )
    counts: collections.Counter = collections.Counter()
    done = threading.Event()

    def sample():
        me = threading.get_ident()
        while not done.is_set():
            names = {t.ident: _thread_name(t) for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid != me:
                    counts[(names.get(tid, str(tid)), _key(frame))] += 1
            time.sleep(a.interval_ms / 1000)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        convert(a.src, a.dst, a.scheme, opts)
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    per_thread: dict[str, list] = collections.defaultdict(list)
    for (name, key), n in counts.items():
        per_thread[name].append((n, key))
    print(
        f"{a.scheme} on {a.device}{' --no-checksums' if a.no_checksums else ''}: convert() {wall:.2f} s; samples per thread "
        f"(one per {a.interval_ms:g} ms per live thread; a pool's threads are summed)"
    )
    for name, rows in sorted(per_thread.items(), key=lambda kv: -sum(n for n, _ in kv[1])):
        total = sum(n for n, _ in rows)
        print(f"  {name}: {total}")
        for n, key in sorted(rows, reverse=True)[: a.top]:
            print(f"    {n:7d} {100 * n / total:5.1f}%  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
