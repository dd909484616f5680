"""On-disk dialects: the config.json ``quantization_config`` and tensor names each engine loads.

MXFP8 (docs/formats.md#mxfp8-dialects):
  ``auto``     the single dialect both engines' disk loaders accept (docs/formats.md#why-auto-loads-in-both): ``quant_method: mxfp8``,
               ``X.weight_scale`` uint8, the exclusion list under ``ignored_layers`` (vLLM reads only
               this, SGLang prefers it) and ``modules_to_not_convert``.
  ``sglang``   miles-style (docs/formats.md#mxfp8-dialects): ``X.weight_scale_inv`` uint8, ``modules_to_not_convert``. SGLang only.
  ``modelopt`` ModelOpt (docs/formats.md#the-modelopt-dialect): ``quant_method: modelopt``, ``quant_algo: MXFP8``, ``ignore`` and
               ``hf_quant_config.json`` with ``exclude_modules``.
NVFP4 (docs/formats.md#nvfp4):
  ``modelopt``            ``X.weight`` uint8 [N, K/2], ``X.weight_scale`` e4m3 [N, K/16],
                          ``X.weight_scale_2`` fp32 [] (amax/2688, decode), ``X.input_scale`` fp32 [];
                          ``quant_method: modelopt``, ``quant_algo: NVFP4`` (W4A4) or ``W4A16_NVFP4`` (weight-only), ``ignore``.
  ``compressed-tensors``  ``X.weight_packed``, ``X.weight_scale``, ``X.weight_global_scale`` fp32 [1]
                          (2688/amax, encode), ``X.input_global_scale`` fp32 [1]; ``config_groups``,
                          ``format: nvfp4-pack-quantized``, ``ignore`` (exact names or ``re:``).
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
    # SGLang's Fp8Config needs activation_scheme and reads weight_block_size / scale_fmt.
    sglang_keys = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                   "weight_block_size": [1, 32]}
    if dialect == "auto":  # vLLM reads only ignored_layers, SGLang prefers it: both keys, one list
        return {**sglang_keys, "ignored_layers": excl, "modules_to_not_convert": list(excl)}, {}
    if dialect == "sglang":
        return {**sglang_keys, "modules_to_not_convert": excl}, {}
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


NVFP4_INPUT_MODES = ("weight-only", "unit", "copied")


def nvfp4_out_tensors(module: str, shape: tuple[int, int], dialect: str, input_mode: str) -> list[OutTensor]:
    n, k = shape
    if dialect == "modelopt":
        out = [OutTensor(f"{module}.weight", torch.uint8, (n, k // 2), "weight"),
               OutTensor(f"{module}.weight_scale", torch.float8_e4m3fn, (n, k // 16), "scale"),
               OutTensor(f"{module}.weight_scale_2", torch.float32, (), "global_scale")]
        if input_mode != "weight-only":
            out.append(OutTensor(f"{module}.input_scale", torch.float32, (), "input_scale"))
        return out
    if dialect == "compressed-tensors":
        out = [OutTensor(f"{module}.weight_packed", torch.uint8, (n, k // 2), "weight"),
               OutTensor(f"{module}.weight_scale", torch.float8_e4m3fn, (n, k // 16), "scale"),
               OutTensor(f"{module}.weight_global_scale", torch.float32, (1,), "global_scale")]
        if input_mode != "weight-only":
            out.append(OutTensor(f"{module}.input_global_scale", torch.float32, (1,), "input_scale"))
        return out
    raise PlanError(f"unknown NVFP4 dialect {dialect!r}")


def _fp4_args(dynamic) -> dict:
    return {"dynamic": dynamic, "num_bits": 4, "type": "float", "group_size": 16}


def ct_ignore(exclusions: list[str]) -> list[str]:
    """compressed-tensors matches exact names or ``re:`` regexes (re.match): a whole-layer
    ``model.layers.{i}.`` entry becomes an anchored regex, everything else stays exact."""
    import re as _re
    return [f"re:^{_re.escape(e)}" if e.endswith(".") else e for e in exclusions]


def nvfp4_quant_config(exclusions: list[str], dialect: str, input_mode: str) -> tuple[dict, dict[str, dict]]:
    """(config.json quantization_config, extra json files). ``input_mode``: weight-only (W4A16),
    unit or copied (W4A4 with static input scales)."""
    excl = list(exclusions)
    w4a16 = input_mode == "weight-only"
    if dialect == "modelopt":
        qc = {
            "quant_method": "modelopt",
            # weight-only: the ModelOpt algo that both pinned engines read as W4A16 (SGLang would
            # otherwise run W4A4 with a default input scale), docs/formats.md#nvfp4-modelopt-dialect
            "quant_algo": "W4A16_NVFP4" if w4a16 else "NVFP4",
            "group_size": 16,
            "kv_cache_scheme": None,
            "ignore": excl,
            "producer": dict(PRODUCER),
            "config_groups": {"group_0": {"weights": _fp4_args(False),
                                          "input_activations": None if w4a16 else _fp4_args(False),
                                          "targets": ["Linear"]}},
        }
        extra = {}
        if not w4a16:
            # Only for W4A4: an hf_quant_config.json cannot say "weights only" to every reader, and
            # vLLM and SGLang both take config.json's quantization_config first.
            extra["hf_quant_config.json"] = {
                "producer": dict(PRODUCER),
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": list(excl)},
            }
        return qc, extra
    if dialect == "compressed-tensors":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                   "symmetric": True, "dynamic": False, "observer": "minmax", "actorder": None,
                   "block_structure": None, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
        inputs = None if w4a16 else {**weights, "dynamic": "local", "observer": "static_minmax"}
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "kv_cache_scheme": None,
            "ignore": ct_ignore(excl),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs, "output_activations": None,
                                          "format": "nvfp4-pack-quantized"}},
            "producer": dict(PRODUCER),
        }, {}
    raise PlanError(f"unknown NVFP4 dialect {dialect!r}")


def engines_for(scheme: str, dialect: str) -> list[str]:
    """Which engines' disk loaders read this dialect (docs/formats.md#compatibility)."""
    return {
        ("mxfp8", "auto"): ["vllm", "sglang"],
        ("mxfp8", "sglang"): ["sglang"],
        ("mxfp8", "modelopt"): ["vllm", "sglang"],
        ("nvfp4", "modelopt"): ["vllm", "sglang"],
        ("nvfp4", "compressed-tensors"): ["vllm", "sglang"],
        ("bf16", "bf16"): ["vllm", "sglang"],
    }.get((scheme, dialect), [])
