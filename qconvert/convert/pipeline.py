"""Compatibility names: the converter's public API as it was importable before the split into
options, kernels, jobs, runner, metadata, destination and conversion (the conversion job)."""

from __future__ import annotations

from ..formats.manifest import MANIFEST_NAME
from .conversion import convert, prepare
from .jobs import BuiltJobs, Job, build_jobs, load_input_scales, plan_rows
from .kernels import CPU_WORKERS, CUDA_QUANTIZERS, HASH_STREAMS, cuda_quantizer
from .options import ConvertOptions, ConvertResult, PlanRow

__all__ = [
    "BuiltJobs",
    "CPU_WORKERS",
    "CUDA_QUANTIZERS",
    "ConvertOptions",
    "ConvertResult",
    "HASH_STREAMS",
    "Job",
    "MANIFEST_NAME",
    "PlanRow",
    "build_jobs",
    "convert",
    "cuda_quantizer",
    "load_input_scales",
    "plan_rows",
    "prepare",
]
