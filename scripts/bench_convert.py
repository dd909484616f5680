#!/usr/bin/env python3
"""CPU conversion benchmark: qconvert vs the I/O floor vs peers, as ratios measured in one run.

Every figure is a whole process, started fresh (interpreter and torch import included), timed by
wall clock, with its peak resident memory read from the kernel's accounting of that process
(``wait4``) and, for peers that fork workers, the peak sum over its process tree (polled).

The I/O floor is a process that reads the same safetensors (same reader strategy as the
converter: tensor by tensor, in file order, on a reader thread, each tensor mapped copy-on-write
from the page cache, every page of it read once) and writes the same number of output bytes per
shard (``pwrite`` from those bytes on a writer thread), with no compute at all. Mapping costs less CPU, but copying into
buffers (``readinto``) lets the reader thread share the work, which can be faster in wall time on
few cores; by default each round runs both floors and the faster one counts (``--floor``). Floor and
qconvert runs alternate (F Q F Q ...), and each ratio is taken pair by pair, so a machine whose
speed drifts (shared CPUs) still gives a fair ratio; the table shows the median and range.

    python scripts/bench_convert.py --layers 4 --shard-gb 2 --repeat 3 --peers llmc,autoround --rss-sweep
    python scripts/bench_convert.py --layers 2 --shard-gb 1 --repeat 3 --variants w4a4,layout   # --layout vs plain

Targets (issue 7): qconvert / floor <= 1.4; peak RSS <= 2 x largest input shard + 1 GiB and
about the same for 1 shard vs many and for 2x vs 4x layers; peers at least 3x slower.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import queue
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 1 << 30


# ---- the floor process ---------------------------------------------------------------------------


def floor_main(src: str, dst: str, sizes_json: str, fsync: bool, queue_bytes: int = GiB, mapped: bool = True):
    """Read every tensor of every shard of SRC; write len(output shard) bytes per shard to DST.

    Mapped (as the converter reads): each tensor is mapped, a prefix of its bytes is written, and
    the pages of the rest are faulted in (one byte read per page), so every input page is read
    once, as it must be for any reader; no more. (Until 2026-12-04 the rest was left untouched,
    so the floor read only the output's share of the input: 36 % for NVFP4, 57 % for MXFP8.)"""
    import mmap

    import numpy as np
    import torch  # the converter pays this start-up too

    from qconvert.convert.safetensors_io import ShardReader, read_header

    sizes = json.loads(sizes_json)
    root, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(root.glob("*.safetensors"))
    q: queue.Queue = queue.Queue()
    inflight = [0]
    cond = threading.Condition()

    def reader():
        for p in shards:
            h = read_header(p)
            ratio = sizes[p.name] / h.file_size
            q.put(("open", p.name, sizes[p.name]))
            # the converter's own reader (unhashed), mapping or copying each tensor in file order
            with ShardReader(h, hash_file=False, mapped=mapped) as r:
                for e in h.entries.values():
                    with cond:
                        while inflight[0] and inflight[0] + e.nbytes > queue_bytes:
                            cond.wait()
                        inflight[0] += e.nbytes
                    t = r.read(e.name)
                    arr = t.reshape(-1).view(torch.uint8).numpy() if e.nbytes else np.empty(0, np.uint8)
                    keep = int(e.nbytes * ratio)
                    if mapped and e.nbytes > keep:  # the writer's copy reads the prefix; fault in the rest
                        arr[keep :: mmap.PAGESIZE].max()
                    q.put(("data", memoryview(arr)[:keep], e.nbytes))
            q.put(("close", None, 0))
        q.put(None)

    def writer():
        fd, pos, size = None, 0, 0
        while True:
            item = q.get()
            if item is None:
                return
            kind, a, b = item
            if kind == "open":
                fd = os.open(out / a, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                pos, size = 0, b
            elif kind == "data":
                n = min(len(a), size - pos)
                done = 0
                while done < n:
                    done += os.pwrite(fd, a[done:n], pos + done)
                pos += n
                with cond:
                    inflight[0] -= b
                    cond.notify()
            else:
                if pos < size:  # header bytes and rounding: same file size as the converter's
                    os.pwrite(fd, bytes(size - pos), pos)
                if fsync:
                    os.fsync(fd)
                os.close(fd)

    rt = threading.Thread(target=reader)
    wt = threading.Thread(target=writer)
    rt.start()
    wt.start()
    rt.join()
    wt.join()


def qconvert_main(
    scheme: str,
    src: str,
    dst: str,
    fsync: bool,
    device: str = "cpu",
    source_checksums: bool = True,
    output_checksums: bool = True,
    layout: str | None = None,
    input_mode: str | None = None,
):
    from qconvert.convert.pipeline import ConvertOptions, convert

    opts = ConvertOptions(
        scheme=scheme,
        device=device,
        force=True,
        progress=False,
        fsync=fsync,
        source_checksums=source_checksums,
        output_checksums=output_checksums,
        layout=layout,
    )
    if input_mode:
        opts.input_mode = input_mode
    convert(src, dst, scheme, opts)  # (the scheme argument also for trees before options.resolve_scheme)


# ---- running and measuring processes ----------------------------------------------------------------


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for c in procs:
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(cmd: list[str], env: dict | None = None, log: Path | None = None, timeout: float = 3600) -> dict:
    """Run cmd; wall seconds, CPU seconds, peak RSS of the process (wait4) and of its tree (polled)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL, env={**os.environ, **(env or {})}
    )
    peak_tree = [0]
    done = threading.Event()

    def poll():
        while not done.wait(0.2):
            peak_tree[0] = max(peak_tree[0], _tree_rss(p.pid))

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    finally:
        done.set()
        th.join()
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if log:
        out.close()
    return {
        "wall": wall,
        "cpu": ru.ru_utime + ru.ru_stime,
        "rss": ru.ru_maxrss * 1024,
        "rss_tree": max(peak_tree[0], ru.ru_maxrss * 1024),
        "rc": p.returncode,
    }


def _shard_sizes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.glob("*.safetensors"))}


def _rm(p: Path):
    shutil.rmtree(p, ignore_errors=True)
    for q in p.parent.glob(f".{p.name}.qconvert-*"):
        shutil.rmtree(q, ignore_errors=True)


def _py() -> list[str]:
    return [sys.executable, str(HERE / "bench_convert.py")]


FLOOR_READS = {"mapped": (False,), "readinto": (True,), "best": (False, True)}


def cmd_floor(src, dst, sizes, fsync, readinto=False):
    return (
        _py()
        + ["_floor", str(src), str(dst), json.dumps(sizes)]
        + (["--fsync"] if fsync else [])
        + (["--readinto"] if readinto else [])
    )


#: qconvert variants (flags of the _qconvert process). "layout" writes the MoE experts pre-shuffled
#: (--layout flashinfer-trtllm); "w4a4" and "layout" give NVFP4 unit input scales (the TRT-LLM NVFP4
#: MoE kernels are W4A4), so compare "layout" with "w4a4": --variants w4a4,layout (for MXFP8 the
#: input-scale flag is ignored, and "w4a4" is the plain conversion).
VARIANTS = {
    "default": [],
    "no-source-checksums": ["--no-source-checksums"],
    "no-checksums": ["--no-checksums"],
    "w4a4": ["--input-scale", "unit"],
    "layout": ["--input-scale", "unit", "--layout", "flashinfer-trtllm"],
}


def checksum_flags(a) -> list[str]:
    """qconvert's hashing options of the first (or only) variant (the CLI flags of the same names)."""
    return variants(a)[0][1]


def variants(a) -> list[tuple[str, list[str]]]:
    """(name, qconvert flags) of each qconvert variant run in every round (--variants)."""
    if a.variants:
        names = a.variants.split(",")
        bad = [n for n in names if n not in VARIANTS]
        if bad:
            raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
        return [(n, VARIANTS[n]) for n in names]
    name = (
        "no-checksums"
        if getattr(a, "no_checksums", False)
        else "no-source-checksums"
        if getattr(a, "no_source_checksums", False)
        else "default"
    )
    return [(name, VARIANTS[name])]


def cmd_qconvert(scheme, src, dst, fsync, flags=()):
    return _py() + ["_qconvert", scheme, str(src), str(dst)] + (["--fsync"] if fsync else []) + list(flags)


PEER_CODE = {
    ("llmc", "mxfp8"): "MXFP8",
    ("llmc", "nvfp4"): "NVFP4A16",
    ("autoround", "mxfp8"): "MXFP8",
}


def cmd_peer(peer, scheme, src, dst, python):
    if peer == "llmc":
        code = (
            "from llmcompressor import model_free_ptq\n"
            f"model_free_ptq({str(src)!r}, {str(dst)!r}, scheme={PEER_CODE[peer, scheme]!r}, "
            "ignore=['lm_head', 're:.*mlp.gate$'], max_workers=2, device='cpu')"
        )
    else:
        code = (
            "from auto_round import AutoRound\n"
            f"AutoRound(model={str(src)!r}, scheme={PEER_CODE[peer, scheme]!r}, model_free=True)"
            f".quantize_and_save({str(dst)!r})"
        )
    return [python, "-c", code]


# ---- the benchmark -------------------------------------------------------------------------------


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def _gib(n):
    return f"{n / GiB:.2f} GiB"


def _ratio_cell(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})" if len(xs) > 1 else f"{xs[0]:.2f}"


def machine() -> str:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    import torch

    return (
        f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}), {mem / GiB:.0f} GiB RAM, "
        f"torch {torch.__version__}, Python {platform.python_version()}, load average {load:.1f} at start"
    )


def bench(a) -> dict:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    results = {"date": _dt.date.today().isoformat(), "machine": machine(), "argv": sys.argv, "runs": []}
    src = Path(a.src) if a.src else work / f"synth-{a.layers}L-{a.shard_gb:g}gb"
    made = []
    if not a.src and not src.exists():
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
        made.append(src)
    in_sizes = _shard_sizes(src)
    bytes_in = sum(in_sizes.values())
    results["input"] = {
        "path": str(src),
        "bytes": bytes_in,
        "shards": len(in_sizes),
        "largest_shard": max(in_sizes.values()),
    }
    schemes = [s for s in a.schemes.split(",") if s]
    peers = [p for p in a.peers.split(",") if p]
    rows = []

    def record(label, kind, scheme, m, extra=None):
        m = {**m, "label": label, "kind": kind, "scheme": scheme, **(extra or {})}
        results["runs"].append(m)
        print(
            f"  {label:<34} {scheme:<6} wall {m['wall']:7.2f} s  cpu {m['cpu']:7.2f} s  "
            f"rss {_gib(m['rss'])}  rc {m['rc']}",
            flush=True,
        )
        return m

    try:
        for scheme in schemes:
            dst = work / f"out-{scheme}"
            # warm-up: also fills the page cache and gives the output shard sizes for the floor
            m = run_measured(cmd_qconvert(scheme, src, dst, a.fsync, checksum_flags(a)), log=log)
            if m["rc"]:
                raise SystemExit(f"qconvert {scheme} failed (rc {m['rc']}); see {log}")
            out_sizes = _shard_sizes(dst)
            bytes_out = sum(out_sizes.values())
            _rm(dst)
            fl = []
            qc: dict[str, list] = {name: [] for name, _ in variants(a)}
            reps = a.repeat_nvfp4 if scheme == "nvfp4" and a.repeat_nvfp4 else a.repeat
            for r in range(reps):
                # the floor of a round is the faster of the chosen ways of reading (see --floor)
                fms = []
                for readinto in FLOOR_READS[a.floor]:
                    fms.append(
                        record(
                            f"floor {'readinto' if readinto else 'mapped'} (read + write {_gb(bytes_out)})",
                            "floor",
                            scheme,
                            run_measured(cmd_floor(src, work / "out-floor", out_sizes, a.fsync, readinto), log=log),
                        )
                    )
                    _rm(work / "out-floor")
                fl.append(min(fms, key=lambda m: m["wall"]))
                vs = variants(a)
                for name, flags in vs[r % len(vs) :] + vs[: r % len(vs)]:  # rotated: no variant always runs last
                    qc[name].append(
                        record(
                            " ".join(["qconvert"] + flags),
                            "qconvert",
                            scheme,
                            run_measured(cmd_qconvert(scheme, src, dst, a.fsync, flags), log=log),
                        )
                    )
                    _rm(dst)
            first = qc[variants(a)[0][0]]
            for name, _ in variants(a):
                q = qc[name]
                rows.append(
                    {
                        "vs_first": [m["wall"] / f["wall"] for f, m in zip(first, q)],
                        "scheme": scheme,
                        "variant": name,
                        "bytes_out": bytes_out,
                        "floor_wall": statistics.median(f["wall"] for f in fl),
                        "qconvert_wall": statistics.median(m["wall"] for m in q),
                        "ratio": [m["wall"] / f["wall"] for f, m in zip(fl, q)],
                        "floor_rss": max(f["rss"] for f in fl),
                        "qconvert_rss": max(m["rss"] for m in q),
                        "qconvert_cpu": statistics.median(m["cpu"] for m in q),
                        "floor_cpu": statistics.median(f["cpu"] for f in fl),
                        "peers": {},
                    }
                )
            row = rows[-len(variants(a))]  # peers are compared with the first variant
            for peer in peers:
                if (peer, scheme) not in PEER_CODE:
                    row["peers"][peer] = {"note": "scheme not supported in its model-free mode"}
                    continue
                pdst = work / f"out-{peer}-{scheme}"
                _rm(pdst)
                pm = record(
                    f"peer {peer}",
                    peer,
                    scheme,
                    run_measured(
                        cmd_peer(peer, scheme, src, pdst, a.peer_python), log=log, env={"CUDA_VISIBLE_DEVICES": ""}
                    ),
                )
                pm["bytes_out"] = sum(_shard_sizes(pdst).values()) if pdst.exists() else 0
                _rm(pdst)
                row["peers"][peer] = pm
        results["rows"] = rows

        if a.rss_sweep:
            results["rss_sweep"] = rss_sweep(a, work, log, record, made)
    finally:
        if not a.keep:
            for p in made:
                _rm(p)
    return results


def rss_sweep(a, work, log, record, made) -> list[dict]:
    """Same layers as one shard vs many; 2x vs 4x layers (many shards)."""
    base = max(1, a.sweep_layers)
    variants = [(base, a.shard_gb), (base, 1000.0), (2 * base, a.shard_gb)]
    out = []
    for layers, shard_gb in variants:
        src = work / f"synth-{layers}L-{shard_gb:g}gb"
        if not src.exists():
            subprocess.run(
                [
                    sys.executable,
                    str(HERE / "make_synthetic.py"),
                    str(src),
                    "--layers",
                    str(layers),
                    "--shard-gb",
                    str(shard_gb),
                ],
                check=True,
            )
            made.append(src)
        sizes = _shard_sizes(src)
        for scheme in a.sweep_schemes.split(","):
            dst = work / f"out-sweep-{scheme}"
            m = record(
                f"qconvert {layers}L {len(sizes)} shard(s)",
                "sweep",
                scheme,
                run_measured(cmd_qconvert(scheme, src, dst, a.fsync, checksum_flags(a)), log=log),
            )
            _rm(dst)
            largest = max(sizes.values())
            out.append(
                {
                    "layers": layers,
                    "shards": len(sizes),
                    "bytes_in": sum(sizes.values()),
                    "largest_shard": largest,
                    "scheme": scheme,
                    "rss": m["rss"],
                    "limit": 2 * largest + GiB,
                    "wall": m["wall"],
                    "rc": m["rc"],
                }
            )
        if src in made and not a.keep:
            _rm(src)
            made.remove(src)
    return out


def report(res: dict, a) -> str:
    L = []
    L.append(f"### CPU conversion, {res['date']}")
    L.append("")
    L.append(f"Machine: {res['machine']}.")
    inp = res["input"]
    L.append(
        f"Input: {inp['path']} ({_gb(inp['bytes'])}, {inp['shards']} shards, largest {_gb(inp['largest_shard'])}); "
        f"writes {'fsync-ed to disk' if a.fsync else 'to the page cache (no fsync: compute is exposed, not hidden behind the disk)'}."
    )
    L.append("")
    L.append(
        {
            "best": "Floor of each pair: the faster of two floor runs, one mapping the input tensors and one "
            "copying them into buffers (`--floor best`).",
            "mapped": "Floor: input tensors mapped, as the converter reads them (`--floor mapped`).",
            "readinto": "Floor: input tensors copied into buffers (`--floor readinto`).",
        }[a.floor]
    )
    L.append("")
    L.append(
        "qconvert options: default = source and output shards hashed (sha256 in the manifest); "
        "no-source-checksums = output shards only; no-checksums = nothing hashed. "
        "Each round runs the floor, then every variant (order rotated per round); ratios are per round."
    )
    L.append("")
    first = variants(a)[0][0]
    L.append(
        f"| scheme | qconvert options | output | floor wall | qconvert wall | qconvert / floor (median, range) | target | / {first} (median, range) | peak RSS floor | peak RSS qconvert | qconvert CPU s | floor CPU s |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res.get("rows", []):
        vs = _ratio_cell(r["vs_first"]) if "vs_first" in r and r.get("variant") != first else "-"
        if r.get("variant") == "layout":
            vs += " (target <= 1.2)"
        L.append(
            f"| {r['scheme']} | {r.get('variant', '')} | {_gb(r['bytes_out'])} | {r['floor_wall']:.2f} s | {r['qconvert_wall']:.2f} s | "
            f"{_ratio_cell(r['ratio'])} | <= 1.4 | {vs} | {_gib(r['floor_rss'])} | {_gib(r['qconvert_rss'])} | "
            f"{r['qconvert_cpu']:.1f} | {r['floor_cpu']:.1f} |"
        )
    peer_rows = [(r, p, m) for r in res.get("rows", []) for p, m in r["peers"].items()]
    if peer_rows:
        L.append("")
        L.append(
            "| scheme | peer | peer wall | peer / qconvert (wall) | peer peak RSS (process / tree) | qconvert peak RSS | peer output | rc / note |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
        for r, p, m in peer_rows:
            if "wall" not in m:
                L.append(f"| {r['scheme']} | {p} | - | - | - | - | - | {m['note']} |")
                continue
            L.append(
                f"| {r['scheme']} | {p} | {m['wall']:.1f} s | {m['wall'] / r['qconvert_wall']:.1f}x | "
                f"{_gib(m['rss'])} / {_gib(m['rss_tree'])} | {_gib(r['qconvert_rss'])} | {_gb(m['bytes_out'])} | "
                f"{m['rc']} |"
            )
    if res.get("rss_sweep"):
        L.append("")
        L.append("| scheme | layers | shards | input | largest shard | peak RSS | limit 2 x shard + 1 GiB | wall |")
        L.append("|---|---|---|---|---|---|---|---|")
        for s in res["rss_sweep"]:
            L.append(
                f"| {s['scheme']} | {s['layers']} | {s['shards']} | {_gb(s['bytes_in'])} | {_gb(s['largest_shard'])} | "
                f"{_gib(s['rss'])} | {_gib(s['limit'])} | {s['wall']:.1f} s |"
            )
    L.append("")
    L.append(
        "Reproduce: `"
        + " ".join(shlex.quote(x) for x in ["python", "scripts/bench_convert.py"] + res["argv"][1:])
        + "`"
    )
    L.append(
        f"(per process: `{' '.join(shlex.quote(x) for x in cmd_qconvert('mxfp8', 'SRC', 'DST', a.fsync, checksum_flags(a))[1:])}`, "
        f"floor `{' '.join(shlex.quote(x) for x in cmd_floor('SRC', 'DST', {'...': 0}, a.fsync)[1:])}`)"
    )
    return "\n".join(L)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_floor":
        floor_main(argv[1], argv[2], argv[3], "--fsync" in argv, mapped="--readinto" not in argv)
        return
    if argv and argv[0] == "_qconvert":
        dev = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
        none = "--no-checksums" in argv
        layout = argv[argv.index("--layout") + 1] if "--layout" in argv else None
        mode = argv[argv.index("--input-scale") + 1] if "--input-scale" in argv and argv[1] == "nvfp4" else None
        qconvert_main(
            argv[1],
            argv[2],
            argv[3],
            "--fsync" in argv,
            dev,
            source_checksums=not none and "--no-source-checksums" not in argv,
            output_checksums=not none,
            layout=layout,
            input_mode=mode,
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/qconvert-bench", help="scratch directory (synthetic input and outputs)")
    ap.add_argument("--src", help="existing BF16 checkpoint (default: make a synthetic one)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--schemes", default="mxfp8,nvfp4")
    ap.add_argument("--repeat", type=int, default=3, help="floor/qconvert pairs per scheme")
    ap.add_argument("--peers", default="", help="comma list: llmc (llm-compressor model_free_ptq), autoround")
    ap.add_argument(
        "--peer-python", default="/work/venv-peers/bin/python", help="interpreter that has the peers installed"
    )
    ap.add_argument(
        "--no-source-checksums",
        action="store_true",
        help="run qconvert with --no-source-checksums (source shards not hashed; outputs still are)",
    )
    ap.add_argument(
        "--no-checksums",
        action="store_true",
        help="run qconvert with --no-checksums (nothing hashed, neither source nor output shards)",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of qconvert variants run in every round against the "
        "same floor: " + ", ".join(VARIANTS) + " (overrides the two flags above)",
    )
    ap.add_argument(
        "--floor",
        choices=sorted(FLOOR_READS),
        default="best",
        help="how the floor reads: mapped (as the converter), readinto (copies into buffers, which "
        "overlaps reading and writing on two threads), or best: both each round, the faster counts",
    )
    ap.add_argument(
        "--fsync", action="store_true", help="fsync outputs (qconvert's CLI default); then the disk dominates"
    )
    ap.add_argument("--rss-sweep", action="store_true", help="peak RSS: 1 shard vs many, 2x vs 4x layers")
    ap.add_argument(
        "--sweep-layers", type=int, default=2, help="smaller layer count of the sweep (doubled for the other)"
    )
    ap.add_argument("--sweep-schemes", default="mxfp8")
    ap.add_argument("--repeat-nvfp4", type=int, default=None, help="pairs for nvfp4 (default: --repeat)")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    a = ap.parse_args(argv)
    res = bench(a)
    text = report(res, a)
    print()
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
