"""Streaming conversion: read shard by shard, quantize, write; temp directory renamed at the end.

Three stages overlap: a reader thread reads tensors in file order (hashing the input as it goes),
the calling thread quantizes (torch releases the GIL and uses all cores), and a writer thread
``pwrite``s each output tensor at its precomputed offset. Peak memory is the tensors in flight,
bounded by the queues, plus fused-group members waiting for their partners.

Each output shard corresponds to one input shard (same file name), so output shards keep the
source's proportions and a tensor's bytes are found where a reader of the source expects them.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import shutil
import stat
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import __version__
from ..errors import CheckpointError, OutputError, QConvertError
from . import dialects
from . import resume as _resume
from .checkpoint import INDEX_NAME, Checkpoint, load_checkpoint
from .numerics import cpu_kernels
from .numerics.mxfp8 import mxfp8_quantize
from .plan import KEEP, QUANTIZE, Plan, PlanOptions, build_plan
from .safetensors_io import (BackgroundSha256, ShardReader, ShardWriter, hub_cache_sha256, local_dir_sha256,
                             sha256_file)

MANIFEST_NAME = "qconvert.json"
MXFP8_SCALE_RULE = "RCEIL: E = ceil(log2(amax/448)) in fp32, elements e4m3 RNE of x*2^-E (docs/formats.md#mxfp8-scale-rule)"
NVFP4_SCALE_RULE = {
    "te": "TransformerEngine / FlashInfer (no fast math) order: s = e4m3(amax_blk * (S_enc / 6)), codes e2m1_rn(x * 1/(s / S_enc)), S_enc = 2688 / global amax",
    "modelopt": "ModelOpt NVFP4QTensor order: s = e4m3(clamp(amax_blk / (6 * ws2), 2^-9, 448)), codes e2m1_rne(x / (s * ws2)), ws2 = global amax / 2688",
}
MXFP8_ZERO_POLICY = "E8M0 byte 0 never written: exponent clamped to >= -126 (byte 1); only blocks with amax < 448*2^-127 (all-zero blocks) differ from online quantizers"


@dataclass
class ConvertOptions:
    scheme: str = "mxfp8"
    dialect: str | None = None
    plan: PlanOptions = field(default_factory=PlanOptions)
    device: str = "cpu"
    force: bool = False
    dry_run: bool = False
    allow_non_finite: bool = False
    progress: bool | None = None  # None: on a terminal only
    queue_bytes: int = 512 << 20  # read-ahead bound: input bytes read whose outputs are not written yet
    fsync: bool = True
    recipe: str = "te"  # NVFP4: te | modelopt
    input_mode: str = "weight-only"  # NVFP4: weight-only (W4A16) | unit | copied
    input_scales_from: str | None = None  # NVFP4: checkpoint to copy calibrated input scales from
    layout: str | None = None  # "flashinfer-trtllm": MoE experts pre-shuffled (layout_jobs.py)
    engine: str = "vllm"  # layout target engine: vllm | sglang
    tp: int = 1
    ep: int = 1
    allow_pickle: bool = False  # read .bin/.pt with torch.load(weights_only=True), via a safetensors copy
    _layout_layers: dict = field(default_factory=dict, repr=False)  # filled by build_jobs
    resume: bool = False  # continue an interrupted run from its journal (resume.py)
    source_checksums: bool = True  # sha256 of each source shard in the manifest (free for Hub-cache files)
    output_checksums: bool = True  # sha256 of each output shard (manifest, verify, resume); --no-checksums


@dataclass
class PlanRow:
    module: str
    action: str
    fmt: str
    shape: tuple
    bytes_in: int
    bytes_out: int
    reason: str
    sources: tuple[str, ...] = ()  # the source tensors of this row's job (fused groups, layout layers)


@dataclass
class ConvertResult:
    dst: Path | None
    plan: Plan
    scheme: str
    dialect: str
    rows: list[PlanRow]
    bytes_in: int
    bytes_out: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    options: ConvertOptions | None = None  # what was asked: recipe, activations, layout (the summary says them)

    @property
    def n_quantized(self) -> int:
        return len(self.plan.quantized)

    @property
    def n_kept(self) -> int:
        return len(self.plan.kept)


# ---- jobs -------------------------------------------------------------------------------------

@dataclass
class Job:
    """Turns source tensors into output tensors; ``outputs`` is known before any byte is read."""
    sources: list[str]
    outputs: list[dialects.OutTensor]
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    fmt: str
    device_input: bool = False  # the reader thread moves its sources to opts.device (CUDA overlap)


def _all_finite(t: torch.Tensor) -> bool:
    """True unless ``t`` holds NaN or +-Inf: one pass, no temporary the size of ``t`` (about 50x
    faster on CPU than ``isfinite(t).all()``)."""
    return bool(torch.isfinite(_abs_max(t)))


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """``t.abs().amax()`` exactly (NaN propagates): on CPU the C kernel's bit-pattern maximum on the
    worker threads (the calling thread dispatches every job, so its time is on the critical path),
    else one min/max pass without a |t| copy."""
    if t.device.type == "cpu" and t.numel():
        if cpu_kernels.usable(t):
            return cpu_kernels.abs_max(t, _workers())
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.abs(), hi.abs())


#: Worker threads for CPU quantization (all cores; the reader and writer threads mostly wait on I/O).
CPU_WORKERS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))

#: CPU jobs whose sources are at most this many bytes run whole on job threads, one per core, each
#: quantizing single-threaded; larger ones run on the calling thread split over all cores. A 3 MB
#: expert split over the cores spends about as long in Python dispatch as in the kernel, and with
#: every dispatch on one thread the cores wait (on 2 cores a conversion kept only 1.4 of them busy).
SMALL_JOB_BYTES = 64 << 20

#: Input shards read at once (see reader() in _run_threads): one per 4 cores, at most 4.
READ_STREAMS = min(4, max(1, CPU_WORKERS // 4))

#: Source shards hashed at once (see input_digest() in _run_threads): one per 4 cores, at most 8.
HASH_STREAMS = min(8, max(1, CPU_WORKERS // 4))

_tls = threading.local()
_F32_MAX = np.float32(np.finfo(np.float32).max)
_WAKE = object()  # put on the read queue when a job thread finishes


def _workers() -> int:
    """Quantizer threads for the current thread's job: all cores, or one on a job thread."""
    return getattr(_tls, "workers", CPU_WORKERS)


#: CUDA quantizer cores: "triton" (one-pass kernels, the default where Triton imports), "eager"
#: (the torch op chains) or "compile" (torch.compile of the chains). All give the same bytes.
CUDA_QUANTIZERS = ("triton", "eager", "compile")


def cuda_quantizer(device: str) -> str:
    """Which CUDA core the pipeline uses, from QCONVERT_CUDA_QUANTIZER (QCONVERT_COMPILE=1 is the
    older spelling of "compile"). Compiling is opt-in: it compiles once per tensor shape, which
    cost a whole conversion 3.6-5x the I/O floor on an H200 (docs/benchmarks-history.md#earlier-run-2026-12-02-one-pass-triton-kernels-the-pipelines-cuda-default)."""
    choice = os.environ.get("QCONVERT_CUDA_QUANTIZER", "")
    if not choice:
        choice = "compile" if os.environ.get("QCONVERT_COMPILE", "0") == "1" else "triton"
    if choice not in CUDA_QUANTIZERS:
        raise QConvertError(f"QCONVERT_CUDA_QUANTIZER={choice!r}: expected one of {', '.join(CUDA_QUANTIZERS)}")
    if choice == "triton":
        from .numerics import cuda_kernels
        if not cuda_kernels.available(device):
            choice = "eager"
    return choice


def _blocks_fn(scheme: str, device: str):
    """The quantizer core for ``device``: None on CPU and for eager CUDA (the torch chains run
    directly), else a function on flat blocks (see :func:`cuda_quantizer`)."""
    if device == "cpu":
        return None
    choice = cuda_quantizer(device)
    if choice == "triton":
        from .numerics import cuda_kernels
        return cuda_kernels.mxfp8_blocks if scheme == "mxfp8" else cuda_kernels.nvfp4_blocks
    if choice == "eager":
        return None
    if scheme == "mxfp8":
        from .numerics.mxfp8 import compiled_mxfp8_blocks
        return compiled_mxfp8_blocks()
    from .numerics.nvfp4 import compiled_nvfp4_blocks
    return compiled_nvfp4_blocks()


def _slow_quantizer_note(scheme: str, device: str) -> str | None:
    """A summary note when the fast quantizer core cannot run here (same bytes, slower)."""
    if device == "cpu":
        why = cpu_kernels.unavailable_reason()
        if why is not None:
            return f"{scheme} quantized by the torch op chains, not the C kernels ({why}): same bytes, several times slower"
        base = cpu_kernels.baseline_reason()
        if base is not None:
            return f"{scheme} quantized by C kernels built for the baseline ISA ({base}): same bytes, slower"
        return None
    if cuda_quantizer(device) == "eager" and os.environ.get("QCONVERT_CUDA_QUANTIZER") != "eager":
        return f"{scheme} quantized by the eager torch chains on {device}: Triton is not importable; same bytes, slower"
    return None


def _keep_job(name: str, dtype: torch.dtype, shape: tuple, check_finite: bool) -> Job:
    def fn(src):
        t = src[name]
        if check_finite and t.is_floating_point() and t.numel() and not _all_finite(t):
            raise CheckpointError(f"tensor {name!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite")
        return {name: t}
    return Job([name], [dialects.OutTensor(name, dtype, tuple(shape), "bf16")], fn, "bf16")


def _mxfp8_job(tp, dialect: str, device: str, check_finite: bool) -> Job:
    outs = dialects.mxfp8_out_tensors(tp.module, tp.shape, dialect)
    blocks_fn = _blocks_fn("mxfp8", device)

    def fn(src):
        x = src[tp.name]
        if device != "cpu":
            x = x.to(device, non_blocking=True)
        q, s = mxfp8_quantize(x, workers=_workers(), blocks_fn=blocks_fn)
        if check_finite and bool((s == 255).any()):
            raise CheckpointError(f"tensor {tp.name!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite")
        return {outs[0].name: q, outs[1].name: s}  # the writer thread copies device tensors back
    return Job([tp.name], outs, fn, "mxfp8", device_input=device != "cpu")


def _nvfp4_group_job(members, dialect: str, opts: ConvertOptions, input_scales: dict | None, check_finite: bool) -> Job:
    """One job per fused group: members share one global scale (max amax over the group)."""
    from .numerics.nvfp4 import nvfp4_quantize

    outs_of = {tp.name: dialects.nvfp4_out_tensors(tp.module, tp.shape, dialect, opts.input_mode) for tp in members}
    device = opts.device
    blocks_fn = _blocks_fn("nvfp4", device)

    def fn(src):
        xs = {n: (src[n].to(device, non_blocking=True) if device != "cpu" else src[n]) for n in outs_of}
        if all(cpu_kernels.usable(x) for x in xs.values()):  # fp32 scalars in numpy, not 0-dim tensors
            amaxes = {n: cpu_kernels.abs_max_f32(x, _workers()) for n, x in xs.items()}
            g = np.max(np.array(list(amaxes.values()), dtype=np.float32))  # NaN propagates
            finite = bool(np.isfinite(g))
        else:
            amaxes = {n: _abs_max(x).float() for n, x in xs.items()}
            g = torch.stack(list(amaxes.values())).amax()
            finite = bool(torch.isfinite(g))
        if check_finite and not finite:
            bad = next(n for n, a in amaxes.items() if not bool(np.isfinite(float(a))))
            raise CheckpointError(f"tensor {bad!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite")
        result = {}
        for n, x in xs.items():
            packed, scale, scale_2 = nvfp4_quantize(x, global_amax=g, recipe=opts.recipe, workers=_workers(),
                                                    blocks_fn=blocks_fn)
            outs = outs_of[n]
            mod = n[: -len(".weight")]
            result[outs[0].name] = packed  # the writer thread copies device tensors back
            result[outs[1].name] = scale
            if dialect == "modelopt":
                result[outs[2].name] = scale_2.cpu().reshape(())
            else:
                # encode convention: S_enc = 2688/g (fp32), clamped at FLT_MAX as TE does (tiny g)
                gf = np.float32(float(g))
                with np.errstate(all="ignore"):
                    enc = np.minimum(np.float32(2688.0) / gf, _F32_MAX) if gf > 0 else np.float32(1.0)
                result[outs[2].name] = torch.tensor([enc], dtype=torch.float32)
            if len(outs) > 3:
                dec = input_scales[mod] if input_scales is not None else torch.tensor(1.0)
                result[outs[3].name] = dec.reshape(()) if dialect == "modelopt" else (1.0 / dec).reshape(1)
        return result
    return Job([tp.name for tp in members], [o for tp in members for o in outs_of[tp.name]], fn, "nvfp4",
               device_input=device != "cpu")


def load_input_scales(path: str, modules: list[str]) -> dict[str, torch.Tensor]:
    """Calibrated activation scales (decode convention) from an existing NVFP4 checkpoint."""
    from .safetensors_io import read_header
    root = Path(path).expanduser()
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise CheckpointError(f"{root}: --input-scales-from needs a directory with an NVFP4 checkpoint's .safetensors files")
    found: dict[str, torch.Tensor] = {}
    from .checkpoint import guard
    for f in files:
        h = read_header(guard(root, f))  # inside that checkpoint, a regular file
        names = [n for n in h.entries if n.endswith((".input_scale", ".input_global_scale"))]
        if not names:
            continue
        with ShardReader(h, hash_file=False) as r:
            for n in names:
                e = h.entries[n]
                if e.dtype not in ("F32", "BF16", "F16") or len(e.shape) > 1 or (e.shape and e.shape[0] != 1):
                    raise CheckpointError(f"{f}: tensor {n!r} has dtype {e.dtype} shape {list(e.shape)}; expected a scalar fp32 input scale")
                v = r.read(n).float().reshape(())
                if n.endswith(".input_global_scale"):
                    mod, v = n[: -len(".input_global_scale")], 1.0 / v
                else:
                    mod = n[: -len(".input_scale")]
                if not bool(torch.isfinite(v)) or not bool(v > 0):
                    raise CheckpointError(f"{f}: input scale {n!r} is {v.item()}; expected a finite positive value")
                found[mod] = v
    if not found:
        raise CheckpointError(f"{root}: holds no input_scale / input_global_scale tensors; it is not a W4A4 NVFP4 checkpoint")
    missing = [m for m in modules if m not in found]
    if missing:
        raise CheckpointError(f"{root}: no input scale for {missing[0]!r} ({len(missing)} of {len(modules)} modules missing); "
                              "the checkpoints differ in architecture or exclusions")
    return {m: found[m] for m in modules}


def build_jobs(ckpt: Checkpoint, plan: Plan, scheme: str, dialect: str, opts: ConvertOptions) -> list[Job]:
    from .safetensors_io import DTYPES
    jobs = []
    check = not opts.allow_non_finite
    entries = ckpt.tensors
    input_scales = None
    if scheme == "nvfp4":
        if opts.input_mode not in dialects.NVFP4_INPUT_MODES:
            raise QConvertError(f"unknown input-scale mode {opts.input_mode!r}")
        if opts.input_mode == "copied":
            if not opts.input_scales_from:
                raise QConvertError("input mode 'copied' needs --input-scales-from CKPT")
            input_scales = load_input_scales(opts.input_scales_from, [t.module for t in plan.quantized])
    groups: dict[str, list] = {}
    in_layout: set[str] = set()
    if opts.layout:
        from . import layout_jobs
        if opts.layout != "flashinfer-trtllm":
            raise QConvertError(f"unknown layout {opts.layout!r}; the only layout is flashinfer-trtllm")
        layers = layout_jobs.expert_layers(plan)
        if not layers:
            raise QConvertError("--layout flashinfer-trtllm: this model has no MoE experts to pre-shuffle")
        opts._layout_layers = {}
        for prefix, members in layers.items():
            acts = {t.action for t in members}
            lscheme = scheme if acts == {QUANTIZE} else "bf16"
            opts._layout_layers[prefix] = lscheme
            jobs.append(layout_jobs.moe_layer_job(prefix, members, lscheme, opts.engine, opts.tp, opts.ep, opts,
                                                  input_scales, Job))
            in_layout |= {t.name for t in members}
    for name, tp in plan.tensors.items():
        if name in in_layout:
            continue
        if tp.action == KEEP:
            jobs.append(_keep_job(name, DTYPES[entries[name].dtype][0], tp.shape, check))
        elif scheme == "mxfp8":
            jobs.append(_mxfp8_job(tp, dialect, opts.device, check))
        elif scheme == "nvfp4":
            if tp.group:
                groups.setdefault(tp.group, []).append(tp)
            else:
                jobs.append(_nvfp4_group_job([tp], dialect, opts, input_scales, check))
        else:
            raise QConvertError(f"scheme {scheme!r} is not implemented in this version")
    for members in groups.values():
        jobs.append(_nvfp4_group_job(members, dialect, opts, input_scales, check))
    return jobs


# ---- planning output ----------------------------------------------------------------------------

def _nbytes(o: dialects.OutTensor) -> int:
    n = 1
    for d in o.shape:
        n *= d
    return n * o.dtype.itemsize  # (a torch.tensor([]) per output cost 16 us: 0.4 s per 8-layer model)


def plan_rows(ckpt: Checkpoint, plan: Plan, jobs: list[Job]) -> list[PlanRow]:
    entries = ckpt.tensors
    rows = []
    for j in jobs:
        tp = plan.tensors[j.sources[0]]
        rows.append(PlanRow(tp.module or tp.name, tp.action, j.fmt, tp.shape,
                            sum(entries[s].nbytes for s in j.sources), sum(_nbytes(o) for o in j.outputs), tp.reason,
                            tuple(j.sources)))
    return rows


def prepare(src: str, scheme: str, opts: ConvertOptions):
    ckpt = load_checkpoint(src)
    inventory = {n: (e.dtype, e.shape) for n, e in ckpt.tensors.items()}
    plan = build_plan(inventory, ckpt.config, opts.plan, config_path=ckpt.root / "config.json")
    dialect = dialects.resolve_dialect(scheme, opts.dialect)
    jobs = build_jobs(ckpt, plan, scheme, dialect, opts)
    return ckpt, plan, dialect, jobs


# ---- output directory handling ------------------------------------------------------------------

def _lstat(p: Path):
    try:
        return os.lstat(p)
    except FileNotFoundError:
        return None


def _check_not_overlapping(src_root: Path, dst: Path):
    """Refuse a DST that is SRC, lies inside it or contains it, compared on real paths (symlinks
    resolved, on DST and on its parent), with or without --force: replacing DST would delete the
    source, or the conversion would be written into the checkpoint it reads."""
    s = Path(os.path.realpath(src_root))
    for d in {Path(os.path.realpath(dst)), Path(os.path.realpath(dst.parent)) / dst.name}:
        if d == s or s in d.parents or d in s.parents:
            what = "is SRC" if d == s else ("lies inside SRC" if s in d.parents else "contains SRC")
            raise OutputError(f"{dst}: DST {what} ({src_root}); choose a DST outside the source checkpoint "
                              "(--force never replaces or writes into the source)")


def _check_dst(dst: Path, force: bool, src: str | None = None):
    """Every command that writes a DST from a SRC passes here (convert, and so mxfp8, nvfp4, bf16,
    demo; unshuffle). ``src``: the source, checked against DST when it is a local directory (a Hub
    source is checked once resolved, in :func:`_convert`)."""
    if src is not None and Path(src).expanduser().is_dir():
        _check_not_overlapping(Path(src).expanduser(), dst)
    st = _lstat(dst)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{dst}: is a symbolic link; qconvert does not write through or replace links: "
                          "choose another DST")
    if st is not None and not force:
        raise OutputError(f"{dst}: already exists; choose another DST or pass --force to replace it")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{dst}: exists and is not a directory; remove it or choose another DST")
    if st is not None:
        _check_old_free(dst)
    parent = dst.parent
    if not parent.exists():
        raise OutputError(f"{parent}: parent directory of DST does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{parent}: not writable; choose a DST in a writable directory")


def _check_old_free(dst: Path) -> Path:
    """The path an existing DST is moved to while --force installs the new one; nothing may be there."""
    old = dst.parent / f".{dst.name}.qconvert-old-{os.getpid()}"
    if _lstat(old) is not None:
        raise OutputError(f"{old}: already exists (left by an interrupted --force run: the DST it replaced); "
                          "move it away, then rerun")
    return old


def _tmp_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.qconvert-tmp-{os.getpid()}"


def _install(tmp: Path, dst: Path, force: bool = True):
    """Rename the finished directory ``tmp`` into place. Call it holding the writer lock (the rename
    is the last thing done under it). An existing DST (--force) is moved aside first and deleted
    last; if the second rename fails, it is moved back, so a failure never leaves no DST. Nothing
    here follows a symlink: DST and the old-DST path are checked with lstat."""
    st = _lstat(dst)
    old = None
    if st is not None:
        if not force:
            raise OutputError(f"{dst}: appeared while converting (another process?); pass --force to replace it "
                              "or choose another DST")
        if not stat.S_ISDIR(st.st_mode):  # a link or a file put there since _check_dst
            raise OutputError(f"{dst}: is not a directory (a symbolic link?); choose another DST")
        old = _check_old_free(dst)
    try:
        if old is not None:
            os.rename(dst, old)
        os.rename(tmp, dst)
    except BaseException:  # OSError, or Ctrl-C between the renames
        if old is not None and _lstat(dst) is None and _lstat(old) is not None:
            try:
                os.rename(old, dst)
            except OSError as e:
                raise OutputError(f"{dst}: cannot move the finished output into place nor restore the "
                                  f"previous DST ({e.strerror}); the previous DST is in {old}") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # a directory we renamed; rmtree never follows links in it


# ---- the run ------------------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, enabled: bool | None, desc: str):
        self.bar = None
        if enabled is None:
            enabled = os.isatty(2)
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc,
                            dynamic_ncols=True, smoothing=0.1, leave=False)

    def update(self, n: int):
        if self.bar:
            self.bar.update(n)

    def close(self):
        if self.bar:
            self.bar.close()


class _HashingWriter:
    """ShardWriter plus a sha256 of the file, computed while tensors are written. A tensor that
    arrives before its predecessors in the file (its job finished early, e.g. a fused group that
    spans input shards read side by side) is written at once and hashed once they have arrived,
    from the file (page cache), so no tensor is held back in memory."""

    def __init__(self, path: Path, specs, hashed: bool = True):
        self.w = ShardWriter(path, specs)
        self._order = list(self.w.names)
        self._next = 0
        self._early: set[str] = set()
        self._hash = BackgroundSha256(self.w.header_bytes) if hashed else None
        self.closed = False

    def abort(self):
        """Give up on this shard (an error or interrupt): close its file unless :meth:`close` did,
        and end its hash thread, waiting for it, so no thread outlives the conversion."""
        if not self.closed:
            self.closed = True
            self.w.abort()
        if self._hash is not None:
            self._hash.close(wait=True)

    def write(self, name: str, t: torch.Tensor):
        if self._hash is None:
            self.w.write(name, t)
            return
        if self._order[self._next] != name:
            self.w.write(name, t)
            self._early.add(name)
            return
        self.w.write(name, t, before=self._hash.update)  # hashed while being written
        self._next += 1
        while self._next < len(self._order) and self._order[self._next] in self._early:
            early = self._order[self._next]
            self._early.discard(early)
            for chunk in self.w.read_back(early):
                self._hash.update(chunk)
            self._next += 1

    @property
    def complete(self):
        return self.w.complete

    def close(self, fsync: bool) -> str:
        """The shard's sha256, or "" (not recorded) when unhashed."""
        self.closed = True  # the file is closed whether or not this succeeds
        try:
            self.w.close(fsync)
        except BaseException:
            self.abort()
            raise
        if self._hash is None:
            return ""
        if self._next != len(self._order):
            raise AssertionError(f"internal: {self.w.path} closed with {len(self._order) - self._next} tensors unhashed")
        return self._hash.hexdigest()


def convert(src: str, dst: str | os.PathLike | None, scheme: str = "mxfp8",
            opts: ConvertOptions | None = None, log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst``. With ``opts.dry_run`` only plans."""
    opts = opts or ConvertOptions(scheme=scheme)
    log = log or (lambda s: None)
    t0 = time.perf_counter()
    if opts.device != "cpu" and not torch.cuda.is_available():
        raise QConvertError(f"--device {opts.device}: CUDA is not available here; use --device cpu")
    if not opts.dry_run:
        if dst is None:
            raise OutputError("DST is required unless --dry-run")
        dst = Path(dst).expanduser().absolute()
        _check_dst(dst, opts.force, src)
    pickled = _materialize_pickles(src, dst, opts)
    try:
        return _convert(src if pickled is None else str(pickled), src, dst, scheme, opts, t0)
    finally:
        if pickled is not None:
            shutil.rmtree(pickled, ignore_errors=True)


def _materialize_pickles(src: str, dst: Path | None, opts: ConvertOptions) -> Path | None:
    from .checkpoint import pickle_files, pickle_to_safetensors
    if not opts.allow_pickle or not pickle_files(src):
        return None
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="qconvert-pickle-")) if dst is None else dst.parent
    out = base / (f".{dst.name}.qconvert-pickle-src" if dst is not None else "src")
    st = _lstat(out)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{out}: exists and is not a directory (a symbolic link?); qconvert writes its "
                          "safetensors copy of the pickles there: move it away")
    shutil.rmtree(out, ignore_errors=True)
    try:
        return pickle_to_safetensors(src, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _convert(read_src: str, src: str, dst, scheme: str, opts: ConvertOptions, t0: float) -> ConvertResult:
    ckpt, plan, dialect, jobs = prepare(read_src, scheme, opts)
    if read_src != src:
        ckpt.source_id = src  # the manifest names what the user converted, not the safetensors copy
    elif dst is not None and not opts.dry_run:
        # a Hub source, now resolved: its whole repo cache (snapshots/ and the blobs/ they point into)
        root = ckpt.root.resolve().parents[1] if ckpt.revision is not None else ckpt.root
        _check_not_overlapping(root, dst)
    rows = plan_rows(ckpt, plan, jobs)
    bytes_in = sum(r.bytes_in for r in rows)
    bytes_out = sum(r.bytes_out for r in rows)
    result = ConvertResult(None if opts.dry_run else dst, plan, scheme, dialect, rows, bytes_in, bytes_out,
                           notes=list(plan.notes), options=opts)
    if opts.dry_run:
        result.seconds = time.perf_counter() - t0
        return result

    slow = _slow_quantizer_note(scheme, opts.device) if any(j.fmt in ("mxfp8", "nvfp4") for j in jobs) else None
    if slow:
        result.notes.append(slow)
    # Resumable partial dir beside DST (resume.py): kept on output errors and interrupts.
    part = _resume.open_partial(dst, ckpt, scheme, dialect, opts)
    result.notes.extend(part.notes)
    tmp = part.dir
    try:
        input_sha, output_sha = _run(ckpt, plan, jobs, tmp, opts, bytes_in, journal=part)
        _write_metadata(ckpt, plan, jobs, scheme, dialect, tmp, opts, input_sha, output_sha, created=part.created)
        part.finish()
        try:
            _install(tmp, dst, opts.force)  # under the lock: released only once DST is in place
        except (OSError, OutputError) as e:
            part.unfinish()  # the journal back, so that --resume keeps every shard
            if isinstance(e, OutputError):
                raise
            raise OutputError(f"{dst}: cannot move the finished output into place ({e.strerror})") from None
        part.release()
    except OutputError as e:
        part.release()
        raise OutputError(f"{e} [finished shards kept in {tmp}: fix this and rerun with --resume, "
                          "or delete it]") from None
    except KeyboardInterrupt:
        part.release()
        raise
    except BaseException:
        part.discard()
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _run(*args, **kwargs):
    """:func:`_run_threads`, leaving the caller's torch thread count as it was, with Python's
    cyclic garbage collector paused: the conversion makes no reference cycles, and its many
    short-lived objects set off collections that scan the whole heap (3% of a CPU profile)."""
    prev = torch.get_num_threads()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _run_threads(*args, **kwargs)
    finally:
        torch.set_num_threads(prev)
        if gc_was_on:
            gc.enable()


def _run_threads(ckpt: Checkpoint, plan: Plan, jobs: list[Job], tmp: Path, opts: ConvertOptions, bytes_in: int,
                 journal: "_resume.Partial | None" = None):
    # The calling thread runs only small torch ops: one OpenMP fork/join each costs milliseconds
    # on a busy machine (measured: 18 ms per tiny op with 2 threads under load). The heavy work
    # runs on the quantizers' worker threads (CPU_WORKERS), each single-threaded in torch.
    torch.set_num_threads(1)
    shard_of = ckpt.shard_of()
    job_of = {s: j for j in jobs for s in j.sources}
    # output tensor -> output shard: the shard of the source it came from
    specs: list[list] = [[] for _ in ckpt.shards]
    out_shard: dict[str, int] = {}
    entries = ckpt.tensors
    order = {name: (shard_of[name], entries[name].start) for name in entries}
    for j in sorted(jobs, key=lambda j: max(order[s] for s in j.sources)):
        for o, srcname in zip(j.outputs, _source_for_outputs(j)):
            i = shard_of[srcname]
            specs[i].append((o.name, o.dtype, o.shape))
            out_shard[o.name] = i
    # Resume: output shards the journal verified are not rewritten (writer None); only jobs with an
    # output in another shard run, and only input shards holding their sources are read.
    done = journal.done if journal is not None else set()
    writers: list[_HashingWriter | None] = []
    try:
        for i, h in enumerate(ckpt.shards):
            writers.append(None if h.path.name in done else
                           _HashingWriter(tmp / h.path.name, specs[i], opts.output_checksums))
    except BaseException:
        _settle([w.abort for w in writers if w is not None])  # their hash threads end here too
        raise
    needed = {s for j in jobs if any(writers[out_shard[o.name]] is not None for o in j.outputs) for s in j.sources}
    skipped_bytes = sum(e.nbytes for n, e in entries.items() if n not in needed)

    stop = threading.Event()
    errors: list[BaseException] = []
    read_q: queue.Queue = queue.Queue()
    write_q: queue.Queue = queue.Queue(maxsize=64)  # jobs' outputs; memory is bounded by `inflight`
    inflight = [0]  # input bytes read whose outputs are not yet written: bounds memory in flight
    cond = threading.Condition()
    input_sha: dict[str, str] = {}
    # CUDA: the reader thread reads quantizer inputs into page-locked memory and moves them to the
    # device on a side stream, so the transfer overlaps the calling thread's compute; the writer
    # thread copies outputs back, also through page-locked memory (see _to_host).
    side = torch.cuda.Stream(device=opts.device) if opts.device != "cpu" else None
    # the stream the calling thread's kernels run on (a library caller's own, if it set one): the
    # reader's copies are waited for on it, and the writer copies results back on it
    main_stream = torch.cuda.current_stream(opts.device) if side is not None else None
    to_device = {s for j in jobs if j.device_input for s in j.sources} if side is not None else set()

    # Source digests: each shard hashed by reading the file on a thread of its own (HASH_STREAMS
    # at once), so neither the reader nor the writer waits for a digest (one sha256 stream runs
    # at 1.2-1.7 GB/s, slower than the page cache on a many-core host).
    def input_digest(h, known: str | None):
        try:
            name = h.path.name
            if known is None:
                try:
                    known = sha256_file(h.path, cancel=stop)
                except OSError as e:
                    raise CheckpointError(f"{h.path}: cannot read ({e.strerror}); check the file and rerun") from None
                if known is None:  # cancelled
                    return
            input_sha[name] = known  # "": not recorded
            if journal is not None:
                journal.input_done(name, known)
        except BaseException as ex:
            errors.append(ex)
            stop.set()

    def streams():
        """(shard, reader, tensor iterator) for each shard still to read, opened lazily."""
        for h in ckpt.shards:
            only = {n for n in h.entries if n in needed}
            if not only:
                continue
            r = ShardReader(h, hash_file=False, mapped=True, pinned=to_device)
            yield h, r, r.iter_tensors(only if len(only) < len(h.entries) else None)

    def reader():
        # READ_STREAMS shards are read at once, a tensor from each in turn, so that as many output
        # shards fill side by side (their sha256 streams run in parallel).
        active: deque = deque()
        todo = streams()
        try:
            while True:
                while len(active) < READ_STREAMS:
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    active.append(nxt)
                if not active:
                    break
                h, r, it = active.popleft()
                item = next(it, None)
                if item is None:
                    r.close()
                    continue
                active.append((h, r, it))
                e, t = item
                with cond:
                    while inflight[0] > 0 and inflight[0] + e.nbytes > opts.queue_bytes and not stop.is_set():
                        cond.wait(0.2)
                    if stop.is_set():
                        return
                    inflight[0] += e.nbytes
                if e.name in to_device:
                    with torch.cuda.stream(side):
                        t = t.to(opts.device, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(side)
                    t = (t, ev)
                read_q.put((e, t))
        except BaseException as ex:  # surfaced by the main loop
            errors.append(ex)
        finally:
            for _, r, _ in active:
                r.close()
            read_q.put(None)

    output_sha: dict[str, str] = {}
    closers: list[threading.Thread] = []

    def close_output(i: int, w: _HashingWriter):
        try:
            name = ckpt.shards[i].path.name
            output_sha[name] = w.close(opts.fsync)
            if journal is not None:
                journal.output_done(name, output_sha[name], w.w.size)
        except BaseException as ex:
            errors.append(ex)
            stop.set()

    def writer():
        try:
            while True:
                item = write_q.get()
                if item is None:
                    return
                outputs, release = item  # one job's outputs, then its input bytes leave the budget
                for name, t in outputs:
                    if t.device.type != "cpu":
                        with torch.cuda.stream(main_stream):  # after the kernels that made t
                            t = _to_host(t)
                    i = out_shard[name]
                    w = writers[i]
                    w.write(name, t)
                    if w.complete:  # fsync and digest on another thread: the writer goes on
                        ct = threading.Thread(target=close_output, args=(i, w), name="qconvert-output-close", daemon=True)
                        ct.start()
                        closers.append(ct)
                outputs = t = None  # drop the references before waiting for the next job
                with cond:
                    inflight[0] -= release
                    cond.notify()
        except BaseException as ex:
            errors.append(ex)
            stop.set()

    rt = threading.Thread(target=reader, name="qconvert-reader", daemon=True)
    wt = threading.Thread(target=writer, name="qconvert-writer", daemon=True)
    bar = _Progress(bytes_in, opts.progress, "convert")
    bar.update(skipped_bytes)
    waiting: dict[str, torch.Tensor] = {}
    # CPU: small jobs run on job threads, several at once (SMALL_JOB_BYTES); their outputs still
    # reach the writer in job order, so output shards are hashed while written.
    n_job = min(CPU_WORKERS, 32) if opts.device == "cpu" and CPU_WORKERS > 1 else 0
    pool: ThreadPoolExecutor | None = None
    hashers: ThreadPoolExecutor | None = None
    pending: deque = deque()  # (future of outputs, job, input bytes to release, source bytes), in job order

    def emit():
        fut, j, release, nsrc = pending.popleft()
        out = fut.result()
        item = ([(o.name, out[o.name]) for o in j.outputs
                 if writers[out_shard[o.name]] is not None],  # resumed: shard already complete
                release)  # released by the writer once the outputs are written
        del out
        while True:
            try:
                write_q.put(item, timeout=0.2)
                break
            except queue.Full:
                if errors:
                    raise errors[0]
        bar.update(nsrc)

    failed = True  # until the loop below has finished: then threads end by themselves
    try:
        rt.start()
        wt.start()
        if n_job:
            pool = ThreadPoolExecutor(n_job, thread_name_prefix="qconvert-job",
                                      initializer=lambda: setattr(_tls, "workers", 1))
        hashers = ThreadPoolExecutor(HASH_STREAMS, thread_name_prefix="qconvert-input-sha")
        for h in ckpt.shards:
            name = h.path.name
            if journal is not None and name in journal.inputs and not any(n in needed for n in h.entries):
                input_sha[name] = journal.inputs[name]  # resumed and not read again
            elif not opts.source_checksums:
                input_digest(h, "")
            elif (known := hub_cache_sha256(h.path) or local_dir_sha256(h.path)) is not None:
                input_digest(h, known)
            else:
                hashers.submit(input_digest, h, None)
        while True:
            item = read_q.get()
            if item is None:
                break
            if errors:
                break
            if item is _WAKE:  # a job thread finished: write what is done, in job order
                while pending and pending[0][0].done():
                    emit()
                continue
            e, t = item
            if isinstance(t, tuple):  # moved to the device by the reader on the side stream
                t, ev = t
                main_stream.wait_event(ev)
                t.record_stream(main_stream)
            j = job_of[e.name]
            waiting[e.name] = t
            if all(s in waiting for s in j.sources):
                src = {s: waiting.pop(s) for s in j.sources}
                nsrc = sum(x.numel() * x.element_size() for x in src.values())
                if pool is not None and nsrc <= SMALL_JOB_BYTES:
                    fut = pool.submit(j.fn, src)
                    # wakes this loop even when the reader is blocked on the memory budget, which
                    # only the writer (fed from here) can release
                    fut.add_done_callback(lambda _: read_q.put(_WAKE))
                else:
                    fut = Future()
                    fut.set_result(j.fn(src))
                pending.append((fut, j, e.nbytes, nsrc))
                del src
                while pending and (pending[0][0].done() or len(pending) > 2 * n_job):
                    emit()
            else:  # parked until its fused partners arrive: not counted, so partners can be read
                with cond:
                    inflight[0] -= e.nbytes
                    cond.notify()
        while pending and not errors:
            emit()
        if errors:
            raise errors[0]
        if waiting:
            raise CheckpointError(f"tensor {next(iter(waiting))!r}: its fused partners never arrived (internal)")
        failed = False
    finally:
        # Every thread this run started has ended when it returns or raises, whatever happened: a
        # thread still running at interpreter exit aborts the process as it drops a torch tensor
        # ("terminate called without an active exception", exit -6), and one still quantizing
        # writes into freed memory. A Ctrl-C while waiting here is held until they have ended.
        def stop_all():
            if failed:
                stop.set()
                with cond:
                    cond.notify_all()

        def end_writer():
            pending.clear()
            while wt.is_alive():  # a writer that failed leaves the queue as it was: do not wait on it
                try:
                    write_q.put(None, timeout=0.2)
                    break
                except queue.Full:
                    pass
            if wt.ident is not None:
                wt.join()

        def end_closers():
            for ct in closers:
                ct.join()

        def end_reader():
            if rt.ident is not None:
                rt.join()  # it checks `stop` at least every 0.2 s

        def end_hashers():
            if hashers is not None:  # a set stop also ends running digests
                hashers.shutdown(wait=True, cancel_futures=stop.is_set())

        def end_writers():
            if failed or errors:
                for w in writers:
                    if w is not None:
                        w.abort()

        _settle([stop_all, lambda: pool is not None and pool.shutdown(wait=True, cancel_futures=True),
                 end_writer, end_closers, end_reader, end_hashers, bar.close, end_writers])
    if errors:
        raise errors[0]
    if side is not None:  # the reader's copies are done: hand the page-locked buffers back
        side.synchronize()
        _release_pinned()
    try:
        for i, w in enumerate(writers):
            name = ckpt.shards[i].path.name
            if w is None:
                output_sha[name] = journal.outputs[name]["sha256"]
            elif name not in output_sha:
                if w.w.names:
                    raise OutputError(f"{tmp / name}: output shard incomplete (internal)")
                output_sha[name] = w.close(opts.fsync)  # empty shard: header only
                if journal is not None:
                    journal.output_done(name, output_sha[name], w.w.size)
    except BaseException:
        _settle([w.abort for w in writers if w is not None])  # no hash thread outlives the run
        raise
    order = [h.path.name for h in ckpt.shards]  # shard order, whatever order shards finished in
    return {n: input_sha[n] for n in order}, {n: output_sha[n] for n in order}


def _settle(steps: list[Callable[[], object]]) -> None:
    """Run each cleanup step to its end, in order. A KeyboardInterrupt (a second Ctrl-C) during a
    step runs that step again (each is safe to repeat: joins, shutdowns, closes) and is raised
    once every step has finished, so threads are never left running behind the interrupt."""
    interrupted: KeyboardInterrupt | None = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as e:
                interrupted = e
    if interrupted is not None:
        raise interrupted


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into page-locked host memory: 55 GB/s on an H200 host against 5 GB/s
    for ``t.cpu()`` (pageable). torch's caching host allocator reuses the buffer once written."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)
    return h


def _release_pinned():
    """Return the caching host allocator's page-locked buffers to the system (a library caller's
    process goes on after the conversion)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _source_for_outputs(j: Job) -> list[str]:
    """Source name per output: outputs named after a source module stay in that source's shard."""
    out = []
    for o in j.outputs:
        best = j.sources[0]
        for s in j.sources:
            mod = s[: -len(".weight")] if s.endswith(".weight") else s
            if o.name == s or o.name.startswith(mod + "."):
                best = s
                break
        out.append(best)
    return out


def _write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _write_metadata(ckpt: Checkpoint, plan: Plan, jobs: list[Job], scheme: str, dialect: str, tmp: Path,
                    opts: ConvertOptions, input_sha: dict, output_sha: dict, created: str | None = None):
    config = dict(ckpt.config)
    if scheme == "mxfp8":
        qcfg, extra = dialects.mxfp8_quant_config(plan.exclusions, dialect)
    elif scheme == "nvfp4":
        qcfg, extra = dialects.nvfp4_quant_config(plan.exclusions, dialect, opts.input_mode)
    elif scheme == "bf16":
        qcfg, extra = None, {}
    else:
        raise QConvertError(f"scheme {scheme!r} is not implemented in this version")
    if qcfg is not None:
        config["quantization_config"] = qcfg
    _write_json(tmp / "config.json", config)
    for fname, obj in extra.items():
        _write_json(tmp / fname, obj)

    if len(ckpt.shards) > 1:
        weight_map, total = {}, 0
        shard_of = ckpt.shard_of()  # a dict over every tensor: build it once, not per output
        for j in jobs:
            for o, s in zip(j.outputs, _source_for_outputs(j)):
                weight_map[o.name] = ckpt.shards[shard_of[s]].path.name
                total += _nbytes(o)
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total},
                                       "weight_map": dict(sorted(weight_map.items()))})
    for d in ckpt.extra_dirs:  # folders of SRC (sentence-transformers' 1_Pooling/, 2_Normalize/, ...)
        (tmp / d.relative_to(ckpt.root)).mkdir(parents=True, exist_ok=True)
    for p in ckpt.extra_files:  # files of SRC, subfolders too, guarded (checkpoint.extra_members)
        shutil.copy2(p, tmp / p.relative_to(ckpt.root))

    manifest = {
        "qconvert_version": __version__,
        "created": created or _resume.created_timestamp(),
        "scheme": scheme,
        "dialect": dialect,
        "engines": dialects.engines_for(scheme, dialect),
        "source": {"id": ckpt.source_id, "revision": ckpt.revision, "architecture": plan.arch_name,
                   "sha256": {n: d for n, d in input_sha.items() if d},
                   **({} if all(input_sha.values()) else
                      {"sha256_note": "not recorded (--no-checksums)" if not opts.output_checksums
                       else "not recorded (--no-source-checksums)"})},
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts.plan).items()},
        "non_finite_allowed": bool(opts.allow_non_finite),
        "bf16_layers": plan.bf16_layers,
        "exclusions": plan.exclusions,
        "outputs": {"sha256": {n: d for n, d in output_sha.items() if d},
                    **({} if all(output_sha.values()) else {"sha256_note": "not recorded (--no-checksums)"})},
        "tensors": {},
    }
    if scheme == "mxfp8":
        manifest["recipe"] = "rceil"
        manifest["scale_rule"] = MXFP8_SCALE_RULE
        manifest["zero_block_scale_byte"] = 1
        manifest["zero_block_policy"] = MXFP8_ZERO_POLICY
    if scheme == "nvfp4":
        manifest["recipe"] = opts.recipe
        manifest["scale_rule"] = NVFP4_SCALE_RULE[opts.recipe]
        manifest["global_scale"] = ("weight_scale_2 = group amax / 2688 (decode)" if dialect == "modelopt"
                                    else "weight_global_scale = 2688 / group amax (encode)")
        manifest["fused_groups_share_global_scale"] = ["q/k/v", "dense gate/up", "expert gate/up"]
        manifest["activations"] = {"weight-only": "W4A16: no input scales", "unit": "W4A4 with input scale 1.0",
                                   "copied": f"W4A4 with input scales copied from {opts.input_scales_from}"}[opts.input_mode]
    if opts.layout:
        from .layout_jobs import layout_manifest
        manifest["layout"] = layout_manifest(plan, opts._layout_layers, opts.engine, opts.tp, opts.ep)
    for name, tp in plan.tensors.items():
        if tp.module is None:
            continue
        manifest["tensors"][tp.module] = {"format": scheme if tp.action == QUANTIZE else "bf16",
                                          "shape": list(tp.shape), "reason": tp.reason}
    _write_json(tmp / MANIFEST_NAME, manifest)
