"""One-pass CPU kernels (C, ``cpu_kernels.c``) for the MXFP8 and NVFP4 block quantizers.

The torch op chains in ``mxfp8.py`` / ``nvfp4.py`` define the bytes, but on CPU they cost ~12-20
whole-chunk torch ops per cache-sized chunk, each a pass over memory plus Python dispatch under
the GIL. The C loops read each element once, keep a block in registers, and run without the GIL,
so the quantizer's worker threads scale with cores. They give the same bytes as the torch chains
on every BF16 bit pattern (``tests/test_cpu_kernels.py``, in CI), and every oracle test of
``mxfp8_quantize`` / ``nvfp4_quantize`` on CPU runs through them.

The C file is built at first use with the system C compiler (``$CC``, else ``cc``/``gcc``/
``clang``) into a cache directory (``$QCONVERT_CACHE_DIR``, else ``~/.cache/qconvert``), keyed by
the source, the compiler and the machine, and loaded with ctypes. Without a compiler, or with
``QCONVERT_CPU_KERNELS=0``, the torch chains run instead (same bytes, slower).

A fresh build is used only after it passed a self-check against the torch chains (every finite
BF16 pattern and wide-range FP32, MXFP8 and the three NVFP4 recipes, vector and portable loops): a
compiler that miscompiles the loops for this CPU (GCC 12 did, once, with AVX-512) must not write
wrong bytes. A -march=native build that fails it is rebuilt for the baseline ISA; a build that
still fails is not used, and :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from .pool import run_chunks

_SRC = Path(__file__).with_name("cpu_kernels.c")
#: No fast-math, no contraction into FMA: each float operation is one IEEE fp32 operation (the
#: vector instructions of -march=native included). The build is keyed by this CPU's features.
_CFLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_NATIVE = ["-march=native"]
_KIND = {torch.bfloat16: 0, torch.float32: 1}
_state: dict = {}
_lock = threading.Lock()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dir() -> Path:
    d = os.environ.get("QCONVERT_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qconvert"


def _cpu_id() -> bytes:
    """This CPU's model and feature flags: a cache shared by several machines (an NFS home) must
    not hand a -march=native build to a CPU without those instructions."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith((b"model name", b"flags", b"Features"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return (platform.machine() + platform.processor()).encode()


def _build() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not); (library, why) where the baseline build runs because the
    -march=native one could not be built or failed the self-check."""
    if os.environ.get("QCONVERT_CPU_KERNELS", "1") == "0":
        return None, "disabled by QCONVERT_CPU_KERNELS=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC)"
    src = _SRC.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc}: {e}"
    key = hashlib.sha256(src + version + " ".join(_CFLAGS + _NATIVE).encode() + _cpu_id()).hexdigest()[:16]
    why = ""
    for extra in (_NATIVE, []):  # the baseline ISA: a compiler without -march=native, or a failed check
        out = _cache_dir() / f"cpu_kernels-{key}{'' if extra else '-baseline'}.so"
        rejected = out.with_suffix(".rejected")
        if rejected.exists():
            why = rejected.read_text().strip()
            continue
        if not out.exists():
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
                os.close(fd)
                r = subprocess.run(
                    [cc, *_CFLAGS, *extra, str(_SRC), "-o", tmp], capture_output=True, text=True, timeout=300
                )
                if r.returncode:
                    os.unlink(tmp)
                    why = f"{cc} failed: {(r.stderr or r.stdout).strip()[:300]}"
                    continue
                lib, load_why = _load(tmp)
                if lib is None:
                    os.unlink(tmp)
                    return None, load_why
                bad = _self_check(lib)
                if bad:
                    os.unlink(tmp)
                    why = (
                        f"the {' '.join(extra) or 'baseline'} build by {cc} failed the self-check against "
                        f"the torch chains ({bad})"
                    )
                    _write_atomic(rejected, why)
                    continue
                os.replace(tmp, out)  # atomic: concurrent builders each leave a complete, checked file
                return lib, why
            except (OSError, subprocess.SubprocessError) as e:
                return None, f"cannot build {out}: {e}"
        lib, load_why = _load(str(out))
        return lib, (why if lib is not None else load_why)
    return None, why


def _write_atomic(path: Path, text: str):
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _load(path: str) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.qc_mxfp8.argtypes = [p, i, i64, i64, p, p]
    lib.qc_mxfp8.restype = None
    lib.qc_nvfp4.argtypes = [p, i, i64, i64, i, f, f, i, p, p]
    lib.qc_nvfp4.restype = None
    lib.qc_nvfp4_4over6.argtypes = [p, i, i64, i64, f, f, f, p, p]
    lib.qc_nvfp4_4over6.restype = None
    lib.qc_absmax_bits.argtypes = [p, i, i64, i64]
    lib.qc_absmax_bits.restype = ctypes.c_uint32
    lib.qc_avx2.argtypes = []
    lib.qc_avx2.restype = ctypes.c_int
    lib.qc_decode_stats.argtypes = [p, i, i64, i64, i, i, p, p, p, p, f, f, f, p, p, p, p]
    lib.qc_decode_stats.restype = None
    lib.qc_mxfp8_to_bf16.argtypes = [p, p, i64, i64, p]
    lib.qc_mxfp8_to_bf16.restype = None
    lib.qc_nvfp4_to_bf16.argtypes = [p, p, p, i64, i64, i64, p]
    lib.qc_nvfp4_to_bf16.restype = None
    return lib, ""


def _self_check_inputs() -> list[tuple[str, torch.Tensor]]:
    """Every finite BF16 pattern (sorted, so blocks of tiny values meet zero block scales, and
    shuffled), and FP32 over the whole exponent range with subnormals and zeros."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf = bits[torch.isfinite(bits.float())]  # 65280 values: a whole number of 32-blocks
    g = torch.Generator().manual_seed(0)
    shuffled = bf[torch.randperm(bf.numel(), generator=g)]
    f32 = torch.randn(32 * 256, generator=g) * torch.exp2(torch.randint(-149, 127, (32 * 256,), generator=g).float())
    f32[::97] = 0.0
    return [("bf16 sorted", bf.contiguous()), ("bf16 shuffled", shuffled), ("fp32", f32)]


def _loop_paths():
    """Yield "vector", then "portable" with ``QCONVERT_NO_AVX2`` set (the C code reads it at each
    call); the caller's setting is restored afterwards."""
    saved = os.environ.get("QCONVERT_NO_AVX2")
    try:
        os.environ.pop("QCONVERT_NO_AVX2", None)
        yield "vector"
        os.environ["QCONVERT_NO_AVX2"] = "1"
        yield "portable"
    finally:
        if saved is None:
            os.environ.pop("QCONVERT_NO_AVX2", None)
        else:
            os.environ["QCONVERT_NO_AVX2"] = saved


def _self_check(lib: ctypes.CDLL) -> str:
    """ "" if ``lib`` gives the torch chains' bytes on :func:`_self_check_inputs`, else what differed.
    Runs the kernels directly (the library is not installed yet), through both the vector and the
    portable loops; each expected result is computed once."""
    from . import mxfp8, nvfp4

    for name, x in _self_check_inputs():
        kind = _KIND[x.dtype]
        xb = x.view(-1, mxfp8.MXFP8_BLOCK)
        q_ref = torch.empty(xb.shape, dtype=torch.float8_e4m3fn)
        s_ref = torch.empty(xb.shape[0], dtype=torch.uint8)
        mxfp8.quantize_cpu_chain(xb, q_ref, s_ref, 1)
        q, s = torch.empty(xb.shape, dtype=torch.uint8), torch.empty(xb.shape[0], dtype=torch.uint8)
        for path in _loop_paths():
            lib.qc_mxfp8(xb.data_ptr(), kind, 0, xb.shape[0], q.data_ptr(), s.data_ptr())
            if not (torch.equal(q, q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
                return f"MXFP8, {name}, {path} loops"
        xb = x.view(-1, nvfp4.NVFP4_BLOCK)
        amax = float(x.float().abs().max())
        pk, sc = torch.empty(xb.shape[0], 8, dtype=torch.uint8), torch.empty(xb.shape[0], dtype=torch.uint8)
        for recipe in ("te", "modelopt", "4over6"):
            for gv in (amax, amax * 2.0**-40, 2688.0):
                g = np.float32(gv)
                gt = torch.tensor(g, dtype=torch.float32)
                pk_ref = torch.empty(xb.shape[0], 8, dtype=torch.uint8)
                sc_ref = torch.empty(xb.shape[0], dtype=torch.float8_e4m3fn)
                nvfp4.quantize_cpu_chain(xb, gt, nvfp4.recipe_scale_2(gt, recipe), recipe, pk_ref, sc_ref, 1)
                _, k0, k1 = nvfp4.cpu_tensor_scalars(g, recipe)
                for path in _loop_paths():
                    if recipe == "4over6":
                        args = (float(k0), float(k1), float(g), pk.data_ptr(), sc.data_ptr())
                        lib.qc_nvfp4_4over6(xb.data_ptr(), kind, 0, xb.shape[0], *args)
                    else:
                        args = (int(recipe == "te"), float(k0), float(k1), int(g == 0), pk.data_ptr(), sc.data_ptr())
                        lib.qc_nvfp4(xb.data_ptr(), kind, 0, xb.shape[0], *args)
                    if not (torch.equal(pk, pk_ref) and torch.equal(sc, sc_ref.view(torch.uint8))):
                        return f"NVFP4 {recipe}, {name}, global amax {gv:g}, {path} loops"
    # MXFP8 -> BF16: every code under every scale byte
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).view(-1, 32)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(8)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    want = mxfp8_to_bf16_reference(q, s).view(torch.int16)
    for path in _loop_paths():
        lib.qc_mxfp8_to_bf16(q.data_ptr(), s.data_ptr(), 0, s.numel(), out.data_ptr())
        if not torch.equal(out.view(torch.int16), want):
            return f"MXFP8 to BF16, every code and scale, {path} loops"
    # NVFP4 -> BF16: every pair of codes under every scale byte, rows with their own global scales
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).view(-1, 8)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(32)
    g = torch.tensor([1.0, 0.37, 2.0**-20, 3.0e5], dtype=torch.float32).repeat(256)
    want = nvfp4_to_bf16_reference(q, s, g.repeat_interleave(8)).view(torch.int16)
    out = torch.empty(q.shape[0], 16, dtype=torch.bfloat16)
    for path in _loop_paths():
        lib.qc_nvfp4_to_bf16(q.data_ptr(), s.data_ptr(), g.data_ptr(), 8, 0, s.numel(), out.data_ptr())
        if not torch.equal(out.view(torch.int16), want):
            return f"NVFP4 to BF16, every code pair and scale, {path} loops"
    return ""


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None where they cannot be built (see :func:`status`)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _build()
        return _state["lib"]


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    return None if library() is not None else _state["why"]


def baseline_reason() -> str | None:
    """Why the kernels run as a baseline-ISA build (no -march=native: slower loops), or None."""
    if library() is None:
        return None
    return _state["why"] or None


def status() -> str:
    """ "compiled C" (with why, for a baseline-ISA build) or why the torch chains are used on CPU."""
    why = unavailable_reason()
    if why is not None:
        return f"torch op chains ({why})"
    base = baseline_reason()
    return "compiled C" if base is None else f"compiled C, baseline ISA ({base})"


def avx2() -> bool:
    """True where the AVX2 loops for BF16 MXFP8 and NVFP4 (every recipe) are compiled in. They run
    unless ``QCONVERT_NO_AVX2`` is set (read at each call), which gives the portable loops: same
    bytes, slower (tests run both)."""
    lib = library()
    return lib is not None and bool(lib.qc_avx2())


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _KIND and x.is_contiguous() and library() is not None


def abs_max_f32(x: torch.Tensor, workers: int) -> np.float32:
    """``max |x|`` of a contiguous BF16/FP32 CPU tensor as a numpy fp32 scalar, exactly (NaN if any
    element is NaN), on ``workers`` threads."""
    lib = library()
    kind = _KIND[x.dtype]
    xp = x.data_ptr()
    bits = max(run_chunks(lambda i0, i1: lib.qc_absmax_bits(xp, kind, i0, i1), x.numel(), workers, 1 << 20), default=0)
    return np.uint32(bits).view(np.float32)  # bits <= 0x7FFFFFFF: the sign is clear


def abs_max(x: torch.Tensor, workers: int) -> torch.Tensor:
    """:func:`abs_max_f32` as an fp32 0-dim tensor."""
    return torch.tensor(abs_max_f32(x, workers), dtype=torch.float32)


def mxfp8_into(xb: torch.Tensor, q: torch.Tensor, s: torch.Tensor, workers: int) -> None:
    """Quantize contiguous blocks ``xb [n, 32]`` (BF16 or FP32, CPU) into e4m3 ``q [n, 32]`` and
    uint8 ``s [n]``: the bytes of :func:`mxfp8.mxfp8_quantize`."""
    lib = library()
    kind = _KIND[xb.dtype]
    xp, qp, sp = xb.data_ptr(), q.data_ptr(), s.data_ptr()
    run_chunks(lambda b0, b1: lib.qc_mxfp8(xp, kind, b0, b1, qp, sp), xb.shape[0], workers)


def mxfp8_to_bf16_into(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, workers: int) -> None:
    """BF16 values of contiguous MXFP8 blocks ``q [n, 32]`` (uint8 or e4m3 bytes) with uint8 E8M0
    ``s [n]`` into contiguous BF16 ``out [n, 32]``: ``(q.float() * exp2(s - 127.0)).to(bfloat16)``
    bit for bit, NaN written 0xFFFF (``qc_mxfp8_to_bf16`` in ``cpu_kernels.c``)."""
    lib = library()
    qp, sp, op = q.data_ptr(), s.data_ptr(), out.data_ptr()
    run_chunks(lambda b0, b1: lib.qc_mxfp8_to_bf16(qp, sp, b0, b1, op), s.numel(), workers, 1 << 12)


def mxfp8_to_bf16_reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The torch definition :func:`mxfp8_to_bf16_into` computes (blocks ``q [n, 32]``, ``s [n]``)."""
    x = q.view(torch.float8_e4m3fn).to(torch.float32) * torch.exp2(s.to(torch.float32) - 127.0).unsqueeze(-1)
    out = x.to(torch.bfloat16)
    out.view(torch.int16)[torch.isnan(x)] = -1  # 0xFFFF, whichever conversion loop torch took
    return out


def nvfp4_to_bf16_into(q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, out: torch.Tensor, workers: int) -> None:
    """BF16 values of contiguous NVFP4 blocks ``q [n, 8]`` (two E2M1 codes a byte, the low nibble
    first) with E4M3 scale bytes ``s [n]`` and fp32 per-tensor scales ``g [r]`` (block b takes
    ``g[b // (n // r)]``: one per row, or one for all) into contiguous BF16 ``out [n, 16]``:
    :func:`nvfp4_to_bf16_reference` bit for bit (``qc_nvfp4_to_bf16`` in ``cpu_kernels.c``)."""
    lib = library()
    n = s.numel()
    if g.dtype != torch.float32 or not g.is_contiguous() or g.numel() == 0 or n % g.numel():
        raise ValueError(f"{n} blocks cannot share {g.numel()} per-tensor scales evenly")
    bpr = n // g.numel()
    qp, sp, gp, op = q.data_ptr(), s.data_ptr(), g.data_ptr(), out.data_ptr()
    run_chunks(lambda b0, b1: lib.qc_nvfp4_to_bf16(qp, sp, gp, bpr, b0, b1, op), n, workers, 1 << 12)


def nvfp4_to_bf16_reference(q: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The torch definition :func:`nvfp4_to_bf16_into` computes, for blocks ``q [n, 8]``, ``s [n]``
    and one fp32 per-tensor scale per block ``g [n]``: the E2M1 value times the fp32 product of the
    E4M3 scale and ``g``, rounded to BF16, NaN written 0xFFFF."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
    codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], 16).to(torch.int64)
    vals = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    sc = s.view(torch.float8_e4m3fn).to(torch.float32) * g
    x = vals * sc.unsqueeze(-1)
    out = x.to(torch.bfloat16)
    out.view(torch.int16)[torch.isnan(x)] = -1
    return out


def nvfp4_into(
    xb: torch.Tensor,
    te: bool,
    k0: float,
    k1: float,
    g_zero: bool,
    packed: torch.Tensor,
    scale: torch.Tensor,
    workers: int,
) -> None:
    """Quantize contiguous blocks ``xb [n, 16]`` into ``packed [n, 8]`` and e4m3 ``scale [n]``
    with the per-tensor factors of the recipe (see ``cpu_kernels.c``)."""
    lib = library()
    kind = _KIND[xb.dtype]
    xp, pp, sp = xb.data_ptr(), packed.data_ptr(), scale.data_ptr()
    te_i, gz = int(bool(te)), int(bool(g_zero))
    run_chunks(lambda b0, b1: lib.qc_nvfp4(xp, kind, b0, b1, te_i, k0, k1, gz, pp, sp), xb.shape[0], workers)


def nvfp4_4over6_into(
    xb: torch.Tensor, s_enc: float, s_dec: float, g: float, packed: torch.Tensor, scale: torch.Tensor, workers: int
) -> None:
    """The 4over6 recipe (``qc_nvfp4_4over6``) on contiguous blocks ``xb [n, 16]`` into ``packed
    [n, 8]`` and e4m3 ``scale [n]``, with TE's ``S_enc``, ``S_dec`` and the global amax ``g``."""
    lib = library()
    kind = _KIND[xb.dtype]
    xp, pp, sp = xb.data_ptr(), packed.data_ptr(), scale.data_ptr()
    run_chunks(lambda b0, b1: lib.qc_nvfp4_4over6(xp, kind, b0, b1, s_enc, s_dec, g, pp, sp), xb.shape[0], workers)


def decode_stats(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    elem_lut: torch.Tensor,
    scale_lut: torch.Tensor,
    s2: float,
    bound: float,
    atol: float,
    block: int,
    nibbles: bool,
    workers: int,
) -> tuple[float, float, bool, float, int]:
    """Error statistics of an encoded tensor against its source ``x`` (contiguous BF16/FP32 CPU) in
    one pass, no decoded copy: ``(sum x^2, sum err^2, any decoded value non-finite, worst block
    ratio, first block with ratio > 1 or -1)``; see ``qc_decode_stats`` in ``cpu_kernels.c``.
    ``codes``: uint8, one per element or (``nibbles``) two; ``scales``: uint8, one per block;
    ``elem_lut`` (16 or 256) and ``scale_lut`` (256): fp32 decode tables."""
    lib = library()
    kind = _KIND[x.dtype]
    n = x.numel() // block
    elut = elem_lut.to(torch.float32).contiguous()
    slut = scale_lut.to(torch.float32).contiguous()
    ptrs = (x.data_ptr(), codes.data_ptr(), scales.data_ptr(), elut.data_ptr(), slut.data_ptr())

    def run(b0, b1):
        sums = np.zeros(2, dtype=np.float64)
        nonfinite, worst, first = ctypes.c_int32(0), ctypes.c_float(0.0), ctypes.c_int64(-1)
        lib.qc_decode_stats(
            ptrs[0],
            kind,
            b0,
            b1,
            block,
            int(nibbles),
            ptrs[1],
            ptrs[2],
            ptrs[3],
            ptrs[4],
            s2,
            bound,
            atol,
            sums.ctypes.data,
            ctypes.byref(nonfinite),
            ctypes.byref(worst),
            ctypes.byref(first),
        )
        return float(sums[0]), float(sums[1]), bool(nonfinite.value), worst.value, first.value

    parts = run_chunks(run, n, workers, 1 << 12)
    firsts = [p[4] for p in parts if p[4] >= 0]
    return (
        sum(p[0] for p in parts),
        sum(p[1] for p in parts),
        any(p[2] for p in parts),
        max((p[3] for p in parts), default=0.0),
        firsts[0] if firsts else -1,
    )
