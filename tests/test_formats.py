"""qconvert/formats/: the on-disk contract has one home.

* No module outside ``qconvert/formats/`` spells the contract's literals (the manifest's and
  ModelOpt's file names, the exclusion-list keys, the scale and global-scale suffixes): an AST
  scan over every string constant.
* The formats package is pure: importing it loads no torch.
* Its facts against the engines' own code: block sizes against vLLM's constants, the configs the
  dialects write parsed by vLLM's config classes with the same exclusion list, the
  compressed-tensors matcher against vLLM's ``should_ignore_layer``.
* Decisions travel as values: plan rows carry a ``Reason`` code, detection ``Finding`` codes.
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qconvert.convert.plan import NOTABLE_REASONS, PlanOptions, Reason, build_plan
from qconvert.formats import detect as D
from qconvert.formats import dialects, exclusions, manifest, schemes

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "qconvert"

#: string constants that belong to the on-disk contract and may be spelled only in qconvert/formats/
CONTRACT_LITERALS = {
    manifest.MANIFEST_NAME,
    dialects.HF_QUANT_CONFIG,
    exclusions.IGNORED_LAYERS,
    exclusions.MODULES_TO_NOT_CONVERT,
    exclusions.IGNORE,
    exclusions.EXCLUDE_MODULES,
    dialects.WEIGHT_SCALE,
    dialects.WEIGHT_SCALE_INV,
    dialects.WEIGHT_SCALE_2,
    dialects.WEIGHT_GLOBAL_SCALE,
    dialects.WEIGHT_PACKED,
    dialects.INPUT_SCALE,
    dialects.INPUT_GLOBAL_SCALE,
}
#: (file, literal): the same word meaning something else there
ALLOWED = {
    ("qconvert/cli/options.py", "input_scale"): "the --input-scale option's parameter name, not a tensor suffix",
}


def _keyword_values(tree: ast.AST) -> set[int]:
    """ids of constants passed as a keyword argument's value (``np.errstate(all="ignore")``)."""
    return {id(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}


def test_contract_literals_are_spelled_only_in_formats():
    """qconvert/ and scripts/: every contract literal comes from qconvert/formats/."""
    found = []
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("qconvert/formats/"):
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        kw = _keyword_values(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CONTRACT_LITERALS:
                if node.value == exclusions.IGNORE and id(node) in kw:
                    continue  # errors="ignore" / all="ignore": a keyword's value, not the key
                if (rel, node.value) in ALLOWED:
                    continue
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == [], "contract literals outside qconvert/formats/ (look them up there):\n" + "\n".join(found)


def test_the_scan_sees_a_literal(tmp_path):
    """The scan above can fail: the same walk finds the manifest name in a module that spells it."""
    tree = ast.parse('p = root / "qconvert.json"\nq = {"ignore": []}\nwith np.errstate(all="ignore"): pass\n')
    kw = _keyword_values(tree)
    hits = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in CONTRACT_LITERALS and not (n.value == "ignore" and id(n) in kw)
    ]
    assert hits == ["qconvert.json", "ignore"]


def test_formats_imports_no_torch():
    code = (
        "import sys\nimport qconvert.formats.schemes, qconvert.formats.dialects, qconvert.formats.exclusions, "
        "qconvert.formats.manifest, qconvert.formats.detect, qconvert.formats.safetensors, qconvert.formats.staging\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_block_sizes_are_defined_once():
    from qconvert.convert import numerics
    from qconvert.convert.layouts import trtllm

    assert schemes.BLOCK == {"mxfp8": 32, "nvfp4": 16}
    assert numerics.MXFP8_BLOCK is schemes.MXFP8_BLOCK and numerics.NVFP4_BLOCK is schemes.NVFP4_BLOCK
    assert trtllm._SF_BLOCK is schemes.BLOCK
    assert numerics.NVFP4_RECIPES is schemes.NVFP4_RECIPES


@pytest.mark.vllm
def test_block_sizes_are_the_engines():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import MXFP8_BLOCK_SIZE
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4DynamicGroupScale

    assert schemes.MXFP8_BLOCK == MXFP8_BLOCK_SIZE
    assert (1, schemes.NVFP4_BLOCK) == tuple(kNvfp4DynamicGroupScale.group_shape)


EXCL = ["model.layers.1.", "model.layers.2.mlp.experts", "model.layers.3.self_attn.q_proj", "lm_head"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "scheme,dialect,input_mode",
    [
        ("mxfp8", "auto", None),
        ("nvfp4", "modelopt", "weight-only"),
        ("nvfp4", "modelopt", "unit"),
        ("nvfp4", "compressed-tensors", "weight-only"),
        ("nvfp4", "compressed-tensors", "unit"),
    ],
)
def test_vllm_parses_the_written_config(scheme, dialect, input_mode):
    """vLLM's own config class takes what quant_config writes, with our block size and list."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization import get_quantization_config

    qc, extra = dialects.quant_config(scheme, dialect, EXCL, input_mode)
    qc = json.loads(json.dumps(qc))  # as read back from config.json
    if dialect == "compressed-tensors":
        v = get_quantization_config("compressed-tensors").from_config(qc)
        assert v.ignore == exclusions.ct_ignore(EXCL)
        return
    method = "modelopt_fp4" if scheme == "nvfp4" else "mxfp8"
    v = get_quantization_config(method).from_config(qc)
    assert list(v.exclude_modules) == EXCL
    if scheme == "nvfp4":
        assert v.group_size == schemes.NVFP4_BLOCK
        assert (dialects.HF_QUANT_CONFIG in extra) == (input_mode != "weight-only")


@pytest.mark.vllm
def test_ct_matcher_is_vllms():
    """exclusions.ct_excluded on the ct_ignore forms agrees with vLLM's should_ignore_layer."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    rng = random.Random(0)
    mods = ["self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.experts"]
    for _ in range(300):
        entries = sorted(
            {
                rng.choice(
                    [
                        f"model.layers.{rng.randrange(12)}.",
                        f"model.layers.{rng.randrange(12)}.{rng.choice(mods)}",
                        "lm_head",
                    ]
                )
                for _ in range(rng.randrange(1, 5))
            }
        )
        prefix = rng.choice(
            [
                f"model.layers.{rng.randrange(12)}.{rng.choice(mods)}",
                "lm_head",
                f"model.layers.1{rng.randrange(3)}.{rng.choice(mods)}",
            ]
        )
        forms = exclusions.ct_ignore(entries)
        assert exclusions.ct_excluded(prefix, forms) == should_ignore_layer(prefix, forms), (prefix, forms)


def _fake_modules(scheme: str, dialect: str, input_mode: str | None) -> dict[str, D.Module]:
    """The modules of one quantized Linear as qconvert writes it, and a kept norm."""
    import torch

    tag = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32"}
    outs = (
        dialects.mxfp8_out_tensors("model.layers.0.mlp.down_proj", (64, 128), dialect)
        if scheme == "mxfp8"
        else dialects.nvfp4_out_tensors("model.layers.0.mlp.down_proj", (64, 128), dialect, input_mode)
    )
    entries = {o.name: SimpleNamespace(name=o.name, dtype=tag[o.dtype], shape=list(o.shape), nbytes=0) for o in outs}
    entries["model.norm.weight"] = SimpleNamespace(name="model.norm.weight", dtype="BF16", shape=[64], nbytes=128)
    return D.modules_of(entries)


@pytest.mark.parametrize(
    "scheme,dialect,input_mode",
    [
        ("mxfp8", "auto", None),
        ("mxfp8", "sglang", None),
        ("mxfp8", "modelopt", None),
        ("nvfp4", "modelopt", "weight-only"),
        ("nvfp4", "modelopt", "unit"),
        ("nvfp4", "compressed-tensors", "weight-only"),
        ("nvfp4", "compressed-tensors", "unit"),
    ],
)
def test_detect_reads_back_what_the_dialect_writes(scheme, dialect, input_mode):
    qc, extra = dialects.quant_config(scheme, dialect, EXCL, input_mode)
    mods = _fake_modules(scheme, dialect, input_mode)
    m = mods["model.layers.0.mlp.down_proj"]
    assert (m.format, m.shape) == (scheme, [64, 128])
    accepted = dialects.accepted_tensors(scheme, dialect, m.scale_suffix, 64, 128)
    for sfx, (dtype, shape) in m.tensors.items():  # every written tensor is one verify accepts
        tags, want = accepted[sfx]
        assert dtype in tags and (want is None and shape in ([], [1]) or shape == want), (sfx, dtype, shape)
    man = {manifest.VERSION_KEY: "x", "scheme": scheme, "dialect": dialect}
    det = D.detect({"quantization_config": qc}, extra.get(dialects.HF_QUANT_CONFIG), man, mods)
    assert (det.scheme, det.dialect, det.producer) == (scheme, dialect, "qconvert")
    assert det.findings == []
    for key in exclusions.EXCLUSION_KEYS[(scheme, dialect)]:
        want = exclusions.ct_ignore(EXCL) if dialect == "compressed-tensors" else EXCL
        assert det.exclusion_keys[f"config.json quantization_config.{key}"] == want
    assert D.nvfp4_activations(mods, []) == (
        None if scheme == "mxfp8" else "W4A16" if input_mode == "weight-only" else "W4A4"
    )


def test_findings_are_codes():
    qc, _ = dialects.quant_config("mxfp8", "auto", [], None)
    mods = _fake_modules("mxfp8", "auto", None)
    det = D.detect(
        {"quantization_config": qc}, None, {manifest.VERSION_KEY: "x", "scheme": "nvfp4", "dialect": "auto"}, mods
    )
    assert [f.code for f in det.findings] == [D.Code.MANIFEST_DISAGREES]
    assert det.findings[0].conflict and det.conflicts == [
        "qconvert.json says nvfp4/auto but config and tensors say mxfp8/auto"
    ]
    det = D.detect({"quantization_config": {"quant_method": "awq"}}, None, None, mods)
    assert [f.code for f in det.findings] == [D.Code.UNKNOWN_QUANT_METHOD] and det.conflicts == []
    assert not det.verifiable and det.scheme == "unknown"
    det = D.detect({"quantization_config": qc}, None, None, _fake_modules("nvfp4", "modelopt", "unit"))
    assert [f.code for f in det.findings] == [D.Code.CONFIG_WITHOUT_TENSORS] and det.findings[0].conflict


def test_plan_reasons_are_codes():
    """Each kept or quantized weight carries its Reason; the text (manifest, dry-run plan) renders from it."""
    cfg = {"architectures": ["Foo"], "num_hidden_layers": 2, "tie_word_embeddings": False}
    inv = {
        "model.embed_tokens.weight": ("BF16", (256, 64)),
        "lm_head.weight": ("BF16", (256, 64)),
        "model.norm.weight": ("BF16", (64,)),
    }
    for i in range(2):
        inv[f"model.layers.{i}.self_attn.q_proj.weight"] = ("BF16", (64, 64))
        inv[f"model.layers.{i}.self_attn.k_proj.weight"] = ("BF16", (64, 64 if i else 48))  # K=48: not /32
        inv[f"model.layers.{i}.mlp.down_proj.weight"] = ("BF16", (64, 64))
    plan = build_plan(inv, cfg, PlanOptions(scheme="mxfp8", last_n_bf16=0))
    t = plan.tensors
    assert t["model.embed_tokens.weight"].code is Reason.EMBEDDING
    assert t["lm_head.weight"].code is Reason.LM_HEAD
    assert t["model.layers.1.mlp.down_proj.weight"].code is Reason.LINEAR
    k = t["model.layers.0.self_attn.k_proj.weight"]
    assert k.code is Reason.K_NOT_MULTIPLE and k.reason == "K=48 not a multiple of 32"
    q = t["model.layers.0.self_attn.q_proj.weight"]  # kept with its fused group
    assert (
        q.code is Reason.FUSED_WITH
        and q.reason == "fused with model.layers.0.self_attn.k_proj (K=48 not a multiple of 32)"
    )
    assert {k.code, q.code} <= NOTABLE_REASONS and Reason.LINEAR not in NOTABLE_REASONS
    assert t["model.norm.weight"].code is Reason.NOT_2D and t["model.norm.weight"].reason == "1-D"
    assert all(x.code is not None for x in t.values())


def test_manifest_accessors():
    lay = {"layout": "flashinfer-trtllm", "layout_version": 1, "engine": "vllm"}
    man = {manifest.VERSION_KEY: "0.1.0", "recipe": "te", manifest.LAYOUT_KEY: {"contracts": {"nvfp4": lay}}}
    assert manifest.is_qconvert(man) and not manifest.is_qconvert({"recipe": "te"}) and not manifest.is_qconvert(None)
    assert manifest.recipe(man) == "te" and manifest.recipe({"recipe": "te"}) is None
    assert manifest.layout_section(man) == {"contracts": {"nvfp4": lay}}
    assert manifest.layout_section({manifest.LAYOUT_KEY: {}}) is None and manifest.layout_section([]) is None
    assert manifest.find_layouts(man) == [lay]


def test_exclusion_entry_forms():
    assert exclusions.whole_layer_entry("model.layers", 1) == "model.layers.1."
    assert exclusions.experts_entry("model.layers.3.mlp.experts.7.gate_proj") == "model.layers.3.mlp.experts"
    # the whole-layer form means layer 1 only, under every matcher that reads it
    e = [exclusions.whole_layer_entry("model.layers", 1)]
    for p, want in (("model.layers.1.mlp.down_proj", True), ("model.layers.10.mlp.down_proj", False)):
        assert exclusions.sglang_dotted_excluded(p, e) is want
        assert exclusions.vllm_substring_excluded(p, e) is want
        assert exclusions.ct_excluded(p, exclusions.ct_ignore(e)) is want
