"""The files a conversion writes besides the weights: config.json (with the dialect's
quantization_config), the dialect's extra files, the shard index, the source's other files, and
the manifest (qconvert.json)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..errors import QConvertError
from . import dialects
from . import resume as _resume
from .checkpoint import INDEX_NAME, Checkpoint
from .jobs import Job, out_nbytes, source_for_outputs
from .numerics.nvfp4 import global_div
from .options import ConvertOptions
from .plan import QUANTIZE, Plan

MANIFEST_NAME = "qconvert.json"
MXFP8_SCALE_RULE = "RCEIL: E = ceil(log2(amax/448)) in fp32, elements e4m3 RNE of x*2^-E (docs/formats.md#mxfp8-scale-rule)"
NVFP4_SCALE_RULE = {
    "te": "TransformerEngine / FlashInfer (no fast math) order: s = e4m3(amax_blk * (S_enc / 6)), codes e2m1_rn(x * 1/(s / S_enc)), S_enc = 2688 / global amax",
    "modelopt": "ModelOpt NVFP4QTensor order: s = e4m3(clamp(amax_blk / (6 * ws2), 2^-9, 448)), codes e2m1_rne(x / (s * ws2)), ws2 = global amax / 2688",
    "4over6": "TransformerEngine 2.17 4over6 (nvfp4_e4m3_max 256, MAE, no fast math): per block s6 = e4m3((amax_blk / 6) * S_enc), s4 = e4m3(1.5 * that), codes e2m1_rn(x * 1/(s / S_enc)) for each; the one with the smaller sum |decoded - x| kept (ties: s6); S_enc = 1536 / global amax",
}
MXFP8_ZERO_POLICY = "E8M0 byte 0 never written: exponent clamped to >= -126 (byte 1); only blocks with amax < 448*2^-127 (all-zero blocks) differ from online quantizers"



def _write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_metadata(ckpt: Checkpoint, plan: Plan, jobs: list[Job], layout_layers: dict[str, str], scheme: str,
                   dialect: str, tmp: Path, opts: ConvertOptions, input_sha: dict, output_sha: dict,
                   created: str | None = None, source=None):
    """``source``: the quantized source the jobs decoded (fp8_source.Fp8BlockSource), or None."""
    config, extra = output_config(ckpt.config, plan, scheme, dialect, opts)
    _write_json(tmp / "config.json", config)
    for fname, obj in extra.items():
        _write_json(tmp / fname, obj)

    if len(ckpt.shards) > 1:
        weight_map, total = {}, 0
        shard_of = ckpt.shard_of()  # a dict over every tensor: build it once, not per output
        for j in jobs:
            for o, s in zip(j.outputs, source_for_outputs(j)):
                weight_map[o.name] = ckpt.shards[shard_of[s]].path.name
                total += out_nbytes(o)
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total},
                                       "weight_map": dict(sorted(weight_map.items()))})
    for d in ckpt.extra_dirs:  # folders of SRC (sentence-transformers' 1_Pooling/, 2_Normalize/, ...)
        (tmp / d.relative_to(ckpt.root)).mkdir(parents=True, exist_ok=True)
    for p in ckpt.extra_files:  # files of SRC, subfolders too, guarded (checkpoint.extra_members)
        shutil.copy2(p, tmp / p.relative_to(ckpt.root))

    manifest = {
        "qconvert_version": __version__,
        "created": created or _resume.created_timestamp(),
        "scheme": scheme,
        "dialect": dialect,
        "engines": dialects.engines_for(scheme, dialect),
        "source": {"id": ckpt.source_id, "revision": ckpt.revision, "architecture": plan.arch_name,
                   "sha256": {n: d for n, d in input_sha.items() if d},
                   **({} if all(input_sha.values()) else
                      {"sha256_note": "not recorded (--no-checksums)" if not opts.output_checksums
                       else "not recorded (--no-source-checksums)"}),
                   **({} if source is None else {"quantized": source.manifest()})},
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts.plan).items()},
        "non_finite_allowed": bool(opts.allow_non_finite),
        "bf16_layers": plan.bf16_layers,
        "exclusions": plan.exclusions,
        "outputs": {"sha256": {n: d for n, d in output_sha.items() if d},
                    **({} if all(output_sha.values()) else {"sha256_note": "not recorded (--no-checksums)"})},
        "tensors": {},
    }
    manifest.update(scheme_keys(scheme, dialect, opts))
    if opts.layout:
        from .layout_jobs import layout_manifest
        manifest["layout"] = layout_manifest(plan, layout_layers, opts.engine, opts.tp, opts.ep)
    manifest["tensors"] = module_formats(plan, scheme, source)
    _write_json(tmp / MANIFEST_NAME, manifest)



def scheme_keys(scheme: str, dialect: str, opts: ConvertOptions) -> dict:
    """The manifest's keys that say how the scheme was applied (recipe, scale rule, activations)."""
    out: dict = {}
    if scheme == "mxfp8":
        out["recipe"] = "rceil"
        out["scale_rule"] = MXFP8_SCALE_RULE
        out["zero_block_scale_byte"] = 1
        out["zero_block_policy"] = MXFP8_ZERO_POLICY
    if scheme == "nvfp4":
        out["recipe"] = opts.recipe
        out["scale_rule"] = NVFP4_SCALE_RULE[opts.recipe]
        div = int(global_div(opts.recipe))
        out["global_scale"] = (f"weight_scale_2 = group amax / {div} (decode)" if dialect == "modelopt"
                               else f"weight_global_scale = {div} / group amax (encode)")
        out["fused_groups_share_global_scale"] = ["q/k/v", "dense gate/up", "expert gate/up"]
        out["activations"] = {"weight-only": "W4A16: no input scales", "unit": "W4A4 with input scale 1.0",
                              "copied": f"W4A4 with input scales copied from {opts.input_scales_from}"}[opts.input_mode]
    return out


def module_formats(plan: Plan, scheme: str, source=None) -> dict:
    """The manifest's ``tensors``: each module's format, shape and the plan's reason."""
    out = {}
    for name, tp in plan.tensors.items():
        if tp.module is None:
            continue
        out[tp.module] = {"format": scheme if tp.action == QUANTIZE else "bf16", "shape": list(tp.shape),
                          "reason": tp.reason}
        if source is not None and tp.module in source.paths:
            out[tp.module]["source_path"] = source.paths[tp.module]
    return out


def output_config(config: dict, plan: Plan, scheme: str, dialect: str, opts: ConvertOptions) -> tuple[dict, dict]:
    """(config.json of the output: the source's with the dialect's ``quantization_config``, the
    dialect's extra files {name: JSON object})."""
    config = dict(config)
    if scheme == "mxfp8":
        qcfg, extra = dialects.mxfp8_quant_config(plan.exclusions, dialect)
    elif scheme == "nvfp4":
        qcfg, extra = dialects.nvfp4_quant_config(plan.exclusions, dialect, opts.input_mode)
    elif scheme == "bf16":
        qcfg, extra = None, {}
    else:
        raise QConvertError(f"scheme {scheme!r} is not implemented in this version")
    if qcfg is not None:
        config["quantization_config"] = qcfg
    return config, extra
