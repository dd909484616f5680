"""The files a conversion writes besides the weights: config.json (with the dialect's
quantization_config), the dialect's extra files, the shard index, the source's other files, and
the manifest (qconvert.json)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..formats import dialects
from ..formats import manifest as _manifest
from ..formats.manifest import MANIFEST_NAME
from ..formats.schemes import BF16
from . import resume as _resume
from .checkpoint import INDEX_NAME, Checkpoint
from .jobs import Job, out_nbytes, source_for_outputs
from .numerics.nvfp4 import global_div
from .options import ConvertOptions
from .plan import QUANTIZE, Plan


def _write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_metadata(
    ckpt: Checkpoint,
    plan: Plan,
    jobs: list[Job],
    layout_layers: dict[str, str],
    scheme: str,
    dialect: str,
    tmp: Path,
    opts: ConvertOptions,
    input_sha: dict,
    output_sha: dict,
    created: str | None = None,
    source=None,
):
    """``source``: the quantized source the jobs decoded (fp8_source.Fp8BlockSource, decode.DecodedSource), or None."""
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
        _write_json(
            tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        )
    for d in ckpt.extra_dirs:  # folders of SRC (sentence-transformers' 1_Pooling/, 2_Normalize/, ...)
        (tmp / d.relative_to(ckpt.root)).mkdir(parents=True, exist_ok=True)
    for p in ckpt.extra_files:  # files of SRC, subfolders too, guarded (checkpoint.extra_members)
        shutil.copy2(p, tmp / p.relative_to(ckpt.root))

    layout = None
    if opts.layout:
        from .layout_jobs import layout_manifest

        layout = layout_manifest(plan, layout_layers, opts.engine, opts.tp, opts.ep)
    manifest = _manifest.build(
        version=__version__,
        created=created or _resume.created_timestamp(),
        scheme=scheme,
        dialect=dialect,
        source={
            "id": ckpt.source_id,
            "revision": ckpt.revision,
            "architecture": plan.arch_name,
            "sha256": {n: d for n, d in input_sha.items() if d},
            **(
                {}
                if all(input_sha.values())
                else {
                    "sha256_note": "not recorded (--no-checksums)"
                    if not opts.output_checksums
                    else "not recorded (--no-source-checksums)"
                }
            ),
            **({} if source is None else {"quantized": source.manifest()}),
        },
        options={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts.plan).items()},
        non_finite_allowed=opts.allow_non_finite,
        bf16_layers=plan.bf16_layers,
        exclusions=plan.exclusions,
        output_sha=output_sha,
        output_note=None if all(output_sha.values()) else "not recorded (--no-checksums)",
        scheme_keys=scheme_keys(scheme, dialect, opts),
        layout=layout,
        tensors=module_formats(plan, scheme, source),
    )
    _write_json(tmp / MANIFEST_NAME, manifest)


def scheme_keys(scheme: str, dialect: str, opts: ConvertOptions) -> dict:
    """The manifest's keys that say how the scheme was applied (recipe, scale rule, activations)."""
    return _manifest.scheme_keys(
        scheme,
        dialect,
        recipe=opts.recipe,
        global_div=int(global_div(opts.recipe)) if scheme == "nvfp4" else None,
        input_mode=opts.input_mode,
        input_scales_from=opts.input_scales_from,
    )


def module_formats(plan: Plan, scheme: str, source=None) -> dict:
    """The manifest's ``tensors``: each module's format, shape and the plan's reason."""
    out = {}
    for tp in plan.tensors.values():
        if tp.module is None:
            continue
        out[tp.module] = {
            "format": scheme if tp.action == QUANTIZE else "bf16",
            "shape": list(tp.shape),
            "reason": tp.reason,
        }
        if source is not None and tp.module in source.paths:
            out[tp.module]["source_path"] = source.paths[tp.module]
    return out


def output_config(config: dict, plan: Plan, scheme: str, dialect: str, opts: ConvertOptions) -> tuple[dict, dict]:
    """(config.json of the output: the source's with the dialect's ``quantization_config``, the
    dialect's extra files {name: JSON object})."""
    config = dict(config)
    if scheme == BF16:  # nothing quantized: a quantized source's declaration goes (decode.py)
        config.pop("quantization_config", None)
    qcfg, extra = dialects.quant_config(scheme, dialect, plan.exclusions, opts.input_mode)
    if qcfg is not None:
        config["quantization_config"] = qcfg
    return config, extra
