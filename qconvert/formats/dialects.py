"""Per (scheme, dialect): tensors written and accepted, config.json ``quantization_config``, extra
files, exclusion-list key, engines that load it (GPUs, flags), and the human descriptions.

MXFP8 (docs/formats.md#mxfp8-dialects):
  ``auto``     the single dialect both engines' disk loaders accept (docs/formats.md#why-auto-loads-in-both): ``quant_method: mxfp8``,
               ``X.weight_scale`` uint8, the exclusion list under ``ignored_layers`` (vLLM reads only
               this, SGLang prefers it) and ``modules_to_not_convert``.
  ``sglang``   miles-style (docs/formats.md#mxfp8-dialects): ``X.weight_scale_inv`` uint8, ``modules_to_not_convert``. SGLang only.
  ``modelopt`` ModelOpt (docs/formats.md#the-modelopt-dialect): ``quant_method: modelopt``, ``quant_algo: MXFP8``, ``ignore`` and
               ``hf_quant_config.json`` with ``exclude_modules``.
NVFP4 (docs/formats.md#nvfp4):
  ``modelopt``            ``X.weight`` uint8 [N, K/2], ``X.weight_scale`` e4m3 [N, K/16],
                          ``X.weight_scale_2`` fp32 [] (amax/2688, decode), ``X.input_scale`` fp32 [];
                          ``quant_method: modelopt``, ``quant_algo: NVFP4`` (W4A4) or ``W4A16_NVFP4`` (weight-only), ``ignore``.
  ``compressed-tensors``  ``X.weight_packed``, ``X.weight_scale``, ``X.weight_global_scale`` fp32 [1]
                          (2688/amax, encode), ``X.input_global_scale`` fp32 [1]; ``config_groups``,
                          ``format: nvfp4-pack-quantized``, ``ignore`` (exact names or ``re:``).
Dialects qconvert only reads (inspect, verify): MXFP8 ``flat`` (``quant_method: mxfp8`` without
SGLang's keys), ``compressed-tensors`` MXFP8 and FP8, FP8 ``modelopt``, FP8-block ``deepseek``.
Pure: no I/O; torch is imported only by the functions that name torch dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import __version__
from ..errors import PlanError
from .exclusions import EXCLUDE_MODULES, IGNORE, IGNORED_LAYERS, MODULES_TO_NOT_CONVERT, ct_ignore
from .schemes import BF16, MXFP8, MXFP8_BLOCK, NVFP4, NVFP4_BLOCK

# ---- tensor names -------------------------------------------------------------------------------
# docs/formats.md#tensor-names: suffixes of a module's tensors (``{module}.{suffix}``)
WEIGHT = "weight"
WEIGHT_PACKED = "weight_packed"  # compressed-tensors NVFP4 packed codes
WEIGHT_SCALE = "weight_scale"  # block scales (MXFP8 E8M0 bytes, NVFP4 E4M3)
WEIGHT_SCALE_INV = "weight_scale_inv"  # SGLang/miles MXFP8 block scales (E8M0 bytes, not an inverse)
WEIGHT_SCALE_2 = "weight_scale_2"  # ModelOpt NVFP4 global scale, decode convention (amax/2688)
WEIGHT_GLOBAL_SCALE = "weight_global_scale"  # compressed-tensors NVFP4 global scale, encode (2688/amax)
INPUT_SCALE = "input_scale"  # ModelOpt NVFP4 activation scale
INPUT_GLOBAL_SCALE = "input_global_scale"  # compressed-tensors NVFP4 activation scale
WEIGHT_SHAPE = "weight_shape"  # compressed-tensors
WEIGHT_ZERO_POINT = "weight_zero_point"
BIAS = "bias"
K_SCALE, V_SCALE = "k_scale", "v_scale"

#: gpt-oss MXFP4 pairs: ``<base>_blocks`` U8 [..., K/32, 16] and ``<base>_scales`` U8 [..., K/32] (E8M0),
#: one module ``<base>`` (docs/formats.md#mxfp4-sources); bytes per 32-element block
MXFP4_BLOCKS, MXFP4_SCALES, MXFP4_BLOCK_BYTES = "_blocks", "_scales", 16

#: tensor-name suffixes that belong to a module (longest first so ``weight_scale_2`` wins)
SUFFIXES = (
    WEIGHT_SCALE_INV,
    WEIGHT_SCALE_2,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_ZERO_POINT,
    WEIGHT_PACKED,
    WEIGHT_SHAPE,
    WEIGHT_SCALE,
    INPUT_GLOBAL_SCALE,
    INPUT_SCALE,
    K_SCALE,
    V_SCALE,
    WEIGHT,
    BIAS,
)
#: tensors of a quantized Linear that stay in their source dtype, byte for byte (a Linear's bias:
#: Qwen2's q/k/v, BERT encoders); they are not part of the quantized format
KEPT_SUFFIXES = (BIAS,)
#: the tensors that make a module quantized (verify requires one of them per quantized module)
REQUIRED_SUFFIXES = frozenset(
    {WEIGHT, WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_SCALE_INV, WEIGHT_SCALE_2, WEIGHT_GLOBAL_SCALE}
)
#: packed NVFP4 codes, either dialect's name
NVFP4_WEIGHT_SUFFIXES = (WEIGHT_PACKED, WEIGHT)
#: NVFP4 activation scales, either dialect's name
NVFP4_INPUT_SCALE_SUFFIXES = (INPUT_SCALE, INPUT_GLOBAL_SCALE)
#: per-tensor NVFP4 scalars (stored as [] by ModelOpt)
NVFP4_SCALAR_SUFFIXES = (WEIGHT_SCALE_2, INPUT_SCALE)

#: the file ModelOpt exports write beside config.json
HF_QUANT_CONFIG = "hf_quant_config.json"

# ---- dialects -----------------------------------------------------------------------------------

#: the dialects qconvert writes, per scheme
DIALECTS = {
    MXFP8: ("auto", "sglang", "modelopt"),
    NVFP4: ("modelopt", "compressed-tensors"),
    BF16: ("bf16",),
}
DEFAULT_DIALECT = {MXFP8: "auto", NVFP4: "modelopt", BF16: "bf16"}

PRODUCER = {"name": "qconvert", "version": __version__}

#: the block-scale suffix of each MXFP8 dialect (written or read)
MXFP8_SCALE_SUFFIX = {
    "auto": WEIGHT_SCALE,
    "sglang": WEIGHT_SCALE_INV,
    "flat": WEIGHT_SCALE,
    "modelopt": WEIGHT_SCALE,
    "compressed-tensors": WEIGHT_SCALE,
}


def resolve_dialect(scheme: str, dialect: str | None) -> str:
    d = dialect or DEFAULT_DIALECT[scheme]
    if d == "auto" and scheme != MXFP8:
        d = DEFAULT_DIALECT[scheme]
    if d not in DIALECTS[scheme]:
        raise PlanError(f"dialect {d!r} is not available for {scheme}; choose one of {', '.join(DIALECTS[scheme])}")
    return d


def mxfp8_scale_suffix(dialect: str | None) -> str:
    """The block-scale suffix qconvert writes for an MXFP8 dialect (``weight_scale_inv`` for sglang)."""
    return WEIGHT_SCALE_INV if dialect == "sglang" else WEIGHT_SCALE


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: object  # torch.dtype
    shape: tuple[int, ...]
    role: str  # weight | scale | global_scale | input_scale | bf16 | layout


def mxfp8_out_tensors(module: str, shape: tuple[int, int], dialect: str) -> list[OutTensor]:
    import torch

    n, k = shape
    return [
        OutTensor(f"{module}.{WEIGHT}", torch.float8_e4m3fn, (n, k), "weight"),
        OutTensor(f"{module}.{mxfp8_scale_suffix(dialect)}", torch.uint8, (n, k // MXFP8_BLOCK), "scale"),
    ]


def nvfp4_out_tensors(module: str, shape: tuple[int, int], dialect: str, input_mode: str) -> list[OutTensor]:
    import torch

    n, k = shape
    if dialect == "modelopt":
        out = [
            OutTensor(f"{module}.{WEIGHT}", torch.uint8, (n, k // 2), "weight"),
            OutTensor(f"{module}.{WEIGHT_SCALE}", torch.float8_e4m3fn, (n, k // NVFP4_BLOCK), "scale"),
            OutTensor(f"{module}.{WEIGHT_SCALE_2}", torch.float32, (), "global_scale"),
        ]
        if input_mode != "weight-only":
            out.append(OutTensor(f"{module}.{INPUT_SCALE}", torch.float32, (), "input_scale"))
        return out
    if dialect == "compressed-tensors":
        out = [
            OutTensor(f"{module}.{WEIGHT_PACKED}", torch.uint8, (n, k // 2), "weight"),
            OutTensor(f"{module}.{WEIGHT_SCALE}", torch.float8_e4m3fn, (n, k // NVFP4_BLOCK), "scale"),
            OutTensor(f"{module}.{WEIGHT_GLOBAL_SCALE}", torch.float32, (1,), "global_scale"),
        ]
        if input_mode != "weight-only":
            out.append(OutTensor(f"{module}.{INPUT_GLOBAL_SCALE}", torch.float32, (1,), "input_scale"))
        return out
    raise PlanError(f"unknown NVFP4 dialect {dialect!r}")


def accepted_tensors(
    fmt: str, dialect: str, scale_suffix: str | None, n: int, k: int
) -> dict[str, tuple[set, list | None]]:
    """suffix -> (allowed dtype tags, shape or None for 'scalar or [1]') of a quantized [n, k] module
    as ``verify`` accepts it (qconvert's dialects and the ones it reads)."""
    if fmt == MXFP8:
        sfx = MXFP8_SCALE_SUFFIX.get(dialect, scale_suffix or WEIGHT_SCALE)
        tags = {"U8"} if dialect in ("auto", "sglang") else {"U8", "F8_E8M0"}
        return {WEIGHT: ({"F8_E4M3"}, [n, k]), sfx: (tags, [n, k // MXFP8_BLOCK])}
    if fmt == NVFP4 and dialect == "compressed-tensors":
        return {
            WEIGHT_PACKED: ({"U8"}, [n, k // 2]),
            WEIGHT_SCALE: ({"F8_E4M3"}, [n, k // NVFP4_BLOCK]),
            WEIGHT_GLOBAL_SCALE: ({"F32"}, None),
            INPUT_GLOBAL_SCALE: ({"F32"}, None),
            WEIGHT_SHAPE: ({"I64", "I32"}, [2]),
        }
    if fmt == NVFP4:
        return {
            WEIGHT: ({"U8"}, [n, k // 2]),
            WEIGHT_SCALE: ({"F8_E4M3"}, [n, k // NVFP4_BLOCK]),
            WEIGHT_SCALE_2: ({"F32"}, None),
            INPUT_SCALE: ({"F32"}, None),
        }
    return {}


# ---- config.json quantization_config and extra files ----------------------------------------------


def mxfp8_quant_config(exclusions: list[str], dialect: str) -> tuple[dict, dict[str, dict]]:
    """(config.json quantization_config, {extra json file name: content})."""
    excl = list(exclusions)
    # SGLang's Fp8Config needs activation_scheme and reads weight_block_size / scale_fmt.
    sglang_keys = {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [1, MXFP8_BLOCK],
    }
    if dialect == "auto":  # vLLM reads only ignored_layers, SGLang prefers it: both keys, one list
        return {**sglang_keys, IGNORED_LAYERS: excl, MODULES_TO_NOT_CONVERT: list(excl)}, {}
    if dialect == "sglang":
        return {**sglang_keys, MODULES_TO_NOT_CONVERT: excl}, {}
    if dialect == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "group_size": MXFP8_BLOCK,
            IGNORE: excl,
            "producer": dict(PRODUCER),
        }, {
            HF_QUANT_CONFIG: {
                "producer": dict(PRODUCER),
                "quantization": {
                    "quant_algo": "MXFP8",
                    "kv_cache_quant_algo": None,
                    "group_size": MXFP8_BLOCK,
                    EXCLUDE_MODULES: list(excl),
                },
            }
        }
    raise PlanError(f"unknown MXFP8 dialect {dialect!r}")


def _fp4_args(dynamic) -> dict:
    return {"dynamic": dynamic, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}


def nvfp4_quant_config(exclusions: list[str], dialect: str, input_mode: str) -> tuple[dict, dict[str, dict]]:
    """(config.json quantization_config, extra json files). ``input_mode``: weight-only (W4A16),
    unit or copied (W4A4 with static input scales)."""
    excl = list(exclusions)
    w4a16 = input_mode == "weight-only"
    if dialect == "modelopt":
        qc = {
            "quant_method": "modelopt",
            # weight-only: the ModelOpt algo that both pinned engines read as W4A16 (SGLang would
            # otherwise run W4A4 with a default input scale), docs/formats.md#nvfp4-modelopt-dialect
            "quant_algo": "W4A16_NVFP4" if w4a16 else "NVFP4",
            "group_size": NVFP4_BLOCK,
            "kv_cache_scheme": None,
            IGNORE: excl,
            "producer": dict(PRODUCER),
            "config_groups": {
                "group_0": {
                    "weights": _fp4_args(False),
                    "input_activations": None if w4a16 else _fp4_args(False),
                    "targets": ["Linear"],
                }
            },
        }
        extra = {}
        if not w4a16:
            # Only for W4A4: an hf_quant_config.json cannot say "weights only" to every reader, and
            # vLLM and SGLang both take config.json's quantization_config first.
            extra[HF_QUANT_CONFIG] = {
                "producer": dict(PRODUCER),
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": None,
                    "group_size": NVFP4_BLOCK,
                    EXCLUDE_MODULES: list(excl),
                },
            }
        return qc, extra
    if dialect == "compressed-tensors":
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": NVFP4_BLOCK,
            "symmetric": True,
            "dynamic": False,
            "observer": "minmax",
            "actorder": None,
            "block_structure": None,
            "scale_dtype": "torch.float8_e4m3fn",
            "zp_dtype": None,
        }
        inputs = None if w4a16 else {**weights, "dynamic": "local", "observer": "static_minmax"}
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "kv_cache_scheme": None,
            IGNORE: ct_ignore(excl),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": inputs,
                    "output_activations": None,
                    "format": "nvfp4-pack-quantized",
                }
            },
            "producer": dict(PRODUCER),
        }, {}
    raise PlanError(f"unknown NVFP4 dialect {dialect!r}")


def quant_config(
    scheme: str, dialect: str, exclusions: list[str], input_mode: str
) -> tuple[dict | None, dict[str, dict]]:
    """(config.json quantization_config or None for bf16, extra json files) of a (scheme, dialect)."""
    if scheme == MXFP8:
        return mxfp8_quant_config(exclusions, dialect)
    if scheme == NVFP4:
        return nvfp4_quant_config(exclusions, dialect, input_mode)
    if scheme == BF16:
        return None, {}
    raise PlanError(f"scheme {scheme!r} is not implemented in this version")


# ---- engines ------------------------------------------------------------------------------------

#: the engine versions the formats and layouts were checked against (docs/formats.md#versions)
ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}

_ENGINES_FOR = {
    (MXFP8, "auto"): ["vllm", "sglang"],
    (MXFP8, "sglang"): ["sglang"],
    (MXFP8, "modelopt"): ["vllm", "sglang"],
    (NVFP4, "modelopt"): ["vllm", "sglang"],
    (NVFP4, "compressed-tensors"): ["vllm", "sglang"],
    (BF16, "bf16"): ["vllm", "sglang"],
}


def engines_for(scheme: str, dialect: str) -> list[str]:
    """Which engines' disk loaders read this dialect (docs/formats.md#compatibility)."""
    return list(_ENGINES_FOR.get((scheme, dialect), []))


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
        return [
            EngineSupport(
                e,
                e == eng,
                "SM100+ (FlashInfer TRT-LLM MoE kernels)",
                [],
                f"pre-shuffled {layout.get('layout')} v{layout.get('layout_version')} expert layout for "
                f"{eng} (tp={layout.get('tp')}, ep={layout.get('ep')}, FlashInfer "
                f"{layout.get('flashinfer_version')}): load through qconvert's loader, not the stock disk loader"
                if e == eng
                else f"layout was written for {eng}",
            )
            for e in ("vllm", "sglang")
        ]
    if scheme == BF16:
        return [EngineSupport("vllm", True, "any", []), EngineSupport("sglang", True, "any", [])]
    if scheme == MXFP8:
        vllm_ok = dialect in ("auto", "modelopt", "flat", "compressed-tensors")
        sgl_ok = dialect in ("auto", "sglang", "modelopt")
        return [
            EngineSupport(
                "vllm",
                vllm_ok,
                "SM80-SM90 via Marlin W8A16, SM100+ via FlashInfer MXFP8 GEMMs",
                [],
                ""
                if vllm_ok
                else (
                    f"{WEIGHT_SCALE_INV} tensors are unexpected in vLLM (load error); re-convert with --dialect auto"
                ),
            ),
            EngineSupport(
                "sglang",
                sgl_ok,
                "SM100+ only (B200/GB200/B300; SM90 refused)",
                ["--fp8-gemm-backend", "flashinfer_trtllm"] + moe_flags,
                "" if sgl_ok else "SGLang does not read this MXFP8 dialect; re-convert with --dialect auto",
            ),
        ]
    if scheme == NVFP4:
        return [
            EngineSupport("vllm", True, "SM100+ native FP4; SM80-SM90 via Marlin W4A16 (weight-only)", []),
            EngineSupport(
                "sglang",
                True,
                "SM100+ native FP4",
                moe_flags if dialect == "modelopt" else [],
                "",
                [("SM80-SM90", ["--fp4-gemm-backend", "marlin"])] if dialect == "modelopt" else [],
            ),
        ]
    if scheme in ("fp8", "fp8-block"):
        return [EngineSupport("vllm", True, "SM89+ (FP8)", []), EngineSupport("sglang", True, "SM89+ (FP8)", [])]
    if scheme == "mxfp4":  # gpt-oss as shipped (docs/formats.md#gpt-oss-quantized-forms)
        return [EngineSupport("vllm", True, "gpt-oss MXFP4", []), EngineSupport("sglang", True, "gpt-oss MXFP4", [])]
    return [
        EngineSupport("vllm", False, "", [], "unknown format"),
        EngineSupport("sglang", False, "", [], "unknown format"),
    ]


# ---- human descriptions (model card) ---------------------------------------------------------------

DIALECT_TEXT = {
    (MXFP8, "auto"): "`quant_method: mxfp8`, `weight_scale` uint8 [N, K/32], exclusions in `ignored_layers` and "
    "`modules_to_not_convert` (loads in vLLM and SGLang)",
    (MXFP8, "sglang"): "SGLang/miles: `quant_method: mxfp8`, `weight_scale_inv` uint8 [N, K/32] (an E8M0 byte, not an "
    "inverse), exclusions in `modules_to_not_convert` (SGLang only)",
    (MXFP8, "modelopt"): "ModelOpt: `quant_method: modelopt`, `quant_algo: MXFP8`, `weight_scale` uint8 [N, K/32], "
    "`ignore` + `hf_quant_config.json`",
    (NVFP4, "modelopt"): "ModelOpt `modelopt_fp4`: packed `weight` uint8 [N, K/2], `weight_scale` E4M3 [N, K/16], "
    "`weight_scale_2` = amax/2688 (decode), `input_scale`",
    (NVFP4, "compressed-tensors"): "compressed-tensors `nvfp4-pack-quantized`: `weight_packed` uint8 [N, K/2], "
    "`weight_scale` E4M3 [N, K/16], `weight_global_scale` = 2688/amax (encode)",
}
