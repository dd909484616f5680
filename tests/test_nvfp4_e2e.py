"""NVFP4 end to end: both dialects, fused global scales, activation-scale modes, engine parsers.

Decoding uses a table written here and compressed-tensors' own decompressor, never qconvert's
dequantize.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import have
from test_convert_e2e import load_dir

from qconvert.cli import main
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def decode(packed, scale, scale_2):
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes]
    n, k = vals.shape
    s = scale.to(torch.float64) * float(scale_2)
    return (vals.view(n, k // 16, 16) * s.unsqueeze(-1)).view(n, k)


@pytest.fixture(scope="module")
def nv(demo_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("nv")
    mo = root / "modelopt"
    ct = root / "ct"
    convert(
        str(demo_moe),
        mo,
        "nvfp4",
        ConvertOptions(scheme="nvfp4", plan=PlanOptions(scheme="nvfp4", last_n_bf16=1), progress=False),
    )
    convert(
        str(demo_moe),
        ct,
        "nvfp4",
        ConvertOptions(
            scheme="nvfp4",
            dialect="compressed-tensors",
            input_mode="unit",
            plan=PlanOptions(scheme="nvfp4", last_n_bf16=1),
            progress=False,
        ),
    )
    return demo_moe, mo, ct


def test_modelopt_w4a16_tensors_error_and_shared_scales(nv):
    src, mo, _ = nv
    s_t, _ = load_dir(src)
    d_t, _ = load_dir(mo)
    assert not any(k.endswith("input_scale") for k in d_t)  # W4A16 default: no activation scales
    n = 0
    for name, x in s_t.items():
        mod = name[: -len(".weight")]
        if f"{mod}.weight_scale_2" not in d_t:
            continue
        w, s, s2 = d_t[f"{mod}.weight"], d_t[f"{mod}.weight_scale"], d_t[f"{mod}.weight_scale_2"]
        assert w.dtype == torch.uint8 and w.shape == (x.shape[0], x.shape[1] // 2)
        assert s.dtype == torch.float8_e4m3fn and s.shape == (x.shape[0], x.shape[1] // 16)
        assert s2.dtype == torch.float32 and s2.shape == ()
        xf = x.to(torch.float64)
        rel = ((decode(w, s, s2) - xf).norm() / xf.norm()).item()
        assert 0.02 < rel < 0.15, (name, rel)
        n += 1
    assert n == 84
    for i in range(3):
        p = f"model.layers.{i}."
        q, k, v = (d_t[f"{p}self_attn.{x}_proj.weight_scale_2"] for x in "qkv")
        assert q == k == v
        amax = max(s_t[f"{p}self_attn.{x}_proj.weight"].float().abs().max() for x in "qkv")
        assert torch.equal(q, amax / 2688)
        for e in range(8):
            g = d_t[f"{p}mlp.experts.{e}.gate_proj.weight_scale_2"]
            assert g == d_t[f"{p}mlp.experts.{e}.up_proj.weight_scale_2"]
        downs = {float(d_t[f"{p}mlp.experts.{e}.down_proj.weight_scale_2"]) for e in range(8)}
        assert len(downs) > 1  # down_proj independent, per expert
    assert "model.layers.3.mlp.experts" in json.loads((mo / "config.json").read_text())["quantization_config"]["ignore"]
    man = json.loads((mo / "qconvert.json").read_text())
    assert man["recipe"] == "te" and man["activations"].startswith("W4A16")


def test_compressed_tensors_decompressor_matches_modelopt_dialect(nv):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    _, mo, ct = nv
    m_t, _ = load_dir(mo)
    c_t, _ = load_dir(ct)
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**qc["config_groups"]["group_0"])
    checked = 0
    for k in [k for k in c_t if k.endswith(".weight_packed")]:
        mod = k[: -len(".weight_packed")]
        assert torch.equal(c_t[k], m_t[f"{mod}.weight"]) and torch.equal(
            c_t[f"{mod}.weight_scale"].view(torch.uint8), m_t[f"{mod}.weight_scale"].view(torch.uint8)
        )
        gs = c_t[f"{mod}.weight_global_scale"]
        assert gs.shape == (1,) and gs.dtype == torch.float32
        torch.testing.assert_close(gs, 1.0 / m_t[f"{mod}.weight_scale_2"].reshape(1), rtol=1e-6, atol=0)
        assert c_t[f"{mod}.input_global_scale"].item() == 1.0
        ref = decode(m_t[f"{mod}.weight"], m_t[f"{mod}.weight_scale"], m_t[f"{mod}.weight_scale_2"])
        # compressed-tensors' decode in fp32 (its unpacker and dequantize, as its decompressor runs them)
        packed = c_t[k]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        out = dequantize(x_q=codes, scale=c_t[f"{mod}.weight_scale"].float(), global_scale=gs, dtype=torch.float32).to(
            torch.float64
        )
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
        # and its decompressor proper (BF16 output) agrees to BF16 rounding
        dec = NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": c_t[f"{mod}.weight_scale"], "weight_global_scale": gs}, scheme
        )["weight"]
        torch.testing.assert_close(dec.to(torch.float64), ref, rtol=2**-7, atol=0)
        checked += 1
    assert checked == 84
    assert any(e.startswith("re:^model\\.layers\\.3\\.") for e in qc["ignore"])


@pytest.mark.skipif(not have("vllm"), reason="vLLM not installed")
def test_vllm_parsers_agree_with_plan(nv):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    _, mo, ct = nv
    mq = json.loads((mo / "config.json").read_text())["quantization_config"]
    assert mq["quant_algo"] == "W4A16_NVFP4"  # docs/formats.md#nvfp4-weight-only-quant_algo
    vm = ModelOptNvFp4Config.from_config(mq)
    assert vm.quant_method == "W4A16_NVFP4" and vm.group_size == 16
    vm.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    cq = json.loads((ct / "config.json").read_text())["quantization_config"]
    vc = CompressedTensorsConfig.from_config(cq)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for i in range(4):
        quantized = i < 3
        for prefix in (
            f"model.layers.{i}.self_attn.qkv_proj",
            f"model.layers.{i}.self_attn.o_proj",
            f"model.layers.{i}.mlp.experts",
        ):
            assert vm.is_layer_excluded(prefix) == (not quantized), prefix
            assert should_ignore_layer(prefix, ignore=vc.ignore, fused_mapping=fused) == (not quantized), prefix
        assert vm.is_layer_excluded(f"model.layers.{i}.mlp.gate")
        assert should_ignore_layer(f"model.layers.{i}.mlp.gate", ignore=vc.ignore)
    assert vm.is_layer_excluded("lm_head") and should_ignore_layer("lm_head", ignore=vc.ignore)


def test_cli_unit_copied_and_mismatch(demo_moe, tmp_path):
    r = CliRunner()
    unit = tmp_path / "unit"
    res = r.invoke(main, ["nvfp4", str(demo_moe), str(unit), "--input-scale", "unit", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "W4A4, input scale 1.0" in res.output
    u_t, _ = load_dir(unit)
    assert u_t["model.layers.0.self_attn.q_proj.input_scale"].item() == 1.0
    assert (unit / "hf_quant_config.json").exists()

    # calibrated scales are copied module by module, in the target dialect's convention
    from safetensors.torch import load_file, save_file

    shard = next(
        f for f in sorted(unit.glob("*.safetensors")) if "model.layers.0.self_attn.q_proj.input_scale" in load_file(f)
    )
    t = load_file(shard)
    t["model.layers.0.self_attn.q_proj.input_scale"] = torch.tensor(0.125)
    save_file(t, shard)
    copied = tmp_path / "copied"
    res = r.invoke(
        main,
        [
            "nvfp4",
            str(demo_moe),
            str(copied),
            "--dialect",
            "compressed-tensors",
            "--input-scales-from",
            str(unit),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    c_t, _ = load_dir(copied)
    assert c_t["model.layers.0.self_attn.q_proj.input_global_scale"].item() == 8.0
    assert c_t["model.layers.0.self_attn.k_proj.input_global_scale"].item() == 1.0

    # a source of another shape of plan is refused, naming the module, and nothing is written
    eo = tmp_path / "eo"
    assert (
        r.invoke(
            main, ["nvfp4", str(demo_moe), str(eo), "--experts-only", "--input-scale", "unit", "--no-progress"]
        ).exit_code
        == 0
    )
    bad = tmp_path / "bad"
    res = r.invoke(main, ["nvfp4", str(demo_moe), str(bad), "--input-scales-from", str(eo), "--no-progress"])
    assert res.exit_code == 1 and "self_attn" in res.output and "input scale" in res.output
    assert not bad.exists()
    e_t, _ = load_dir(eo)
    assert e_t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert e_t["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.uint8

    res = r.invoke(main, ["nvfp4", str(demo_moe), str(tmp_path / "x"), "--weight-only", "--input-scale", "unit"])
    assert res.exit_code != 0 and "at most one" in res.output


def test_recipes_differ_only_slightly(demo_dense, tmp_path):
    a, b = tmp_path / "te", tmp_path / "mo"
    for d, recipe in ((a, "te"), (b, "modelopt")):
        convert(
            str(demo_dense),
            d,
            "nvfp4",
            ConvertOptions(scheme="nvfp4", recipe=recipe, plan=PlanOptions(scheme="nvfp4"), progress=False),
        )
    ta, _ = load_dir(a)
    tb, _ = load_dir(b)
    diff = total = 0
    for k in ta:
        if k.endswith(".weight_scale") and ta[k].dtype == torch.float8_e4m3fn:
            diff += (ta[k].view(torch.uint8) != tb[k].view(torch.uint8)).sum().item()
            total += ta[k].numel()
    assert total > 0 and diff / total < 0.01
    assert json.loads((b / "qconvert.json").read_text())["recipe"] == "modelopt"
