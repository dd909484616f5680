"""--layout flashinfer-trtllm end to end: every scheme and engine, per-rank tensors, unshuffle.

The layout functions themselves are checked against FlashInfer's and vLLM's own code in
test_layouts_trtllm.py; here the pipeline's use of them is checked: names, shapes, manifest
contract, and that unshuffle gives back exactly the plain conversion's tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_convert_e2e import load_dir

from qconvert.cli import main

CASES = [
    ("mxfp8", "vllm", 1, 1, []),
    ("mxfp8", "sglang", 1, 1, ["--dialect", "sglang"]),
    ("mxfp8", "vllm", 1, 2, []),
    ("nvfp4", "sglang", 1, 1, ["--input-scale", "unit"]),
    ("nvfp4", "sglang", 1, 1, ["--input-scale", "unit", "--dialect", "compressed-tensors"]),
    ("bf16", "vllm", 2, 1, []),
    ("bf16", "sglang", 1, 1, []),
]


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


@pytest.mark.parametrize("scheme,engine,tp,ep,extra", CASES)
def test_layout_roundtrip(demo_moe, tmp_path, scheme, engine, tp, ep, extra):
    r = CliRunner()
    plain, lay, back = tmp_path / "plain", tmp_path / "layout", tmp_path / "back"
    last = [] if scheme == "bf16" else ["--last-n-bf16", "1"]
    if scheme != "bf16":
        res = r.invoke(main, [scheme, str(demo_moe), str(plain), "--no-progress", *last, *extra])
        assert res.exit_code == 0, res.output
    res = r.invoke(
        main,
        [
            scheme,
            str(demo_moe),
            str(lay),
            "--no-progress",
            "--layout",
            "flashinfer-trtllm",
            "--engine",
            engine,
            "--tp",
            str(tp),
            "--ep",
            str(ep),
            *last,
            *extra,
        ],
    )
    assert res.exit_code == 0, res.output
    lt, _ = load_dir(lay)
    # experts only under the layout namespace; nothing a stock loader would take for its own params
    assert not any(".experts.0." in k for k in lt)
    tags = {k.split(".experts.")[1].split(".")[0] for k in lt if ".experts." in k}
    want = {"trtllm"} if tp == ep == 1 else {f"trtllm_tp{a}_ep{b}" for a in range(tp) for b in range(ep)}
    assert tags == want
    man = json.loads((lay / "qconvert.json").read_text())["layout"]
    assert man["engine"] == engine and man["tp"] == tp and man["ep"] == ep
    layer_schemes = man["layers"]
    assert layer_schemes["model.layers.0.mlp.experts"] == scheme
    if scheme != "bf16":
        assert layer_schemes["model.layers.3.mlp.experts"] == "bf16"
    for c in man["contracts"].values():
        assert c["engine"] == engine and c["gate_up_order"] == "up,gate" and c["epilogue_tile_m"] == 128
    if engine == "sglang" and scheme == "bf16":
        assert lt["model.layers.0.mlp.experts.trtllm.w13_weight"].shape == (8, 256 // 64, 256, 64)
    if engine == "vllm" and scheme == "bf16":
        from qconvert.convert.layouts.trtllm import rank_shape

        ip = rank_shape("bf16", "vllm", 8, 128, 256, tp=2).ip  # per-rank I after vLLM's padding
        assert lt["model.layers.0.mlp.experts.trtllm_tp1_ep0.w13_weight"].shape == (8, 2 * ip, 256)
    if scheme == "mxfp8":
        for k, t in lt.items():
            if ".experts." in k and k.endswith(("weight_scale", "weight_scale_inv")):
                assert int(t.min()) > 0, f"{k}: E8M0 byte 0 written"
    if ep == 2:
        assert lt["model.layers.0.mlp.experts.trtllm_tp0_ep1.w13_weight"].shape[0] == 4

    if scheme == "bf16":
        return  # the unshuffled BF16 checkpoint must equal the source itself
    res = r.invoke(main, ["unshuffle", str(lay), str(back)])
    if "compressed-tensors" in extra:  # 2688/amax is not recoverable from decode-convention scalars
        assert res.exit_code == 1 and "bit-exactly" in res.output and not back.exists()
        return
    assert res.exit_code == 0, res.output
    pt, _ = load_dir(plain)
    bt, _ = load_dir(back)
    assert set(pt) == set(bt)
    for k in pt:
        assert pt[k].dtype == bt[k].dtype and pt[k].shape == bt[k].shape, k
        assert torch.equal(_bytes(pt[k]), _bytes(bt[k])), k


def test_bf16_layout_unshuffles_to_source(demo_moe, tmp_path):
    r = CliRunner()
    lay, back = tmp_path / "layout", tmp_path / "back"
    assert (
        r.invoke(
            main,
            ["bf16", str(demo_moe), str(lay), "--layout", "flashinfer-trtllm", "--engine", "sglang", "--no-progress"],
        ).exit_code
        == 0
    )
    res = r.invoke(main, ["unshuffle", str(lay), str(back)])
    assert res.exit_code == 0, res.output
    st, _ = load_dir(demo_moe)
    bt, _ = load_dir(back)
    assert set(st) == set(bt)
    assert all(torch.equal(st[k], bt[k]) for k in st)
    assert "quantization_config" not in json.loads((lay / "config.json").read_text())


def test_layout_refusals(demo_moe, demo_dense, tmp_path):
    r = CliRunner()
    res = r.invoke(main, ["nvfp4", str(demo_moe), str(tmp_path / "a"), "--layout", "flashinfer-trtllm"])
    assert res.exit_code == 1 and "--input-scale unit" in res.output and not (tmp_path / "a").exists()
    res = r.invoke(main, ["mxfp8", str(demo_dense), str(tmp_path / "b"), "--layout", "flashinfer-trtllm"])
    assert res.exit_code == 1 and "no MoE experts" in res.output
    res = r.invoke(
        main,
        [
            "mxfp8",
            str(demo_moe),
            str(tmp_path / "c"),
            "--layout",
            "flashinfer-trtllm",
            "--engine",
            "sglang",
            "--tp",
            "2",
        ],
    )
    assert res.exit_code == 1 and "tp" in res.output.lower() and not (tmp_path / "c").exists()
    res = r.invoke(main, ["bf16", str(demo_moe), str(tmp_path / "d")])
    assert res.exit_code != 0 and "--layout" in res.output
    res = r.invoke(main, ["unshuffle", str(demo_moe), str(tmp_path / "e")])
    assert res.exit_code == 1 and "qconvert.json" in res.output


def test_verify_checks_layout_values(demo_moe, tmp_path):
    """verify decodes a pre-shuffled checkpoint through unshuffle and catches a corrupted scale byte."""
    from safetensors.torch import load_file, save_file

    from qconvert.verify import verify

    lay = tmp_path / "layout"
    r = CliRunner()
    assert (
        r.invoke(main, ["mxfp8", str(demo_moe), str(lay), "--layout", "flashinfer-trtllm", "--no-progress"]).exit_code
        == 0
    )
    rep = verify(str(demo_moe), str(lay))
    assert rep.ok, rep.failures
    assert rep.checks["layout"].startswith("ok") and len(rep.tensors) == 4 * (4 + 8 * 3)
    name = "model.layers.1.mlp.experts.trtllm.w2_weight_scale"
    shard = next(f for f in lay.glob("*.safetensors") if name in load_file(f))
    t = load_file(shard)
    t[name] = t[name].clone()
    t[name].view(-1)[5] += 3  # one E8M0 byte: that block decodes 8x too large
    save_file(t, shard)
    rep = verify(str(demo_moe), str(lay))
    assert not rep.ok
    assert any("model.layers.1.mlp.experts." in f and "down_proj" in f for f in rep.failures), rep.failures
