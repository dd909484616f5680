"""Format detection from a checkpoint's config.json (+ ``hf_quant_config.json``), manifest and
tensor headers: per-module formats and the checkpoint's (scheme, dialect, producer).

Decisions travel as values: a :class:`Detection` carries :class:`Finding` objects whose
:class:`Code` says what was found and whether the checkpoint contradicts itself
(:attr:`Finding.conflict`, which ``verify`` fails on); the English text is rendered from the code
(:meth:`Finding.text`) where a report is printed. Pure: no I/O, no torch.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from .dialects import (
    HF_QUANT_CONFIG,
    MXFP4_BLOCK_BYTES,
    MXFP4_BLOCKS,
    MXFP4_SCALES,
    SUFFIXES,
    WEIGHT,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
)
from .exclusions import (
    COMPRESSED_TENSORS_READ_KEYS,
    EXCLUDE_MODULES,
    FP8_READ_KEYS,
    IGNORED_LAYERS,
    MODELOPT_READ_KEYS,
    MODULES_TO_NOT_CONVERT,
    MXFP8_READ_KEYS,
    config_where,
)
from .manifest import MANIFEST_NAME, is_qconvert
from .schemes import MXFP8_BLOCK, SCALE_TAGS

_STACKED_RE = re.compile(r"^(?P<w>w13|w2|w1|w3)_(?P<suffix>.+)$")
#: the stacked expert tensors of a pre-shuffled layout
STACKED_MODULES = ("w13", "w2", "w1", "w3")
_ROLE_TAGS = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64"}
#: module formats that are quantized (the ones qconvert writes, and FP8 it reads)
QUANTIZED_FORMATS = ("mxfp8", "nvfp4", "fp8", "fp8-block", "mxfp4")
#: schemes qconvert can verify; the others detect but do not verify
UNVERIFIABLE = ("unknown", "fp8", "fp8-block", "mxfp4")
#: dtypes of FP8 block-scale tensors (fp32 in DeepSeek-style sources, the model's dtype in
#: compressed-tensors ones; docs/formats.md#compressed-tensors-fp8-block-sources)
FP8_BLOCK_SCALE_TAGS = ("F32", "BF16", "F16")
#: ModelOpt quant_method values
MODELOPT_METHODS = ("modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_fp8")


def hf_quant_where(key: str = EXCLUDE_MODULES) -> str:
    """Where ``hf_quant_config.json``'s exclusion list lives, named as exclusions.config_where names
    config.json's (the keys of :attr:`Detection.exclusion_keys`)."""
    return f"{HF_QUANT_CONFIG} quantization.{key}"


def role_tag(dtype: str) -> str:
    """The format name of an unquantized dtype tag (``BF16`` -> ``bf16``; ``other`` when not a float)."""
    return _ROLE_TAGS.get(dtype, "other")


def split_name(name: str) -> tuple[str, str]:
    """(module, suffix) of a tensor name. Stacked expert tensors (``...experts.w13_weight``)
    become module ``...experts.w13`` with suffix ``weight``."""
    parent, _, last = name.rpartition(".")
    m = _STACKED_RE.match(last)
    if m and m.group("suffix") in SUFFIXES:
        return (f"{parent}.{m.group('w')}" if parent else m.group("w")), m.group("suffix")
    if last in SUFFIXES and parent:
        return parent, last
    return name, ""


# ---- per-module format --------------------------------------------------------------------------


@dataclass
class Module:
    name: str
    format: str  # bf16 | f16 | f32 | mxfp8 | nvfp4 | fp8 | fp8-block | other
    shape: list[int]  # logical (unpacked) weight shape; [] if no weight
    bytes: int
    tensors: dict[str, list]  # suffix -> [dtype tag, shape]
    scale_suffix: str | None = None
    stacked: bool = False  # a stacked expert tensor (pre-shuffled layouts)


def module_format(tensors: dict[str, tuple[str, tuple]]) -> tuple[str, list[int], str | None]:
    """(format, logical weight shape, scale tensor suffix) from one module's tensors."""
    w = tensors.get(WEIGHT) or tensors.get(WEIGHT_PACKED)
    if w is None:
        t = next(iter(tensors.values()))
        return role_tag(t[0]), list(t[1]), None
    dtype, shape = w[0], list(w[1])
    scale_sfx = WEIGHT_SCALE_INV if WEIGHT_SCALE_INV in tensors else (WEIGHT_SCALE if WEIGHT_SCALE in tensors else None)
    scale = tensors.get(scale_sfx) if scale_sfx else None
    if dtype in _ROLE_TAGS and WEIGHT_PACKED not in tensors:
        return _ROLE_TAGS[dtype], shape, None
    if dtype == "U8" and scale is not None and scale[0] == "F8_E4M3" and shape:
        logical = shape[:-1] + [shape[-1] * 2]
        return "nvfp4", logical, scale_sfx
    if dtype == "F8_E4M3" and scale is not None:
        if (
            scale[0] in SCALE_TAGS["mxfp8"]
            and len(scale[1]) == len(shape)
            and shape
            and scale[1][-1] * MXFP8_BLOCK == shape[-1]
        ):
            return "mxfp8", shape, scale_sfx
        if (
            scale[0] in FP8_BLOCK_SCALE_TAGS
            and len(scale[1]) == 2
            and len(shape) == 2
            and (scale[1][0] > 1 or scale[1][1] > 1)
            and scale[1][1] < shape[1]
            and not (scale[1][0] == shape[0] and scale[1][1] == 1)  # per-channel [N, 1]
        ):
            return "fp8-block", shape, scale_sfx
        return "fp8", shape, scale_sfx
    return "other", shape, scale_sfx


def mxfp4_pairs(tensors: dict) -> dict[str, str]:
    """Tensor name -> its MXFP4 module (``<base>``) for every ``<base>_blocks`` U8 [..., K/32, 16] with
    a ``<base>_scales`` U8 [..., K/32] beside it (gpt-oss experts; docs/formats.md#mxfp4-sources)."""
    out = {}
    for name, e in tensors.items():
        if not name.endswith(MXFP4_BLOCKS):
            continue
        base = name[: -len(MXFP4_BLOCKS)]
        s = tensors.get(base + MXFP4_SCALES)
        shape = list(e.shape)
        if (
            s is not None
            and e.dtype == s.dtype == "U8"
            and len(shape) >= 3
            and shape[-1] == MXFP4_BLOCK_BYTES
            and list(s.shape) == shape[:-1]
        ):
            out[name] = out[base + MXFP4_SCALES] = base
    return out


def modules_of(tensors: dict) -> dict[str, Module]:
    """Modules from tensor entries (name -> entry with ``name``, ``dtype``, ``shape``, ``nbytes``);
    an MXFP4 pair is one module of format ``mxfp4``, its shape the unpacked [..., N, K]."""
    groups: dict[str, dict] = {}
    pairs = mxfp4_pairs(tensors)
    for name, e in tensors.items():
        if name in pairs:
            groups.setdefault(pairs[name], {})[name[len(pairs[name]) + 1 :]] = e
            continue
        mod, sfx = split_name(name)
        groups.setdefault(mod, {})[sfx or e.name] = e
    mx = set(pairs.values())
    out = {}
    for mod, ts in groups.items():
        desc = {s: (e.dtype, tuple(e.shape)) for s, e in ts.items()}
        if mod in mx:
            b = list(desc[MXFP4_BLOCKS[1:]][1])
            fmt, shape, sfx = "mxfp4", b[:-2] + [b[-2] * 2 * MXFP4_BLOCK_BYTES], MXFP4_SCALES[1:]
        else:
            fmt, shape, sfx = module_format(desc)
        stacked = mod.rsplit(".", 1)[-1] in STACKED_MODULES
        out[mod] = Module(
            mod,
            fmt,
            shape,
            sum(e.nbytes for e in ts.values()),
            {s: [d, list(sh)] for s, (d, sh) in desc.items()},
            sfx,
            stacked,
        )
    return out


# ---- findings -----------------------------------------------------------------------------------


class Code(enum.Enum):
    """What detection found. Conflicts (the checkpoint contradicts itself) fail ``verify``."""

    HF_QUANT_CONFIG_ONLY = "hf-quant-config-only"  # older ModelOpt export
    QUANTIZED_WITHOUT_CONFIG = "quantized-without-config"  # args: formats
    UNKNOWN_MODELOPT_ALGO = "unknown-modelopt-algo"  # args: algo
    UNKNOWN_QUANT_METHOD = "unknown-quant-method"  # args: method
    STACKED_WITHOUT_LAYOUT = "stacked-without-layout"
    MANIFEST_DISAGREES = "manifest-disagrees"  # args: manifest scheme, dialect; detected scheme, dialect
    CONFIG_WITHOUT_TENSORS = "config-without-tensors"  # args: scheme


#: the codes that mean the checkpoint contradicts itself
CONFLICTS = frozenset({Code.MANIFEST_DISAGREES, Code.CONFIG_WITHOUT_TENSORS})

_TEXT = {
    Code.HF_QUANT_CONFIG_ONLY: HF_QUANT_CONFIG + " only (no quantization_config in config.json): older ModelOpt export",
    Code.QUANTIZED_WITHOUT_CONFIG: "tensors are {formats} but config.json has no quantization_config; "
    "no engine will load this as quantized",
    Code.UNKNOWN_MODELOPT_ALGO: "ModelOpt quant_algo {algo!r} is not one qconvert knows",
    Code.UNKNOWN_QUANT_METHOD: "quant_method {method!r} is not one qconvert knows",
    Code.STACKED_WITHOUT_LAYOUT: "stacked expert tensors (w13_/w2_) but no layout contract in "
    + MANIFEST_NAME
    + "; their kernel layout is unknown",
    Code.MANIFEST_DISAGREES: MANIFEST_NAME + " says {ms}/{md} but config and tensors say {scheme}/{dialect}",
    Code.CONFIG_WITHOUT_TENSORS: "config.json declares {scheme} but no tensor is stored as {scheme}",
}


@dataclass(frozen=True)
class Finding:
    code: Code
    args: tuple = ()  # (name, value) pairs the text is rendered from

    @property
    def conflict(self) -> bool:
        return self.code in CONFLICTS

    def text(self) -> str:
        return _TEXT[self.code].format(**dict(self.args))


def finding(code: Code, **args) -> Finding:
    return Finding(code, tuple(args.items()))


@dataclass
class Detection:
    scheme: str  # bf16 | mxfp8 | nvfp4 | fp8 | fp8-block | mxfp4 | unknown
    dialect: str
    producer: str  # qconvert | modelopt | compressed-tensors | miles/sglang | transformers | unknown
    quant_method: str | None
    exclusion_keys: dict[str, list]  # where -> list
    findings: list[Finding] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """Informational findings, as text."""
        return [f.text() for f in self.findings if not f.conflict]

    @property
    def conflicts(self) -> list[str]:
        """Findings where the checkpoint contradicts itself (manifest vs config, config vs tensors), as text."""
        return [f.text() for f in self.findings if f.conflict]

    @property
    def verifiable(self) -> bool:
        return self.scheme not in UNVERIFIABLE


def _ct_scheme(qc: dict) -> str:
    fmt = str(qc.get("format") or "")
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        bits, typ, gs = w.get("num_bits"), w.get("type"), w.get("group_size")
        if bits == 4 and typ == "float":
            return "nvfp4"
        if bits == 8 and typ == "float" and w.get("strategy") == "block":
            return "fp8-block"  # llm-compressor FP8_BLOCK (docs/formats.md#compressed-tensors-fp8-block-sources)
        if bits == 8 and typ == "float":
            return (
                "mxfp8"
                if (gs == MXFP8_BLOCK and w.get("strategy") in ("group", "tensor_group")) or "mx" in fmt
                else "fp8"
            )
    if "nvfp4" in fmt:
        return "nvfp4"
    return "unknown"


def detect(config: dict, hf_quant_config: dict | None, manifest: dict | None, modules: dict[str, Module]) -> Detection:
    """Format and dialect from config.json (+ hf_quant_config.json) and the tensors."""
    qc = config.get("quantization_config")
    formats = {m.format for m in modules.values()}
    producer = "qconvert" if is_qconvert(manifest) else "unknown"
    found: list[Finding] = []
    if not isinstance(qc, dict) and hf_quant_config:
        hq = hf_quant_config.get("quantization") or {}
        qc = {"quant_method": "modelopt", "quant_algo": hq.get("quant_algo")}  # list read from hf_quant_config below
        found.append(finding(Code.HF_QUANT_CONFIG_ONLY))
    if not isinstance(qc, dict):
        quantized = formats & set(QUANTIZED_FORMATS)
        if quantized:
            return Detection(
                "unknown",
                "none",
                producer,
                None,
                {},
                [finding(Code.QUANTIZED_WITHOUT_CONFIG, formats=", ".join(sorted(quantized)))],
            )
        return Detection("bf16", "bf16", producer if producer != "unknown" else "transformers", None, {}, found)
    method = str(qc.get("quant_method") or "").lower()
    keys: dict[str, list] = {}

    def grab(names):
        for n in names:
            if n in qc:
                keys[config_where(n)] = list(qc.get(n) or [])

    if method == "mxfp8" or (method == "fp8" and "mxfp8" in formats):
        scheme = "mxfp8"
        scale_sfx = {m.scale_suffix for m in modules.values() if m.format == "mxfp8"}
        if WEIGHT_SCALE_INV in scale_sfx:
            dialect = "sglang"
        elif "activation_scheme" in qc and IGNORED_LAYERS in qc and MODULES_TO_NOT_CONVERT in qc:
            dialect = "auto"
        elif "activation_scheme" in qc:
            dialect = "sglang"  # miles-style config but weight_scale names (SGLang renames them on load)
        else:
            dialect = "flat"
        grab(MXFP8_READ_KEYS)
        if producer == "unknown":
            producer = "miles/sglang" if dialect == "sglang" else "unknown"
    elif method in MODELOPT_METHODS:
        algo = str(qc.get("quant_algo") or "").upper()
        if not algo and hf_quant_config:
            algo = str((hf_quant_config.get("quantization") or {}).get("quant_algo") or "").upper()
        if method == "modelopt_fp4" or "NVFP4" in algo or "FP4" in algo:
            scheme = "nvfp4"
        elif "MXFP8" in algo or method == "modelopt_mxfp8":
            scheme = "mxfp8"
        elif "FP8" in algo:
            scheme = "fp8"
        else:
            scheme = "unknown"
            found.append(finding(Code.UNKNOWN_MODELOPT_ALGO, algo=algo))
        dialect = "modelopt"
        grab(MODELOPT_READ_KEYS)
        if hf_quant_config:
            hq = hf_quant_config.get("quantization") or {}
            if EXCLUDE_MODULES in hq:
                keys[hf_quant_where(EXCLUDE_MODULES)] = list(hq.get(EXCLUDE_MODULES) or [])
        if producer == "unknown":
            producer = "modelopt"
    elif method == "compressed-tensors":
        scheme = _ct_scheme(qc)
        dialect = "compressed-tensors"
        grab(COMPRESSED_TENSORS_READ_KEYS)
        if producer == "unknown":
            producer = "compressed-tensors"
    elif method == "fp8":
        if "fp8-block" in formats or qc.get("weight_block_size"):
            scheme, dialect = "fp8-block", "deepseek"
        else:
            scheme, dialect = "fp8", "fp8"
        grab(FP8_READ_KEYS)
    elif method == "mxfp4":  # gpt-oss's own experts (docs/formats.md#mxfp4-sources)
        scheme, dialect = "mxfp4", "gpt-oss"
        grab((MODULES_TO_NOT_CONVERT,))
    else:
        scheme, dialect = "unknown", method or "unknown"
        found.append(finding(Code.UNKNOWN_QUANT_METHOD, method=method))
    if manifest and producer == "qconvert":
        ms, md = manifest.get("scheme"), manifest.get("dialect")
        if (ms, md) != (scheme, dialect):
            found.append(finding(Code.MANIFEST_DISAGREES, ms=ms, md=md, scheme=scheme, dialect=dialect))
    if scheme in ("mxfp8", "nvfp4") and scheme not in formats:
        found.append(finding(Code.CONFIG_WITHOUT_TENSORS, scheme=scheme))
    return Detection(scheme, dialect, producer, method or None, keys, found)


def nvfp4_activations(mods: dict[str, Module], layouts: list[dict]) -> str | None:
    """W4A16 / W4A4 / mixed from the NVFP4 modules' tensors (a pre-shuffled layout is W4A4: its
    kernels need the activation scales)."""
    from .dialects import NVFP4_INPUT_SCALE_SUFFIXES

    if layouts:
        return "W4A4"
    fp4 = [m for m in mods.values() if m.format == "nvfp4"]
    if not fp4:
        return None
    with_scale = sum(1 for m in fp4 if any(s in m.tensors for s in NVFP4_INPUT_SCALE_SUFFIXES))
    return "W4A16" if with_scale == 0 else "W4A4" if with_scale == len(fp4) else "mixed"
