#!/usr/bin/env python3
"""qconvert checkpoints in a real vLLM on a CUDA GPU (issue #22): accuracy, hot reload, timings.

Run on the device machine after ``source scripts/gpu_vllm_setup.sh PARTS`` (vLLM's CUDA build on
PYTHONPATH), from the repository root:

    python scripts/gpu_vllm_check.py --out $OUT [--stages kl,reload,refit,online,synthetic]

Stages (each records its figures or its error in ``OUT/gpu_vllm.json``, written after every step):

* ``kl``: the demo models (qwen3, qwen3-moe; seed 0) converted to MXFP8 (auto dialect, plain and
  last-1-BF16), MXFP8 ModelOpt and NVFP4 W4A16, run with ``vllm.LLM`` next to their BF16 source in
  one worker (``qconvert.engine.vllm_compare``, what ``verify --engine vllm`` uses): top-1 agreement,
  mean/max KL of the next-token distributions, identical greedy continuations.
* ``reload``: a vLLM OpenAI server (127.0.0.1, ``--enforce-eager``, dev mode, qconvert's worker
  extension) on checkpoint A; ``reload_vllm`` to B through shared memory (outputs change), back to A
  from disk (outputs equal the first ones exactly), and A->B under 4 concurrent clients
  (``--pause wait``: every request succeeds; each answer equals A's or B's greedy text for its prompt).
  Times the pause (POST /pause sent -> /resume answered) and the whole reload.
* ``refit``: ``qconvert.refit`` of B's BF16 tensors held on the GPU (quantized there,
  ``device="cuda"``), staged and reloaded; outputs equal reloading B converted on disk.
* ``online``: vLLM's own path for the same job: the BF16 checkpoint served with
  ``--quantization mxfp8`` and B's BF16 checkpoint reloaded (vLLM quantizes while loading).
* ``synthetic``: a 4-layer Qwen3-30B-A3B-shaped checkpoint (``scripts/make_synthetic.py``) in MXFP8:
  served (token ids only, no tokenizer), reload timings as above.

vLLM 0.26.0 (the release built for the device's torch 2.11) has no ``/weight_info``,
``/update_weight_version`` or ``/weight_checker`` routes (qconvert's client is written for
0.32/0.33). This script keeps the weight version client-side for those servers
(:class:`Versionless`) and checks loads through outputs instead of ``--verify`` checksums.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import requests
from vllm_server import VllmServer  # scripts/ is on sys.path when run as a script

PROMPTS = ["The quick brown fox", "Once upon a time", "MXFP8 stores", "def add(a, b):"]
MAX_TOKENS = 12
FORMATS = ["mxfp8", "mxfp8-last1", "mxfp8-modelopt", "nvfp4"]
RESULT: dict = {"stages": {}}
#: the bundle carries no FlashInfer; vLLM 0.26.0's sampler imports it unless told not to (seen on the H100)
NO_FLASHINFER = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
PROFILE = 0  # --profile N: the synthetic stage also profiles one load (top N functions)
REFIT_ONLY = False  # --refit-only: the synthetic stage times only the refits, the floor and the A/B
OUT: Path = Path(".")


def log(*a):
    print("[gpu_vllm]", time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def save():
    (OUT / "gpu_vllm.json").write_text(json.dumps(RESULT, indent=1, default=str))


def stage(name):
    def deco(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            log("stage", name)
            rec = RESULT["stages"].setdefault(name, {})
            try:
                fn(rec, *a, **kw)
                rec["ok"] = True
            except BaseException as e:  # noqa: BLE001 - record and go on to the next stage
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:3000]
                rec["traceback"] = traceback.format_exc()[-6000:]
                log("stage", name, "FAILED", rec["error"][:500])
                if isinstance(e, KeyboardInterrupt):
                    raise
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            save()

        return run

    return deco


# ------------------------------------------------------------------ checkpoints


def convert(src: Path, dst: Path, fmt: str, device: str = "cpu") -> Path:
    from qconvert.convert.pipeline import ConvertOptions
    from qconvert.convert.pipeline import convert as run
    from qconvert.convert.plan import PlanOptions

    scheme = fmt.split("-")[0]
    last = 1 if fmt.endswith("last1") else 0
    opts = ConvertOptions(
        scheme=scheme, plan=PlanOptions(scheme=scheme, last_n_bf16=last), fsync=False, progress=False, device=device
    )
    if fmt == "mxfp8-modelopt":
        opts.dialect = "modelopt"
    if scheme == "nvfp4":
        opts.input_mode = "weight-only"
    if not dst.exists():
        run(str(src), dst, scheme, opts)
    return dst


def demo(root: Path, arch: str, seed: int) -> Path:
    from qconvert.convert.demo import build_demo_model

    d = root / f"{arch}-s{seed}-bf16"
    if not d.exists():
        build_demo_model(d, arch=arch, seed=seed)
    return d


# ------------------------------------------------------------------ server


class Server(VllmServer):
    """A GPU server small enough to share the card with the trainer-side refit in the same process tree."""

    def __init__(
        self, model: Path, logf: Path, extra: list[str] | None = None, timeout: float = 400, env: dict | None = None
    ):
        from qconvert.client.vllm_client import EXTENSION_FLAG

        flags = [
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "16",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--gpu-memory-utilization",
            "0.35",
            "--kv-cache-memory-bytes",
            str(1 << 30),
            *EXTENSION_FLAG.split(),
            *(extra or []),
        ]
        super().__init__(
            model,
            logf,
            flags,
            env={"VLLM_SERVER_DEV_MODE": "1", **NO_FLASHINFER, **(env or {})},
            timeout=timeout,
            poll_s=0.5,
        )

    def model(self) -> str:
        return requests.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def complete(self, prompt, max_tokens=MAX_TOKENS) -> str:
        r = requests.post(
            self.url + "/v1/completions",
            json={
                "model": self.model(),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            timeout=300,
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions {r.status_code}: {r.text[:500]}")
        c = r.json()["choices"][0]
        return c.get("text") or json.dumps(c.get("token_ids"))

    def greedy(self, prompts=PROMPTS) -> list[str]:
        return [self.complete(p) for p in prompts]


# ------------------------------------------------------------------ client shims and timing


TIMES: list[dict] = []


def install_client_shims():
    """Pause/resume timestamps for every reload, and a client-side weight version where the server
    has no /weight_info (vLLM < 0.32): qconvert's client records the served path by version."""
    from qconvert.client import vllm_client as vc
    from qconvert.client.http import ServerError

    versions: dict[str, str] = {}
    orig_wv, orig_set, orig_pause, orig_resume, orig_reload = (
        vc.VllmClient.weight_version,
        vc.VllmClient.set_weight_version,
        vc.VllmClient.pause,
        vc.VllmClient.resume,
        vc.VllmClient.reload_weights,
    )

    def weight_version(self):
        # qconvert's client refuses such servers (docs/reload.md#vllm-weight-versions); this run
        # keeps the version here instead, to time the reload path vLLM 0.26.0 does have
        status, _ = self.http.request("GET", "/weight_info", ok_status=(404,))
        if status == 404:
            return versions.get(self.url, "default")
        return orig_wv(self)

    def set_weight_version(self, v):
        try:
            orig_set(self, v)
        except ServerError as e:
            if e.status != 404:
                raise
            versions[self.url] = v

    def pause(self, mode="wait"):
        TIMES.append({"url": self.url, "pause_sent": time.perf_counter()})
        orig_pause(self, mode)
        TIMES[-1]["paused"] = time.perf_counter()

    def reload_weights(self, path):
        t = time.perf_counter()
        orig_reload(self, path)
        if TIMES:
            TIMES[-1]["reload_weights_s"] = time.perf_counter() - t

    def resume(self):
        orig_resume(self)
        if TIMES:
            TIMES[-1]["resumed"] = time.perf_counter()

    vc.VllmClient.weight_version = weight_version
    vc.VllmClient.set_weight_version = set_weight_version
    vc.VllmClient.pause = pause
    vc.VllmClient.resume = resume
    vc.VllmClient.reload_weights = reload_weights


def last_pause() -> dict:
    t = TIMES[-1]
    return {
        "pause_to_resume_s": round(t["resumed"] - t["pause_sent"], 4),
        "drain_s": round(t["paused"] - t["pause_sent"], 4),
        "reload_weights_rpc_s": round(t.get("reload_weights_s", float("nan")), 4),
    }


def timed_reload(urls, ckpt, **kw) -> dict:
    from qconvert.client.vllm_client import reload_vllm

    t0 = time.perf_counter()
    res = reload_vllm(urls, ckpt, **kw)
    total = time.perf_counter() - t0
    assert all(r.ok for r in res), res
    return {"total_s": round(total, 4), **last_pause(), "load": res[0].load}


# ------------------------------------------------------------------ stages


@stage("env")
def st_env(rec):
    import torch

    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    rec["gpu"] = torch.cuda.get_device_name(0)
    rec["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    from importlib.metadata import version

    rec["vllm"] = version("vllm")
    rec["shm"] = shutil.disk_usage("/dev/shm")._asdict()


@stage("kl")
def st_kl(rec, root: Path, archs, formats=FORMATS, reload_fmt: str | None = None):
    from qconvert.engine.vllm_compare import compare_logprobs, run_in_vllm

    for arch in archs:
        src = demo(root, arch, 0)
        dsts = {f: convert(src, root / f"{arch}-s0-{f}", f) for f in formats}
        jobs = [src, *dsts.values()]
        if reload_fmt in dsts:  # in the same worker: reload_weights to B, then back to A
            b = convert(demo(root, arch, 1), root / f"{arch}-s1-{reload_fmt}", reload_fmt)
            i = 1 + list(dsts).index(reload_fmt)
            jobs[i] = {"model": str(jobs[i]), "reload": [str(b), str(jobs[i])]}
        t0 = time.perf_counter()
        res = run_in_vllm(
            jobs,
            PROMPTS,
            max_tokens=16,
            score_with_first=True,
            llm_kwargs={"gpu_memory_utilization": 0.12, "kv_cache_memory_bytes": 1 << 29},
            env={"VLLM_LOGGING_LEVEL": "INFO", **NO_FLASHINFER},
            timeout=900,
        )
        rec[f"{arch}_wall_s"] = round(time.perf_counter() - t0, 1)
        base = res["jobs"][0]["stages"][0]
        for f, job in zip(dsts, res["jobs"][1:]):
            st = job["stages"][0]
            m = compare_logprobs(base["score"], st["score"])
            gen = sum(a == b for a, b in zip(base["tokens"], st["tokens"])) / len(base["tokens"])
            rec[f"{arch}:{f}"] = {
                k: m[k]
                for k in (
                    "top1_agreement",
                    "mean_kl",
                    "max_kl",
                    "max_abs_logprob_diff",
                    "positions",
                    "nonfinite_positions",
                )
            } | {"generation_agreement": gen}
            log(arch, f, rec[f"{arch}:{f}"])
            if len(job["stages"]) == 3:  # reloaded B, then A again
                rb, ra = job["stages"][1], job["stages"][2]
                rec[f"{arch}:{f}:reload"] = {
                    "outputs_changed": rb["tokens"] != st["tokens"],
                    "restored_tokens": ra["tokens"] == st["tokens"],
                    "restored_logprobs_exactly": ra["score"] == st["score"],
                }
        rec[f"{arch}_stderr_tail"] = res.get("stderr_tail", "")[-1500:]
        save()


def concurrent_check(srv: Server, b_ckpt, a_out, b_out) -> dict:
    results = []
    stop = threading.Event()

    def client(k):
        i = 0
        while not stop.is_set():
            p = (k + i) % len(PROMPTS)
            try:
                results.append((p, 200, srv.complete(PROMPTS[p])))
            except Exception as e:  # noqa: BLE001
                results.append((p, 0, str(e)[:300]))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    timing = timed_reload([srv.url], b_ckpt, pause="wait", weight_version="V-new")
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(300)
    failed = [r for r in results if r[1] != 200]
    which = {"A": 0, "B": 0, "neither": 0}
    for p, st, text in results:
        if st == 200:
            which["A" if text == a_out[p] else "B" if text == b_out[p] else "neither"] += 1
    return {
        "requests": len(results),
        "failed": len(failed),
        "failed_examples": failed[:3],
        "answers": which,
        **{f"reload_{k}": v for k, v in timing.items()},
    }


def reload_round_trip(rec, root: Path, arch: str, fmt: str, repeats: int = 3):
    a_src, b_src = demo(root, arch, 0), demo(root, arch, 1)
    a = a_src if fmt == "bf16" else convert(a_src, root / f"{arch}-s0-{fmt}", fmt)
    b = b_src if fmt == "bf16" else convert(b_src, root / f"{arch}-s1-{fmt}", fmt)
    os.environ["QCONVERT_STATE_DIR"] = str(root / "state")
    os.environ["QCONVERT_SHM_ROOT"] = str(Path("/dev/shm") / f"qconvert-{os.getpid()}")
    srv = Server(a, OUT / f"server-{arch}-{fmt}.log")
    r = rec.setdefault(f"{arch}:{fmt}", {})
    r["server_start_s"] = round(srv.start_s, 1)
    try:
        orig = srv.greedy()
        r["greedy_a"] = orig
        shm = [timed_reload([srv.url], b, via="shm", weight_version=f"B{i}") for i in range(repeats)]
        out_b = srv.greedy()
        r["reload_b_shm"] = shm
        r["outputs_changed"] = out_b != orig
        disk = [timed_reload([srv.url], a, weight_version=f"A{i}") for i in range(repeats)]
        r["reload_a_disk"] = disk
        r["restored_exactly"] = srv.greedy() == orig
        r["concurrent"] = concurrent_check(srv, b, orig, out_b)
        timed_reload([srv.url], a, weight_version="A-end")
        r["restored_after_concurrent"] = srv.greedy() == orig
        save()
        return srv, a, b, a_src, b_src, orig, out_b
    except BaseException:
        srv.stop()
        raise


@stage("reload")
def st_reload(rec, root: Path, kinds, with_refit: bool = False):
    for kind in kinds:
        arch, fmt = kind.split(":")
        try:
            srv, a, b, a_src, b_src, orig, _ = reload_round_trip(rec, root, arch, fmt)
            try:
                if with_refit and kind == "qwen3-moe:mxfp8-last1":  # the refit on the same server
                    refit_on(rec.setdefault("refit", {}), srv, a, b, b_src, orig)
            finally:
                srv.stop()
        except Exception as e:  # noqa: BLE001 - next kind
            rec.setdefault(kind, {})["error"] = f"{type(e).__name__}: {e}"[:3000]
            rec[kind]["traceback"] = traceback.format_exc()[-4000:]
            log(kind, "FAILED", str(e)[:300])
        save()


@stage("refit")
def st_refit(rec, root: Path):
    arch, fmt = "qwen3-moe", "mxfp8-last1"
    a_src, b_src = demo(root, arch, 0), demo(root, arch, 1)
    a, b = convert(a_src, root / f"{arch}-s0-{fmt}", fmt), convert(b_src, root / f"{arch}-s1-{fmt}", fmt)
    os.environ["QCONVERT_SHM_ROOT"] = str(Path("/dev/shm") / f"qconvert-{os.getpid()}")
    srv = Server(a, OUT / "server-refit.log")
    try:
        refit_on(rec, srv, a, b, b_src, srv.greedy())
    finally:
        srv.stop()


@contextmanager
def gpu_refitter(srv: Server, b_src: Path, name: str):
    """B's BF16 tensors loaded onto the GPU, and a Refitter (MXFP8, last layer BF16) into ``srv``."""
    import torch
    from safetensors.torch import load_file

    from qconvert.convert.options import ConvertOptions
    from qconvert.convert.plan import PlanOptions
    from qconvert.trainer.refit import Refitter

    gpu = {}
    for f in sorted(b_src.glob("*.safetensors")):
        gpu.update({k: v.to("cuda") for k, v in load_file(f).items()})
    torch.cuda.synchronize()
    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), progress=False, device="cuda")
    try:
        with Refitter(b_src, opts, name, [srv.url]) as r:
            yield r, gpu
    finally:
        del gpu
        torch.cuda.empty_cache()


def timed_refits(r, gpu: dict, label: str, runs: list, n: int = 4) -> None:
    """``n`` refits through ``r`` (the first creates, maps and registers the area): each one's
    stage, commit and server reload (pause to resume), appended to ``runs``."""
    for i in range(n):
        t0 = time.perf_counter()
        res = r.refit(iter(gpu.items()), f"{label}{i}")
        total = time.perf_counter() - t0
        assert res.reload and all(x.ok for x in res.reload), res.reload
        runs.append(
            {
                "first": i == 0,
                "total_s": round(total, 4),
                **{f"{k}_s": round(v, 4) for k, v in res.seconds.items()},
                **last_pause(),
                "load": res.reload[0].load,
            }
        )
        log(label, runs[-1])
        save()


def refit_on(rec, srv: Server, a: Path, b: Path, b_src: Path, orig: list[str]):
    """qconvert's Refitter fed B's BF16 tensors (on the GPU) into a server serving A (MXFP8, last 1
    BF16): the first refit (area created, mapped, registered) and three more into the same area."""
    timed_reload([srv.url], b, weight_version="B-converted")
    want = srv.greedy()
    with gpu_refitter(srv, b_src, "policy") as (r, gpu):
        timed_refits(r, gpu, "B-refit", rec.setdefault("runs", []))
    rec["equals_converted_reload"] = srv.greedy() == want
    timed_reload([srv.url], a, weight_version="A-after")
    rec["restored_exactly"] = srv.greedy() == orig


@stage("online")
def st_online(rec, root: Path):
    """vLLM's own path: BF16 checkpoint, --quantization mxfp8 (quantized while loading), reload of B's BF16."""
    from qconvert.client.vllm_client import VllmClient

    arch = "qwen3-moe"
    a_src, b_src = demo(root, arch, 0), demo(root, arch, 1)
    srv = Server(a_src, OUT / "server-online.log", extra=["--quantization", "mxfp8"])
    try:
        rec["server_start_s"] = round(srv.start_s, 1)
        orig = srv.greedy()
        c = VllmClient(srv.url)
        runs = []
        for i, ck in enumerate([b_src, a_src, b_src, a_src]):
            t0 = time.perf_counter()
            c.pause("wait")
            c.reload_weights(str(ck))
            c.resume()
            runs.append({"checkpoint": ck.name, "pause_to_resume_s": round(time.perf_counter() - t0, 4)})
            if i == 0:
                out_b = srv.greedy()
                rec["outputs_changed"] = out_b != orig
        rec["runs"] = runs
        rec["restored_exactly"] = srv.greedy() == orig
    finally:
        srv.stop()


def synthetic_checkpoints(rec, root: Path, layers: int) -> tuple[Path, Path, Path]:
    """The two BF16 sources (seeds 0 and 1) and their MXFP8-last1 conversions (on the GPU), made
    once per layer count: a call that is stopped midway leaves no directory that looks finished."""
    a_src = root / f"synth{layers}-s0-bf16"
    b_src = root / f"synth{layers}-s1-bf16"
    for d, seed in ((a_src, 0), (b_src, 1)):
        if not d.exists():
            tmp = d.with_name(d.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(
                [sys.executable, "scripts/make_synthetic.py", str(tmp), "--layers", str(layers), "--seed", str(seed)],
                check=True,
            )
            tmp.rename(d)
    t0 = time.perf_counter()
    a = convert(a_src, root / f"synth{layers}-s0-mxfp8", "mxfp8-last1", device="cuda")
    rec["convert_a_cuda_s"] = round(time.perf_counter() - t0, 2)
    convert(b_src, root / f"synth{layers}-s1-mxfp8", "mxfp8-last1", device="cuda")
    rec["checkpoint_gb"] = round(sum(f.stat().st_size for f in a.glob("*.safetensors")) / 1e9, 3)
    return b_src, a, root / f"synth{layers}-s1-mxfp8"


@stage("synthetic")
def st_synthetic(rec, root: Path, layers: int):
    b_src, a, b = synthetic_checkpoints(rec, root, layers)
    os.environ["QCONVERT_SHM_ROOT"] = str(Path("/dev/shm") / f"qconvert-{os.getpid()}")
    # the server's defaults: the loader replay (docs/reload.md#loader-replay) and the kept mappings
    # (docs/reload.md#kept-mappings) on; the A/B records below turn each off for single loads
    srv = Server(a, OUT / "server-synth.log", extra=["--skip-tokenizer-init"])
    try:
        rec["server_start_s"] = round(srv.start_s, 1)
        if not REFIT_ONLY:  # the publisher's paths: `qconvert stage` + reload, and reload from disk
            rec["reload_b_shm"] = [timed_reload([srv.url], b, via="shm", weight_version=f"B{i}") for i in range(2)]
            rec["reload_a_disk"] = [timed_reload([srv.url], a, weight_version=f"A{i}") for i in range(2)]
            save()
        refit_synthetic(rec.setdefault("refit", {}), srv, b_src)
    finally:
        srv.stop()


def refit_synthetic(rec, srv: Server, b_src: Path):
    """The Refitter on B's BF16 tensors held on the GPU, into the served synthetic model; then the
    server's copy floor for the same area and, with --profile, one profiled load."""
    from qconvert.client.vllm_client import VllmClient

    with gpu_refitter(srv, b_src, "synth") as (r, gpu):
        timed_refits(r, gpu, "synth-refit", rec.setdefault("runs", []))
        # the floor of the server's load: in its worker, the area's files mapped and copied to the GPU
        # (kept: the area's files whole from the worker's kept, registered mappings; fresh: mapped
        # afresh and copied per tensor from pageable memory, the floor before the kept mappings)
        c0 = VllmClient(srv.url)
        (rec["copy_floor"],) = c0.collective_rpc("qconvert_copy_floor", area=str(r.area), repeat=3, keep_maps=True)
        (rec["copy_floor_fresh"],) = c0.collective_rpc(
            "qconvert_copy_floor", area=str(r.area), repeat=3, keep_maps=False
        )
        log("copy floor", rec["copy_floor"], "fresh maps", rec["copy_floor_fresh"])
        save()
        # the GPU load with the device chunks (the default) against host views, alternating in
        # this one server: pause, load the same committed area, resume
        c = VllmClient(srv.url)

        def paused_load(**kw) -> dict:
            """One load of the committed area in the paused server (the worker's statistics)."""
            c.pause("wait")
            try:
                (st,) = c.collective_rpc("qconvert_load_staged", area=str(r.area), **kw)
            finally:
                c.resume()
            return st

        # the loader replay against vLLM's own layerwise reload (direct=False), alternating, both
        # with the device chunks; the first pair also compares every served tensor's digest
        keys = (
            "device_chunks",
            "kept_maps",
            "pinned_files",
            "pin_error",
            "load_seconds",
            "seconds",
            "bytes",
            "path",
            "why",
            "plan",
            "replay",
            "modules",
            "marlin",
            "copies_recorded",
        )

        def alternate(label: str, arg: str, digests: bool) -> dict[str, list]:
            """Three loads each with ``arg`` False and True, alternating; with ``digests`` every
            served tensor's digest after the first of each (as {"False": ..., "True": ...})."""
            runs, got = rec.setdefault(f"{label}_ab", []), {}
            for i in range(3):
                for on in (False, True):
                    st = paused_load(**{arg: on})
                    runs.append({arg: on, **{k: st.get(k) for k in keys}})
                    if digests and i == 0:
                        (got[str(on)],) = c.collective_rpc("qconvert_weights_digest")
                    log(f"{label} A/B", runs[-1])
            save()
            return got

        d = alternate("replay", "direct", digests=True)
        rec["replay_equals_layerwise"] = d["True"] == d["False"]
        rec["tensors_compared"] = len(d["True"])
        log("replay leaves the served tensors of vLLM's layerwise reload:", rec["replay_equals_layerwise"])
        # vLLM's MXFP8 MoE Marlin preparation as learnt byte gathers (docs/reload.md#marlin-gather)
        # against vLLM's per-expert loop; the first pair also compares every served tensor's digest
        d = alternate("marlin", "marlin_gather", digests=True)
        rec["marlin_gather_equals_vllm"] = d["True"] == d["False"]
        log("the Marlin gather leaves the served tensors of vLLM's preparation:", rec["marlin_gather_equals_vllm"])
        # the replayed modules' loader calls made as their recorded copies (docs/reload.md#loader-copies)
        # against the calls themselves; the first pair also compares every served tensor's digest
        d = alternate("copies", "loader_copies", digests=True)
        rec["loader_copies_equal_calls"] = d["True"] == d["False"]
        log("the loader copies leave the served tensors of vLLM's loaders:", rec["loader_copies_equal_calls"])
        # the kept, registered mappings (docs/reload.md#kept-mappings) against mapping afresh, both
        # with the server's default load path
        alternate("keep_maps", "keep_maps", digests=False)
        if PROFILE:  # where a GPU server's load spends its time (cProfile in the worker)
            rec["profiled_load"] = paused_load(profile=PROFILE)
            save()


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/qgpu")
    ap.add_argument("--stages", default="env,kl,reload,refit,online,synthetic")
    ap.add_argument("--reload-kinds", default="qwen3-moe:mxfp8-last1,qwen3-moe:nvfp4,qwen3:mxfp8-modelopt")
    ap.add_argument("--archs", default="qwen3,qwen3-moe")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--kl-reload", default=None, help="a format whose vllm.LLM also reloads B and A again")
    ap.add_argument("--prepare", action="store_true", help="only build and convert the checkpoints (no GPU)")
    ap.add_argument("--synthetic-layers", type=int, default=4)
    ap.add_argument("--profile", type=int, default=0, help="synthetic: profile one server load (top N functions)")
    ap.add_argument("--refit-only", action="store_true", help="synthetic: skip the stage-and-reload and disk reloads")
    args = ap.parse_args()
    global PROFILE, REFIT_ONLY
    PROFILE = args.profile
    REFIT_ONLY = args.refit_only
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    install_client_shims()
    stages = args.stages.split(",")
    RESULT["args"] = vars(args)
    if args.prepare and "synthetic" in stages:  # the synthetic checkpoints, made ahead (GPU conversions)
        synthetic_checkpoints(RESULT.setdefault("prepared", {}), root, args.synthetic_layers)
        save()
        return
    if args.prepare:  # the checkpoints the other stages read, made ahead (CPU)
        for arch in args.archs.split(","):
            for seed in (0, 1):
                src = demo(root, arch, seed)
                for f in args.formats.split(","):
                    if seed == 0 or f == args.kl_reload:
                        convert(src, root / f"{arch}-s{seed}-{f}", f)
        return
    if "env" in stages:
        st_env()
    if "kl" in stages:
        st_kl(root, args.archs.split(","), args.formats.split(","), args.kl_reload)
    if "reload" in stages:
        st_reload(root, args.reload_kinds.split(","), with_refit="refit-in-reload" in stages)
    if "refit" in stages:
        st_refit(root)
    if "online" in stages:
        st_online(root)
    if "synthetic" in stages:
        st_synthetic(root, args.synthetic_layers)
    save()
    print(json.dumps({k: v.get("ok") for k, v in RESULT["stages"].items()}))


if __name__ == "__main__":
    main()
