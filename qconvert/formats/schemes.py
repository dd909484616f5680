"""Per scheme (mxfp8, nvfp4, bf16): block size, scale dtype, recipes, verify bounds, card text.

Pure data (docs/formats.md#mxfp8-scale-rule, docs/formats.md#nvfp4-encoding): no torch, no I/O.
"""

from __future__ import annotations

MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
BF16 = "bf16"
#: the schemes qconvert writes
SCHEMES = (MXFP8, NVFP4, BF16)
#: the schemes whose weights are block-quantized
QUANTIZED = (MXFP8, NVFP4)

#: elements per block scale along K: one E8M0 scale per 1x32 (MXFP8), one E4M3 per 1x16 (NVFP4)
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
BLOCK = {MXFP8: MXFP8_BLOCK, NVFP4: NVFP4_BLOCK}
#: the same, with None for a scheme that quantizes nothing
SCHEME_BLOCK = {**BLOCK, BF16: None}

#: safetensors dtype tags of the stored block scales: MXFP8 E8M0 bytes (as U8, or F8_E8M0 from other
#: writers), NVFP4 E4M3
SCALE_TAGS = {MXFP8: frozenset({"U8", "F8_E8M0"}), NVFP4: frozenset({"F8_E4M3"})}

#: quantization recipes (what the manifest's ``recipe`` records): MXFP8 RCEIL
#: (docs/formats.md#mxfp8-scale-rule); NVFP4 TE / FlashInfer order, ModelOpt order
#: (docs/formats.md#nvfp4-block-scale-recipes) or TE 2.17's 4over6 (docs/formats.md#nvfp4-4over6)
MXFP8_RECIPE = "rceil"
NVFP4_RECIPES = ("te", "modelopt", "4over6")
DEFAULT_NVFP4_RECIPE = "te"
RECIPES = {MXFP8: (MXFP8_RECIPE,), NVFP4: NVFP4_RECIPES}
ALL_RECIPES = (MXFP8_RECIPE, *NVFP4_RECIPES)

#: NVFP4 activation modes: weight-only (W4A16), unit or copied input scales (W4A4)
NVFP4_INPUT_MODES = ("weight-only", "unit", "copied")

#: default ``verify --max-rel-err`` per scheme (relative Frobenius error of one tensor). RCEIL MXFP8
#: of Gaussian-like weights gives ~0.02-0.03 and NVFP4 ~0.09-0.11.
DEFAULT_MAX_REL_ERR = {MXFP8: 0.06, NVFP4: 0.16}
#: per-block bound: max |decoded - source| <= BOUND * block amax (+ ATOL). MXFP8 RCEIL meets 1/14,
#: FLOOR (clipping at 448) 63/511; NVFP4 1/6 times (1 + 1/16) for the scale rounding.
BLOCK_BOUND = {MXFP8: 0.13, NVFP4: 0.2}

#: the model card's one-line description of each scheme
SCHEME_TEXT = {
    MXFP8: "MXFP8: FP8 E4M3 elements with one E8M0 (power-of-two) scale per 1x32 block along the input dimension",
    NVFP4: "NVFP4: FP4 E2M1 elements with one FP8 E4M3 scale per 1x16 block and one FP32 global scale per tensor",
    BF16: "BF16 (not quantized)",
}

#: the manifest's description of each recipe's scale rule
MXFP8_SCALE_RULE = (
    "RCEIL: E = ceil(log2(amax/448)) in fp32, elements e4m3 RNE of x*2^-E (docs/formats.md#mxfp8-scale-rule)"
)
NVFP4_SCALE_RULE = {
    "te": "TransformerEngine / FlashInfer (no fast math) order: s = e4m3(amax_blk * (S_enc / 6)), codes e2m1_rn(x * 1/(s / S_enc)), S_enc = 2688 / global amax",
    "modelopt": "ModelOpt NVFP4QTensor order: s = e4m3(clamp(amax_blk / (6 * ws2), 2^-9, 448)), codes e2m1_rne(x / (s * ws2)), ws2 = global amax / 2688",
    "4over6": "TransformerEngine 2.17 4over6 (nvfp4_e4m3_max 256, MAE, no fast math): per block s6 = e4m3((amax_blk / 6) * S_enc), s4 = e4m3(1.5 * that), codes e2m1_rn(x * 1/(s / S_enc)) for each; the one with the smaller sum |decoded - x| kept (ties: s6); S_enc = 1536 / global amax",
}
#: MXFP8's scale byte of an all-zero block (docs/formats.md#mxfp8-byte-zero)
MXFP8_ZERO_BLOCK_SCALE_BYTE = 1
MXFP8_ZERO_POLICY = (
    "E8M0 byte 0 never written: exponent clamped to >= -126 (byte 1); only blocks with amax < 448*2^-127 "
    "(all-zero blocks) differ from online quantizers"
)
#: the manifest's ``activations`` text per NVFP4 input mode
NVFP4_ACTIVATIONS_TEXT = {
    "weight-only": "W4A16: no input scales",
    "unit": "W4A4 with input scale 1.0",
    "copied": "W4A4 with input scales copied from {source}",
}
#: NVFP4 fused groups sharing one global scale (docs/formats.md#nvfp4-shared-global-scales)
NVFP4_SHARED_GLOBAL_SCALE = ["q/k/v", "dense gate/up", "expert gate/up"]


def block_of(scheme: str) -> int | None:
    """Elements per block scale of ``scheme`` (None for bf16); KeyError for an unknown scheme."""
    return SCHEME_BLOCK[scheme]
