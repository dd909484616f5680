"""Exclusion lists: where each dialect keeps the list, the entry forms, and each engine's matcher.

The list qconvert writes uses only entry forms that mean the same under SGLang's dotted-path
matcher and vLLM's substring + fnmatch matcher (docs/formats.md#exclusion-entry-forms);
compressed-tensors takes exact names or ``re:`` regexes. The matchers below are how each engine
reads a list (docs/formats.md#exclusion-matchers): ``verify`` and the tests use them, and the
tests hold them to the engines' own code. Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

# ---- keys ---------------------------------------------------------------------------------------

#: config.json ``quantization_config`` keys that hold an exclusion list
IGNORED_LAYERS = "ignored_layers"  # vLLM's MXFP8 config reads only this; SGLang prefers it
MODULES_TO_NOT_CONVERT = "modules_to_not_convert"  # SGLang Fp8Config / miles
IGNORE = "ignore"  # ModelOpt and compressed-tensors
#: ModelOpt's ``hf_quant_config.json`` ``quantization`` key
EXCLUDE_MODULES = "exclude_modules"

#: where each (scheme, dialect) keeps its list in config.json's quantization_config; also the
#: dialects qconvert only reads (mxfp8 flat, fp8, fp8-block deepseek and compressed-tensors)
EXCLUSION_KEYS = {
    ("mxfp8", "auto"): (IGNORED_LAYERS, MODULES_TO_NOT_CONVERT),
    ("mxfp8", "sglang"): (MODULES_TO_NOT_CONVERT,),
    ("mxfp8", "flat"): (IGNORED_LAYERS,),
    ("mxfp8", "modelopt"): (IGNORE,),
    ("mxfp8", "compressed-tensors"): (IGNORE,),
    ("nvfp4", "modelopt"): (IGNORE,),
    ("nvfp4", "compressed-tensors"): (IGNORE,),
    ("fp8", "modelopt"): (IGNORE,),
    ("fp8", "compressed-tensors"): (IGNORE,),
    ("fp8-block", "deepseek"): (MODULES_TO_NOT_CONVERT,),
    ("fp8-block", "compressed-tensors"): (IGNORE,),
    ("mxfp4", "gpt-oss"): (MODULES_TO_NOT_CONVERT,),
}

#: keys under which a reader finds the list, per quant_method family (inspect's detection)
MXFP8_READ_KEYS = (IGNORED_LAYERS, MODULES_TO_NOT_CONVERT)
MODELOPT_READ_KEYS = (IGNORE, EXCLUDE_MODULES, MODULES_TO_NOT_CONVERT)
COMPRESSED_TENSORS_READ_KEYS = (IGNORE,)
FP8_READ_KEYS = (MODULES_TO_NOT_CONVERT, IGNORED_LAYERS)
#: the first of these a quantization_config holds is its list (reload compatibility compares it)
ANY_LIST_KEYS = (IGNORE, EXCLUDE_MODULES, MODULES_TO_NOT_CONVERT)
#: every key that holds a list
ALL_KEYS = (IGNORED_LAYERS, MODULES_TO_NOT_CONVERT, IGNORE, EXCLUDE_MODULES)


def config_where(key: str) -> str:
    """Where a config.json exclusion list lives, as :attr:`Detection.exclusion_keys` names it (and
    ``verify`` and ``inspect`` print it)."""
    return f"config.json quantization_config.{key}"


def first_list(qc: dict) -> list[str] | None:
    """The exclusion list of a quantization_config (the first of :data:`ANY_LIST_KEYS` present), sorted."""
    for k in ANY_LIST_KEYS:
        if k in qc:
            return sorted(qc[k] or [])
    return None


# ---- forms --------------------------------------------------------------------------------------

CT_REGEX_PREFIX = "re:"


def whole_layer_entry(layers_prefix: str, layer: int) -> str:
    """A whole BF16 layer: ``model.layers.{i}.`` (the trailing dot keeps ``layers.1.`` from matching
    ``layers.10``; docs/formats.md#exclusion-entry-forms)."""
    return f"{layers_prefix}.{layer}."


def experts_entry(expert_module: str) -> str:
    """A BF16 MoE layer's experts module (``...mlp.experts``) from one expert's module
    (``...mlp.experts.{e}.gate_proj``): SGLang's ModelOpt FusedMoE matcher needs the module itself."""
    return expert_module.split(".experts.")[0] + ".experts"


def ct_ignore(exclusions: list[str]) -> list[str]:
    """compressed-tensors matches exact names or ``re:`` regexes (re.match): a whole-layer
    ``model.layers.{i}.`` entry becomes an anchored regex, everything else stays exact."""
    return [f"{CT_REGEX_PREFIX}^{re.escape(e)}" if e.endswith(".") else e for e in exclusions]


# ---- matchers -----------------------------------------------------------------------------------


def sglang_dotted_excluded(prefix: str, entries: list[str]) -> bool:
    """SGLang Fp8Config's dotted-path rule (docs/formats.md#exclusion-matchers), on an HF module path."""
    forms = set()
    for e in entries:
        e = e.rstrip(".")
        base = e.removeprefix("model.")
        forms |= {base, "model." + base}
    p = prefix.rstrip(".")
    for e in forms:
        if p == e or p.startswith(e + ".") or ("." + e + ".") in ("." + p + "."):
            return True
    return False


VLLM_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_substring_excluded(prefix: str, entries: list[str]) -> bool:
    """vLLM ModelOpt-style rule on a vLLM module prefix (docs/formats.md#exclusion-matchers): exact (a fused module is
    excluded when its shards are listed), plain substring anywhere, or fnmatch."""
    parent, _, last = prefix.rpartition(".")
    if last in VLLM_PACKED and all(f"{parent}.{s}" in entries for s in VLLM_PACKED[last]):
        return True
    return any(prefix == e or e in prefix or fnmatch.fnmatchcase(prefix, e) for e in entries)


def sglang_modelopt_excluded(prefix: str, entries: list[str], fused_moe: bool) -> bool:
    """SGLang ModelOpt: Linear uses the dotted rule or ``is_layer_excluded``; FusedMoE only the latter."""
    for e in entries:
        rx = re.compile(re.escape(e).replace(r"\*", ".*"))
        if rx.fullmatch(prefix) or any(rx.fullmatch(part) for part in prefix.split(".")):
            return True
    return False if fused_moe else sglang_dotted_excluded(prefix, entries)


def ct_excluded(prefix: str, entries: list[str]) -> bool:
    """compressed-tensors: an exact name, or a ``re:`` regex that re.match-es the prefix."""
    for e in entries:
        if e.startswith(CT_REGEX_PREFIX):
            try:
                if re.match(e[len(CT_REGEX_PREFIX) :], prefix):
                    return True
            except re.error:
                continue
        elif e == prefix:
            return True
    return False


Matcher = Callable[[str, list, bool], bool]

#: consumer names (also the engine a report names)
SGLANG, VLLM, SGLANG_MODELOPT, COMPRESSED_TENSORS = (
    "SGLang",
    "vLLM",
    "SGLang ModelOpt",
    "compressed-tensors (vLLM/SGLang)",
)


def matchers(scheme: str, dialect: str) -> list[tuple[str, Matcher]]:
    """(consumer name, excluded(prefix, entries, is_fused_moe)) for each engine reading this dialect."""
    sgl = (SGLANG, lambda p, e, moe: sglang_dotted_excluded(p, e))
    vll = (VLLM, lambda p, e, moe: vllm_substring_excluded(p, e))
    if dialect == "compressed-tensors":
        return [(COMPRESSED_TENSORS, lambda p, e, moe: ct_excluded(p, e))]
    if (scheme, dialect) == ("mxfp8", "auto"):
        return [sgl, vll]
    if (scheme, dialect) == ("mxfp8", "sglang"):
        return [sgl]
    if (scheme, dialect) == ("mxfp8", "flat"):
        return [vll]
    if (scheme, dialect) == ("mxfp8", "modelopt"):
        return [vll, sgl]  # SGLang translates ModelOpt MXFP8 into Fp8Config (dotted rule)
    if dialect == "modelopt":
        return [vll, (SGLANG_MODELOPT, sglang_modelopt_excluded)]
    return [vll, sgl]
