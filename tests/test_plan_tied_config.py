"""The plan against config.json: tied output heads, layer counts that disagree with the weights,
wrongly typed config keys and FP8 tensors in a BF16 checkpoint.

Tied heads: every dialect's written config is parsed with vLLM's own config classes, which are
asked whether the module ``lm_head`` is quantized (vLLM builds a ParallelLMHead from the config
and ties its weight to the embedding afterwards, so the list decides). SGLang: qconvert's
transcription of its dotted-path rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import have

from qconvert.convert.demo import build_demo_model, demo_config, demo_tensors, write_sharded
from qconvert.convert.plan import PlanOptions, build_plan
from qconvert.errors import PlanError
from qconvert.formats.dialects import mxfp8_quant_config, nvfp4_quant_config
from qconvert.formats.exclusions import sglang_dotted_excluded, vllm_substring_excluded


def inventory(config, drop=()):
    return {n: ("BF16", tuple(t.shape)) for n, t in demo_tensors(config).items() if n not in drop}


def tied_config(where="top"):
    c = demo_config("llama-tied")
    if where == "text_config":
        del c["tie_word_embeddings"]
        c["text_config"] = {"tie_word_embeddings": True}
    return c


def vllm_head_excluded(plan) -> dict[str, bool]:
    """{dialect: whether vLLM's own config class leaves lm_head unquantized}."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config, ModelOptNvFp4Config

    out = {}
    for dialect in ("auto", "modelopt"):
        qcfg, extra = mxfp8_quant_config(plan.exclusions, dialect)
        vcfg = ModelOptMxFp8Config.from_config(json.loads(json.dumps(extra.get("hf_quant_config.json", qcfg))))
        out["mxfp8-" + dialect] = vcfg.is_layer_excluded("lm_head")
    qcfg, _ = mxfp8_quant_config(plan.exclusions, "sglang")
    out["mxfp8-sglang"] = sglang_dotted_excluded("lm_head", qcfg["modules_to_not_convert"])
    for mode in ("weight-only", "unit"):
        qcfg, _ = nvfp4_quant_config(plan.exclusions, "modelopt", mode)
        vcfg = ModelOptNvFp4Config.from_config(json.loads(json.dumps(qcfg)))
        out["nvfp4-modelopt-" + mode] = vcfg.is_layer_excluded("lm_head")
        qcfg, _ = nvfp4_quant_config(plan.exclusions, "compressed-tensors", mode)
        out["nvfp4-ct-" + mode] = should_ignore_layer("lm_head", ignore=qcfg["ignore"], fused_mapping={})
    return out


@pytest.mark.parametrize("case", ["no_tensor", "text_config", "tensor_present"])
def test_tied_head_is_excluded_for_every_engine_and_dialect(case):
    cfg = tied_config("text_config" if case == "text_config" else "top")
    inv = inventory(cfg)
    if case == "tensor_present":  # some tied checkpoints also store the head
        inv["lm_head.weight"] = inv["model.embed_tokens.weight"]
    for scheme in ("mxfp8", "nvfp4"):
        plan = build_plan(inv, cfg, PlanOptions(scheme=scheme))
        assert plan.tied_lm_head is True
        assert "lm_head" in plan.exclusions, (case, plan.exclusions)
        assert vllm_substring_excluded("lm_head", plan.exclusions)
        assert sglang_dotted_excluded("lm_head", plan.exclusions)
        if have("vllm"):
            got = vllm_head_excluded(plan)
            assert all(got.values()), (case, scheme, got)
    # the rest of the model is still quantized
    assert plan.tensors["model.layers.0.self_attn.q_proj.weight"].action == "quantize"


def test_untied_head_without_tie_key_for_unknown_arch_is_excluded():
    """An unknown causal LM without the key (transformers' PretrainedConfig defaulted to tied)."""
    cfg = tied_config()
    del cfg["tie_word_embeddings"]
    cfg["architectures"] = ["SmolThingForCausalLM"]
    plan = build_plan(inventory(cfg), cfg, PlanOptions())
    assert plan.tied_lm_head is None and "lm_head" in plan.exclusions


def test_wrapped_language_model_head_is_excluded_under_its_name():
    cfg = tied_config()
    inv = {("language_model." + n if n.startswith("model.") else n): v for n, v in inventory(cfg).items()}
    cfg["num_hidden_layers"] = 4
    plan = build_plan(inv, cfg, PlanOptions())
    assert {"lm_head", "language_model.lm_head"} <= set(plan.exclusions)


def test_untied_known_arch_exclusions_unchanged(demo_dense):
    """Untied models keep exactly their old list (lm_head from its tensor)."""
    cfg = demo_config("qwen3")
    plan = build_plan(inventory(cfg), cfg, PlanOptions())
    assert plan.tied_lm_head is False
    assert plan.exclusions.count("lm_head") == 1
    assert not [n for n in plan.notes if "tie" in n]


@pytest.mark.parametrize("present", [False, True])
def test_quantize_lm_head_on_tied_head_is_refused(present):
    cfg = tied_config()
    inv = inventory(cfg)
    if present:
        inv["lm_head.weight"] = inv["model.embed_tokens.weight"]
    with pytest.raises(PlanError) as e:
        build_plan(inv, cfg, PlanOptions(quantize_lm_head=True))
    msg = str(e.value)
    assert "\n" not in msg and "--quantize-lm-head" in msg and "tie" in msg and "embed_tokens" in msg, msg


def test_keep_bf16_lm_head_on_tied_head_matches():
    cfg = tied_config()
    plan = build_plan(inventory(cfg), cfg, PlanOptions(keep_bf16=("lm_head",)))
    assert not [n for n in plan.notes if "matched no tensor" in n], plan.notes
    assert "lm_head" in plan.exclusions
    plan = build_plan(inventory(cfg), cfg, PlanOptions(keep_bf16=("nothing_like_this",)))
    assert [n for n in plan.notes if "matched no tensor" in n]


# ---- config.json layer count against the weights ----------------------------------------------


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("opts", [PlanOptions(last_n_bf16=1), PlanOptions(first_n_bf16=2), PlanOptions()])
def test_layer_count_disagreeing_with_weights_is_refused(n, opts):
    cfg = demo_config("qwen3")
    inv = inventory(cfg)  # 4 layers
    cfg["num_hidden_layers"] = n
    with pytest.raises(PlanError) as e:
        build_plan(inv, cfg, opts, config_path="/m/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"/m/config.json: num_hidden_layers is {n}"), msg
    assert "4 decoder layers" in msg, msg


def test_missing_middle_layer_is_refused():
    cfg = demo_config("qwen3")
    inv = {n: v for n, v in inventory(cfg).items() if not n.startswith("model.layers.2.")}
    with pytest.raises(PlanError, match=r"num_hidden_layers is 4 but the weights hold 3 decoder layers .*1 missing"):
        build_plan(inv, cfg, PlanOptions(last_n_bf16=1))


def test_layer_count_unknown_arch_plain_is_a_note_and_flags_refuse():
    cfg = demo_config("qwen3")
    inv = inventory(cfg)
    cfg["architectures"] = ["SomethingNewForCausalLM"]
    cfg["num_hidden_layers"] = 6
    plan = build_plan(inv, cfg, PlanOptions())
    assert [n for n in plan.notes if "num_hidden_layers is 6" in n and "4 decoder layers" in n], plan.notes
    with pytest.raises(PlanError, match="num_hidden_layers is 6"):
        build_plan(inv, cfg, PlanOptions(last_n_bf16=2))


def test_mtp_layers_after_the_decoder_are_accepted():
    """DeepSeek-V3 stores num_nextn_predict_layers MTP layers as model.layers.{n}..."""
    cfg = demo_config("qwen3")
    inv = inventory(cfg)
    cfg["num_hidden_layers"] = 3
    cfg["num_nextn_predict_layers"] = 1
    plan = build_plan(inv, cfg, PlanOptions(last_n_bf16=1))
    assert plan.bf16_layers == [2]


def test_last_n_without_layer_names_is_refused():
    inv = {f"transformer.h.{i}.mlp.c_fc.weight": ("BF16", (64, 64)) for i in range(2)}
    with pytest.raises(PlanError, match="--last-n-bf16: no tensor is named"):
        build_plan(inv, {"architectures": ["GPT2LMHeadModel"], "n_layer": 2}, PlanOptions(last_n_bf16=1))


# ---- wrongly typed config.json keys and FP8 tensors: one line through the CLI ----------------

BAD_KEYS = [
    ("hidden_size", "256"),
    ("hidden_size", None),
    ("hidden_size", [256]),
    ("hidden_size", True),
    ("num_attention_heads", "4"),
    ("num_attention_heads", 0),
    ("num_key_value_heads", [2]),
    ("head_dim", "64"),
    ("intermediate_size", 512.0),
    ("vocab_size", -1),
    ("num_hidden_layers", "4"),
    ("num_hidden_layers", None),
    ("architectures", "Qwen3ForCausalLM"),
    ("tie_word_embeddings", "yes"),
    ("text_config", "x"),
    ("num_nextn_predict_layers", "1"),
]


@pytest.mark.parametrize("key,value", BAD_KEYS)
def test_wrongly_typed_config_key_is_one_line(key, value):
    cfg = demo_config("qwen3")
    inv = inventory(cfg)
    cfg[key] = value
    with pytest.raises(PlanError) as e:
        build_plan(inv, cfg, PlanOptions(), config_path="/m/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"/m/config.json: {key} is "), msg


def test_wrongly_typed_moe_keys(demo_moe):
    cfg = demo_config("qwen3-moe")
    inv = inventory(cfg)
    for key, value in (("num_experts", "8"), ("moe_intermediate_size", [128])):
        bad = dict(cfg, **{key: value})
        with pytest.raises(PlanError, match=f"^config.json: {key} is "):
            build_plan(inv, bad, PlanOptions())


def test_null_head_dim_and_kv_heads_mean_the_default():
    cfg = demo_config("qwen3")
    inv = inventory(cfg)
    cfg["head_dim"] = None  # hidden_size / heads = 64, as written
    build_plan(inv, cfg, PlanOptions())


@pytest.mark.parametrize(
    "name",
    [
        "model.norm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.mlp.up_proj.weight",
    ],
)
def test_fp8_tensor_in_bf16_checkpoint_is_refused(name):
    cfg = demo_config("qwen3")
    inv = inventory(cfg)
    inv[name] = ("F8_E4M3", inv[name][1])
    with pytest.raises(PlanError) as e:
        build_plan(inv, cfg, PlanOptions())
    assert f"tensor {name!r} is already quantized (F8_E4M3)" in str(e.value) and "\n" not in str(e.value)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", "from qconvert.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("case", ["fp8_norm", "fp8_lm_head", "hidden_str", "layers_off"])
def test_cli_one_line_error(case, tmp_path):
    import torch

    cfg = demo_config("qwen3")
    t = demo_tensors(cfg)
    if case == "fp8_norm":
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.float8_e4m3fn)
    elif case == "fp8_lm_head":
        t["lm_head.weight"] = t["lm_head.weight"].to(torch.float8_e4m3fn)
    elif case == "hidden_str":
        cfg["hidden_size"] = "256"
    else:
        cfg["num_hidden_layers"] = 3
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    write_sharded(src, t, 1)
    for scheme in ("mxfp8", "nvfp4"):
        r = _cli(scheme, str(src), str(tmp_path / f"out-{scheme}"), "--last-n-bf16", "1")
        assert r.returncode == 1, (case, r.returncode, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert (
            "model.norm.weight"
            if case == "fp8_norm"
            else "lm_head.weight"
            if case == "fp8_lm_head"
            else str(src / "config.json")
        ) in lines[0], lines[0]
        assert not (tmp_path / f"out-{scheme}").exists()


def test_demo_builds_tied_model(tmp_path):
    d = build_demo_model(tmp_path / "t", arch="llama-tied")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["architectures"] == ["LlamaForCausalLM"]
    from qconvert.convert.checkpoint import load_checkpoint

    names = set(load_checkpoint(str(d)).tensors)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
