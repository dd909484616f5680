#!/usr/bin/env python3
"""Host-side cost of a trainer-side refit after the first, per layer, measured on CPU.

On a GPU the refit's own work is tiny (quantizing a Qwen3-30B-A3B layer takes well under a
millisecond), so what a refit costs beyond the device-to-host floor is host work per tensor:
name and shape checks, splitting, dict traffic, per-output slicing, sorting, concatenation and
copies. This script measures that part without a GPU: a model with Qwen3-30B-A3B's tensor COUNT
and names (``make_synthetic.py``'s ``tensor_specs``: 128 experts x 3 per layer, attention,
norms, router) but tiny matrices (``--hidden``, ``--inter``), so that quantizing costs little,
staged by ``Refitter`` (``device="cpu"``) on the CUDA path's host code: the batched NaN/Inf
check (``Refitter._BATCHED``) and the stacked quantization (``jobs.STACKED_DEVICES`` with
"cpu", the same bytes: tests/test_refit_area.py::test_batched_path_equals_converter).

What the proxy covers: everything a refit after the first does in Python on the host
(``stage``: input checks, grouping, the jobs' Python, output checks, run planning and
concatenation, the copy into the mapping; ``commit``: digests and commit.json).
What it does not cover: CUDA launch latency, streams and events (the copier's device path), the
Triton kernels, and the device-to-host copy itself; on CPU the quantizer is the C kernel, whose
time is reported apart ("jobs": time inside the jobs' functions, which includes their Python).
The figure to read is the calling thread's CPU time (``time.thread_time``) in ``stage()`` outside
the jobs' functions: other processes on a shared machine do not change it; on CPU it includes
the copy into the mapping (a memcpy of the outputs, small at these sizes), the NaN/Inf check's
norms and a little foreign-thread GIL traffic (digest and kernel pools).

``--device cuda`` runs the real CUDA path (real matrix sizes unless given) and adds the floor of
``bench_refit.py --stage`` (device-to-host copy of the same bytes into the registered mapping):
there "jobs" is the time to launch the quantizers, "waiting for copies" the copier's event waits
(a stage whose wall time is mostly that wait is bound by the device-to-host copy, not the host),
and the cProfile list shows where the host works.

    python scripts/profile_refit_host.py                       # all variants, 2 layers, CPU
    python scripts/profile_refit_host.py --variants mxfp8 --profile 25
    python scripts/profile_refit_host.py --device cuda --layers 4 --profile 30   # on the GPU machine
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _shapes(hidden: int, inter: int, vocab: int) -> None:
    """Shrink make_synthetic's matrices; names and counts stay Qwen3-30B-A3B's."""
    import make_synthetic as ms

    ms.HIDDEN, ms.MOE_INTER, ms.VOCAB = hidden, inter, vocab
    ms.HEADS, ms.KV_HEADS, ms.HEAD_DIM = 4, 2, hidden // 4


class _JobClock:
    """Seconds spent inside the jobs' functions (quantization and its Python) of a Refitter, and
    waiting for a group's copies to land (the copier's event wait: on CUDA that wait may spin,
    so it counts as CPU time too)."""

    def __init__(self, r):
        self.s = self.cpu = self.wait = 0.0
        retire = r._copier._retire

        def timed_retire():
            t0 = time.perf_counter()
            try:
                retire()
            finally:
                self.wait += time.perf_counter() - t0

        r._copier._retire = timed_retire
        import dataclasses

        for js in r._group_jobs.values():
            for j in js:
                j.fn = self._wrap(j.fn)
                if getattr(j, "stacked", None) is not None:  # the refit calls the stacks' function
                    j.stacked = dataclasses.replace(j.stacked, fn=self._wrap(j.stacked.fn))

    def _wrap(self, fn):
        def timed(src):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(src)
            finally:
                self.s += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0

        return timed


def run(a) -> dict:
    import torch
    from bench_refit import VARIANTS, _floor, _sparse_reference, _weights

    from qconvert.convert import jobs
    from qconvert.convert.pipeline import ConvertOptions
    from qconvert.refit import Refitter

    cuda = a.device == "cuda"
    if a.hidden is None:  # real sizes on a GPU; tiny ones on CPU, where the quantizer's time is not the subject
        a.hidden, a.inter = (2048, 768) if cuda else (64, 32)
    if a.cuda_path and not cuda:
        Refitter._BATCHED = True
        jobs.STACKED_DEVICES = {*jobs.STACKED_DEVICES, "cpu"}
    torch.set_num_threads(a.threads)
    _shapes(a.hidden, a.inter, a.vocab)
    work, root = Path(a.work), Path(a.shm_root)
    ref = _sparse_reference(work / "ref", a.layers)
    weights = _weights(a.layers, a.device)
    out = {
        "qconvert": str(Path(sys.modules["qconvert"].__file__).parent),
        "layers": a.layers,
        "tensors_in": len(weights),
        "shape": {"hidden": a.hidden, "inter": a.inter, "experts": 128},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda_path": cuda or a.cuda_path,
        "runs": [],
    }
    for v in a.variants:
        opts = ConvertOptions(device=a.device, progress=False, **VARIANTS[v])
        name = f"prof-{v.replace('+', '-')}"
        shutil.rmtree(root / name, ignore_errors=True)
        r = Refitter(ref, opts, name, root=root, hash_threads=None if cuda else 2)
        try:
            clock = _JobClock(r)
            res = r.refit(weights)  # the first: area, mappings
            stage, commit, jobs_s, stage_cpu, jobs_cpu, waits = [], [], [], [], [], []
            for _ in range(a.repeat):
                clock.s = clock.cpu = clock.wait = 0.0
                t0, c0 = time.perf_counter(), time.thread_time()
                r.stage(weights)  # returns once every copy has landed (the copier waits for its events)
                t1, c1 = time.perf_counter(), time.thread_time()
                r.commit()
                stage.append(t1 - t0)
                stage_cpu.append(c1 - c0)
                commit.append(time.perf_counter() - t1)
                jobs_s.append(clock.s)
                jobs_cpu.append(clock.cpu)
                waits.append(clock.wait)
            floor = _floor(r, torch, 3) if cuda else None
            top = None
            if a.profile:
                pr = cProfile.Profile()
                pr.enable()
                r.refit(weights)
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.profile)
                top = s.getvalue()
        finally:
            r.close()
            shutil.rmtree(root / name, ignore_errors=True)
        per_layer = 1e3 / a.layers
        host = [s - j - (w if cuda else 0.0) for s, j, w in zip(stage_cpu, jobs_cpu, waits)]
        row = {
            "variant": v,
            "tensors_out": res.tensors_out,
            "files": len(r.spec.files),
            "stage_ms_per_layer": statistics.median(stage) * per_layer,
            "jobs_ms_per_layer": statistics.median(jobs_s) * per_layer,
            "copy_wait_ms_per_layer": statistics.median(waits) * per_layer,
            "host_cpu_ms_per_layer": min(host) * per_layer,
            "host_cpu_ms_per_layer_median": statistics.median(host) * per_layer,
            "commit_ms": statistics.median(commit) * 1e3,
            "floor_ms_per_layer": floor * per_layer if floor is not None else None,
            "stage_s": stage,
            "host_cpu_s": host,
        }
        out["runs"].append(row)
        print(
            f"{v:14s} out {row['tensors_out']:6d}  wall: stage {row['stage_ms_per_layer']:7.2f} ms/layer, "
            f"in jobs {row['jobs_ms_per_layer']:6.2f}, waiting for copies {row['copy_wait_ms_per_layer']:6.2f}"
            f"  | calling thread's CPU outside jobs{' and waits' if cuda else ''}: "
            f"{row['host_cpu_ms_per_layer']:6.2f} ms/layer (min; median {row['host_cpu_ms_per_layer_median']:6.2f})"
            f"  | commit {row['commit_ms']:5.1f} ms"
            + (
                f"  | d2h floor {row['floor_ms_per_layer']:6.2f} ms/layer, stage / floor "
                f"{row['stage_ms_per_layer'] / row['floor_ms_per_layer']:.2f}x"
                if floor
                else ""
            ),
            flush=True,
        )
        if top:
            print(top, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return out


def main():
    from bench_refit import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 64 on CPU, 2048 on CUDA: real)")
    ap.add_argument("--inter", type=int, default=None, help="expert intermediate size (default 32 / 768: real)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the C kernels' pool too)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one refit, top N by own time")
    ap.add_argument(
        "--no-cuda-path", dest="cuda_path", action="store_false", help="the CPU path (per-tensor jobs) instead"
    )
    ap.add_argument("--shm-root", default=f"/dev/shm/qconvert-prof-{os.getpid()}")
    ap.add_argument("--work", default=f"/tmp/qconvert-prof-{os.getpid()}")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    try:
        out = run(a)
    finally:
        shutil.rmtree(a.shm_root, ignore_errors=True)
        shutil.rmtree(a.work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
