"""The manifest qconvert writes beside every checkpoint (``qconvert.json``): its name, how it is
built, whether a read one is qconvert's, and accessors for its sections (the layout contract above
all, the recipe).

Pure: the callers read and write the file (through the guarded readers); this module only builds
and looks into the JSON value.
"""

from __future__ import annotations

from .dialects import WEIGHT_GLOBAL_SCALE, WEIGHT_SCALE_2, engines_for
from .schemes import (MXFP8, MXFP8_RECIPE, MXFP8_SCALE_RULE, MXFP8_ZERO_BLOCK_SCALE_BYTE, MXFP8_ZERO_POLICY, NVFP4,
                      NVFP4_ACTIVATIONS_TEXT, NVFP4_SCALE_RULE, NVFP4_SHARED_GLOBAL_SCALE)

#: the manifest's file name, in the checkpoint directory
MANIFEST_NAME = "qconvert.json"
#: the key whose presence marks a manifest as qconvert's own
VERSION_KEY = "qconvert_version"
#: the section a pre-shuffled (kernel-layout) checkpoint records its layout in
LAYOUT_KEY = "layout"


def build(*, version: str, created: str, scheme: str, dialect: str, source: dict, options: dict,
          non_finite_allowed: bool, bf16_layers: list, exclusions: list, output_sha: dict, output_note: str | None,
          recipe: str | None, global_div: int | None, input_mode: str | None, input_scales_from, layout: dict | None,
          tensors: dict) -> dict:
    """The manifest of a conversion, key order as written. ``source`` is the ``source`` section
    (id, revision, architecture, sha256[, sha256_note]); ``tensors`` maps module -> {format, shape,
    reason}; ``layout`` is the layout section or None; ``global_div`` is NVFP4's global-scale numerator
    for the recipe (``scale_2 = amax / global_div``: numerics.nvfp4.global_div)."""
    manifest = {
        VERSION_KEY: version,
        "created": created,
        "scheme": scheme,
        "dialect": dialect,
        "engines": engines_for(scheme, dialect),
        "source": source,
        "options": options,
        "non_finite_allowed": bool(non_finite_allowed),
        "bf16_layers": bf16_layers,
        "exclusions": exclusions,
        "outputs": {"sha256": {n: d for n, d in output_sha.items() if d},
                    **({} if output_note is None else {"sha256_note": output_note})},
        "tensors": {},
    }
    if scheme == MXFP8:
        manifest["recipe"] = MXFP8_RECIPE
        manifest["scale_rule"] = MXFP8_SCALE_RULE
        manifest["zero_block_scale_byte"] = MXFP8_ZERO_BLOCK_SCALE_BYTE
        manifest["zero_block_policy"] = MXFP8_ZERO_POLICY
    if scheme == NVFP4:
        manifest["recipe"] = recipe
        manifest["scale_rule"] = NVFP4_SCALE_RULE[recipe]
        manifest["global_scale"] = (f"{WEIGHT_SCALE_2} = group amax / {global_div} (decode)" if dialect == "modelopt"
                                    else f"{WEIGHT_GLOBAL_SCALE} = {global_div} / group amax (encode)")
        manifest["fused_groups_share_global_scale"] = list(NVFP4_SHARED_GLOBAL_SCALE)
        manifest["activations"] = NVFP4_ACTIVATIONS_TEXT[input_mode].format(source=input_scales_from)
    if layout is not None:
        manifest[LAYOUT_KEY] = layout
    manifest["tensors"] = tensors
    return manifest


def is_qconvert(manifest: dict | None) -> bool:
    """Whether a manifest was written by qconvert."""
    return bool(manifest) and VERSION_KEY in manifest


def layout_section(manifest: dict | None) -> dict | None:
    """The ``layout`` section of a pre-shuffled checkpoint's manifest, or None (a plain checkpoint)."""
    lay = manifest.get(LAYOUT_KEY) if isinstance(manifest, dict) else None
    return lay if isinstance(lay, dict) and lay else None


def find_layouts(manifest: dict | None) -> list[dict]:
    """Layout contracts (``{"layout": "flashinfer-trtllm", "layout_version": ...}``) anywhere in the manifest."""
    out: list[dict] = []

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get(LAYOUT_KEY), str) and "layout_version" in x:
                out.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(manifest or {})
    return out


def recipe(manifest: dict | None) -> str | None:
    """The recipe a qconvert manifest records (a string), else None."""
    r = manifest.get("recipe") if is_qconvert(manifest) else None
    return r if isinstance(r, str) else None
