"""The exclusion list must mean, in the engines' own parsers, exactly what qconvert's plan did.

vLLM: the written config is parsed with vLLM's own quantization-config class and its exclusion
function is asked, module by module in vLLM's naming (fused qkv_proj / gate_up_proj, experts,
router, lm_head), whether the module is quantized. SGLang cannot be imported here; its dotted-path
rule is checked through qconvert's transcription of it (docs/formats.md#exclusion-matchers), which is weaker.
"""

from __future__ import annotations

import json

import pytest
from conftest import have

from qconvert.convert.plan import PlanOptions, build_plan, exclusion_list
from qconvert.convert.safetensors_io import read_header
from qconvert.formats.dialects import mxfp8_quant_config
from qconvert.formats.exclusions import sglang_dotted_excluded, vllm_substring_excluded

QKV = {"q_proj", "k_proj", "v_proj"}
GATE_UP = {"gate_proj", "up_proj"}


def inventory(d):
    inv = {}
    for f in sorted(d.glob("*.safetensors")):
        for n, e in read_header(f).entries.items():
            inv[n] = (e.dtype, e.shape)
    return inv, json.loads((d / "config.json").read_text())


def engine_modules(plan):
    """vLLM-side module prefixes -> whether qconvert quantized the tensors behind them."""
    mods: dict[str, set[bool]] = {}
    for t in plan.tensors.values():
        if t.module is None or len(t.shape) != 2 or t.kind in ("embed", "norm"):
            continue
        parent, last = t.module.rsplit(".", 1) if "." in t.module else ("", t.module)
        if t.kind == "expert":
            key = t.module.split(".experts.")[0] + ".experts"
        elif last in QKV:
            key = parent + ".qkv_proj"
        elif last in GATE_UP:
            key = parent + ".gate_up_proj"
        else:
            key = t.module
        mods.setdefault(key, set()).add(t.action == "quantize")
    for k, v in mods.items():
        assert len(v) == 1, f"{k}: fused shards disagree"
    return {k: v.pop() for k, v in mods.items()}


CASES = [
    ("moe", PlanOptions()),
    ("moe", PlanOptions(last_n_bf16=1)),
    ("moe", PlanOptions(last_n_bf16=2, first_n_bf16=1)),
    ("moe", PlanOptions(keep_bf16=("model.layers.1.self_attn.*",))),
    ("dense", PlanOptions(last_n_bf16=1)),
    ("dense", PlanOptions(keep_bf16=("*.down_proj",), quantize_lm_head=True)),
]


@pytest.mark.parametrize("model,opts", CASES)
def test_vllm_exclusions_match_plan(model, opts, demo_moe, demo_dense):
    if not have("vllm"):
        pytest.skip("vLLM not installed")
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    inv, cfg = inventory(demo_moe if model == "moe" else demo_dense)
    plan = build_plan(inv, cfg, opts)
    expected = engine_modules(plan)
    assert any(expected.values()) and (not all(expected.values()))
    for dialect in ("auto", "modelopt"):
        qcfg, extra = mxfp8_quant_config(plan.exclusions, dialect)
        parsed = json.loads(json.dumps(extra.get("hf_quant_config.json", qcfg)))
        vcfg = ModelOptMxFp8Config.from_config(parsed)
        vcfg.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
        for prefix, quantized in expected.items():
            assert vcfg.is_layer_excluded(prefix) == (not quantized), (dialect, prefix, quantized)
        # the substring transcription agrees with vLLM itself (so `verify` can use it)
        for prefix in expected:
            assert vllm_substring_excluded(prefix, plan.exclusions) == vcfg.is_layer_excluded(prefix)


@pytest.mark.parametrize("model,opts", CASES)
def test_sglang_dotted_rule_matches_plan(model, opts, demo_moe, demo_dense):
    inv, cfg = inventory(demo_moe if model == "moe" else demo_dense)
    plan = build_plan(inv, cfg, opts)
    for prefix, quantized in engine_modules(plan).items():
        if prefix.endswith(".mlp.gate") or prefix == "lm_head":
            continue  # SGLang's Fp8Config never quantizes routers or lm_head
        shards = [prefix]
        if prefix.endswith(".qkv_proj"):
            shards = [prefix.replace("qkv_proj", p) for p in sorted(QKV)]
        if prefix.endswith(".gate_up_proj"):
            shards = [prefix.replace("gate_up_proj", p) for p in sorted(GATE_UP)]
        for s in shards:
            assert sglang_dotted_excluded(s, plan.exclusions) == (not quantized), (s, quantized)


def test_trailing_dot_prevents_spillover():
    """model.layers.1. must not exclude layers 10-19 under vLLM's substring rule."""
    inv = {}
    for i in range(12):
        inv[f"model.layers.{i}.self_attn.q_proj.weight"] = ("BF16", (64, 64))
        inv[f"model.layers.{i}.self_attn.k_proj.weight"] = ("BF16", (64, 64))
        inv[f"model.layers.{i}.self_attn.v_proj.weight"] = ("BF16", (64, 64))
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 12}
    plan = build_plan(inv, cfg, PlanOptions(first_n_bf16=2))
    assert "model.layers.1." in plan.exclusions
    assert not vllm_substring_excluded("model.layers.10.self_attn.qkv_proj", plan.exclusions)
    assert vllm_substring_excluded("model.layers.1.self_attn.qkv_proj", plan.exclusions)


def test_k_not_divisible_kept_and_listed():
    inv = {
        "model.layers.0.self_attn.q_proj.weight": ("BF16", (64, 64)),
        "model.layers.0.self_attn.k_proj.weight": ("BF16", (64, 64)),
        "model.layers.0.self_attn.v_proj.weight": ("BF16", (64, 64)),
        "model.layers.0.mlp.down_proj.weight": ("BF16", (64, 48)),
        "model.layers.0.mlp.up_proj.weight": ("BF16", (48, 64)),
        "model.layers.0.mlp.gate_proj.weight": ("BF16", (48, 64)),
    }
    plan = build_plan(inv, {"architectures": ["Foo"], "num_hidden_layers": 1}, PlanOptions())
    assert plan.tensors["model.layers.0.mlp.down_proj.weight"].action == "keep"
    assert "K=48" in plan.tensors["model.layers.0.mlp.down_proj.weight"].reason
    assert "model.layers.0.mlp.down_proj" in plan.exclusions
    assert plan.tensors["model.layers.0.mlp.up_proj.weight"].action == "quantize"
    assert any("Foo" in n for n in plan.notes)  # unknown architecture is said


def test_partial_fused_group_is_kept_whole():
    inv = {f"model.layers.0.self_attn.{p}.weight": ("BF16", (64, 64)) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    plan = build_plan(
        inv, {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}, PlanOptions(keep_bf16=("*.k_proj",))
    )
    acts = {n.split(".")[-2]: t.action for n, t in plan.tensors.items()}
    assert acts == {"q_proj": "keep", "k_proj": "keep", "v_proj": "keep", "o_proj": "quantize"}
    assert {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    } <= set(plan.exclusions)


def test_moe_layer_with_unquantizable_down_keeps_all_experts():
    inv = {}
    for e in range(2):
        inv[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = ("BF16", (48, 64))
        inv[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = ("BF16", (48, 64))
        inv[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = ("BF16", (64, 48))
    inv["model.layers.0.self_attn.o_proj.weight"] = ("BF16", (64, 64))
    plan = build_plan(inv, {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1}, PlanOptions())
    assert all(t.action == "keep" for n, t in plan.tensors.items() if ".experts." in n)
    assert "model.layers.0.mlp.experts" in plan.exclusions
    assert exclusion_list(plan.tensors, [], plan.options, [0]) == plan.exclusions
