"""``qconvert bf16 SRC DST`` of a quantized source (docs/formats.md#quantized-sources-decoded-to-bf16).

Oracles: for MXFP4 (gpt-oss), transformers itself: the source loaded with ``Mxfp4Config(dequantize=True)``
against the output loaded as a plain BF16 checkpoint, every parameter bit for bit; for FP8 block
sources, vLLM's ``scaled_dequantize`` (BF16 output) on sources made with vLLM's block quantizer, and
compressed-tensors' own BF16 ``dequantize`` on sources its compressor wrote.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import have
from test_convert_e2e import load_dir
from test_hostile_convert import assert_one_line, cli

from qconvert.convert.demo import build_gpt_oss_mxfp4
from qconvert.convert.numerics import fp8_block
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions

DOC = "docs/formats.md#gpt-oss-quantized-forms"
GU0 = "model.layers.0.mlp.experts.gate_up_proj"
DOWN0 = "model.layers.0.mlp.experts.down_proj"


def _edge_exponents(config, t):
    """Scale bytes at both ends of E8M0: 0..3 (BF16 subnormal and smallest normal results) on one
    expert, 254 (2^127) and 253 with elements of magnitude <= 1.5 on two others (the largest finite
    values)."""
    s = t[DOWN0 + "_scales"]
    g = torch.Generator().manual_seed(1)
    s[0] = torch.randint(0, 4, s[0].shape, generator=g).to(torch.uint8)
    s[1], s[2] = 254, 253
    t[DOWN0 + "_blocks"][1:3] &= 0xBB  # each nibble's magnitude code <= 3 (1.5)


def _bf16(src, dst, **kw):
    return convert(
        str(src), dst, "bf16", ConvertOptions(scheme="bf16", plan=PlanOptions(scheme="bf16"), progress=False, **kw)
    )


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(SRC, DST, result): the tiny gpt-oss MXFP4 checkpoint (35 exponents, edge bytes) and its decode."""
    root = tmp_path_factory.mktemp("gptoss")
    src = build_gpt_oss_mxfp4(root / "src", exponents=(-30, 4), mutate=_edge_exponents)
    res = _bf16(src, root / "bf16")
    return src, root / "bf16", res


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def test_gpt_oss_decode_equals_transformers_dequantize(gptoss):
    if not have("transformers"):
        pytest.skip("transformers not installed")
    from transformers import AutoModelForCausalLM, Mxfp4Config

    src, dst, _ = gptoss
    ref = _params(
        AutoModelForCausalLM.from_pretrained(
            str(src), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
        )
    )
    ours = _params(AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.bfloat16))
    assert ours.keys() == ref.keys()
    for n, p in ref.items():
        assert p.dtype == ours[n].dtype == torch.bfloat16, n
        assert torch.equal(p.view(torch.int16), ours[n].view(torch.int16)), n
    # the edge exponents are there: subnormal BF16 values and values of 2^127
    d = ours[DOWN0].float()
    assert bool(((d != 0) & (d.abs() < 2.0**-126)).any()) and float(d.abs().max()) == 1.5 * 2.0**127


def test_gpt_oss_output_is_the_bf16_checkpoint(gptoss):
    src, dst, res = gptoss
    cfg, src_cfg = json.loads((dst / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert {k: v for k, v in src_cfg.items() if k != "quantization_config"} == cfg
    out, _ = load_dir(dst)
    assert not any(n.endswith(("_blocks", "_scales")) for n in out)
    assert out[GU0].shape == (4, 128, 128) and out[DOWN0].shape == (4, 64, 128)  # [E, H, 2I], [E, I, H]
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    q = json.loads((dst / "qconvert.json").read_text())["source"]["quantized"]
    assert q["kind"] == "mxfp4" and q["form"] == "gpt-oss" and q["decoded_to"] == "bf16" and q["lossless"] is True
    assert set(q["tensor_paths"]) == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    }
    assert set(q["tensor_paths"].values()) == {"exact"} and q["rounded_elements"] == {}
    assert any("4 of 4 tensors exactly" in n for n in res.notes), res.notes
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    src_idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert idx[GU0] == src_idx[GU0 + "_blocks"]  # output shard i holds what input shard i held


def test_gpt_oss_bf16_still_not_converted_to_mxfp8_nvfp4(gptoss, tmp_path):
    """The decoded checkpoint is a BF16 gpt-oss: refused for the same engine reason as the MXFP4 one."""
    _, dst, _ = gptoss
    for scheme in ("mxfp8", "nvfp4"):
        assert_one_line(cli(scheme, dst, tmp_path / scheme), 1, GU0, "gpt-oss", DOC)
        assert not (tmp_path / scheme).exists()


def test_dry_run_shows_the_decode_paths(gptoss):
    src, _, _ = gptoss
    r = cli("bf16", src, "--dry-run")
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(GU0 + " ") or ln.startswith("lm_head ")]
    assert "decoded to BF16 from MXFP4" in rows[-1] and "[4, 128, 128]" in rows[-1]
    assert "not quantized in the source: copied" in rows[0]
    assert "MXFP4 (gpt-oss *_blocks/*_scales); 4 tensors decoded to BF16" in r.stdout


def _overflow(config, t):
    t[GU0 + "_scales"][2, 7, 1] = 254
    t[GU0 + "_blocks"][2, 7, 1] = 0
    t[GU0 + "_blocks"][2, 7, 1, 3] = 0x40  # element 7 of the block: 2.0 x 2^127 = 2^128, beyond BF16


def _overflow_253(config, t):
    t[DOWN0 + "_scales"][1, 3, 0] = 253
    t[DOWN0 + "_blocks"][1, 3, 0] = 0
    t[DOWN0 + "_blocks"][1, 3, 0, 5] = 0x06  # element 10 of the block: 4.0 x 2^126 = 2^128


def _nan_scale(config, t):
    t[DOWN0 + "_scales"][3, 5, 0] = 0xFF


@pytest.mark.parametrize(
    "mutate,needles",
    [
        (_overflow, (GU0 + "_blocks", "[2, 7, 1]", "BF16 range", "scale byte 254", "magnitude 2 ")),
        (_overflow_253, (DOWN0 + "_blocks", "[1, 3, 0]", "BF16 range", "scale byte 253", "magnitude 4 ")),
        (_nan_scale, (DOWN0 + "_scales", "[3, 5, 0]", "0xFF")),
    ],
)
def test_bad_blocks_refused_naming_the_tensor(tmp_path, mutate, needles):
    src = build_gpt_oss_mxfp4(tmp_path / "src", mutate=mutate)
    dst = tmp_path / "out"
    assert_one_line(cli("bf16", src, dst), 1, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written, no partial directory


def test_bf16_source_without_layout_is_a_usage_error(demo_dense, tmp_path):
    r = cli("bf16", demo_dense, tmp_path / "out")
    assert r.returncode != 0 and "--layout flashinfer-trtllm" in r.stderr and "quantization_config" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
def test_fp8_block_decode_equals_vllm(demo_dense, tmp_path):
    have("vllm")
    from test_quantized_sources import make_fp8_source
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_dequantize

    src, t = make_fp8_source(demo_dense, tmp_path / "src", pow2=("layers.0.",), keep_bf16=("layers.3.mlp",))
    res = _bf16(src, tmp_path / "bf16")
    out, _ = load_dir(tmp_path / "bf16")
    q = json.loads((tmp_path / "bf16" / "qconvert.json").read_text())
    man = q["source"]["quantized"]
    assert man["kind"] == "fp8-block" and man["form"] == "deepseek" and man["weight_block_size"] == [128, 128]
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert not any(n.endswith("weight_scale_inv") for n in out)
    fp8 = [n for n in t if n.endswith(".weight") and n[: -len("weight")] + "weight_scale_inv" in t]
    assert set(man["tensor_paths"]) == set(fp8)
    rounded = 0
    for n in fp8:
        s = t[n[: -len("weight")] + "weight_scale_inv"]
        ref = scaled_dequantize(t[n], s, GroupShape(128, 128), out_dtype=torch.bfloat16)
        assert out[n].dtype == torch.bfloat16 and torch.equal(out[n].view(torch.int16), ref.view(torch.int16)), n
        f32 = scaled_dequantize(t[n], s, GroupShape(128, 128), out_dtype=torch.float32)
        differ = int((ref.float() != f32).sum())
        assert man["tensor_paths"][n] == ("rounded" if differ else "exact"), n
        assert man["rounded_elements"].get(n, 0) == differ
        assert q["tensors"][n[: -len(".weight")]]["source_path"] == man["tensor_paths"][n]
        if bool(fp8_block.pow2_blocks(s).all()):
            assert not differ, n  # power-of-two scales: E4M3 x 2^k is a BF16 value
        rounded += bool(differ)
    assert rounded and man["lossless"] is False  # vLLM's scales: the products need more than 8 bits
    for n in t:  # every other tensor copied as it is
        if n not in fp8 and not n.endswith("weight_scale_inv"):
            assert torch.equal(out[n].view(torch.uint8), t[n].view(torch.uint8)), n
    assert any(f"{len(fp8) - rounded} of {len(fp8)} tensors exactly" in n for n in res.notes), res.notes


def test_ct_fp8_block_decode_equals_compressed_tensors(tmp_path):
    if not have("compressed_tensors"):
        pytest.skip("compressed-tensors not installed")
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from test_ct_fp8_sources import SIZES, ct_scheme, make_ct_source

    from qconvert.convert.demo import build_demo_model

    dense = build_demo_model(tmp_path / "dense", arch="qwen3", overrides=SIZES)
    src, t = make_ct_source(dense, tmp_path / "src", pow2=("layers.0.self_attn",))
    _bf16(src, tmp_path / "bf16")
    out, _ = load_dir(tmp_path / "bf16")
    man = json.loads((tmp_path / "bf16" / "qconvert.json").read_text())["source"]["quantized"]
    assert man["form"] == "compressed-tensors"
    n_exact = 0
    for n in man["tensor_paths"]:
        w, s = t[n], t[n[: -len("weight")] + "weight_scale"]
        assert s.dtype == torch.bfloat16
        ref = dequantize(w, s, args=ct_scheme().weights, dtype=torch.bfloat16)  # compressed-tensors' BF16 decode
        assert torch.equal(out[n].view(torch.int16), ref.view(torch.int16)), n
        n_exact += man["tensor_paths"][n] == "exact"
    assert n_exact >= 4  # the power-of-two layer


def _flip_bit(root, name: str, at: int = 0, bit: int = 0):
    """Flip one bit of tensor ``name`` in DST's shard files, in place (header untouched)."""
    for f in sorted(root.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        if name in header:
            raw[8 + n + header[name]["data_offsets"][0] + at] ^= 1 << bit
            f.write_bytes(bytes(raw))
            return
    raise AssertionError(name)


def test_verify_gpt_oss_decode(gptoss, tmp_path):
    import shutil

    from qconvert.verify import format_report, verify

    src, dst, _ = gptoss
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    assert r.checks["decoded"].startswith("ok (4 tensors") and r.checks["source"].startswith("ok")
    assert sorted(t.module for t in r.decoded) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    )
    assert all(t.exact and t.lossless and t.rel_err == 0 for t in r.decoded)
    assert r.kept_identical == 33
    assert "4 exactly the source's values" in format_report(r)
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    _flip_bit(bad, GU0, at=2 * 1000 + 1, bit=0)  # the lowest exponent bit of one element
    r2 = verify(str(src), str(bad))
    assert not r2.ok and r2.checks["decoded"] == "FAILED"
    assert [t.module for t in r2.decoded if not t.ok] == [GU0]
    assert any(GU0 in f and "not the BF16 of the source's mxfp4 decode" in f for f in r2.failures), r2.failures


@pytest.mark.vllm
def test_verify_fp8_block_decode(demo_dense, tmp_path):
    import shutil

    from test_quantized_sources import make_fp8_source

    from qconvert.verify import verify

    src, t = make_fp8_source(demo_dense, tmp_path / "src", pow2=("layers.0.",))
    dst = tmp_path / "bf16"
    _bf16(src, dst)
    man = json.loads((dst / "qconvert.json").read_text())["source"]["quantized"]
    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    got = {t.module: t.lossless for t in r.decoded}
    assert got == {n: v == "exact" for n, v in man["tensor_paths"].items()}
    assert any(got.values()) and not all(got.values())
    assert all(t.exact for t in r.decoded)
    rounded = next(n for n, v in got.items() if not v)
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    _flip_bit(bad, rounded)
    r2 = verify(str(src), str(bad))
    assert not r2.ok and [t.module for t in r2.decoded if not t.ok] == [rounded]
    assert any(rounded in f and "not the BF16 of the source's fp8-block decode" in f for f in r2.failures)
    # the decoded checkpoint converts as any BF16 checkpoint does, and verifies against itself
    mx = tmp_path / "mx"
    convert(str(dst), mx, "mxfp8", ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False))
    r3 = verify(str(dst), str(mx))
    assert r3.ok and r3.scheme == "mxfp8" and r3.tensors and all(x.exact for x in r3.tensors), r3.failures


def test_inspect_counts_mxfp4_modules_and_says_the_decode(gptoss):
    from qconvert.inspect import inspect_checkpoint

    src, dst, _ = gptoss
    r = inspect_checkpoint(src)
    mx = {m.name: m for m in r.modules if m.format == "mxfp4"}
    assert sorted(mx) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    )
    assert mx[GU0].shape == [4, 128, 128] and mx[DOWN0].shape == [4, 128, 64]  # unpacked [E, N, K]
    assert set(mx[GU0].tensors) == {"blocks", "scales"}
    assert r.totals["quantized_modules"] == 4 and r.totals["tensors"] == 41
    assert not any(m.name.endswith(("_blocks", "_scales")) for m in r.modules)
    # the BF16 size it decodes to: what qconvert bf16 writes
    out_bytes = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    assert abs(r.totals["bf16_bytes"] - out_bytes) < 4096  # headers aside
    d = inspect_checkpoint(dst)
    assert (
        d.scheme == "bf16" and d.source == "MXFP4 (gpt-oss), decoded to BF16: 4 of 4 tensors exactly, 0 rounded to BF16"
    )


@pytest.mark.vllm
def test_vllm_cpu_runs_the_decoded_gpt_oss_like_transformers(tmp_path):
    """vLLM 0.32 CPU loads the decoded BF16 gpt-oss (its non-mxfp4 loader, UnquantizedFusedMoEMethod)
    and generates; its next-token distributions over prompt + continuation are transformers' on the
    MXFP4 source dequantized (Mxfp4Config(dequantize=True)), up to BF16 compute differences. (vLLM CPU
    cannot run the MXFP4 source itself: no MXFP4 MoE backend on CPU.)"""
    pytest.importorskip("vllm")
    if not have("transformers"):
        pytest.skip("transformers not installed")
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from qconvert.engine.vllm_compare import compare_logprobs, run_in_vllm

    src, dst = build_gpt_oss_mxfp4(tmp_path / "src"), tmp_path / "bf16"  # weights of sane magnitude
    _bf16(src, dst)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time there was a small model that"]
    res = run_in_vllm([{"model": dst, "inspect": True}], prompts, 8, score_with_first=True)["jobs"][0]
    assert res["layers"]["model.layers.0.mlp.experts.routed_experts"] == "UnquantizedFusedMoEMethod"
    st = res["stages"][0]
    assert all(len(t) == 8 for t in st["tokens"])
    m = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    ref = []
    for seq in st["score_sequences"]:
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([seq])).logits[0, :-1].float(), -1)
        ref.append([{str(int(i)): float(v) for v, i in zip(*lp[p].topk(20))} for p in range(lp.shape[0])])
    got = compare_logprobs(ref, st["score"])
    # measured: top-1 agreement 0.98, mean KL 6e-5 over 50 positions
    assert got["top1_agreement"] >= 0.9 and got["mean_kl"] < 1e-2, got


def test_resumed_decode_is_byte_identical_and_recounts(gptoss, tmp_path, monkeypatch):
    """A decode interrupted after its first output shard and resumed: the kept shard's tensors are
    counted again from the source (their jobs do not run), so the manifest, and every file, equal an
    uninterrupted run's."""
    from test_resume import _interrupt_after, assert_same_tree
    from test_resume import cli as in_process

    src, _, _ = gptoss
    env = {"SOURCE_DATE_EPOCH": "1700000000"}
    ref, dst = tmp_path / "ref", tmp_path / "out"
    assert in_process("bf16", src, ref, "--no-progress", env=env)[0] == 0
    _interrupt_after(monkeypatch, 1)
    code, out = in_process("bf16", src, dst, "--no-progress", env=env)
    assert code == 130 and "--resume" in out and not dst.exists()
    monkeypatch.undo()
    code, out = in_process("bf16", src, dst, "--no-progress", "--resume", env=env)
    assert code == 0, out
    assert "1 of 2 output shards verified and kept" in out and "4 of 4 tensors exactly" in out
    assert_same_tree(dst, ref)
    q = json.loads((dst / "qconvert.json").read_text())["source"]["quantized"]
    assert len(q["tensor_paths"]) == 4


def test_quantized_source_with_layout_is_refused(gptoss, tmp_path):
    src, _, _ = gptoss
    assert_one_line(
        cli("bf16", src, tmp_path / "out", "--layout", "flashinfer-trtllm"),
        1,
        "a quantized checkpoint",
        "decode it first",
        "docs/formats.md#quantized-sources-decoded-to-bf16",
    )
    assert not (tmp_path / "out").exists()


def test_card_and_summary_say_decode(gptoss, tmp_path):
    from qconvert.hub import render_card

    src, dst, _ = gptoss
    card = render_card(dst, "org/gpt-oss-bf16")
    assert "BF16 decode of its quantized source" in card
    assert "| source | MXFP4 (gpt-oss), decoded to BF16: 4 of 4 tensors exactly, 0 rounded to BF16 |" in card
    r = cli("bf16", src, tmp_path / "out", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "x larger)" in r.stdout and "BF16, the source's quantized tensors decoded" in r.stdout
