"""The manifest qconvert writes beside every checkpoint (``qconvert.json``): its name, how it is
built, whether a read one is qconvert's, and accessors for its sections (the layout contract above
all, the recipe).

Pure: the callers read and write the file (through the guarded readers); this module only builds
and looks into the JSON value.
"""

from __future__ import annotations

from .dialects import WEIGHT_GLOBAL_SCALE, WEIGHT_SCALE_2, engines_for
from .schemes import (
    MXFP8,
    MXFP8_RECIPE,
    MXFP8_SCALE_RULE,
    MXFP8_ZERO_BLOCK_SCALE_BYTE,
    MXFP8_ZERO_POLICY,
    NVFP4,
    NVFP4_ACTIVATIONS_TEXT,
    NVFP4_SCALE_RULE,
    NVFP4_SHARED_GLOBAL_SCALE,
)

#: the manifest's file name, in the checkpoint directory
MANIFEST_NAME = "qconvert.json"
#: the key whose presence marks a manifest as qconvert's own
VERSION_KEY = "qconvert_version"
#: the section a pre-shuffled (kernel-layout) checkpoint records its layout in
LAYOUT_KEY = "layout"


def scheme_keys(
    scheme: str,
    dialect: str,
    *,
    recipe: str | None = None,
    global_div: int | None = None,
    input_mode: str | None = None,
    input_scales_from=None,
) -> dict:
    """The manifest's keys that say how the scheme was applied (recipe, scale rule, activations).
    ``global_div``: NVFP4's global-scale numerator for the recipe (``scale_2 = amax / global_div``,
    numerics.nvfp4.global_div)."""
    out: dict = {}
    if scheme == MXFP8:
        out["recipe"] = MXFP8_RECIPE
        out["scale_rule"] = MXFP8_SCALE_RULE
        out["zero_block_scale_byte"] = MXFP8_ZERO_BLOCK_SCALE_BYTE
        out["zero_block_policy"] = MXFP8_ZERO_POLICY
    if scheme == NVFP4:
        out["recipe"] = recipe
        out["scale_rule"] = NVFP4_SCALE_RULE[recipe]
        out["global_scale"] = (
            f"{WEIGHT_SCALE_2} = group amax / {global_div} (decode)"
            if dialect == "modelopt"
            else f"{WEIGHT_GLOBAL_SCALE} = {global_div} / group amax (encode)"
        )
        out["fused_groups_share_global_scale"] = list(NVFP4_SHARED_GLOBAL_SCALE)
        out["activations"] = NVFP4_ACTIVATIONS_TEXT[input_mode].format(source=input_scales_from)
    return out


def build(
    *,
    version: str,
    created: str,
    scheme: str,
    dialect: str,
    source: dict,
    options: dict,
    non_finite_allowed: bool,
    bf16_layers: list,
    exclusions: list,
    output_sha: dict,
    output_note: str | None,
    scheme_keys: dict,
    layout: dict | None,
    tensors: dict,
) -> dict:
    """The manifest of a conversion, key order as written. ``source`` is the ``source`` section
    (id, revision, architecture, sha256[, sha256_note][, quantized]); ``scheme_keys`` is
    :func:`scheme_keys`' result; ``layout`` is the layout section or None; ``tensors`` maps module ->
    {format, shape, reason[, source_path]}."""
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
        "outputs": {
            "sha256": {n: d for n, d in output_sha.items() if d},
            **({} if output_note is None else {"sha256_note": output_note}),
        },
        "tensors": {},
    }
    manifest.update(scheme_keys)
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
