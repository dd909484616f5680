"""qconvert inspect: format/dialect detection on qconvert output in every dialect and on hand-built
ModelOpt / compressed-tensors / pre-shuffled checkpoints (written with the safetensors library,
not with qconvert's writer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from qconvert.cli import main
from qconvert.convert.demo import build_demo_model
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.inspect import inspect_checkpoint

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- fixtures shared with test_verify / test_hub -----------------------------------------------


def demo_conversions(root: Path) -> dict[str, Path]:
    """Tiny Qwen3-MoE (4 layers, last one BF16) converted to every MXFP8 dialect."""
    src = root / "bf16"
    build_demo_model(src, arch="qwen3-moe")
    out = {"bf16": src}
    for d in ("auto", "sglang", "modelopt"):
        opts = ConvertOptions(
            scheme="mxfp8", dialect=d, plan=PlanOptions(scheme="mxfp8", last_n_bf16=1), progress=False, fsync=False
        )
        convert(str(src), root / d, "mxfp8", opts)
        out[d] = root / d
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_conversions(tmp_path_factory.mktemp("demo"))


def nvfp4_encode(w: torch.Tensor, s2: float):
    """Test-side NVFP4 encoder: nearest E2M1 code per element, E4M3 block scale amax/6/s2."""
    n, k = w.shape
    x = w.float().reshape(n, k // 16, 16)
    scale = (x.abs().amax(-1) / 6 / s2).clamp(min=2.0**-9).to(torch.float8_e4m3fn)
    y = x / (scale.float() * s2).unsqueeze(-1)
    idx = (y.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    codes = (idx | ((y < 0).long() << 3)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale.contiguous()


TINY_CFG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "intermediate_size": 128,
    "torch_dtype": "bfloat16",
}


def tiny_source(root: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "model.embed_tokens.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(64).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 64, generator=g) * 0.05).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 128, generator=g) * 0.05).bfloat16(),
        "model.norm.weight": torch.ones(64).bfloat16(),
        "lm_head.weight": torch.randn(32, 64, generator=g).bfloat16(),
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_CFG))
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    return t


def nvfp4_checkpoint(root: Path, src: dict[str, torch.Tensor], dialect: str) -> Path:
    """A ModelOpt or compressed-tensors NVFP4 export of ``src`` as those tools lay it out."""
    out: dict[str, torch.Tensor] = {}
    quant = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
    for name, t in src.items():
        mod = name[: -len(".weight")]
        if mod not in quant:
            out[name] = t
            continue
        s2 = float(t.float().abs().max()) / 2688
        packed, scale = nvfp4_encode(t, s2)
        if dialect == "modelopt":
            out[f"{mod}.weight"] = packed
            out[f"{mod}.weight_scale"] = scale
            out[f"{mod}.weight_scale_2"] = torch.tensor(s2, dtype=torch.float32)
            out[f"{mod}.input_scale"] = torch.tensor(0.01, dtype=torch.float32)
        else:
            out[f"{mod}.weight_packed"] = packed
            out[f"{mod}.weight_scale"] = scale
            out[f"{mod}.weight_global_scale"] = torch.tensor([1 / s2], dtype=torch.float32)
    root.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_CFG)
    if dialect == "modelopt":
        cfg["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                    "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                    "targets": ["Linear"],
                }
            },
            "producer": {"name": "modelopt", "version": "0.47.0"},
        }
        (root / "hf_quant_config.json").write_text(
            json.dumps(
                {
                    "producer": {"name": "modelopt", "version": "0.47.0"},
                    "quantization": {
                        "quant_algo": "NVFP4",
                        "kv_cache_quant_algo": None,
                        "group_size": 16,
                        "exclude_modules": ["lm_head"],
                    },
                }
            )
        )
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "strategy": "tensor_group",
                        "group_size": 16,
                        "symmetric": True,
                        "dynamic": False,
                        "scale_dtype": "float8_e4m3fn",
                    },
                    "input_activations": None,
                }
            },
        }
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dialect,vllm,sglang,keys",
    [
        ("auto", True, True, {"ignored_layers", "modules_to_not_convert"}),
        ("sglang", False, True, {"modules_to_not_convert"}),
        ("modelopt", True, True, {"ignore", "exclude_modules"}),
    ],
)
def test_inspect_qconvert_mxfp8_dialects(demo, dialect, vllm, sglang, keys):
    r = inspect_checkpoint(demo[dialect])
    man = json.loads((demo[dialect] / "qconvert.json").read_text())
    assert (r.scheme, r.dialect, r.producer) == ("mxfp8", dialect, "qconvert")
    assert r.problems == [] and r.notes == []
    n_mx = sum(1 for v in man["tensors"].values() if v["format"] == "mxfp8")
    assert n_mx == 84
    assert r.totals["quantized_modules"] == n_mx
    mods = {m.name: m for m in r.modules}
    q = mods["model.layers.0.self_attn.q_proj"]
    assert q.format == "mxfp8" and q.shape == [256, 256]
    assert q.scale_suffix == ("weight_scale_inv" if dialect == "sglang" else "weight_scale")
    assert q.bytes == 256 * 256 + 256 * 8
    assert mods["model.layers.3.self_attn.q_proj"].format == "bf16"
    src_bytes = sum(p.stat().st_size for p in demo["bf16"].glob("*.safetensors"))
    # BF16 equivalent within the shards' headers of the real source size
    assert abs(r.totals["bf16_bytes"] - src_bytes) < 20_000
    assert r.totals["compression_ratio"] == pytest.approx(r.totals["bf16_bytes"] / r.totals["bytes"])
    assert r.totals["compression_ratio"] > 1.4
    eng = {e.engine: e for e in r.engines}
    assert eng["vllm"].loads is vllm and eng["sglang"].loads is sglang
    assert "SM100" in eng["sglang"].gpus
    assert {k.rsplit(".", 1)[-1] for k in r.exclusions} == keys
    assert all(len(v) == len(man["exclusions"]) for v in r.exclusions.values())


def test_inspect_bf16(demo):
    r = inspect_checkpoint(demo["bf16"])
    assert (r.scheme, r.dialect) == ("bf16", "bf16")
    assert r.totals["quantized_modules"] == 0
    assert r.totals["compression_ratio"] == pytest.approx(1.0)
    assert all(e.loads for e in r.engines)


@pytest.mark.parametrize(
    "dialect,scale_key", [("modelopt", "weight_scale_2"), ("compressed-tensors", "weight_global_scale")]
)
def test_inspect_handbuilt_nvfp4(tmp_path, dialect, scale_key):
    src = tiny_source(tmp_path / "src")
    ck = nvfp4_checkpoint(tmp_path / dialect, src, dialect)
    r = inspect_checkpoint(ck)
    assert (r.scheme, r.dialect, r.producer) == ("nvfp4", dialect, dialect)
    mods = {m.name: m for m in r.modules}
    q = mods["model.layers.0.mlp.down_proj"]
    assert q.format == "nvfp4" and q.shape == [64, 128]
    assert scale_key in q.tensors and q.tensors["weight_scale"][0] == "F8_E4M3"
    assert mods["lm_head"].format == "bf16"
    assert r.totals["quantized_modules"] == 2
    eng = {e.engine: e for e in r.engines}
    assert eng["vllm"].loads and eng["sglang"].loads
    marlin = [f for _, f in eng["sglang"].alt]
    assert (["--fp4-gemm-backend", "marlin"] in marlin) is (dialect == "modelopt")


def test_inspect_third_party_modelopt_mxfp8_without_config_block(tmp_path):
    """Older ModelOpt exports: only hf_quant_config.json declares the format."""
    g = torch.Generator().manual_seed(1)
    root = tmp_path / "mo"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(TINY_CFG))
    (root / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt"},
                "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
            }
        )
    )
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
            "model.layers.0.self_attn.q_proj.weight_scale": torch.full((64, 2), 120, dtype=torch.uint8),
            "lm_head.weight": torch.randn(32, 64, generator=g).bfloat16(),
        },
        str(root / "model.safetensors"),
    )
    r = inspect_checkpoint(root)
    assert (r.scheme, r.dialect, r.producer) == ("mxfp8", "modelopt", "modelopt")
    assert any("hf_quant_config.json" in n for n in r.notes)
    assert r.exclusions == {"hf_quant_config.json quantization.exclude_modules": ["lm_head"]}


def test_inspect_quantized_tensors_without_config_is_unknown(tmp_path):
    root = tmp_path / "x"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(TINY_CFG))
    save_file(
        {
            "a.weight": torch.zeros(4, 32, dtype=torch.float8_e4m3fn),
            "a.weight_scale": torch.zeros(4, 1, dtype=torch.uint8),
        },
        str(root / "model.safetensors"),
    )
    r = inspect_checkpoint(root)
    assert r.scheme == "unknown"
    assert "no quantization_config" in r.notes[0]


def test_inspect_preshuffled_layout_contract(tmp_path, demo):
    """Stacked kernel-layout experts are recognised through the manifest's layout contract."""
    root = tmp_path / "shuf"
    root.mkdir()
    cfg = json.loads((demo["auto"] / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(cfg))
    contract = {
        "layout": "flashinfer-trtllm",
        "layout_version": 1,
        "engine": "vllm",
        "engine_version": "0.33.0",
        "flashinfer_version": "0.7.4",
        "scheme": "mxfp8",
        "tp": 1,
        "ep": 1,
    }
    (root / "qconvert.json").write_text(
        json.dumps(
            {
                "qconvert_version": "0.1.0",
                "scheme": "mxfp8",
                "dialect": "auto",
                "layouts": {"model.layers.0.mlp.experts": contract},
            }
        )
    )
    save_file(
        {
            "model.layers.0.mlp.experts.w13_weight": torch.zeros(8, 256, 256, dtype=torch.float8_e4m3fn),
            "model.layers.0.mlp.experts.w13_weight_scale": torch.zeros(8, 256, 8, dtype=torch.uint8),
            "model.layers.0.mlp.experts.w2_weight": torch.zeros(8, 256, 128, dtype=torch.float8_e4m3fn),
            "model.layers.0.mlp.experts.w2_weight_scale": torch.zeros(8, 256, 4, dtype=torch.uint8),
            "lm_head.weight": torch.zeros(512, 256, dtype=torch.bfloat16),
        },
        str(root / "model.safetensors"),
    )
    r = inspect_checkpoint(root)
    assert r.scheme == "mxfp8" and r.layouts == [contract]
    mods = {m.name: m for m in r.modules}
    assert mods["model.layers.0.mlp.experts.w13"].stacked and mods["model.layers.0.mlp.experts.w13"].format == "mxfp8"
    assert mods["model.layers.0.mlp.experts.w13"].shape == [8, 256, 256]
    eng = {e.engine: e for e in r.engines}
    assert eng["vllm"].loads and not eng["sglang"].loads
    assert "pre-shuffled" in eng["vllm"].note


def test_inspect_cli_json_and_table(demo):
    res = CliRunner().invoke(main, ["inspect", str(demo["sglang"]), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["scheme"] == "mxfp8" and d["dialect"] == "sglang"
    rows = {r["module"]: r for r in d["rows"]}
    assert rows["model.layers.0.mlp.experts.*.gate_proj"]["count"] == 8
    assert rows["model.layers.0.mlp.experts.*.gate_proj"]["format"] == "mxfp8"
    res = CliRunner().invoke(main, ["inspect", str(demo["auto"])])
    assert res.exit_code == 0
    assert "mxfp8 (auto dialect, written by qconvert" in res.output
    assert "x smaller" in res.output
    res = CliRunner().invoke(main, ["inspect", str(demo["auto"] / "nope")])
    assert res.exit_code == 1 and "not a checkpoint directory" in res.output


@pytest.mark.parametrize("dialect", ["modelopt", "compressed-tensors"])
def test_inspect_says_recipe_and_w4a16_or_w4a4(tmp_path, dialect):
    """inspect reads W4A16 / W4A4 from the tensors (activation scales present or not) and the recipe
    from qconvert.json; the table says them, and the layout (plain here)."""
    src = build_demo_model(tmp_path / "bf16", arch="qwen3")
    seen = {}
    for mode, recipe in (("weight-only", "te"), ("unit", "modelopt")):
        dst = tmp_path / f"{dialect}-{mode}"
        opts = ConvertOptions(
            scheme="nvfp4",
            dialect=dialect,
            recipe=recipe,
            input_mode=mode,
            plan=PlanOptions(scheme="nvfp4"),
            progress=False,
            fsync=False,
        )
        convert(str(src), dst, "nvfp4", opts)
        r = inspect_checkpoint(dst)
        seen[mode] = (r.activations, r.recipe)
        res = CliRunner().invoke(main, ["inspect", str(dst)])
        assert res.exit_code == 0, res.output
        assert f"format     : nvfp4 {r.activations} ({dialect} dialect" in res.output
        assert f"recipe     : {recipe}" in res.output and "layout     : plain" in res.output
    assert seen == {"weight-only": ("W4A16", "te"), "unit": ("W4A4", "modelopt")}
    # without the manifest the recipe cannot be told; the activations still can
    (tmp_path / f"{dialect}-unit" / "qconvert.json").unlink()
    r = inspect_checkpoint(tmp_path / f"{dialect}-unit")
    assert (r.activations, r.recipe) == ("W4A4", None)
