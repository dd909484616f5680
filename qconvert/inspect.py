"""``qconvert inspect``: what a checkpoint directory holds, from its config and tensor headers alone.

Detects the format (BF16, MXFP8, NVFP4, FP8) and on-disk dialect (docs/formats.md#mxfp8-dialects, docs/formats.md#nvfp4) of
checkpoints written by qconvert and by other tools (ModelOpt, compressed-tensors, miles), and
pre-shuffled FlashInfer TRT-LLM expert layouts through the layout contract recorded in
``qconvert.json``. Only safetensors headers are read, never tensor data, so it is instant even on
a 60 GB checkpoint.

Detection itself (per-module formats, scheme and dialect, as codes) and the tables of which engine
loads which dialect on which GPUs live in :mod:`qconvert.formats`; this module reads the
checkpoint and renders the report.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .convert.checkpoint import CheckpointDir, open_checkpoint
from .convert.safetensors_io import DTYPES
from .formats import manifest as _manifest
from .formats.detect import (  # noqa: F401
    QUANTIZED_FORMATS,
    Code,
    Detection,
    Module,
    detect,
    finding,
    module_format,
    modules_of,
    nvfp4_activations,
    role_tag,
    split_name,
)
from .formats.dialects import KEPT_SUFFIXES, EngineSupport, engine_support
from .formats.manifest import find_layouts
from .formats.schemes import BLOCK

# ---- reading a checkpoint (headers only) --------------------------------------------------------


def read_checkpoint(path: str | Path) -> CheckpointDir:
    """Config, optional hf_quant_config / manifest / index, and every shard header, read leniently
    (:func:`~qconvert.convert.checkpoint.open_checkpoint`): only what makes the directory unreadable
    raises; index inconsistencies are collected in ``problems`` so ``verify`` can report them all.
    """
    ck = open_checkpoint(path, strict=False)
    ck.hf_quant_config, ck.manifest  # noqa: B018 -- both are read now: a corrupt one is an error of inspect
    return ck


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
    moe = any(".experts." in n for n in mods) or any(
        k in ck.config for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    findings = [f for f in det.findings if not f.conflict] + [f for f in det.findings if f.conflict]
    notes = [f.text() for f in findings] + (fused_note(ck) if det.scheme == "bf16" and not layouts else [])
    if any(m.stacked for m in mods.values()) and not layouts:
        notes.append(finding(Code.STACKED_WITHOUT_LAYOUT).text())
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
                    tag = role_tag(dtype)
                    by_fmt[tag] = by_fmt.get(tag, 0) + nb
                    bf16_equiv += nb
                    kept += nb
        by_fmt[m.format] = by_fmt.get(m.format, 0) + m.bytes - kept
        n = 1
        for d in m.shape:
            n *= d
        if m.format in QUANTIZED_FORMATS:
            params += n
            bf16_equiv += 2 * n
        else:
            params += n
            bf16_equiv += m.bytes
    total = ck.total_bytes
    quantized = [m for m in mods.values() if m.format in QUANTIZED_FORMATS]
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
    return InspectReport(
        str(ck.root),
        det.scheme,
        det.dialect,
        det.producer,
        det.quant_method,
        archs[0],
        moe,
        layouts,
        sorted(mods.values(), key=lambda m: _natural(m.name)),
        totals,
        det.exclusion_keys,
        engines,
        notes,
        ck.problems,
        nvfp4_activations(mods, layouts) if det.scheme == "nvfp4" else None,
        _manifest.recipe(ck.manifest),
        _quantized_source(ck.manifest, det),
    )


def _quantized_source(manifest: dict | None, det) -> str | None:
    from .convert.decode import summarize

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
        code = getattr(e, "code", None)
        return ["fused expert tensors: qconvert refuses them" + (f" ({code.value})" if code else "") + f": {e}"]
    if not views:
        return []
    n = len({v.source for v in views.values()})
    orient = {v.orientation for v in views.values()}.pop()
    form = "[E, out, in] (transformers 5)" if orient == fused.OUT_IN else "[E, in, out] (transposed)"
    return [
        f"fused expert tensors: {n} (…experts.gate_up_proj / down_proj, {form}); qconvert "
        "writes them as per-expert experts.{e}.gate_proj/up_proj/down_proj"
    ]


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
    lines.append(
        f"format     : {fmt}"
        + (f" {r.activations}" if r.activations else "")
        + f" ({r.dialect} dialect, written by {r.producer}"
        + (f", quant_method {r.quant_method!r}" if r.quant_method else "")
        + ")"
    )
    if r.scheme in ("mxfp8", "nvfp4"):
        lines.append(
            f"recipe     : {r.recipe}"
            if r.recipe
            else "recipe     : unknown (no qconvert.json: the tensors alone do not tell the recipe)"
        )
    if r.source:
        lines.append(f"source     : {r.source}")
    lines.append(f"model      : {r.architecture}" + (" (MoE)" if r.moe else ""))
    for lay in r.layouts:
        lines.append(
            f"layout     : pre-shuffled {lay.get('layout')} v{lay.get('layout_version')} for {lay.get('engine')} "
            f"({lay.get('scheme')}, tp={lay.get('tp')}, ep={lay.get('ep')}, FlashInfer {lay.get('flashinfer_version')})"
        )
    if not r.layouts:
        lines.append("layout     : plain (per-expert tensors, as the engines' stock loaders read them)")
    by = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in t["bytes_by_format"].items())
    lines.append(
        f"modules    : {t['modules']} ({t['quantized_modules']} quantized), {t['tensors']} tensors in {len(t['shards'])} shard(s)"
    )
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
