"""compressed-tensors FP8-block sources (docs/formats.md#compressed-tensors-fp8-block-sources):
checkpoints as llm-compressor's ``FP8_BLOCK`` scheme writes them, converted to MXFP8 and NVFP4.

Oracles: the sources are written by compressed-tensors' own code (its ``FP8_BLOCK`` preset scheme,
``calculate_qparams`` for the block scales, ``FloatQuantizationCompressor.compress`` for the
weights, ``ModelCompressor.update_config`` for config.json, ``match_name`` for the ignore list);
their decode is compressed-tensors' ``dequantize`` (with the scheme's weight arguments) and its
compressor's ``decompress``; vLLM's ``CompressedTensorsConfig`` parses the config.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import have
from test_convert_e2e import load_dir
from test_quantized_sources import decode_mxfp8

from qconvert.convert.numerics import fp8_block
from qconvert.convert.numerics.mxfp8 import mxfp8_quantize
from qconvert.convert.numerics.nvfp4 import nvfp4_quantize
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import QConvertError

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (128, 128)
#: intermediate_size not a multiple of 128: gate/up [320, 256] and down [256, 320] have padded edge blocks
SIZES = {"intermediate_size": 320}
IGNORE = ["lm_head", "re:.*layers\\.3\\.mlp\\..*"]


def ct_scheme():
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    return preset_name_to_scheme("FP8_BLOCK", ["Linear"])


def ct_block_quantize(w: torch.Tensor, pow2: bool = False):
    """compressed-tensors' FP8_BLOCK weight quantization of one Linear weight: per-block min/max
    (its memoryless min-max observer), ``calculate_qparams`` for the scale, the compressor for the
    E4M3 weight. ``pow2``: the scale rounded up to a power of two first (a UE8M0-style source)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, maybe_pad_tensor_for_block_quant

    scheme = ct_scheme()
    bn, bk = scheme.weights.block_structure
    p = maybe_pad_tensor_for_block_quant(w, (bn, bk))
    b = p.reshape(p.shape[0] // bn, bn, p.shape[1] // bk, bk).transpose(1, 2)
    scale, zp = calculate_qparams(b.amin(dim=(-1, -2)), b.amax(dim=(-1, -2)), scheme.weights)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale.float()))).to(scale.dtype)
    comp = BaseCompressor.get_value_from_registry("float-quantized")
    out = comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out["weight"].contiguous(), out["weight_scale"]  # a padded weight comes back as a slice


def ct_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' decode with the scheme's weight arguments, in fp32."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return dequantize(q, s.float(), args=ct_scheme().weights, dtype=torch.float32)


def expected_mxfp8(w: torch.Tensor, ws: torch.Tensor):
    """MXFP8 bytes (elements as uint8, scale bytes) of an FP8-block weight as docs/formats.md#fp8-block-sources
    says: RCEIL of compressed-tensors' decode, except power-of-two blocks, which keep the source's
    E4M3 bytes under the scale's exponent byte."""
    n, k = w.shape
    rq, rs = mxfp8_quantize(ct_dequantize(w, ws))
    mask = fp8_block.pow2_blocks(ws)
    expo = ((ws.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    elem = mask.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    sub_mask, sub_expo = (x.repeat_interleave(128, 0).repeat_interleave(4, 1)[:n, : k // 32] for x in (mask, expo))
    return torch.where(elem, w.view(torch.uint8), rq.view(torch.uint8)), torch.where(sub_mask, sub_expo, rs)


def make_ct_source(bf16_dir, out_dir, ignore=IGNORE, pow2=(), mutate=None, qc_mutate=None):
    """A compressed-tensors FP8_BLOCK copy of a BF16 checkpoint: Linear weights not matched by
    ``ignore`` (compressed-tensors' ``match_name``) quantized by compressed-tensors; modules
    matching ``pow2`` get power-of-two scales. ``mutate(tensors)`` / ``qc_mutate(qc)`` corrupt it."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    for p in bf16_dir.iterdir():
        if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy(p, out_dir / p.name)
    tensors = {}
    for p in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(load_file(p))
    out = {}
    for name, t in tensors.items():
        mod = name[: -len(".weight")]
        if (
            name.endswith(".weight")
            and mod.rsplit(".", 1)[-1] in LINEAR
            and not any(match_name(mod, e) for e in ignore)
        ):
            out[name], out[mod + ".weight_scale"] = ct_block_quantize(t, pow2=any(k in name for k in pow2))
        else:
            out[name] = t
    if mutate:
        mutate(out)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    qc = QuantizationConfig(
        config_groups={"group_0": ct_scheme()},
        format="float-quantized",
        quantization_status="compressed",
        ignore=list(ignore),
    )
    ModelCompressor(quantization_config=qc).update_config(str(out_dir))
    if qc_mutate:
        cfg = json.loads((out_dir / "config.json").read_text())
        qc_mutate(cfg["quantization_config"])
        (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir, out


@pytest.fixture(scope="module")
def dense320(tmp_path_factory):
    from qconvert.convert.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "qwen3-320", arch="qwen3", overrides=SIZES)


@pytest.fixture(scope="module")
def ct_src(dense320, tmp_path_factory):
    have("compressed_tensors") or pytest.skip("compressed-tensors not installed")
    root = tmp_path_factory.mktemp("ctsrc")
    return make_ct_source(dense320, root / "src", pow2=("layers.0.", "layers.1.self_attn.q_proj"))


def scale_names(t):
    return [n for n in t if n.endswith(".weight_scale")]


def test_source_is_the_real_form(ct_src):
    """What compressed-tensors wrote: BF16 block scales of ceil(N/128) x ceil(K/128) beside F8_E4M3
    weights, config keys as read (docs/formats.md#compressed-tensors-fp8-block-sources)."""
    src, t = ct_src
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["block_structure"], w["num_bits"], w["type"]) == ("block", [128, 128], 8, "float")
    a = qc["config_groups"]["group_0"]["input_activations"]
    assert (a["strategy"], a["group_size"], a["dynamic"]) == ("group", 128, True)
    up = "model.layers.0.mlp.up_proj"
    assert t[up + ".weight"].dtype == torch.float8_e4m3fn and t[up + ".weight_scale"].dtype == torch.bfloat16
    assert list(t[up + ".weight"].shape) == [320, 256] and list(t[up + ".weight_scale"].shape) == [3, 2]
    assert "model.layers.3.mlp.up_proj.weight_scale" not in t and "lm_head.weight_scale" not in t


@pytest.mark.vllm
def test_vllm_parses_what_qconvert_reads(ct_src):
    """vLLM's own config parser accepts the source config, with the block qconvert reads."""
    have("vllm") or pytest.skip("vllm not installed")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    from qconvert.convert import fp8_source

    src, t = ct_src
    cfg = json.loads((src / "config.json").read_text())
    decl = fp8_source.declaration(cfg)
    vc = CompressedTensorsConfig.from_config(json.loads(json.dumps(cfg["quantization_config"])))
    wq = vc.target_scheme_map["Linear"]["weights"]
    assert wq.strategy == "block" and tuple(wq.block_structure) == decl.block == BLOCK
    assert CompressedTensorsConfig._is_fp8_w8a8(wq, vc.target_scheme_map["Linear"]["input_activations"])
    inv = {}
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for n in f.keys():
            sl = f.get_slice(n)
            inv[n] = (sl.get_dtype(), tuple(sl.get_shape()))
    qs = fp8_source.detect(cfg, inv)
    # the BF16 Linear weights qconvert counts as on the ignore list are the ones vLLM leaves unquantized
    for w in qs.float_weights:
        mod = w[: -len(".weight")]
        assert (w in qs.ignored) is should_ignore_layer(mod, ignore=vc.ignore, fused_mapping={}), w
    assert {"model.layers.3.mlp.up_proj.weight", "lm_head.weight"} <= set(qs.ignored)
    assert len(qs.scales) == 7 * 4 - 3 and qs.form == "compressed-tensors"


def test_decode_equals_compressed_tensors(ct_src):
    """fp8_block.dequantize of the source equals compressed-tensors' dequantize bit for bit (fp32
    scale), and its BF16 equals compressed-tensors' own BF16 decode (the scale's dtype); the
    compressor's ``decompress`` (block inferred from the shapes) agrees where the shape divides."""
    from compressed_tensors.compressors import BaseCompressor

    src, t = ct_src
    comp = BaseCompressor.get_value_from_registry("float-quantized")
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    # adversarial: every E4M3 pattern (NaN excepted), odd shapes, BF16 scales from tiny to huge, zero
    w = codes[torch.randint(0, len(codes), (300, 200), generator=g)].view(torch.float8_e4m3fn)
    s = torch.tensor([[2.0**-126, 3.1e-5], [2.0**120, 7.25], [0.0, 1.0 + 2.0**-7]], dtype=torch.bfloat16)
    cases = [(t[n[: -len("_scale")]], t[n]) for n in scale_names(t)] + [(w, s)]
    for q, sc in cases:
        ours = fp8_block.dequantize(q, sc, BLOCK)
        assert torch.equal(ours.view(torch.int32), ct_dequantize(q, sc).view(torch.int32))
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        ct_bf16 = dequantize(q, sc, args=ct_scheme().weights)  # computed in the scale's dtype
        assert ct_bf16.dtype == torch.bfloat16 and torch.equal(ours.to(torch.bfloat16), ct_bf16)
        try:
            dec = comp.decompress({"weight": q, "weight_scale": sc}, ct_scheme())["weight"]
        except RuntimeError:  # the inferred blocks do not tile the padded shape
            dec = None
        if q.shape[0] % 128 == 0 and q.shape[1] % 128 == 0:
            assert torch.equal(ours.to(torch.bfloat16), dec)
        else:  # the block inferred from the shapes is not 128x128 (docs/formats.md#compressed-tensors-fp8-block-sources)
            assert dec is None or not torch.equal(ours.to(torch.bfloat16), dec)


def test_mxfp8_from_ct_source(ct_src, tmp_path):
    src, t = ct_src
    dst = tmp_path / "mx"
    res = convert(
        str(src),
        dst,
        "mxfp8",
        ConvertOptions(scheme="mxfp8", dialect="modelopt", plan=PlanOptions(scheme="mxfp8"), progress=False),
    )
    out, _ = load_dir(dst)
    man = json.loads((dst / "qconvert.json").read_text())
    q = man["source"]["quantized"]
    assert (q["kind"], q["form"], q["weight_block_size"]) == ("fp8-block", "compressed-tensors", [128, 128])
    paths = {m: v.get("source_path") for m, v in man["tensors"].items()}
    n_lossless = n_partial = 0
    for name in scale_names(t):
        mod = name[: -len(".weight_scale")]
        oq, os_ = out[mod + ".weight"], out[mod + ".weight_scale"]
        w, ws = t[mod + ".weight"], t[name]
        deq = ct_dequantize(w, ws)
        if bool(fp8_block.pow2_blocks(ws).all()):
            n_lossless += 1
            assert paths[mod] == "lossless"
            assert torch.equal(oq.view(torch.uint8), w.view(torch.uint8))  # E4M3 bytes kept
            assert torch.equal(decode_mxfp8(oq, os_), deq.double())  # decodes exactly to the source
        else:
            # BF16 scales amax / 448 are now and then a power of two: those blocks keep their bytes
            mask = fp8_block.pow2_blocks(ws)
            assert paths[mod] == ("lossless-partial" if bool(mask.any()) else "requantized")
            want_q, want_s = expected_mxfp8(w, ws)
            assert torch.equal(oq.view(torch.uint8), want_q) and torch.equal(os_, want_s)
            n_partial += bool(mask.any())
    assert n_lossless == 7 + 1 and n_partial == sum(v == "lossless-partial" for v in paths.values()) > 0
    # the ignored (BF16) layer-3 MLP: quantized from its own values, and said so
    for p in ("gate_proj", "up_proj", "down_proj"):
        mod = f"model.layers.3.mlp.{p}"
        rq, rs = mxfp8_quantize(t[mod + ".weight"])
        assert torch.equal(out[mod + ".weight"].view(torch.uint8), rq.view(torch.uint8))
        assert paths[mod] == "bf16-ignored"
    assert out["lm_head.weight"].dtype == torch.bfloat16
    assert any("compressed-tensors, block_structure [128, 128]" in n and "8 lossless" in n for n in res.notes)
    assert any("3 quantized Linear weights are on the source's quantization_config.ignore" in n for n in res.notes)


def test_nvfp4_from_ct_source(ct_src, tmp_path):
    src, t = ct_src
    dst = tmp_path / "nv"
    convert(str(src), dst, "nvfp4", ConvertOptions(scheme="nvfp4", plan=PlanOptions(scheme="nvfp4"), progress=False))
    out, _ = load_dir(dst)
    deq = {n[: -len("_scale")]: ct_dequantize(t[n[: -len("_scale")]], t[n]) for n in scale_names(t)}
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


@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_verify_ct_source(ct_src, tmp_path, scheme):
    from qconvert.verify import verify

    src, t = ct_src
    dst = tmp_path / scheme
    convert(str(src), dst, scheme, ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme), progress=False))
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    r.checks.pop("format")
    assert all(v.startswith("ok") for v in r.checks.values()), r.checks
    pow2 = {n[: -len(".weight_scale")] for n in scale_names(t) if bool(fp8_block.pow2_blocks(t[n]).all())}
    got = {x.module: x.lossless for x in r.tensors}
    assert len(pow2) == 8 and all(got[m] is (scheme == "mxfp8") for m in pow2)
    fp8 = {n[: -len(".weight_scale")] for n in scale_names(t)}
    assert all(got[m] is False for m in fp8 - pow2)
    assert all(got[f"model.layers.3.mlp.{p}"] is None for p in ("gate_proj", "up_proj", "down_proj"))  # BF16 source
    if scheme == "mxfp8":
        assert "8 of 25" in r.checks["lossless"]


def test_inspect_dry_run_and_card(ct_src, tmp_path):
    from qconvert.hub import render_card
    from qconvert.inspect import inspect_checkpoint

    src, _ = ct_src
    rep = inspect_checkpoint(str(src))
    assert (rep.scheme, rep.dialect) == ("fp8-block", "compressed-tensors")
    res = convert(
        str(src), None, "mxfp8", ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), dry_run=True)
    )
    assert any("compressed-tensors" in n and "8 lossless" in n for n in res.notes), res.notes
    dst = tmp_path / "mx"
    convert(str(src), dst, "mxfp8", ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False))
    rep = inspect_checkpoint(str(dst))
    assert rep.source.startswith("FP8 block-scaled (compressed-tensors, block_structure [128, 128])")
    assert "8 lossless" in rep.source and "3 bf16-ignored" in rep.source
    card = render_card(dst, "org/model-MXFP8")
    assert "| source | FP8 block-scaled (compressed-tensors" in card


# ---- bad input ----------------------------------------------------------------------------------


def _bad(tmp_path, dense320, scheme="mxfp8", **kw):
    have("compressed_tensors") or pytest.skip("compressed-tensors not installed")
    src, _ = make_ct_source(dense320, tmp_path / "bad", **kw)
    dst = tmp_path / "out"
    with pytest.raises(QConvertError) as ei:
        convert(str(src), dst, scheme, ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme), progress=False))
    assert not dst.exists()
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_bad_scale_shape(tmp_path, dense320):
    def cut(ts):
        n = "model.layers.1.mlp.up_proj.weight_scale"
        ts[n] = ts[n][:2].contiguous()

    msg = _bad(tmp_path, dense320, mutate=cut)
    assert "model.layers.1.mlp.up_proj.weight_scale" in msg and "[2, 2]" in msg and "block_structure" in msg


def test_block_structure_not_128(tmp_path, dense320):
    def set64(qc):
        qc["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]

    msg = _bad(tmp_path, dense320, qc_mutate=set64)
    assert "config_groups.group_0.weights.block_structure" in msg and "[64, 64]" in msg


def test_declared_block_not_matching_shapes(tmp_path, dense320):
    """Scales of a 64x64 grid under a declared [128, 128]: the first weight's scale is named."""

    def regrid(ts):
        for n in [n for n in ts if n.endswith(".weight_scale")]:
            r, c = ts[n[: -len("_scale")]].shape
            ts[n] = torch.ones(-(-r // 64), -(-c // 64), dtype=torch.bfloat16)

    msg = _bad(tmp_path, dense320, mutate=regrid)
    assert ".weight_scale" in msg and "declared block_structure [128, 128]" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_non_finite_or_negative_scale(tmp_path, dense320, value, scheme):
    def poison(ts):
        ts["model.layers.2.self_attn.o_proj.weight_scale"][1, 0] = value

    msg = _bad(tmp_path, dense320, scheme=scheme, mutate=poison)
    assert "model.layers.2.self_attn.o_proj.weight_scale" in msg and "[1, 0]" in msg


@pytest.mark.parametrize("fmt", ["pack-quantized", "nvfp4-pack-quantized", "dense"])
def test_format_other_than_float_quantized(tmp_path, dense320, fmt):
    def set_fmt(qc):
        qc["format"] = fmt

    msg = _bad(tmp_path, dense320, qc_mutate=set_fmt)
    assert "quantization_config.format" in msg and repr(fmt) in msg and "float-quantized" in msg


def test_group_format_other_than_float_quantized(tmp_path, dense320):
    def set_fmt(qc):
        qc["config_groups"]["group_0"]["format"] = "pack-quantized"

    msg = _bad(tmp_path, dense320, qc_mutate=set_fmt)
    assert "config_groups.group_0.format" in msg and "'pack-quantized'" in msg


def test_ignored_module_stored_fp8(tmp_path, dense320):
    """The ignore list says layer 3's MLP is BF16, but the tensors are FP8: config and tensors disagree."""

    def drop_ignore(qc):
        qc["ignore"] = ["lm_head", "model.layers.0.self_attn.q_proj"]

    msg = _bad(tmp_path, dense320, qc_mutate=drop_ignore, ignore=["lm_head"])
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "quantization_config.ignore" in msg


@pytest.mark.vllm
def test_weight_only_naive_quantized_accepted(tmp_path, dense320):
    """Weight-only FP8 block (no input activations): compressed-tensors infers format naive-quantized,
    the same bytes; vLLM parses it (W8A16), and the conversion reads it."""
    have("compressed_tensors") or pytest.skip("compressed-tensors not installed")

    def weight_only(qc):
        qc["format"] = "naive-quantized"
        qc["config_groups"]["group_0"]["input_activations"] = None

    have("vllm") or pytest.skip("vllm not installed")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    src, t = make_ct_source(dense320, tmp_path / "src", qc_mutate=weight_only)
    vc = CompressedTensorsConfig.from_config(json.loads((src / "config.json").read_text())["quantization_config"])
    assert vc.target_scheme_map["Linear"]["weights"].strategy == "block"
    assert CompressedTensorsConfig._is_fp8_w8a16(vc.target_scheme_map["Linear"]["weights"], None)
    dst = tmp_path / "mx"
    convert(str(src), dst, "mxfp8", ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False))
    out, _ = load_dir(dst)
    for name in scale_names(t):
        mod = name[: -len(".weight_scale")]
        want_q, want_s = expected_mxfp8(t[mod + ".weight"], t[name])
        assert torch.equal(out[mod + ".weight"].view(torch.uint8), want_q)
        assert torch.equal(out[mod + ".weight_scale"], want_s)


@pytest.mark.parametrize(
    "key,value",
    [
        ("quantization_status", "frozen"),
        ("transform_config", {"config_groups": {"u": {"type": "hadamard"}}}),
        ("sparsity_config", {"format": "sparse-24-bitmask"}),
        ("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor"}),
    ],
)
def test_config_parts_qconvert_cannot_carry(tmp_path, dense320, key, value):
    def put(qc):
        qc[key] = value

    msg = _bad(tmp_path, dense320, qc_mutate=put)
    assert f"quantization_config.{key}" in msg


def test_static_input_activations_refused(tmp_path, dense320):
    def static(qc):
        qc["config_groups"]["group_0"]["input_activations"]["dynamic"] = False

    msg = _bad(tmp_path, dense320, qc_mutate=static)
    assert "group_0.input_activations" in msg and "static" in msg


def test_other_ct_schemes_still_refused(tmp_path, dense320):
    """A compressed-tensors checkpoint of another scheme (here INT8 weights) is 'already quantized'."""

    def int8(qc):
        qc["config_groups"]["group_0"]["weights"].update(type="int", strategy="channel", block_structure=None)

    msg = _bad(tmp_path, dense320, qc_mutate=int8)
    assert "already quantized" in msg and "group_0.weights" in msg


def test_bad_ct_source_in_a_fresh_process(dense320, tmp_path):
    """As a user runs it: exit 1, one line naming the key / tensor, no DST or partial directory."""
    from test_hostile_convert import assert_one_line, cli

    have("compressed_tensors") or pytest.skip("compressed-tensors not installed")

    def poison(ts):
        ts["model.layers.2.mlp.down_proj.weight_scale"][0, 1] = -1.0

    def packed(qc):
        qc["format"] = "pack-quantized"

    src, _ = make_ct_source(dense320, tmp_path / "src", mutate=poison)
    for i in range(3):  # the error is raised on a job thread: repeat the race at exit
        r = cli("nvfp4", src, tmp_path / f"out{i}")
        assert_one_line(r, 1, "model.layers.2.mlp.down_proj.weight_scale", "[0, 1]")
    src2, _ = make_ct_source(dense320, tmp_path / "src2", qc_mutate=packed)
    r = cli("mxfp8", src2, tmp_path / "outp")
    assert_one_line(r, 1, "quantization_config.format", "'pack-quantized'")
    assert not any((tmp_path / n).exists() for n in ("out0", "out1", "out2", "outp"))
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_moe_ct_source_with_router_ignored(demo_moe, tmp_path):
    """A Qwen3-MoE FP8_BLOCK source as llm-compressor is told to write MoE models (routers on the
    ignore list), experts written in the TRT-LLM layout: verify finds every tensor exact."""
    from qconvert.verify import verify

    have("compressed_tensors") or pytest.skip("compressed-tensors not installed")
    src, t = make_ct_source(demo_moe, tmp_path / "src", ignore=["lm_head", "re:.*mlp.gate$"], pow2=("layers.0.",))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale" in t and "model.layers.0.mlp.gate.weight" in t
    dst = tmp_path / "dst"
    opts = ConvertOptions(
        scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False, layout="flashinfer-trtllm", engine="vllm"
    )
    convert(str(src), dst, "mxfp8", opts)
    man = json.loads((dst / "qconvert.json").read_text())
    paths = man["source"]["quantized"]["tensor_paths"]
    assert paths["model.layers.0.mlp.experts.0.gate_proj"] == "lossless-rceil"
    assert paths["model.layers.0.self_attn.q_proj"] == "lossless"
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    got = {x.module: x.lossless for x in r.tensors}
    assert got["model.layers.0.mlp.experts.0.gate_proj"] is True


def test_module_formats_of_fp8_scales():
    """Module formats from headers: BF16/F16/F32 block grids are fp8-block; a per-channel [N, 1]
    scale (compressed-tensors' channel strategy) and a per-tensor one are plain fp8."""
    from qconvert.formats.detect import module_format

    w = ("F8_E4M3", (320, 256))
    assert module_format({"weight": w, "weight_scale": ("BF16", (3, 2))})[0] == "fp8-block"
    assert module_format({"weight": w, "weight_scale": ("F16", (3, 2))})[0] == "fp8-block"
    assert module_format({"weight": w, "weight_scale_inv": ("F32", (3, 2))})[0] == "fp8-block"
    assert module_format({"weight": w, "weight_scale": ("BF16", (320, 1))})[0] == "fp8"
    assert module_format({"weight": w, "weight_scale": ("F32", (1,))})[0] == "fp8"
    assert module_format({"weight": w, "weight_scale": ("U8", (320, 8))})[0] == "mxfp8"
