"""On-disk dialects: the config.json ``quantization_config`` and tensor names each engine loads.

MXFP8 (formats.md §4):
  ``auto``     the single dialect both engines' disk loaders accept (§4.1): ``quant_method: mxfp8``,
               ``X.weight_scale`` uint8, the exclusion list under ``ignored_layers`` (vLLM reads only
               this, SGLang prefers it) and ``modules_to_not_convert``.
  ``sglang``   miles-style (§4 A): ``X.weight_scale_inv`` uint8, ``modules_to_not_convert``. SGLang only.
  ``modelopt`` ModelOpt (§4 B): ``quant_method: modelopt``, ``quant_algo: MXFP8``, ``ignore`` and
               ``hf_quant_config.json`` with ``exclude_modules``.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import __version__
from ..errors import PlanError

DIALECTS = {
    "mxfp8": ("auto", "sglang", "modelopt"),
    "nvfp4": ("modelopt", "compressed-tensors"),
    "bf16": ("bf16",),
}
DEFAULT_DIALECT = {"mxfp8": "auto", "nvfp4": "modelopt", "bf16": "bf16"}

PRODUCER = {"name": "qconvert", "version": __version__}


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    role: str  # weight | scale | global_scale | input_scale | bf16


def resolve_dialect(scheme: str, dialect: str | None) -> str:
    d = dialect or DEFAULT_DIALECT[scheme]
    if d == "auto" and scheme != "mxfp8":
        d = DEFAULT_DIALECT[scheme]
    if d not in DIALECTS[scheme]:
        raise PlanError(f"dialect {d!r} is not available for {scheme}; choose one of {', '.join(DIALECTS[scheme])}")
    return d


def mxfp8_out_tensors(module: str, shape: tuple[int, int], dialect: str) -> list[OutTensor]:
    n, k = shape
    scale = "weight_scale_inv" if dialect == "sglang" else "weight_scale"
    return [
        OutTensor(f"{module}.weight", torch.float8_e4m3fn, (n, k), "weight"),
        OutTensor(f"{module}.{scale}", torch.uint8, (n, k // 32), "scale"),
    ]


def mxfp8_quant_config(exclusions: list[str], dialect: str) -> tuple[dict, dict[str, dict]]:
    """(config.json quantization_config, {extra json file name: content})."""
    excl = list(exclusions)
    if dialect == "auto":
        return {
            "quant_method": "mxfp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [1, 32],
            "ignored_layers": excl,
            "modules_to_not_convert": list(excl),
        }, {}
    if dialect == "sglang":
        return {
            "quant_method": "mxfp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [1, 32],
            "modules_to_not_convert": excl,
        }, {}
    if dialect == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "group_size": 32,
            "ignore": excl,
            "producer": dict(PRODUCER),
        }, {"hf_quant_config.json": {
            "producer": dict(PRODUCER),
            "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "group_size": 32,
                             "exclude_modules": list(excl)},
        }}
    raise PlanError(f"unknown MXFP8 dialect {dialect!r}")


def engines_for(scheme: str, dialect: str) -> list[str]:
    """Which engines' disk loaders read this dialect (formats.md §7)."""
    return {
        ("mxfp8", "auto"): ["vllm", "sglang"],
        ("mxfp8", "sglang"): ["sglang"],
        ("mxfp8", "modelopt"): ["vllm", "sglang"],
        ("nvfp4", "modelopt"): ["vllm", "sglang"],
        ("nvfp4", "compressed-tensors"): ["vllm", "sglang"],
        ("bf16", "bf16"): ["vllm", "sglang"],
    }.get((scheme, dialect), [])
