"""Which quantizer core runs a job, and on how many threads: the CPU C kernels or torch chains,
the CUDA Triton kernels, eager chains or their ``torch.compile``; one-pass NaN/Inf checks.

Every choice here gives the same bytes; only the speed differs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from ..errors import QConvertError
from .numerics import cpu_kernels

#: Worker threads for CPU quantization (all cores; the reader and writer threads mostly wait on I/O).
CPU_WORKERS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))

#: CPU jobs whose sources are at most this many bytes run whole on job threads, one per core, each
#: quantizing single-threaded; larger ones run on the calling thread split over all cores. A 3 MB
#: expert split over the cores spends about as long in Python dispatch as in the kernel, and with
#: every dispatch on one thread the cores wait (on 2 cores a conversion kept only 1.4 of them busy).
SMALL_JOB_BYTES = 64 << 20

#: Input shards read at once (see Runner.reader): one per 4 cores, at most 4.
READ_STREAMS = min(4, max(1, CPU_WORKERS // 4))

#: Source shards hashed at once (see Runner.input_digest): one per 4 cores, at most 8.
HASH_STREAMS = min(8, max(1, CPU_WORKERS // 4))

_tls = threading.local()


def workers() -> int:
    """Quantizer threads for the current thread's job: all cores (``CPU_WORKERS``, read at each
    call), or one on a job thread (see :func:`single_threaded_job_thread`)."""
    return getattr(_tls, "workers", CPU_WORKERS)


def single_threaded_job_thread() -> None:
    """Initializer of a job thread: its jobs quantize on that thread alone."""
    _tls.workers = 1


def all_finite(t: torch.Tensor) -> bool:
    """True unless ``t`` holds NaN or +-Inf: one pass, no temporary the size of ``t`` (about 50x
    faster on CPU than ``isfinite(t).all()``)."""
    return bool(torch.isfinite(abs_max(t)))


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """``t.abs().amax()`` exactly (NaN propagates): on CPU the C kernel's bit-pattern maximum on the
    worker threads (the calling thread dispatches every job, so its time is on the critical path),
    else one min/max pass without a |t| copy."""
    if t.device.type == "cpu" and t.numel():
        if cpu_kernels.usable(t):
            return cpu_kernels.abs_max(t, workers())
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.abs(), hi.abs())


#: CUDA quantizer cores: "triton" (one-pass kernels, the default where Triton imports), "eager"
#: (the torch op chains) or "compile" (torch.compile of the chains). All give the same bytes.
CUDA_QUANTIZERS = ("triton", "eager", "compile")


def cuda_quantizer(device: str) -> str:
    """Which CUDA core the pipeline uses, from QCONVERT_CUDA_QUANTIZER (QCONVERT_COMPILE=1 is the
    older spelling of "compile"). Compiling is opt-in: it compiles once per tensor shape, which
    cost a whole conversion 3.6-5x the I/O floor on an H200
    (docs/benchmarks-history.md#earlier-run-2026-12-02-one-pass-triton-kernels-the-pipelines-cuda-default)."""
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


def blocks_fn(scheme: str, device: str):
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


def stacked_blocks_fn(scheme: str, device: str):
    """The one-launch quantizer core for a stack of tensors with a global amax each (NVFP4,
    ``nvfp4.nvfp4_quantize_stacked``): the Triton kernel where :func:`blocks_fn` would give the
    Triton kernel, else None (the op chains run, per block)."""
    if device == "cpu" or scheme != "nvfp4" or cuda_quantizer(device) != "triton":
        return None
    from .numerics import cuda_kernels

    return cuda_kernels.nvfp4_blocks_stacked


def slow_quantizer_note(scheme: str, device: str) -> str | None:
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


def settle(steps: list[Callable[[], object]]) -> None:
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
