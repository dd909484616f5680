"""``qconvert inspect``: what a checkpoint directory holds, from its config and tensor headers alone.

Detects the format (BF16, MXFP8, NVFP4, FP8) and on-disk dialect (docs/formats.md#mxfp8-dialects, docs/formats.md#nvfp4) of
checkpoints written by qconvert and by other tools (ModelOpt, compressed-tensors, miles), and
pre-shuffled FlashInfer TRT-LLM expert layouts through the layout contract recorded in
``qconvert.json``. Only safetensors headers are read, never tensor data, so it is instant even on
a 60 GB checkpoint.

The tables of which engine loads which dialect on which GPUs live here (:func:`engine_support`)
and are shared with ``verify`` and the model card in :mod:`qconvert.hub`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .convert.checkpoint import HF_QUANT_CONFIG, MANIFEST_NAME, CheckpointDir, open_checkpoint
from .convert.safetensors_io import DTYPES, TensorEntry

#: tensor-name suffixes that belong to a module (longest first so ``weight_scale_2`` wins)
SUFFIXES = (
    "weight_scale_inv", "weight_scale_2", "weight_global_scale", "weight_zero_point", "weight_packed",
    "weight_shape", "weight_scale", "input_global_scale", "input_scale", "k_scale", "v_scale",
    "weight", "bias",
)
_STACKED_RE = re.compile(r"^(?P<w>w13|w2|w1|w3)_(?P<suffix>.+)$")
_ROLE_TAGS = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64"}
_MXFP8_SCALE_TAGS = {"U8", "F8_E8M0"}

#: block size of each quantized format along K
BLOCK = {"mxfp8": 32, "nvfp4": 16}
#: tensors of a quantized Linear that stay in their source dtype, byte for byte (a Linear's bias:
#: Qwen2's q/k/v, BERT encoders); they are not part of the quantized format
KEPT_SUFFIXES = ("bias",)


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


# ---- reading a checkpoint (headers only) --------------------------------------------------------

#: what inspect and verify read: the one checkpoint-directory reader's result
CheckpointFiles = CheckpointDir


def read_checkpoint(path: str | Path) -> CheckpointDir:
    """Config, optional hf_quant_config / manifest / index, and every shard header, read leniently
    (:func:`~qconvert.convert.checkpoint.open_checkpoint`): only what makes the directory unreadable
    raises; index inconsistencies are collected in ``problems`` so ``verify`` can report them all.
    """
    ck = open_checkpoint(path, strict=False)
    ck.hf_quant_config, ck.manifest  # noqa: B018 -- both are read now: a corrupt one is an error of inspect
    return ck


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
    w = tensors.get("weight") or tensors.get("weight_packed")
    if w is None:
        t = next(iter(tensors.values()))
        return _ROLE_TAGS.get(t[0], "other"), list(t[1]), None
    dtype, shape = w[0], list(w[1])
    scale_sfx = "weight_scale_inv" if "weight_scale_inv" in tensors else ("weight_scale" if "weight_scale" in tensors else None)
    scale = tensors.get(scale_sfx) if scale_sfx else None
    if dtype in _ROLE_TAGS and "weight_packed" not in tensors:
        return _ROLE_TAGS[dtype], shape, None
    if dtype == "U8" and scale is not None and scale[0] == "F8_E4M3" and shape:
        logical = shape[:-1] + [shape[-1] * 2]
        return "nvfp4", logical, scale_sfx
    if dtype == "F8_E4M3" and scale is not None:
        if scale[0] in _MXFP8_SCALE_TAGS and len(scale[1]) == len(shape) and shape and scale[1][-1] * 32 == shape[-1]:
            return "mxfp8", shape, scale_sfx
        if scale[0] == "F32" and len(scale[1]) == 2 and len(shape) == 2 and (scale[1][0] > 1 or scale[1][1] > 1) \
                and scale[1][1] < shape[1]:
            return "fp8-block", shape, scale_sfx
        return "fp8", shape, scale_sfx
    return "other", shape, scale_sfx


def modules_of(tensors: dict[str, TensorEntry]) -> dict[str, Module]:
    groups: dict[str, dict[str, TensorEntry]] = {}
    for name, e in tensors.items():
        mod, sfx = split_name(name)
        groups.setdefault(mod, {})[sfx or e.name] = e
    out = {}
    for mod, ts in groups.items():
        desc = {s: (e.dtype, tuple(e.shape)) for s, e in ts.items()}
        fmt, shape, sfx = module_format(desc)
        stacked = mod.rsplit(".", 1)[-1] in ("w13", "w2", "w1", "w3")
        out[mod] = Module(mod, fmt, shape, sum(e.nbytes for e in ts.values()),
                          {s: [d, list(sh)] for s, (d, sh) in desc.items()}, sfx, stacked)
    return out


# ---- dialect detection --------------------------------------------------------------------------

#: where each dialect keeps its exclusion list (config.json quantization_config keys)
EXCLUSION_KEYS = {
    ("mxfp8", "auto"): ("ignored_layers", "modules_to_not_convert"),
    ("mxfp8", "sglang"): ("modules_to_not_convert",),
    ("mxfp8", "flat"): ("ignored_layers",),
    ("mxfp8", "modelopt"): ("ignore",),
    ("mxfp8", "compressed-tensors"): ("ignore",),
    ("nvfp4", "modelopt"): ("ignore",),
    ("nvfp4", "compressed-tensors"): ("ignore",),
    ("fp8", "modelopt"): ("ignore",),
    ("fp8", "compressed-tensors"): ("ignore",),
    ("fp8-block", "deepseek"): ("modules_to_not_convert",),
}

#: the scale-tensor suffix each MXFP8 dialect uses
MXFP8_SCALE_SUFFIX = {"auto": "weight_scale", "sglang": "weight_scale_inv", "flat": "weight_scale",
                      "modelopt": "weight_scale", "compressed-tensors": "weight_scale"}


@dataclass
class Detection:
    scheme: str  # bf16 | mxfp8 | nvfp4 | fp8 | fp8-block | unknown
    dialect: str
    producer: str  # qconvert | modelopt | compressed-tensors | miles/sglang | unknown
    quant_method: str | None
    exclusion_keys: dict[str, list]  # where -> list
    notes: list[str] = field(default_factory=list)  # informational
    #: the checkpoint contradicts itself (manifest vs config, config vs tensors): verify fails on these
    conflicts: list[str] = field(default_factory=list)


def _ct_scheme(qc: dict) -> str:
    fmt = str(qc.get("format") or "")
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        bits, typ, gs = w.get("num_bits"), w.get("type"), w.get("group_size")
        if bits == 4 and typ == "float":
            return "nvfp4"
        if bits == 8 and typ == "float":
            return "mxfp8" if (gs == 32 and w.get("strategy") in ("group", "tensor_group")) or "mx" in fmt else "fp8"
    if "nvfp4" in fmt:
        return "nvfp4"
    return "unknown"


def detect(config: dict, hf_quant_config: dict | None, manifest: dict | None,
           modules: dict[str, Module]) -> Detection:
    """Format and dialect from config.json (+ hf_quant_config.json) and the tensors."""
    qc = config.get("quantization_config")
    formats = {m.format for m in modules.values()}
    producer = "qconvert" if manifest and "qconvert_version" in manifest else "unknown"
    notes: list[str] = []
    conflicts: list[str] = []
    if not isinstance(qc, dict) and hf_quant_config:
        hq = hf_quant_config.get("quantization") or {}
        qc = {"quant_method": "modelopt", "quant_algo": hq.get("quant_algo")}  # list read from hf_quant_config below
        notes.append(f"{HF_QUANT_CONFIG} only (no quantization_config in config.json): older ModelOpt export")
    if not isinstance(qc, dict):
        quantized = formats & {"mxfp8", "nvfp4", "fp8", "fp8-block"}
        if quantized:
            return Detection("unknown", "none", producer, None, {},
                             [f"tensors are {', '.join(sorted(quantized))} but config.json has no quantization_config; "
                              "no engine will load this as quantized"])
        return Detection("bf16", "bf16", producer if producer != "unknown" else "transformers", None, {}, notes)
    method = str(qc.get("quant_method") or "").lower()
    keys: dict[str, list] = {}

    def grab(*names):
        for n in names:
            if n in qc:
                keys[f"config.json quantization_config.{n}"] = list(qc.get(n) or [])

    if method == "mxfp8" or (method == "fp8" and "mxfp8" in formats):
        scheme = "mxfp8"
        scale_sfx = {m.scale_suffix for m in modules.values() if m.format == "mxfp8"}
        if "weight_scale_inv" in scale_sfx:
            dialect = "sglang"
        elif "activation_scheme" in qc and "ignored_layers" in qc and "modules_to_not_convert" in qc:
            dialect = "auto"
        elif "activation_scheme" in qc:
            dialect = "sglang"  # miles-style config but weight_scale names (SGLang renames them on load)
        else:
            dialect = "flat"
        grab("ignored_layers", "modules_to_not_convert")
        if producer == "unknown":
            producer = "miles/sglang" if dialect == "sglang" else "unknown"
    elif method in ("modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_fp8"):
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
            notes.append(f"ModelOpt quant_algo {algo!r} is not one qconvert knows")
        dialect = "modelopt"
        grab("ignore", "exclude_modules", "modules_to_not_convert")
        if hf_quant_config:
            hq = hf_quant_config.get("quantization") or {}
            if "exclude_modules" in hq:
                keys[f"{HF_QUANT_CONFIG} quantization.exclude_modules"] = list(hq.get("exclude_modules") or [])
        if producer == "unknown":
            producer = "modelopt"
    elif method == "compressed-tensors":
        scheme = _ct_scheme(qc)
        dialect = "compressed-tensors"
        grab("ignore")
        if producer == "unknown":
            producer = "compressed-tensors"
    elif method == "fp8":
        if "fp8-block" in formats or qc.get("weight_block_size"):
            scheme, dialect = "fp8-block", "deepseek"
        else:
            scheme, dialect = "fp8", "fp8"
        grab("modules_to_not_convert", "ignored_layers")
    else:
        scheme, dialect = "unknown", method or "unknown"
        notes.append(f"quant_method {method!r} is not one qconvert knows")
    if manifest and producer == "qconvert":
        ms, md = manifest.get("scheme"), manifest.get("dialect")
        if (ms, md) != (scheme, dialect):
            conflicts.append(f"{MANIFEST_NAME} says {ms}/{md} but config and tensors say {scheme}/{dialect}")
    if scheme in ("mxfp8", "nvfp4") and scheme not in formats:
        conflicts.append(f"config.json declares {scheme} but no tensor is stored as {scheme}")
    return Detection(scheme, dialect, producer, method or None, keys, notes, conflicts)


def find_layouts(manifest: dict | None) -> list[dict]:
    """Layout contracts (``{"layout": "flashinfer-trtllm", ...}``) anywhere in the manifest."""
    out: list[dict] = []

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("layout"), str) and "layout_version" in x:
                out.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(manifest or {})
    return out


# ---- engines ------------------------------------------------------------------------------------

@dataclass
class EngineSupport:
    engine: str  # vllm | sglang
    loads: bool
    gpus: str  # which GPU generations (docs/formats.md#compatibility)
    flags: list[str]  # extra launch flags
    note: str = ""
    alt: list[tuple[str, list[str]]] = field(default_factory=list)  # (gpus, flags) for other generations


def engine_support(scheme: str, dialect: str, moe: bool = False, layout: dict | None = None) -> list[EngineSupport]:
    """Which engines load (scheme, dialect) and how (docs/formats.md#compatibility, vLLM 0.33 / SGLang 0.5.23)."""
    moe_flags = ["--moe-runner-backend", "flashinfer_trtllm_routed"] if moe else []
    if layout:
        eng = layout.get("engine", "?")
        return [EngineSupport(e, e == eng, "SM100+ (FlashInfer TRT-LLM MoE kernels)", [],
                              f"pre-shuffled {layout.get('layout')} v{layout.get('layout_version')} expert layout for "
                              f"{eng} (tp={layout.get('tp')}, ep={layout.get('ep')}, FlashInfer "
                              f"{layout.get('flashinfer_version')}): load through qconvert's loader, not the stock disk loader"
                              if e == eng else f"layout was written for {eng}")
                for e in ("vllm", "sglang")]
    if scheme == "bf16":
        return [EngineSupport("vllm", True, "any", []), EngineSupport("sglang", True, "any", [])]
    if scheme == "mxfp8":
        vllm_ok = dialect in ("auto", "modelopt", "flat", "compressed-tensors")
        sgl_ok = dialect in ("auto", "sglang", "modelopt")
        return [
            EngineSupport("vllm", vllm_ok, "SM80-SM90 via Marlin W8A16, SM100+ via FlashInfer MXFP8 GEMMs", [],
                          "" if vllm_ok else ("weight_scale_inv tensors are unexpected in vLLM (load error); "
                                              "re-convert with --dialect auto")),
            EngineSupport("sglang", sgl_ok, "SM100+ only (B200/GB200/B300; SM90 refused)",
                          ["--fp8-gemm-backend", "flashinfer_trtllm"] + moe_flags,
                          "" if sgl_ok else "SGLang does not read this MXFP8 dialect; re-convert with --dialect auto"),
        ]
    if scheme == "nvfp4":
        return [
            EngineSupport("vllm", True, "SM100+ native FP4; SM80-SM90 via Marlin W4A16 (weight-only)", []),
            EngineSupport("sglang", True, "SM100+ native FP4", moe_flags if dialect == "modelopt" else [],
                          "", [("SM80-SM90", ["--fp4-gemm-backend", "marlin"])] if dialect == "modelopt" else []),
        ]
    if scheme in ("fp8", "fp8-block"):
        return [EngineSupport("vllm", True, "SM89+ (FP8)", []), EngineSupport("sglang", True, "SM89+ (FP8)", [])]
    return [EngineSupport("vllm", False, "", [], "unknown format"), EngineSupport("sglang", False, "", [], "unknown format")]


# ---- the report ---------------------------------------------------------------------------------

@dataclass
class InspectReport:
    path: str
    scheme: str
    dialect: str
    producer: str
    quant_method: str | None
    architecture: str
    moe: bool
    layouts: list[dict]
    modules: list[Module]
    totals: dict
    exclusions: dict[str, list]
    engines: list[EngineSupport]
    notes: list[str]
    problems: list[str]
    #: NVFP4 only: "W4A16" (no activation scales), "W4A4" (every quantized module has one) or
    #: "mixed", read from the tensors (a pre-shuffled layout is W4A4: its kernels need the scales)
    activations: str | None = None
    #: the quantization recipe qconvert.json records ("rceil"; NVFP4 "te" or "modelopt"); None when
    #: the checkpoint has no qconvert manifest (the bytes alone cannot tell the recipe)
    recipe: str | None = None
    #: what the quantized source was, from qconvert.json (FP8 block-scaled: which tensors were
    #: lossless, docs/formats.md#fp8-block-sources); None for BF16 sources
    source: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        return d

    def rows(self) -> list[dict]:
        """Modules with experts collapsed: ``...experts.*.gate_proj`` x E when they agree."""
        rows: list[dict] = []
        collapsed: dict[tuple, dict] = {}
        for m in self.modules:
            key_name = re.sub(r"\.experts\.\d+\.", ".experts.*.", m.name)
            if key_name != m.name:
                k = (key_name, m.format, tuple(m.shape))
                if k in collapsed:
                    collapsed[k]["count"] += 1
                    collapsed[k]["bytes"] += m.bytes
                    continue
                row = {"module": key_name, "format": m.format, "shape": m.shape, "bytes": m.bytes, "count": 1}
                collapsed[k] = row
                rows.append(row)
            else:
                rows.append({"module": m.name, "format": m.format, "shape": m.shape, "bytes": m.bytes, "count": 1})
        return rows


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def inspect_checkpoint(path: str | Path) -> InspectReport:
    ck = read_checkpoint(path)
    mods = modules_of(ck.tensors)
    det = detect(ck.config, ck.hf_quant_config, ck.manifest, mods)
    layouts = find_layouts(ck.manifest)
    archs = ck.config.get("architectures") or ["<none>"]
    moe = any(".experts." in n for n in mods) or any(k in ck.config for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    notes = det.notes + det.conflicts + (fused_note(ck) if det.scheme == "bf16" and not layouts else [])
    if any(m.stacked for m in mods.values()) and not layouts:
        notes.append("stacked expert tensors (w13_/w2_) but no layout contract in qconvert.json; "
                     "their kernel layout is unknown")
    # totals
    by_fmt: dict[str, int] = {}
    params = 0
    bf16_equiv = 0
    for m in mods.values():
        kept = 0
        if m.format in BLOCK:  # a quantized Linear's bias stays in its dtype: count it there
            for sfx in KEPT_SUFFIXES:
                if sfx in m.tensors:
                    dtype, shape = m.tensors[sfx]
                    nb = DTYPES[dtype][1] if dtype in DTYPES else 0
                    for d in shape:
                        nb *= d
                    tag = _ROLE_TAGS.get(dtype, "other")
                    by_fmt[tag] = by_fmt.get(tag, 0) + nb
                    bf16_equiv += nb
                    kept += nb
        by_fmt[m.format] = by_fmt.get(m.format, 0) + m.bytes - kept
        n = 1
        for d in m.shape:
            n *= d
        if m.format in BLOCK or m.format in ("fp8", "fp8-block"):
            params += n
            bf16_equiv += 2 * n
        else:
            params += n
            bf16_equiv += m.bytes
    total = ck.total_bytes
    quantized = [m for m in mods.values() if m.format in ("mxfp8", "nvfp4", "fp8", "fp8-block")]
    totals = {
        "tensors": len(ck.tensors),
        "modules": len(mods),
        "quantized_modules": len(quantized),
        "bytes": total,
        "bytes_by_format": dict(sorted(by_fmt.items())),
        "parameters": params,
        "bf16_bytes": bf16_equiv,
        "compression_ratio": (bf16_equiv / total) if total else 0.0,
        "shards": [h.path.name for h in ck.shards],
    }
    engines = engine_support(det.scheme, det.dialect, moe, layouts[0] if layouts else None)
    recipe = ck.manifest.get("recipe") if ck.manifest and det.producer == "qconvert" else None
    return InspectReport(str(ck.root), det.scheme, det.dialect, det.producer, det.quant_method, archs[0], moe,
                         layouts, sorted(mods.values(), key=lambda m: _natural(m.name)), totals,
                         det.exclusion_keys, engines, notes, ck.problems,
                         nvfp4_activations(mods, layouts) if det.scheme == "nvfp4" else None,
                         recipe if isinstance(recipe, str) else None, _quantized_source(ck.manifest, det))


def _quantized_source(manifest: dict | None, det) -> str | None:
    from .convert.fp8_source import summarize

    if not manifest or det.producer != "qconvert" or not isinstance(manifest.get("source"), dict):
        return None
    return summarize(manifest["source"].get("quantized"))


def fused_note(ck) -> list[str]:
    """What qconvert does with a BF16 source's fused expert tensors (docs/formats.md#fused-expert-tensors):
    a note naming their orientation, or the one-line reason it refuses them."""
    from .convert import fused
    from .errors import QConvertError
    try:
        _, views = fused.source_entries(ck.tensors, ck.config, ck.root / "config.json")
    except QConvertError as e:
        return [f"fused expert tensors: qconvert refuses them: {e}"]
    if not views:
        return []
    n = len({v.source for v in views.values()})
    orient = {v.orientation for v in views.values()}.pop()
    form = "[E, out, in] (transformers 5)" if orient == fused.OUT_IN else "[E, in, out] (transposed)"
    return [f"fused expert tensors: {n} (…experts.gate_up_proj / down_proj, {form}); qconvert "
            "writes them as per-expert experts.{e}.gate_proj/up_proj/down_proj"]


def nvfp4_activations(mods: dict[str, Module], layouts: list[dict]) -> str | None:
    """W4A16 / W4A4 / mixed from the NVFP4 modules' tensors (see :attr:`InspectReport.activations`)."""
    if layouts:
        return "W4A4"
    fp4 = [m for m in mods.values() if m.format == "nvfp4"]
    if not fp4:
        return None
    with_scale = sum(1 for m in fp4 if "input_scale" in m.tensors or "input_global_scale" in m.tensors)
    return "W4A16" if with_scale == 0 else "W4A4" if with_scale == len(fp4) else "mixed"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_report(r: InspectReport, limit: int | None = None) -> str:
    lines = []
    rows = r.rows()
    lines.append(f"{'module':<60} {'format':<9} {'shape':<18} {'bytes':>10}")
    for row in rows[: limit if limit else None]:
        name = row["module"] + (f"  x{row['count']}" if row["count"] > 1 else "")
        lines.append(f"{name:<60} {row['format']:<9} {str(row['shape']):<18} {fmt_bytes(row['bytes']):>10}")
    if limit and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more rows (--limit 0 for all)")
    t = r.totals
    lines.append("")
    fmt = r.scheme if r.scheme != "unknown" else "unknown"
    lines.append(f"checkpoint : {r.path}")
    lines.append(f"format     : {fmt}" + (f" {r.activations}" if r.activations else "")
                 + f" ({r.dialect} dialect, written by {r.producer}"
                 + (f", quant_method {r.quant_method!r}" if r.quant_method else "") + ")")
    if r.scheme in ("mxfp8", "nvfp4"):
        lines.append(f"recipe     : {r.recipe}" if r.recipe else
                     "recipe     : unknown (no qconvert.json: the tensors alone do not tell the recipe)")
    if r.source:
        lines.append(f"source     : {r.source}")
    lines.append(f"model      : {r.architecture}" + (" (MoE)" if r.moe else ""))
    for lay in r.layouts:
        lines.append(f"layout     : pre-shuffled {lay.get('layout')} v{lay.get('layout_version')} for {lay.get('engine')} "
                     f"({lay.get('scheme')}, tp={lay.get('tp')}, ep={lay.get('ep')}, FlashInfer {lay.get('flashinfer_version')})")
    if not r.layouts:
        lines.append("layout     : plain (per-expert tensors, as the engines' stock loaders read them)")
    by = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in t["bytes_by_format"].items())
    lines.append(f"modules    : {t['modules']} ({t['quantized_modules']} quantized), {t['tensors']} tensors in {len(t['shards'])} shard(s)")
    lines.append(f"size       : {fmt_bytes(t['bytes'])} ({by})")
    lines.append(f"vs BF16    : {fmt_bytes(t['bf16_bytes'])} -> {t['compression_ratio']:.2f}x smaller")
    for where, lst in r.exclusions.items():
        lines.append(f"exclusions : {len(lst)} entries in {where}")
    for e in r.engines:
        mark = "yes" if e.loads else "no "
        extra = f"; flags: {' '.join(e.flags)}" if e.flags and e.loads else ""
        alt = "".join(f"; {g}: {' '.join(f)}" for g, f in e.alt)
        lines.append(f"engine     : {e.engine:<6} {mark} {e.gpus}{extra}{alt}" + (f" ({e.note})" if e.note else ""))
    for n in r.notes:
        lines.append(f"note       : {n}")
    for p in r.problems:
        lines.append(f"problem    : {p}")
    return "\n".join(lines)
