"""FP8 block-scaled sources (docs/formats.md#fp8-block-sources): DeepSeek-V3 / Qwen3-FP8 style
checkpoints converted to MXFP8 and NVFP4 directly.

Oracles: the FP8 sources are made with vLLM's own block quantizer (``scaled_quantize``), their
decode is vLLM's ``scaled_dequantize``; MXFP8 outputs are decoded here with a table; the
requantized tensors are compared with quantizing vLLM's decode.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import have
from test_convert_e2e import load_dir

from qconvert.convert.numerics import fp8_block
from qconvert.convert.numerics.mxfp8 import mxfp8_quantize
from qconvert.convert.numerics.nvfp4 import nvfp4_quantize
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import QConvertError

pytestmark = pytest.mark.vllm

BLOCK = (128, 128)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def vllm_block_quantize(x: torch.Tensor, block=BLOCK):
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_quantize

    q, s = scaled_quantize(x.float(), GroupShape(*block), torch.float8_e4m3fn)
    return q, s.float().contiguous()


def vllm_block_dequantize(q: torch.Tensor, s: torch.Tensor, block=BLOCK):
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_dequantize

    return scaled_dequantize(q, s, GroupShape(*block), out_dtype=torch.float32)


def pow2_block_quantize(x: torch.Tensor, block=BLOCK):
    """UE8M0-style blocks: scale 2^ceil(log2(amax / 448)) per block, elements x / scale to E4M3."""
    n, k = x.shape
    bn, bk = block
    xb = x.float().reshape(n // bn, bn, k // bk, bk)
    amax = xb.abs().amax(dim=(1, 3)).clamp(min=2.0**-100)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (xb / s[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, s.contiguous()


def make_fp8_source(bf16_dir, out_dir, pow2=(), keep_bf16=(), block=BLOCK, config_block=None, mutate=None):
    """An FP8 block-scaled copy of a BF16 demo checkpoint: Linear weights of the layers quantized
    (modules matching ``pow2`` with power-of-two scales, the others with vLLM's quantizer), modules
    matching ``keep_bf16`` left BF16 (a mixed checkpoint). ``mutate(tensors)`` corrupts it."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    for p in bf16_dir.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(p, out_dir / p.name)
    tensors = {}
    for p in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(load_file(p))
    out = {}
    for name, t in tensors.items():
        mod = name[: -len(".weight")]
        if name.endswith(".weight") and mod.rsplit(".", 1)[-1] in LINEAR and not any(k in name for k in keep_bf16):
            q, s = (pow2_block_quantize if any(k in name for k in pow2) else vllm_block_quantize)(t, block)
            out[name], out[mod + ".weight_scale_inv"] = q, s
        else:
            out[name] = t
    if mutate:
        mutate(out)
    save_file(out, str(out_dir / "model.safetensors"))
    cfg = json.loads((bf16_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(config_block or block),
    }
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir, out


def decode_mxfp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    scale = torch.exp2(s.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return q.to(torch.float64) * scale


@pytest.fixture(scope="module")
def fp8_src(demo_dense, tmp_path_factory):
    have("vllm")
    root = tmp_path_factory.mktemp("fp8src")
    return make_fp8_source(
        demo_dense, root / "src", pow2=("layers.0.", "layers.1.self_attn.q_proj"), keep_bf16=("layers.3.mlp",)
    )


def test_dequantize_equals_vllm(fp8_src):
    _, t = fp8_src
    g = torch.Generator().manual_seed(0)
    cases = [
        (t[f"model.layers.{i}.mlp.down_proj.weight"], t[f"model.layers.{i}.mlp.down_proj.weight_scale_inv"])
        for i in (0, 1)
    ]
    # adversarial: every E4M3 byte pattern (NaN excepted), scales from 2^-126 to 2^120, odd mantissas, zero
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    w = codes[torch.randint(0, len(codes), (256, 384), generator=g)].view(torch.float8_e4m3fn)
    s = torch.tensor([[2.0**-126, 3.1e-5, 0.0], [2.0**120, 1.0 + 2.0**-23, 7.25]], dtype=torch.float32)
    cases.append((w, s))
    for w, s in cases:
        ours = fp8_block.dequantize(w, s, BLOCK)
        ref = vllm_block_dequantize(w, s)
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def test_pow2_blocks():
    s = torch.tensor([[1.0, 2.0**-126, 2.0**127, 0.75], [2.0**-127, 0.0, -2.0, 3.0]])
    assert fp8_block.pow2_blocks(s).tolist() == [[True, True, True, False], [False, False, False, False]]


def test_mxfp8_lossless_where_scales_are_powers_of_two(fp8_src, tmp_path):
    src, t = fp8_src
    dst = tmp_path / "mx"
    res = convert(
        str(src),
        dst,
        "mxfp8",
        ConvertOptions(scheme="mxfp8", dialect="modelopt", plan=PlanOptions(scheme="mxfp8"), progress=False),
    )
    out, _ = load_dir(dst)
    man = json.loads((dst / "qconvert.json").read_text())
    assert man["source"]["quantized"]["kind"] == "fp8-block"
    assert man["source"]["quantized"]["weight_block_size"] == [128, 128]
    paths = {m: v.get("source_path") for m, v in man["tensors"].items()}
    n_lossless = 0
    for name in t:
        if not name.endswith("weight_scale_inv"):
            continue
        mod = name[: -len(".weight_scale_inv")]
        q, s = out[mod + ".weight"], out[mod + ".weight_scale"]
        w, ws = t[mod + ".weight"], t[name]
        deq = vllm_block_dequantize(w, ws)
        if bool(fp8_block.pow2_blocks(ws).all()):
            n_lossless += 1
            assert paths[mod] == "lossless"
            assert torch.equal(q.view(torch.uint8), w.view(torch.uint8))  # E4M3 bytes kept
            assert torch.equal(decode_mxfp8(q, s), deq.double())  # decodes exactly to the source
        else:
            assert paths[mod] == "requantized"
            rq, rs = mxfp8_quantize(deq)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert n_lossless == 7 + 1
    # the BF16 Linear weights of the mixed checkpoint: converted as from a BF16 source
    for p in ("gate_proj", "up_proj", "down_proj"):
        mod = f"model.layers.3.mlp.{p}"
        rq, rs = mxfp8_quantize(t[mod + ".weight"])
        assert torch.equal(out[mod + ".weight"].view(torch.uint8), rq.view(torch.uint8))
        assert paths[mod] == "bf16-source"
    assert not any(k.endswith("weight_scale_inv") for k in out)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "MXFP8"
    assert any("FP8 block-scaled" in n and "8 lossless" in n for n in res.notes), res.notes
    assert any("3 quantized Linear weights are not FP8" in n for n in res.notes), res.notes


def test_nvfp4_from_the_decoded_source(fp8_src, tmp_path):
    src, t = fp8_src
    dst = tmp_path / "nv"
    convert(str(src), dst, "nvfp4", ConvertOptions(scheme="nvfp4", plan=PlanOptions(scheme="nvfp4"), progress=False))
    out, _ = load_dir(dst)
    deq = {
        n: vllm_block_dequantize(t[n], t[n[: -len("weight")] + "weight_scale_inv"])
        for n in t
        if n.endswith(".weight") and (n[: -len("weight")] + "weight_scale_inv") in t
    }
    for i in (0, 2):
        names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        g = np.max([np.float32(deq[n].abs().max()) for n in names])  # the fused group's global amax
        for n in names:
            pk, sc, s2 = nvfp4_quantize(deq[n], global_amax=float(g))
            mod = n[: -len(".weight")]
            assert torch.equal(out[mod + ".weight"], pk)
            assert torch.equal(out[mod + ".weight_scale"].view(torch.uint8), sc.view(torch.uint8))
            assert out[mod + ".weight_scale_2"].item() == s2.item()
    man = json.loads((dst / "qconvert.json").read_text())
    assert man["tensors"]["model.layers.0.self_attn.q_proj"]["source_path"] == "requantized"


def _bad(tmp_path, demo_dense, scheme="mxfp8", **kw):
    src, _ = make_fp8_source(demo_dense, tmp_path / "bad", **kw)
    dst = tmp_path / "out"
    with pytest.raises(QConvertError) as ei:
        convert(str(src), dst, scheme, ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme), progress=False))
    assert not dst.exists()
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_bad_scale_shape(tmp_path, demo_dense):
    def cut(ts):
        n = "model.layers.1.mlp.up_proj.weight_scale_inv"
        ts[n] = ts[n][:, :1].contiguous()

    msg = _bad(tmp_path, demo_dense, mutate=cut)
    assert "model.layers.1.mlp.up_proj.weight_scale_inv" in msg and "[4, 1]" in msg


def test_block_size_other_than_declared(tmp_path, demo_dense):
    msg = _bad(tmp_path, demo_dense, config_block=(64, 64))
    assert "weight_scale_inv" in msg and "weight_block_size" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_non_finite_or_negative_scale(tmp_path, demo_dense, value, scheme):
    def poison(ts):
        ts["model.layers.2.self_attn.o_proj.weight_scale_inv"][1, 0] = value

    msg = _bad(tmp_path, demo_dense, scheme=scheme, mutate=poison)
    assert "model.layers.2.self_attn.o_proj.weight_scale_inv" in msg and "[1, 0]" in msg


def test_fp8_weight_without_scale(tmp_path, demo_dense):
    def drop(ts):
        del ts["model.layers.0.mlp.down_proj.weight_scale_inv"]

    msg = _bad(tmp_path, demo_dense, mutate=drop)
    assert "model.layers.0.mlp.down_proj.weight" in msg and "weight_scale_inv" in msg


def test_per_tensor_fp8_refused(tmp_path, demo_dense):
    src, _ = make_fp8_source(demo_dense, tmp_path / "pt")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]["weight_block_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QConvertError, match="per-tensor FP8"):
        convert(
            str(src),
            tmp_path / "o",
            "mxfp8",
            ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False),
        )


@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_verify_decodes_the_fp8_source(fp8_src, tmp_path, scheme):
    from qconvert.verify import verify

    src, t = fp8_src
    dst = tmp_path / scheme
    convert(
        str(src),
        dst,
        scheme,
        ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme, last_n_bf16=1), progress=False),
    )
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    r.checks.pop("format")
    assert all(v.startswith("ok") for v in r.checks.values()), r.checks
    assert r.tensors and all(x.exact for x in r.tensors)
    pow2 = {
        n[: -len(".weight_scale_inv")]
        for n in t
        if n.endswith("weight_scale_inv") and bool(fp8_block.pow2_blocks(t[n]).all())
    }
    got = {x.module: x.lossless for x in r.tensors}
    assert len(pow2) == 8 and all(got[m] is (scheme == "mxfp8") for m in pow2)
    assert all(v is False for m, v in got.items() if m not in pow2)  # layer 3 (last, BF16 layer) is kept
    if scheme == "mxfp8":
        assert "8 of 21" in r.checks["lossless"]
        # a changed byte in a lossless tensor is caught
        from safetensors.torch import load_file, save_file

        f = dst / "model.safetensors"
        ts = load_file(f)
        w = ts["model.layers.0.mlp.up_proj.weight"].view(torch.uint8)
        w[0, 0] ^= 1
        save_file(ts, str(f), metadata={"format": "pt"})
        r2 = verify(str(src), str(dst))
        assert not r2.ok and any("model.layers.0.mlp.up_proj" in f for f in r2.failures), r2.failures


def test_inspect_and_card_say_the_source(fp8_src, tmp_path):
    from qconvert.hub import render_card
    from qconvert.inspect import format_report, inspect_checkpoint

    src, _ = fp8_src
    dst = tmp_path / "mx"
    convert(str(src), dst, "mxfp8", ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False))
    rep = inspect_checkpoint(str(dst))
    assert rep.source.startswith("FP8 block-scaled (weight_block_size [128, 128])")
    assert "8 lossless" in rep.source and "17 requantized" in rep.source and "3 bf16-source" in rep.source
    assert f"source     : {rep.source}" in format_report(rep)
    card = render_card(dst, "org/model-MXFP8")
    assert "| source | FP8 block-scaled" in card and "8 lossless" in card


@pytest.mark.parametrize("scheme,extra", [("mxfp8", {}), ("nvfp4", {"input_mode": "unit"})])
def test_moe_layout_from_fp8_source(demo_moe, tmp_path, scheme, extra):
    """Experts written in the TRT-LLM layout from an FP8 source: verify (through the layout's exact
    inverse) finds them exact, and power-of-two experts decode exactly (RCEIL keeps them so)."""
    from qconvert.verify import verify

    have("vllm") or pytest.skip("vllm not installed")
    src, _ = make_fp8_source(demo_moe, tmp_path / "src", pow2=("layers.0.",))
    dst = tmp_path / "dst"
    convert(
        str(src),
        dst,
        scheme,
        ConvertOptions(
            scheme=scheme,
            plan=PlanOptions(scheme=scheme),
            progress=False,
            layout="flashinfer-trtllm",
            engine="vllm",
            **extra,
        ),
    )
    man = json.loads((dst / "qconvert.json").read_text())
    paths = man["source"]["quantized"]["tensor_paths"]
    e0 = "model.layers.0.mlp.experts.0.gate_proj"
    assert paths[e0] == ("lossless-rceil" if scheme == "mxfp8" else "requantized")
    assert paths["model.layers.0.self_attn.q_proj"] == ("lossless" if scheme == "mxfp8" else "requantized")
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    got = {x.module: x.lossless for x in r.tensors}
    assert got[e0] is (scheme == "mxfp8") and got["model.layers.1.mlp.experts.0.gate_proj"] is False


@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_bad_fp8_source_in_a_fresh_process(demo_dense, tmp_path, scheme):
    """As a user runs it: exit 1, one line naming the tensor, no traceback or abort, no DST and no
    partial directory left (the bad scale is met by a job thread in the middle of the run)."""
    from test_hostile_convert import assert_one_line, cli

    def poison(ts):
        ts["model.layers.2.mlp.down_proj.weight_scale_inv"][0, 1] = -1.0

    src, _ = make_fp8_source(demo_dense, tmp_path / "src", mutate=poison)
    for i in range(3):  # the error is raised on a job thread: repeat the race at exit
        dst = tmp_path / f"out{i}"
        r = cli(scheme, src, dst)
        assert_one_line(r, 1, "model.layers.2.mlp.down_proj.weight_scale_inv", "[0, 1]")
        assert not dst.exists() and not any(p.name.startswith(f".out{i}") for p in tmp_path.iterdir())
