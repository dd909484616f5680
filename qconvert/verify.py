"""``qconvert verify SRC DST``: is DST what it claims to be, and does it decode back to SRC?

Checks, each reported with the file or tensor it concerns and the fix:

* structure: every source tensor is in DST, either byte-identical (kept) or as the tensors the
  detected format and dialect require (names, dtypes, shapes per docs/formats.md#tensor-names); no
  unexpected tensors; config.json equal to the source's apart from ``quantization_config``;
  index consistent with the shards;
* exclusion list: every BF16-kept Linear module is excluded, and no quantized one is, under the
  matching rules of each engine that reads this dialect (docs/formats.md#exclusion-matchers); the copies of the list
  (``ignored_layers`` / ``modules_to_not_convert`` / ``ignore`` / ``hf_quant_config.json`` /
  ``qconvert.json``) agree;
* manifest: scheme, dialect and per-module formats match the tensors; output sha256;
* source: SRC's shards against the source digests in the manifest (a mismatch is the diagnosis
  listed first); without digests the report says what cannot be told;
* values: every quantized tensor is dequantized and compared with its source (relative error,
  SQNR, and a per-block bound that any sane encoder meets, so one corrupt scale byte fails; a
  figure that is not a number fails); for qconvert's own output the bytes must equal a fresh
  quantization (MXFP8 RCEIL; NVFP4 by its recipe, global scale from the fused group's amax);
  a quantized Linear's bias is a kept tensor, byte-compared;
* layouts: pre-shuffled MoE experts through the bit-exact inverse, or, where the layout keeps no
  plain scalars, against SRC's experts quantized and laid out again, byte for byte.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .convert import fused
from .convert.pipeline import CPU_WORKERS, HASH_STREAMS
from .convert.safetensors_io import ShardReader, sha256_file
from .errors import QConvertError
from .formats.detect import Module, detect, modules_of, split_name
from .formats.dialects import (
    KEPT_SUFFIXES,
    NVFP4_WEIGHT_SUFFIXES,
    REQUIRED_SUFFIXES,
    WEIGHT,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    accepted_tensors,
)
from .formats.exclusions import EXCLUSION_KEYS, SGLANG, SGLANG_MODELOPT, config_where, matchers
from .formats.manifest import MANIFEST_NAME, find_layouts, layout_section
from .formats.schemes import (
    ALL_RECIPES,
    BLOCK,
    BLOCK_BOUND,
    DEFAULT_MAX_REL_ERR,
    DEFAULT_NVFP4_RECIPE,
    MXFP8_RECIPE,
    NVFP4_RECIPES,
)
from .inspect import read_checkpoint
from .interrupts import ctrl_c_safe

VERIFY_PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small model that",
    "def add(a, b):",
    "MXFP8 stores eight-bit floating point elements with",
]


@dataclass
class TensorResult:
    module: str
    format: str
    shape: list[int]
    rel_err: float
    sqnr_db: float
    block_err: float  # worst max|err| / (bound * amax + atol) over blocks; > 1 fails
    exact: bool | None = None  # bytes equal a fresh quantization (None: not checked)
    ok: bool = True
    #: FP8 block-scaled source only: DST decodes to exactly the source's values (None: other sources)
    lossless: bool | None = None


@dataclass
class VerifyReport:
    src: str
    dst: str
    scheme: str = "unknown"
    dialect: str = "unknown"
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)  # check name -> "ok" | "FAILED" | "skipped: ..."
    tensors: list[TensorResult] = field(default_factory=list)
    kept_identical: int = 0
    kept_bytes: int = 0
    max_rel_err: dict[str, float] = field(default_factory=dict)
    engine: dict | None = None
    #: the cause that explains the other failures (DST converted from other weights), listed first
    diagnosis: str | None = None
    #: DST tensors that are the BF16 of a quantized SRC's decode (``qconvert bf16``), one result each:
    #: ``exact`` their bytes are that BF16, ``lossless`` they equal the fp32 decode bit for bit
    decoded: list[TensorResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def worst(self, n: int = 5) -> list[TensorResult]:
        return sorted(self.tensors, key=lambda t: -_nan_last(t.rel_err))[:n]

    def groups(self) -> dict[str, dict]:
        """Error summary per module group: layer and expert indices replaced by ``*``."""
        out: dict[str, dict] = {}
        for t in self.tensors:
            g = re.sub(r"\.\d+\.", ".*.", t.module)
            d = out.setdefault(
                g,
                {
                    "format": t.format,
                    "count": 0,
                    "mean_rel_err": 0.0,
                    "max_rel_err": 0.0,
                    "min_sqnr_db": math.inf,
                    "worst": t.module,
                },
            )
            d["count"] += 1
            d["mean_rel_err"] += t.rel_err
            if not t.rel_err < d["max_rel_err"]:  # NaN is the worst
                d["max_rel_err"], d["worst"] = t.rel_err, t.module
            if not t.sqnr_db >= d["min_sqnr_db"]:
                d["min_sqnr_db"] = t.sqnr_db
        for d in out.values():
            d["mean_rel_err"] /= d["count"]
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["groups"] = self.groups()
        d["worst"] = [t.module for t in self.worst()]
        return d


# ---- numerics -----------------------------------------------------------------------------------


def _nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    try:
        from .convert.numerics.nvfp4 import nvfp4_dequantize
    except ImportError:  # numerics not present in this build: decode here (docs/formats.md#nvfp4-encoding)
        lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
        vals = lut[codes].reshape(*codes.shape[:-1], -1, BLOCK["nvfp4"])
        return (vals * (scale.float() * scale_2.float().reshape(())).unsqueeze(-1)).reshape(codes.shape)
    return nvfp4_dequantize(packed, scale, scale_2)


def _nvfp4_codes(ts: dict[str, torch.Tensor]):
    """The packed NVFP4 codes under either dialect's name (compressed-tensors ``weight_packed``, else ``weight``)."""
    return next((ts[s] for s in NVFP4_WEIGHT_SUFFIXES if s in ts), None)


def _nvfp4_scale_2(ts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decode-convention global scale (fp32 0-dim): ModelOpt's ``weight_scale_2``, or the
    reciprocal of compressed-tensors' ``weight_global_scale``."""
    if WEIGHT_SCALE_2 in ts:
        return ts[WEIGHT_SCALE_2].float().reshape(-1)[0]
    return 1.0 / ts[WEIGHT_GLOBAL_SCALE].float().reshape(-1)[0]


def _dequantize(
    fmt: str, dialect: str, ts: dict[str, torch.Tensor], m: Module
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 decoded weight, decode-convention global scale or None)."""
    if fmt == "mxfp8":
        from .convert.numerics.mxfp8 import mxfp8_dequantize

        s = ts[m.scale_suffix]
        if s.dtype != torch.uint8:
            s = s.view(torch.uint8)
        return mxfp8_dequantize(ts["weight"], s), None
    if fmt == "nvfp4":
        packed = _nvfp4_codes(ts)
        s2 = _nvfp4_scale_2(ts)
        return _nvfp4_dequantize(packed, ts[WEIGHT_SCALE], s2), s2
    raise QConvertError(f"tensor {m.name!r}: format {fmt} cannot be dequantized by verify")


def _finite_or_perfect(v: float) -> bool:
    """A figure that can pass: a number, and not infinite except the SQNR of an exact decode."""
    return v == math.inf or math.isfinite(v)


def _nan_last(v: float) -> float:
    """Sort/max key that ranks NaN as the worst (largest) value."""
    return math.inf if math.isnan(v) else v


def _figures(xn: float, en: float) -> tuple[float, float]:
    """(relative error, SQNR dB) from sum x^2 and sum err^2; NaN where the source's sum is not a
    finite number (``xn > 0`` is false for NaN, which read as an exact decode)."""
    if not math.isfinite(xn) or math.isnan(en):
        return math.nan, math.nan
    rel = math.sqrt(en / xn) if xn > 0 else (0.0 if en == 0 else math.inf)
    if en > 0 and xn > 0:
        ratio = xn / en
        sqnr = 10 * math.log10(ratio) if ratio > 0 else -math.inf  # 0: a decoded value is not finite
    else:
        sqnr = math.inf if en == 0 else -math.inf
    return rel, sqnr


def compare(x: torch.Tensor, deq: torch.Tensor, fmt: str, scale_2=None) -> tuple[float, float, float, tuple | None]:
    """(relative error, SQNR dB, worst block ratio, first failing block (row, block) or None)."""
    x = x.float()
    err = deq - x
    xn = float(x.double().pow(2).sum())
    en = float(err.double().pow(2).sum()) if bool(torch.isfinite(deq).all()) else math.inf
    rel, sqnr = _figures(xn, en)
    blk = BLOCK[fmt]
    k = x.shape[-1]
    xb = x.reshape(-1, k // blk, blk)
    eb = err.reshape(-1, k // blk, blk).abs().amax(-1)
    amax = xb.abs().amax(-1)
    atol = 1e-30 if fmt == "mxfp8" else 6 * 2.0**-6 * float(scale_2 if scale_2 is not None else 0)
    ratio = eb / (BLOCK_BOUND[fmt] * amax + max(atol, 1e-30))
    ratio = torch.nan_to_num(ratio, nan=math.inf)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    first = None
    if worst > 1:
        idx = int(torch.nonzero(ratio.reshape(-1) > 1)[0])
        first = (idx // ratio.shape[1], idx % ratio.shape[1])
    return rel, sqnr, worst, first


_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _decode_tables(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(element values by code, block multipliers by scale byte), fp32, made by the dequantizers
    themselves so that the C statistics decode exactly as :func:`_dequantize` does."""
    if fmt not in _TABLES:
        bytes_ = torch.arange(256, dtype=torch.uint8)
        e4m3 = bytes_.view(torch.float8_e4m3fn).float()
        if fmt == "mxfp8":
            from .convert.numerics.mxfp8 import mxfp8_dequantize

            ones = torch.ones(256, BLOCK["mxfp8"]).to(torch.float8_e4m3fn)
            _TABLES[fmt] = (e4m3, mxfp8_dequantize(ones, bytes_.reshape(256, 1))[:, 0].contiguous())
        else:
            from .convert.numerics.nvfp4 import e2m1_to_float

            _TABLES[fmt] = (e2m1_to_float(torch.arange(16)), e4m3)
    return _TABLES[fmt]


def encoded_compare(
    x: torch.Tensor, ts: dict[str, torch.Tensor], fmt: str, m: Module, workers: int
) -> tuple[float, float, float, tuple | None] | None:
    """:func:`compare` of the decoded tensor, computed from the encoded tensors in one pass by the C
    kernels (no decoded copy; ~20x faster), or None where they cannot run here or the tensors do
    not have the shapes the format implies (the caller then decodes, and reports what is wrong)."""
    from .convert.numerics import cpu_kernels

    if not cpu_kernels.usable(x) or x.dim() == 0:
        return None
    k = x.shape[-1]
    if fmt == "mxfp8":
        q, sc = ts.get("weight"), ts.get(m.scale_suffix or "")
        if q is None or sc is None or q.dtype != torch.float8_e4m3fn or q.shape != x.shape:
            return None
        codes, s2, block, atol = q.view(torch.uint8), 1.0, BLOCK[fmt], 1e-30
    elif fmt == "nvfp4":
        q, sc = _nvfp4_codes(ts), ts.get(WEIGHT_SCALE)
        if q is None or sc is None or q.dtype != torch.uint8 or q.shape != (*x.shape[:-1], k // 2):
            return None
        if WEIGHT_SCALE_2 not in ts and WEIGHT_GLOBAL_SCALE not in ts:
            return None
        s2 = float(_nvfp4_scale_2(ts))
        codes, block, atol = q, BLOCK[fmt], max(6 * 2.0**-6 * s2, 1e-30)
    else:
        return None
    if (
        k % block
        or sc.element_size() != 1
        or sc.shape != (*x.shape[:-1], k // block)
        or not (codes.is_contiguous() and sc.is_contiguous())
    ):
        return None
    elem_lut, scale_lut = _decode_tables(fmt)
    xn, en, nonfinite, worst, first = cpu_kernels.decode_stats(
        x, codes, sc.view(torch.uint8), elem_lut, scale_lut, s2, BLOCK_BOUND[fmt], atol, block, fmt == "nvfp4", workers
    )
    rel, sqnr = _figures(xn, math.inf if nonfinite else en)
    at = None
    if worst > 1:
        at = (first // (k // block), first % (k // block))
    return rel, sqnr, worst, at


# ---- the run ------------------------------------------------------------------------------------


def _nvfp4_groups(mods: dict[str, Module]) -> dict[str, list[str]]:
    """NVFP4 module -> the modules whose source amax gives its global scale (the converter's fused
    groups: q/k/v, gate/up of an MLP or an expert; plan.group_id), itself included."""
    from types import SimpleNamespace

    from .convert.plan import classify, group_id

    groups: dict[str, list[str]] = {}
    for m in mods.values():
        if m.format != "nvfp4" or m.stacked or len(m.shape) != 2:
            continue
        kind = classify(m.name + ".weight", tuple(m.shape))[0]
        gid = group_id(SimpleNamespace(module=m.name)) if kind in ("attn", "mlp", "expert", "shared_expert") else None
        groups.setdefault(gid or m.name, []).append(m.name)
    return {n: members for members in groups.values() for n in members}


def _quantized_suffixes(m: Module) -> list[str]:
    """The tensors of a quantized module that make up its format (not its kept bias)."""
    return [s for s in m.tensors if s not in KEPT_SUFFIXES]


class _Verifier:
    def __init__(
        self, src: str, dst: str, max_rel_err: float | None, progress: bool | None, log: Callable[[str], None]
    ):
        self.r = VerifyReport(str(src), str(dst))
        self.src_arg, self.dst_arg = src, dst
        self.user_max = max_rel_err
        self._kept_bad = 0
        self.fp8 = None  # an FP8 block-scaled SRC (convert.fp8_source.Fp8BlockSource), set by run
        self.decoded = None  # a quantized SRC's decode (convert.decode.DecodedSource), set by run
        self.progress = progress
        self.log = log

    def fail(self, check: str, msg: str):
        self.r.failures.append(msg)
        self.r.checks[check] = "FAILED"

    def ok(self, check: str, detail: str = "ok"):
        self.r.checks.setdefault(check, detail)

    # -- structure --------------------------------------------------------------------------------
    def run(self) -> VerifyReport:
        from .convert.checkpoint import load_checkpoint

        r = self.r
        self.dst = dst = read_checkpoint(self.dst_arg)
        self.src = load_checkpoint(self.src_arg, decode=True)
        from .convert import decode, fp8_source  # a quantized SRC is compared through its decode

        inventory = {n: (e.dtype, e.shape) for n, e in self.src.tensors.items()}
        self.decoded, logical = decode.source_of(self.src.config, inventory, self.src.root / "config.json")
        if self.decoded is not None and self.decoded.kind != fp8_source.KIND:
            # MXFP4 pairs seen as the BF16 tensors they decode to (docs/formats.md#quantized-sources-decoded-to-bf16)
            self._src_entries, self._src_views = decode.logical_entries(self.src.tensors, logical), {}
        else:
            # fused expert tensors of SRC seen as the per-expert tensors DST holds (docs/formats.md#fused-expert-tensors)
            self._src_entries, self._src_views = fused.source_entries(
                self.src.tensors, self.src.config, self.src.root / "config.json"
            )
            self.fp8 = fp8_source.detect(self.src.config, inventory, self.src.root / "config.json")
        for p in dst.problems:
            self.fail("index", p)
        self.ok("index")
        self.mods = modules_of(dst.tensors)
        det = detect(dst.config, dst.hf_quant_config, dst.manifest, self.mods)
        r.scheme, r.dialect = det.scheme, det.dialect
        self.det = det
        if not det.verifiable:
            self.fail(
                "format",
                f"{dst.root / 'config.json'}: format {det.scheme} ({det.dialect}) cannot be verified; "
                f"{'; '.join(det.notes) or 'qconvert verifies BF16, MXFP8 and NVFP4 checkpoints'}",
            )
        else:
            self.ok("format", f"{det.scheme} ({det.dialect})")
        for n in det.conflicts:
            self.fail("format", f"{dst.root}: {n}")
        r.warnings.extend(det.notes)
        self.log(f"verify: {self.src_arg} -> {self.dst_arg} ({det.scheme}, {det.dialect} dialect)")
        self._check_config()
        plan = self._match_names()
        self._check_exclusions()
        self._check_manifest()
        self._compare_values(plan)
        self._finish_thresholds()
        self._diagnose()
        return r

    def _diagnose(self):
        """Without a digest mismatch to name, most tensors disagreeing with SRC is itself the cause
        to lead with (instead of one "re-run the conversion" line per tensor)."""
        r = self.r
        if r.diagnosis or r.ok or r.checks.get("source", "").startswith("ok"):
            return  # digests that match: SRC is DST's source, the failures are DST's own
        bad = sum(not t.ok for t in r.tensors) + self._kept_bad
        total = len(r.tensors) + r.kept_identical + self._kept_bad
        if total >= 4 and bad * 2 > total:
            r.diagnosis = (
                f"{bad} of {total} tensors do not match SRC: DST was probably converted from different "
                "weights than SRC (no source digests to confirm it); pass the SRC DST was converted from"
            )
            r.failures.insert(0, r.diagnosis)

    def _check_config(self):
        sc, dc = self.src.config, self.dst.config
        bad = 0
        for k in sorted(set(sc) | set(dc)):
            if k == "quantization_config":
                continue
            if sc.get(k) != dc.get(k):
                bad += 1
                self.fail(
                    "config",
                    f"{self.dst.root / 'config.json'}: {k!r} is {dc.get(k)!r} but the source has "
                    f"{sc.get(k)!r}; copy it from the source config.json",
                )
        self.ok("config")

    def _match_names(self) -> dict[str, tuple[str, list[str]]]:
        """dst module -> (kind 'kept'|'quantized', source tensor names); checks names/dtypes/shapes."""
        src_t = self._src_entries
        dst_t = self.dst.tensors
        used: set[str] = set()
        plan: dict[str, tuple[str, list[str]]] = {}
        layouts = find_layouts(self.dst.manifest)
        stacked = {m for m, mod in self.mods.items() if mod.stacked}
        fp8_scales = set(self.fp8.scales.values()) if self.fp8 else set()
        if self.decoded is not None and self.fp8 is None:  # MXFP4: the pairs' base names, BF16 in DST
            fp8_scales = set()
        for name, se in src_t.items():
            if name in fp8_scales:
                continue  # an FP8 source's block scales: decoded with their weights, not written
            mod, sfx = split_name(name)
            m = self.mods.get(mod)
            if sfx == "weight" and m is not None and m.format in ("mxfp8", "nvfp4"):
                n, k = se.shape if len(se.shape) == 2 else (None, None)
                if n is None or list(m.shape) != [n, k]:
                    self.fail(
                        "structure",
                        f"tensor {mod}.*: stored as {m.format} of shape {m.shape} but the source "
                        f"{name} is {list(se.shape)}; re-run the conversion",
                    )
                    used |= {f"{mod}.{s}" if not m.stacked else s for s in m.tensors if s not in KEPT_SUFFIXES}
                    continue
                exp = accepted_tensors(m.format, self.det.dialect, m.scale_suffix, n, k)
                for s, (dt, shape) in m.tensors.items():
                    if s in KEPT_SUFFIXES:
                        continue  # the Linear's bias: its own source tensor, checked as kept below
                    tname = f"{mod}.{s}"
                    used.add(tname)
                    if s not in exp:
                        self.fail(
                            "structure",
                            f"tensor {tname!r}: unexpected for {m.format} in the {self.det.dialect} "
                            f"dialect (expected {', '.join(sorted(exp))}); remove it or re-convert",
                        )
                        continue
                    tags, want = exp[s]
                    scalar_ok = want is None and shape in ([], [1])
                    if dt not in tags or not (scalar_ok or shape == want):
                        self.fail(
                            "structure",
                            f"tensor {tname!r}: {dt} {shape}, expected {'/'.join(sorted(tags))} "
                            f"{want if want is not None else '[] or [1]'}; re-run the conversion",
                        )
                for s in exp:
                    if s in REQUIRED_SUFFIXES and s not in m.tensors:
                        self.fail(
                            "structure",
                            f"tensor {mod}.{s!s}: missing ({m.format}, {self.det.dialect} dialect "
                            f"needs it); re-run the conversion",
                        )
                plan[mod] = ("quantized", [name])
                continue
            if name in dst_t:
                used.add(name)
                de = dst_t[name]
                sdt = "BF16" if self.fp8 and name in self.fp8.scales else se.dtype  # kept: its BF16 decode
                if de.dtype != sdt or tuple(de.shape) != tuple(se.shape):
                    self.fail(
                        "structure",
                        f"tensor {name!r}: {de.dtype} {list(de.shape)} in DST but {sdt} "
                        f"{list(se.shape)} in the source; re-run the conversion",
                    )
                    continue
                plan.setdefault(f"kept:{name}", ("kept", [name]))
                continue
            if stacked and re.search(r"\.experts\.\d+\.", name):
                continue  # checked against the stacked layout tensors below
            self.fail("structure", f"tensor {name!r}: in the source but not in DST; re-run the conversion")
        layers = self._layout_layers(dst_t) if stacked else {}
        if layers:
            # checked by re-laying out SRC's experts and comparing bytes (_check_layout_layer)
            for prefix, names in layers.items():
                used |= set(names)
                plan[f"layout:{prefix}"] = ("layout", sorted(names))
            stacked = {m for m in stacked if not any(split_name(n)[0] == m for ns in layers.values() for n in ns)}
        if stacked:
            msg = (
                "pre-shuffled expert tensors "
                + ", ".join(sorted(stacked)[:2])
                + (f" (+{len(stacked) - 2})" if len(stacked) > 2 else "")
                + (f" in layout {layouts[0].get('layout')}" if layouts else " without a layout contract")
                + ": decoding kernel layouts is not implemented in verify; verify the plain checkpoint before "
                "re-laying it out"
            )
            self.fail("structure", msg)
            for m in stacked:
                used |= {n for n in dst_t if split_name(n)[0] == m}
        for name in sorted(set(dst_t) - used):
            self.fail(
                "structure",
                f"tensor {name!r} in {self.dst.shard_of[name]}: not derived from any source tensor "
                "(swapped or extra); remove it or re-run the conversion",
            )
        self.ok("structure", f"ok ({len(dst_t)} tensors)")
        return plan

    def _layout_layers(self, dst_t) -> dict[str, list[str]]:
        """Layout tensors per MoE layer (``{prefix}.trtllm[_tpR_epQ].{param}``) of a layout that can
        be re-made from SRC: written by qconvert with a recorded recipe; {} otherwise."""
        from .convert.layout_jobs import parse_rank_tag

        man = self.dst.manifest or {}
        lay = layout_section(man) if self.det.producer == "qconvert" else None
        if not isinstance(lay, dict) or not isinstance(lay.get("layers"), dict) or man.get("recipe") not in ALL_RECIPES:
            return {}
        out: dict[str, list[str]] = {}
        for name in dst_t:
            for prefix in lay["layers"]:
                if name.startswith(prefix + "."):
                    tag = name[len(prefix) + 1 :].split(".", 1)[0]
                    if parse_rank_tag(tag) is not None:
                        out.setdefault(prefix, []).append(name)
        self.layout = lay
        return out

    def _check_layout_layer(self, prefix: str, got: dict[str, torch.Tensor]):
        """A pre-shuffled MoE layer whose plain scalars the layout does not keep (vLLM folds the
        activation scales into NVFP4's global scales; compressed-tensors' encode-convention global
        scale is not stored): the converter is deterministic, so SRC's experts are quantized and
        laid out again, with the activation scales DST holds (calibration data, not derivable from
        SRC), and every layout tensor must equal DST's byte for byte. Error figures come from DST's
        weights and block scales through the exact inverse of the layout."""
        from types import SimpleNamespace

        from .convert import layout_jobs
        from .convert.jobs import moe_layer_job
        from .convert.layouts import trtllm
        from .convert.numerics.nvfp4 import cpu_tensor_scalars

        lay, recipe = self.layout, (self.dst.manifest or {}).get("recipe")
        scheme, engine, tp, ep = lay["layers"][prefix], lay["engine"], int(lay["tp"]), int(lay["ep"])
        ranks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for name, t in got.items():
            tag, param = name[len(prefix) + 1 :].split(".", 1)
            ranks.setdefault(layout_jobs.parse_rank_tag(tag), {})[param] = t
        n_exp = 0
        while f"{prefix}.{n_exp}.gate_proj.weight" in self._src_shard:
            n_exp += 1
        src_names = [f"{prefix}.{e}.{p}.weight" for e in range(n_exp) for p in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for n in src_names if n not in self._src_shard]
        if not n_exp or missing:
            self.fail(
                "structure",
                f"tensor {prefix}.*: DST lays out MoE experts that SRC does not have "
                f"({missing[0] if missing else prefix + '.0.gate_proj.weight'} missing); pass the right SRC",
            )
            return
        xs = {n: self._read_src(n) for n in src_names}
        members = [SimpleNamespace(name=n, shape=tuple(xs[n].shape), module=n[: -len(".weight")]) for n in src_names]
        i_size, h_size = members[0].shape
        nv_recipe = recipe if recipe in NVFP4_RECIPES else DEFAULT_NVFP4_RECIPE
        try:
            input_scales = None
            if scheme == "nvfp4":
                # activation scales: DST's own (vLLM keeps one per rank: the max over its experts)
                if engine == "sglang":
                    plain = trtllm.untransform_moe_layer(
                        ranks, scheme, engine, intermediate_size=i_size, hidden_size=h_size, tp=tp, ep=ep
                    )
                    a13, a2 = plain["w13_input_scale"].reshape(n_exp, -1), plain["w2_input_scale"].reshape(n_exp)
                else:
                    per = n_exp // ep
                    a13 = torch.stack(
                        [ranks[(0, e // per)]["w13_input_scale"].reshape(-1)[e % per] for e in range(n_exp)]
                    ).reshape(n_exp, 1)
                    a2 = torch.stack(
                        [ranks[(0, e // per)]["w2_input_scale"].reshape(-1)[e % per] for e in range(n_exp)]
                    )
                input_scales = {}
                for e in range(n_exp):
                    input_scales[f"{prefix}.{e}.gate_proj"] = a13[e, 0].reshape(())
                    input_scales[f"{prefix}.{e}.up_proj"] = a13[e, -1].reshape(())
                    input_scales[f"{prefix}.{e}.down_proj"] = a2[e].reshape(())
            opts = SimpleNamespace(input_mode="copied", allow_non_finite=True, device="cpu", recipe=nv_recipe)
            want = moe_layer_job(prefix, members, scheme, engine, tp, ep, opts, input_scales).fn(xs)
        except (QConvertError, KeyError, IndexError, RuntimeError, ValueError) as ex:
            self.fail(
                "structure",
                f"tensor {prefix}.*: the layout tensors cannot be re-made from SRC ({ex}); re-run the conversion",
            )
            return
        exact = True
        for name in sorted(set(want) | set(got)):
            a, b = got.get(name), want.get(name)
            if a is None or b is None:
                exact = False
                self.fail(
                    "structure",
                    f"tensor {name!r}: "
                    + ("missing from DST" if a is None else "not part of the layout")
                    + f" ({lay.get('name')} for {engine}); re-run the conversion",
                )
            elif a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
                exact = False
                self.fail(
                    "structure",
                    f"tensor {name!r}: {a.dtype} {list(a.shape)}, the layout gives {b.dtype} "
                    f"{list(b.shape)}; re-run the conversion",
                )
            else:
                ab, bb = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
                nd = int((ab != bb).sum())
                if nd:
                    exact = False
                    self.fail(
                        "values",
                        f"tensor {name!r}: {nd} of {ab.numel()} bytes differ from SRC's experts "
                        f"quantized ({nv_recipe if scheme == 'nvfp4' else recipe}) and laid out again; "
                        "the tensor was modified or DST was converted from other weights — re-run the "
                        "conversion",
                    )
        self.r.checks["layout"] = (
            "FAILED"
            if not exact
            else self.r.checks.get(
                "layout", f"ok ({lay.get('name')} for {engine}: SRC's experts laid out again equal DST byte for byte)"
            )
        )
        if scheme == "bf16":
            if exact:
                self.r.kept_identical += len(src_names)
            return
        # figures: DST's weights and block scales through the exact inverse; NVFP4 global scales
        # from SRC's amax (DST's folded ones were compared above)
        try:
            plain = trtllm.untransform_moe_layer(
                ranks, scheme, engine, intermediate_size=i_size, hidden_size=h_size, tp=tp, ep=ep
            )
        except (QConvertError, KeyError, IndexError, RuntimeError, ValueError) as ex:
            self.fail(
                "values", f"tensor {prefix}.*: the layout tensors cannot be decoded ({ex}); re-run the conversion"
            )
            return
        plain = {
            k: v for k, v in plain.items() if k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
        }
        if scheme == "nvfp4":

            def s2(*names):
                g = np.max(np.array([self._source_amax(n[: -len(".weight")]) for n in names], dtype=np.float32))
                return float(cpu_tensor_scalars(g, nv_recipe)[0])

            w13s = [s2(f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight") for e in range(n_exp)]
            plain["w13_weight_scale_2"] = torch.tensor([[v, v] for v in w13s], dtype=torch.float32)
            plain["w2_weight_scale_2"] = torch.tensor(
                [s2(f"{prefix}.{e}.down_proj.weight") for e in range(n_exp)], dtype=torch.float32
            )
        per_expert = trtllm.unstack_hf_experts(plain, prefix)
        for n in src_names:
            mod = n[: -len(".weight")]
            ts = {k[len(mod) + 1 :]: v for k, v in per_expert.items() if k.startswith(mod + ".")}
            self._check_quantized(Module(mod, scheme, list(xs[n].shape), 0, {}, WEIGHT_SCALE), ts, xs[n], None)
            self.r.tensors[-1].exact = exact

    # -- exclusion list ---------------------------------------------------------------------------
    def _check_exclusions(self):
        from .convert.plan import classify

        det, dst = self.det, self.dst
        if det.scheme not in ("mxfp8", "nvfp4"):
            self.ok("exclusions", "skipped: not quantized")
            return
        lists = det.exclusion_keys
        man = dst.manifest if det.producer == "qconvert" else None
        # compressed-tensors writes the list in its own forms (exact names / ``re:``), so the
        # manifest's generic list is not a literal copy there; the per-module check below applies.
        if man is not None and "exclusions" in man and det.dialect != "compressed-tensors":
            lists = dict(lists)
            lists[f"{MANIFEST_NAME} exclusions"] = list(man["exclusions"])
        need = EXCLUSION_KEYS.get((det.scheme, det.dialect), ())
        for key in need:
            if config_where(key) not in lists:
                self.fail(
                    "exclusions",
                    f"{dst.root / 'config.json'}: quantization_config.{key} is missing; the "
                    f"{det.dialect} dialect keeps its exclusion list there — re-run the conversion",
                )
        if not lists:
            entries: list[str] = []
        else:
            first_where, entries = next(iter(lists.items()))
            for where, lst in lists.items():
                if set(lst) != set(entries):
                    diff = sorted(set(lst) ^ set(entries))
                    self.fail(
                        "exclusions",
                        f"{where} differs from {first_where} (e.g. {diff[0]!r}); "
                        "the copies of the exclusion list must agree — re-run the conversion",
                    )
        ms = matchers(det.scheme, det.dialect)
        # Linear modules and their formats; experts collapse onto the FusedMoE prefix.
        targets: dict[str, tuple[str, set[str], bool]] = {}
        for m in self.mods.values():
            if m.stacked or len(m.shape) != 2:
                continue
            kind, _, _ = classify(m.name + ".weight", tuple(m.shape))
            if kind in ("embed", "norm"):
                continue
            quant = m.format in ("mxfp8", "nvfp4")
            if kind == "expert":
                pre = m.name.split(".experts.")[0] + ".experts"
                k0, fm, _ = targets.get(pre, ("expert", set(), True))
                targets[pre] = (k0, fm | {m.format if quant else "bf16"}, True)
            else:
                targets[m.name] = (kind, {m.format if quant else "bf16"}, False)
        bad = 0
        for prefix, (kind, fmts, moe) in sorted(targets.items()):
            if len(fmts) > 1:
                self.fail(
                    "exclusions",
                    f"tensor {prefix}.*: experts of one MoE layer are stored as {sorted(fmts)}; "
                    "a FusedMoE layer has one format — re-run the conversion",
                )
                continue
            quant = next(iter(fmts)) != "bf16"
            for who, excluded in ms:
                hit = excluded(prefix, entries, moe)
                if quant and hit:
                    bad += 1
                    self.fail(
                        "exclusions",
                        f"module {prefix!r} is quantized but the exclusion list excludes it for "
                        f"{who}, which would load it as BF16; remove the matching entry",
                    )
                elif not quant and not hit:
                    if who in (SGLANG, SGLANG_MODELOPT) and kind in ("lm_head", "router"):
                        continue  # SGLang never quantizes these
                    bad += 1
                    self.fail(
                        "exclusions",
                        f"module {prefix!r} is stored in BF16 but the exclusion list does not "
                        f"exclude it for {who}, which would try to load it quantized; add "
                        f"{prefix!r} to the list",
                    )
        self.ok("exclusions", f"ok ({len(entries)} entries; {', '.join(w for w, _ in ms)} rules)")

    # -- manifest ---------------------------------------------------------------------------------
    def _check_manifest(self):
        man = self.dst.manifest
        if not man:
            self.ok("manifest", f"skipped: no {MANIFEST_NAME} (not written by qconvert)")
            return
        where = self.dst.root / MANIFEST_NAME
        stacked = any(m.stacked for m in self.mods.values())
        for mod, info in (man.get("tensors") or {}).items():
            m = self.mods.get(mod)
            if m is None and stacked and re.search(r"\.experts\.\d+\.", mod):
                continue  # stored in the stacked layout tensors (reported by the structure check)
            want = (info or {}).get("format")
            if m is None:
                self.fail(
                    "manifest", f"{where}: module {mod!r} is listed but DST has no such tensors; re-run the conversion"
                )
            elif want and m.format != want and not (want == "bf16" and m.format in ("bf16", "f16", "f32")):
                self.fail(
                    "manifest",
                    f"{where}: module {mod!r} is listed as {want} but stored as {m.format}; re-run the conversion",
                )
        self.ok("manifest")

    def _check_hashes(self, out_sha: dict[str, str], src_sha: dict[str, str]):
        man = self.dst.manifest
        if not man:
            self._check_source(src_sha)
            return
        where = self.dst.root / MANIFEST_NAME
        want = (man.get("outputs") or {}).get("sha256") or {}
        out_note = (man.get("outputs") or {}).get("sha256_note")
        n_out = 0
        for fname, digest in sorted(out_sha.items()):
            if fname not in want and out_note:
                continue  # converted with --no-checksums: nothing to compare against
            n_out += 1
            if fname not in want:
                self.fail("checksums", f"{where}: no sha256 for shard {fname}; re-run the conversion")
            elif want[fname] != digest:
                self.fail(
                    "checksums",
                    f"{self.dst.root / fname}: sha256 differs from {MANIFEST_NAME}; the shard was "
                    "modified after conversion — re-run the conversion or restore it",
                )
        src_want = (man.get("source") or {}).get("sha256") or {}
        n_src = sum(h.path.name in src_want for h in self.src.shards)
        note = (man.get("source") or {}).get("sha256_note")
        notes = ("; output " + out_note if out_note else "") + ("; source " + note if note else "")
        self.ok("checksums", f"ok ({n_out} output, {n_src} source shards{notes})")
        self._check_source(src_sha)

    def _check_source(self, src_sha: dict[str, str]):
        """Was DST converted from these SRC files? Decided by the source digests in the manifest;
        without them the report says what cannot be told."""
        man, r = self.dst.manifest, self.r
        exact = (
            "it checks only that DST decodes to SRC within the error bounds, so other weights close to "
            "SRC (another fine-tune of the same model) may pass"
        )
        if self.det.producer == "qconvert" and man and (man.get("recipe") in ALL_RECIPES):
            exact = (
                "it checks that every quantized tensor is exactly what converting SRC gives, so it cannot tell "
                "DST's source from other weights that quantize to the same bytes"
            )
        src_want = ((man or {}).get("source") or {}).get("sha256") or {}
        if not src_want:
            why = (
                (((man or {}).get("source") or {}).get("sha256_note") or "the manifest records none")
                if man
                else f"no {MANIFEST_NAME}"
            )
            msg = f"no source digests ({why}): verify cannot tell whether DST was converted from SRC's files; {exact}"
            r.warnings.append(msg)
            self.ok("source", "not checked: no source digests")
            return
        where = self.dst.root / MANIFEST_NAME
        differ = [
            (h, src_sha[h.path.name], src_want[h.path.name])
            for h in self.src.shards
            if h.path.name in src_want and src_sha[h.path.name] != src_want[h.path.name]
        ]
        names = {h.path.name for h in self.src.shards}
        if differ:
            h, got, want = differ[0]
            diag = (
                f"DST was converted from different weights than SRC: shard {h.path.name} sha256 {got} vs "
                f"{want} in {where}"
                + (f" ({len(differ)} of {len(src_want)} source shards differ)" if len(differ) > 1 else "")
                + "; pass the SRC DST was converted from"
            )
            r.diagnosis = diag
            r.failures.insert(0, diag)
            r.checks["source"] = "FAILED"
        elif set(src_want) != names:
            r.warnings.append(
                f"SRC's shards ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}) are not "
                f"the ones named in {where} ({', '.join(sorted(src_want)[:3])}"
                f"{', ...' if len(src_want) > 3 else ''}), so their digests cannot be compared: verify "
                f"cannot tell whether DST was converted from SRC's files; {exact}"
            )
            self.ok("source", "not checked: SRC's shard names differ from the manifest's")
        else:
            self.ok("source", f"ok ({len(names)} shards match the source digests in {MANIFEST_NAME})")

    # -- values -----------------------------------------------------------------------------------
    def _compare_values(self, plan: dict[str, tuple[str, list[str]]]):
        r = self.r
        # both sides mapped (one mapping per tensor, released with it): no copy of either into buffers
        src_readers = {h.path.name: ShardReader(h, hash_file=False, mapped=True) for h in self.src.shards}
        src_shard = {n: h.path.name for h in self.src.shards for n in h.entries}
        src_shard.update({n: src_shard[v.source] for n, v in self._src_views.items()})
        from .convert.fp8_source import decoding_readers

        src_readers = decoding_readers(src_readers, src_shard, self.fp8)
        by_tensor: dict[str, str] = {}
        for key, (kind, srcs) in plan.items():
            if kind == "kept":
                by_tensor[srcs[0]] = key
            elif kind == "layout":
                for n in srcs:
                    by_tensor[n] = key
            else:
                for s in _quantized_suffixes(self.mods[key]):
                    by_tensor[f"{key}.{s}"] = key
        self._src_readers, self._src_shard = src_readers, src_shard
        self._amax: dict[str, np.float32] = {}
        self._nvfp4_groups = _nvfp4_groups(self.mods)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        recipe = (self.dst.manifest or {}).get("recipe") if self.det.producer == "qconvert" else None
        bar = None
        enabled = self.progress if self.progress is not None else os.isatty(2)
        if enabled:
            from tqdm import tqdm

            bar = tqdm(
                total=self.dst.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc="verify",
                leave=False,
                dynamic_ncols=True,
            )
        out_sha: dict[str, str] = {}
        # source shards the manifest has digests of: hashed on threads of their own meanwhile
        src_want = ((self.dst.manifest or {}).get("source") or {}).get("sha256") or {}
        stop = threading.Event()
        hashers = ThreadPoolExecutor(HASH_STREAMS, thread_name_prefix="qconvert-verify-sha")
        src_sha = {
            h.path.name: hashers.submit(sha256_file, h.path, stop) for h in self.src.shards if h.path.name in src_want
        }
        try:
            for h in self.dst.shards:
                with ShardReader(h, hash_file=True, mapped=True) as rd:
                    for e, t in rd.iter_tensors():
                        if bar:
                            bar.update(e.nbytes)
                        key = by_tensor.get(e.name)
                        if key is None:
                            continue
                        kind, srcs = plan[key]
                        if kind == "kept":
                            s = self._read_src(srcs[0])
                            if self.decoded is not None and srcs[0] in self.decoded.decoded:
                                self._check_decoded(e.name, h.path.name, s, t)
                                continue
                            r.kept_bytes += e.nbytes
                            if s.view(-1).view(torch.uint8).equal(t.view(-1).view(torch.uint8)) if t.numel() else True:
                                r.kept_identical += 1
                            else:
                                self._kept_bad += 1
                                self.fail(
                                    "kept",
                                    f"tensor {e.name!r} in {h.path.name}: kept in BF16 but its bytes differ "
                                    "from the source; re-run the conversion",
                                )
                            continue
                        if kind == "layout":
                            got = pending.setdefault(key, {})
                            got[e.name] = t
                            if len(got) == len(srcs):
                                del pending[key]
                                self._check_layout_layer(key[len("layout:") :], got)
                            continue
                        got = pending.setdefault(key, {})
                        got[split_name(e.name)[1]] = t
                        if len(got) == len(_quantized_suffixes(self.mods[key])):
                            del pending[key]
                            x = self._read_src(srcs[0])
                            self._check_quantized(self.mods[key], got, x, recipe)
                    out_sha[h.path.name] = rd.sha256()
            src_digests = {name: fut.result() for name, fut in src_sha.items()}
        except BaseException:
            stop.set()
            raise
        finally:
            hashers.shutdown(wait=True, cancel_futures=True)
            if bar:
                bar.close()
            for rd in src_readers.values():
                rd.close()
        self.ok("kept", f"ok ({r.kept_identical} byte-identical)")
        self.ok("values", f"ok ({len(r.tensors)} quantized tensors)")
        if r.decoded:
            n_exact = sum(bool(t.lossless) for t in r.decoded)
            self.ok(
                "decoded",
                f"ok ({len(r.decoded)} tensors are the BF16 of the {self.decoded.kind} source's decode, "
                f"{n_exact} of them exactly its values)",
            )
        if self.fp8 and any(t.lossless is not None for t in r.tensors):
            ll = [t for t in r.tensors if t.lossless is not None]
            self.ok(
                "lossless",
                f"ok ({sum(t.lossless for t in ll)} of {len(ll)} tensors from FP8 weights decode "
                "exactly to the source's values; the others were requantized)",
            )
        self._check_hashes(out_sha, src_digests)

    def _check_decoded(self, name: str, shard: str, x: torch.Tensor, t: torch.Tensor):
        """DST tensor ``name`` against the fp32 decode ``x`` of its quantized source: its bytes must be
        the BF16 of ``x`` (as ``qconvert bf16`` writes it; docs/formats.md#quantized-sources-decoded-to-bf16);
        ``lossless`` where it equals ``x`` bit for bit."""
        want = x.to(torch.bfloat16)
        same = (
            tuple(t.shape) == tuple(want.shape)
            and t.dtype == torch.bfloat16
            and torch.equal(want.view(torch.int16), t.view(torch.int16))
        )
        lossless = same and bool(torch.equal(t.float().view(torch.int32), x.contiguous().view(torch.int32)))
        err = (t.double() - x.double()) if tuple(t.shape) == tuple(x.shape) else None
        xn = float(x.double().square().sum()) if x.numel() else 0.0
        en = float(err.square().sum()) if err is not None else math.inf
        rel, sqnr = _figures(xn, en)
        self.r.decoded.append(TensorResult(name, "bf16", list(t.shape), rel, sqnr, 0.0, same, same, lossless))
        if not same:
            self.fail(
                "decoded",
                f"tensor {name!r} in {shard}: its bytes are not the BF16 of the source's {self.decoded.kind} decode "
                "(modified or swapped); re-run qconvert bf16",
            )

    def _check_quantized(self, m: Module, ts: dict[str, torch.Tensor], x: torch.Tensor, recipe: str | None):
        fmt = m.format
        figures = encoded_compare(x, ts, fmt, m, CPU_WORKERS)
        if figures is None:
            try:
                deq, s2 = _dequantize(fmt, self.det.dialect, ts, m)
            except Exception as ex:  # malformed tensors already reported by the structure check
                self.fail("values", f"tensor {m.name}.weight: cannot be decoded ({ex}); re-run the conversion")
                return
            figures = compare(x, deq, fmt, s2)
        rel, sqnr, worst, first = figures
        res = TensorResult(m.name, fmt, list(m.shape), rel, sqnr, worst)
        if first is not None:
            row, blk = first
            sfx = m.scale_suffix or WEIGHT_SCALE
            sc = ts.get(sfx)
            sv = sc.view(torch.uint8)[row, blk].item() if sc is not None and sc.dim() == 2 else "?"
            res.ok = False
            self.fail(
                "values",
                f"tensor {m.name}.{sfx}: block [{row}, {blk}] (scale byte {sv}) decodes with error "
                f"{worst * BLOCK_BOUND[fmt]:.2f}x the block max (bound {BLOCK_BOUND[fmt]}); the scale or "
                f"elements are corrupt or belong to another tensor — re-run the conversion",
            )
        if fmt == "mxfp8" and recipe == MXFP8_RECIPE:
            from .convert.numerics.mxfp8 import mxfp8_quantize

            q_ref, s_ref = mxfp8_quantize(x)
            tinfo = ((self.dst.manifest or {}).get("tensors") or {}).get(m.name)
            from .convert.fp8_source import BYTES_KEPT, mxfp8_reference

            if self.fp8 and isinstance(tinfo, dict) and tinfo.get("source_path") in BYTES_KEPT:
                w = f"{m.name}.weight"  # the conversion kept the power-of-two blocks' E4M3 bytes
                mxfp8_reference(self.fp8, w, self._src_readers[self._src_shard[w]], q_ref, s_ref)
            sc = ts[m.scale_suffix].view(torch.uint8)
            bad_s = (sc != s_ref).nonzero()
            bad_q = (ts["weight"].view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
            res.exact = not len(bad_s) and not len(bad_q)
            if not res.exact and res.ok:
                res.ok = False
                if len(bad_s):
                    rr, cc = bad_s[0].tolist()
                    self.fail(
                        "values",
                        f"tensor {m.name}.{m.scale_suffix}: [{rr}, {cc}] is {int(sc[rr, cc])}, RCEIL "
                        f"gives {int(s_ref[rr, cc])} ({len(bad_s)} scale bytes differ); re-run the conversion",
                    )
                else:
                    rr, cc = bad_q[0].tolist()
                    self.fail(
                        "values",
                        f"tensor {m.name}.weight: element [{rr}, {cc}] differs from RCEIL quantization "
                        f"({len(bad_q)} elements differ); re-run the conversion",
                    )
        if fmt == "nvfp4" and recipe in NVFP4_RECIPES:
            self._check_nvfp4_exact(m, ts, x, recipe, res)
        if self.fp8 and f"{m.name}.weight" in self.fp8.scales:
            try:
                deq, _ = _dequantize(fmt, self.det.dialect, ts, m)
                res.lossless = bool(torch.equal(deq.float(), x.float()))
            except Exception:  # malformed tensors: reported above
                res.lossless = False
        self.r.tensors.append(res)

    def _read_src(self, name: str) -> torch.Tensor:
        """SRC's tensor ``name`` (mapped), or one expert's matrix of a fused SRC tensor, or the fp32
        decode of an MXFP4 pair."""
        if self.decoded is not None and self.fp8 is None and name in self.decoded.decoded:
            from .convert.decode import read_decoded

            return read_decoded(self.decoded, name, lambda n: self._src_readers[self._src_shard[n]].read(n))
        v = self._src_views.get(name)
        if v is None:
            return self._src_readers[self._src_shard[name]].read(name)
        return fused.view(self._src_readers[self._src_shard[v.source]].read(v.source), v)

    def _source_amax(self, mod: str) -> np.float32:
        """max |w| of the source weight of ``mod``, exactly (fp32; NaN propagates)."""
        from .convert.numerics import cpu_kernels

        if mod not in self._amax:
            name = f"{mod}.weight"
            t = self._read_src(name)
            if cpu_kernels.usable(t):
                self._amax[mod] = cpu_kernels.abs_max_f32(t, CPU_WORKERS)
            else:
                self._amax[mod] = np.float32(float(t.float().abs().amax())) if t.numel() else np.float32(0)
        return self._amax[mod]

    def _check_nvfp4_exact(
        self, m: Module, ts: dict[str, torch.Tensor], x: torch.Tensor, recipe: str, res: TensorResult
    ):
        """qconvert's NVFP4 is a function of the source: the global scale of the fused group's amax
        (q/k/v, gate/up share one), block scales and codes by the recorded recipe. Every byte must
        equal a fresh quantization: a global scale off in its lowest bit, or DST made from other
        weights, fails here although its error figures look fine."""
        from .convert.numerics.nvfp4 import encode_global_scale, nvfp4_quantize

        members = self._nvfp4_groups.get(m.name, [m.name])
        g = np.max(np.array([self._source_amax(n) for n in members], dtype=np.float32))
        packed, scale, scale_2 = nvfp4_quantize(x, global_amax=g, recipe=recipe, workers=CPU_WORKERS)
        if WEIGHT_SCALE_2 in ts:  # decode convention (ModelOpt)
            sfx, want = WEIGHT_SCALE_2, scale_2.float().reshape(1)
        else:  # compressed-tensors' encode convention, as the writer computes it from the group amax
            sfx = WEIGHT_GLOBAL_SCALE
            want = torch.tensor([encode_global_scale(g, recipe)], dtype=torch.float32)
        stored = ts.get(sfx)
        q = _nvfp4_codes(ts)
        if (
            stored is None
            or stored.dtype != torch.float32
            or stored.numel() != 1
            or q is None
            or q.shape != packed.shape
            or ts[WEIGHT_SCALE].shape != scale.shape
        ):
            res.exact = False
            return  # the structure check reports it
        stored = stored.reshape(1)
        bad_g = not bool(stored.view(torch.int32).equal(want.view(torch.int32)))
        sc_got, sc_want = ts[WEIGHT_SCALE].view(torch.uint8), scale.view(torch.uint8)
        same_s = np.array_equal(sc_got.numpy(), sc_want.numpy())  # a byte compare, no temporaries
        same_q = np.array_equal(q.view(torch.uint8).numpy(), packed.numpy())
        res.exact = not bad_g and same_s and same_q
        if res.exact or not res.ok:
            return
        bad_s = (sc_got != sc_want).nonzero() if not same_s else ()
        bad_q = (q.view(torch.uint8) != packed).nonzero() if not same_q else ()
        res.ok = False
        group = f" of the group {', '.join(members)}" if len(members) > 1 else ""
        if bad_g:
            sv, wv = float(stored[0]), float(want[0])
            self.fail(
                "values",
                f"tensor {m.name}.{sfx}: {sv!r} (fp32 bits {int(stored.view(torch.int32)[0]) & 0xFFFFFFFF:#010x}) "
                f"but the source's amax {float(g)!r}{group} gives {wv!r} "
                f"({int(want.view(torch.int32)[0]) & 0xFFFFFFFF:#010x}); the global scale was modified or "
                "DST was converted from other weights — re-run the conversion",
            )
        elif len(bad_s):
            rr, cc = bad_s[0].tolist()
            self.fail(
                "values",
                f"tensor {m.name}.weight_scale: [{rr}, {cc}] is byte {int(ts[WEIGHT_SCALE].view(torch.uint8)[rr, cc])}, "
                f"the {recipe} recipe gives {int(scale.view(torch.uint8)[rr, cc])} ({len(bad_s)} block scales "
                "differ); re-run the conversion",
            )
        else:
            rr, cc = bad_q[0].tolist()
            self.fail(
                "values",
                f"tensor {m.name}.{WEIGHT_PACKED if WEIGHT_PACKED in ts else WEIGHT}: byte [{rr}, {cc}] "
                f"differs from {recipe} quantization ({len(bad_q)} bytes differ); re-run the conversion",
            )

    def _finish_thresholds(self):
        r = self.r
        for fmt in sorted({t.format for t in r.tensors}):
            r.max_rel_err[fmt] = self.user_max if self.user_max is not None else DEFAULT_MAX_REL_ERR[fmt]
        for t in r.tensors:
            lim = r.max_rel_err[t.format]
            if not all(map(_finite_or_perfect, (t.rel_err, t.sqnr_db, t.block_err))):
                # a NaN compares false with any bound: every figure must be a number to pass
                t.ok = False
                self.fail(
                    "values",
                    f"tensor {t.module}.weight: non-finite error figures (rel err {t.rel_err}, SQNR "
                    f"{t.sqnr_db} dB, block {t.block_err}): it or its source holds NaN/Inf or it "
                    "does not decode — re-run the conversion",
                )
            elif not t.rel_err <= lim:
                t.ok = False
                self.fail(
                    "values",
                    f"tensor {t.module}.weight: relative error {t.rel_err:.4f} exceeds --max-rel-err "
                    f"{lim}; it does not decode to its source (corrupt or swapped) — re-run the conversion",
                )


#: Default bound on the engine's mean next-token KL to the BF16 source, per scheme: several times
#: what the demo models measure (MXFP8 ~0.02, NVFP4 W4A16 ~0.23, W4A4 unit scales ~0.43), far
#: below a checkpoint with swapped layers (~0.6).
MAX_ENGINE_KL = {"mxfp8": 0.1, "nvfp4": 0.55}


@ctrl_c_safe
def verify(
    src: str,
    dst: str,
    max_rel_err: float | None = None,
    progress: bool | None = False,
    log: Callable[[str], None] | None = None,
    engine: str | None = None,
    max_kl: float | None = None,
) -> VerifyReport:
    """Verify checkpoint ``dst`` against its BF16 source ``src``. Never raises for a failed check:
    failures are in ``report.failures`` (``report.ok`` is False)."""
    rep = _verify_layout(src, dst, max_rel_err, progress, log)
    if rep is None:
        v = _Verifier(src, dst, max_rel_err, progress, log or (lambda s: None))
        rep = v.run()
    if engine:
        rep.engine = engine_compare(src, dst, engine, log or (lambda s: None))
        if rep.engine.get("error"):
            rep.failures.append(rep.engine["error"])
            rep.checks["engine"] = "FAILED"
        elif rep.engine.get("available"):
            lim = max_kl if max_kl is not None else MAX_ENGINE_KL.get(rep.scheme)
            kl = rep.engine.get("mean_kl")
            figs = {k: rep.engine.get(k) for k in ("mean_kl", "max_kl", "top1_agreement")}
            bad = {
                k: v
                for k, v in figs.items()
                if (v is None and k == "mean_kl") or (v is not None and not math.isfinite(v))
            }
            if bad:  # NaN compares false with any bound: a figure that is not a number fails
                nf = rep.engine.get("nonfinite_positions")
                rep.failures.append(
                    "vLLM: "
                    + ", ".join(f"{k} {v}" for k, v in bad.items())
                    + (f" ({nf} of {rep.engine.get('positions')} positions have non-finite logprobs)" if nf else "")
                    + "; DST does not produce valid next-token distributions in the "
                    "engine (garbage or non-finite outputs) — check the exclusion list (tied lm_head?) and scales"
                )
                rep.checks["engine"] = "FAILED"
            elif lim is not None and not kl <= lim:
                rep.failures.append(
                    f"vLLM: mean next-token KL {kl:.4f} to the source exceeds {lim} (top-1 agreement "
                    f"{rep.engine.get('top1_agreement', float('nan')):.3f}); the checkpoint runs but "
                    "does not behave like its source — check the exclusion list and scales, or raise --max-kl"
                )
                rep.checks["engine"] = "FAILED"
            else:
                rep.checks["engine"] = "ok"
        else:
            rep.checks["engine"] = "skipped: " + rep.engine["message"]
    return rep


def _verify_layout(src, dst, max_rel_err, progress, log) -> VerifyReport | None:
    """A pre-shuffled checkpoint is verified through its exact inverse: unshuffle it into a temporary
    directory (bit-exact, see convert/unshuffle.py) and verify that plain checkpoint. None when
    ``dst`` has no qconvert layout or the inverse is not available for it (then the structural
    checks report the layout tensors as not decodable)."""
    import tempfile

    from .convert.checkpoint import read_manifest

    try:
        layout = layout_section(read_manifest(dst))
    except QConvertError:  # an unreadable manifest: the structural checks report it
        return None
    if layout is None:
        return None
    from .convert.unshuffle import unshuffle_checkpoint
    from .errors import QConvertError as _QE

    with tempfile.TemporaryDirectory(prefix="qconvert-verify-") as td:
        plain = Path(td) / "plain"
        try:
            unshuffle_checkpoint(dst, plain)
        except _QE:
            # not invertible (scalars the engine folds): the verifier re-lays out SRC and compares
            (log or (lambda s: None))(
                f"layout {layout.get('name')} for {layout.get('engine')} is not "
                "invertible bit-exactly here: comparing DST with SRC's experts laid out again"
            )
            return None
        rep = _Verifier(src, str(plain), max_rel_err, progress, log or (lambda s: None)).run()
    rep.dst = str(dst)
    rep.checks["layout"] = f"ok (unshuffled bit-exactly from {layout.get('name')}, then verified)"
    return rep


def engine_compare(src: str, dst: str, engine: str, log: Callable[[str], None]) -> dict:
    """Top-1 agreement / mean KL of next-token distributions in a real engine, where available."""
    if engine != "vllm":
        return {"available": False, "message": f"engine {engine!r} is not supported; use --check-in-engine vllm"}
    try:
        from .engine.vllm_compare import compare_in_vllm
    except ImportError as e:
        return {"available": False, "message": f"vLLM comparison is unavailable here ({e.__class__.__name__}: {e})"}
    log("engine: running source and DST in vLLM (this takes a while)")
    try:
        res = compare_in_vllm(src, dst, VERIFY_PROMPTS, 8)
    except QConvertError as e:  # the first line names the worker's real error (vllm_compare.run_in_vllm)
        return {"available": True, "error": f"vLLM comparison failed: {str(e).splitlines()[0]}"}
    keep = (
        "top1_agreement",
        "mean_kl",
        "max_kl",
        "positions",
        "generation_agreement",
        "max_abs_logprob_diff",
        "nonfinite_positions",
    )
    return {"available": True, **{k: res[k] for k in keep if k in res}}


# ---- text summary -------------------------------------------------------------------------------


def format_report(r: VerifyReport, worst: int = 5) -> str:
    lines = [f"verify: {r.src} -> {r.dst} ({r.scheme}, {r.dialect} dialect)"]
    if r.diagnosis:
        lines.append(f"  diagnosis  : {r.diagnosis}")
    for name, st in r.checks.items():
        lines.append(f"  {name:<11}: {st}")
    if r.tensors:
        rels = [t.rel_err for t in r.tensors]
        exact = [t.exact for t in r.tensors if t.exact is not None]
        sq = [t.sqnr_db for t in r.tensors]
        lines.append(
            f"  quantized  : {len(r.tensors)} tensors, rel err mean {sum(rels) / len(rels):.4f} max "
            f"{max(rels, key=_nan_last):.4f}, SQNR min {-max((-v for v in sq), key=_nan_last):.1f} dB"
            + (f"; bytes equal a fresh quantization {sum(exact)}/{len(exact)}" if exact else "")
        )
    lines.append(f"  kept BF16  : {r.kept_identical} tensors byte-identical to the source")
    if r.decoded:
        bad = [t.module for t in r.decoded if not t.ok]
        rounded = [t.module for t in r.decoded if t.ok and not t.lossless]
        lines.append(
            f"  decoded    : {len(r.decoded)} tensors, {len(r.decoded) - len(bad) - len(rounded)} exactly the source's "
            f"values, {len(rounded)} its BF16 rounding" + (f", {len(bad)} FAILED" if bad else "")
        )
        for t in r.decoded:
            what = "FAILED" if not t.ok else "lossless" if t.lossless else f"rounded (rel err {t.rel_err:.2e})"
            lines.append(f"    {t.module:<56} {what}")
    if r.engine:
        if r.engine.get("available") and "top1_agreement" in r.engine:
            lines.append(
                f"  vLLM       : top-1 agreement {r.engine['top1_agreement']:.3f}, mean KL {r.engine['mean_kl']:.4g} "
                f"over {r.engine.get('positions')} positions"
            )
        elif not r.engine.get("available"):
            lines.append(f"  vLLM       : {r.engine['message']}")
    g = r.groups()
    if g:
        lines.append("  per group (rel err mean / max, min SQNR):")
        for name, d in g.items():
            lines.append(
                f"    {name:<50} {d['format']:<6} x{d['count']:<5} {d['mean_rel_err']:.4f} / {d['max_rel_err']:.4f}  "
                f"{d['min_sqnr_db']:.1f} dB"
            )
        lines.append("  worst tensors:")
        for t in r.worst(worst):
            lines.append(
                f"    {t.module:<50} rel err {t.rel_err:.4f}  SQNR {t.sqnr_db:.1f} dB" + ("" if t.ok else "  FAILED")
            )
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    if r.ok:
        lines.append("PASSED")
    elif r.diagnosis:
        rest = [f for f in r.failures if f != r.diagnosis]
        lines.append(f"FAILED: {r.diagnosis}")
        if rest:
            lines.append(
                f"  {len(rest)} further problem{'s' if len(rest) != 1 else ''}, expected from that cause "
                f"(first {min(5, len(rest))}; all in --json):"
            )
            lines += [f"  - {f}" for f in rest[:5]]
    else:
        lines.append(f"FAILED ({len(r.failures)} problem{'s' if len(r.failures) != 1 else ''}):")
        for f in r.failures[:50]:
            lines.append(f"  - {f}")
        if len(r.failures) > 50:
            lines.append(f"  ... {len(r.failures) - 50} more (see --json)")
    return "\n".join(lines)
