"""qconvert verify: passes on good conversions, fails naming the tensor on corrupt ones.

Independent oracle: MXFP8 and NVFP4 are decoded here from the raw bits (E4M3 / E8M0 / E2M1 field
arithmetic), not with qconvert's dequantize functions, and compared with what verify reports."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from test_inspect import demo_conversions, nvfp4_checkpoint, tiny_source

from qconvert.cli import main
from qconvert.verify import verify


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_conversions(tmp_path_factory.mktemp("vdemo"))


def e4m3_bits_to_float(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int64)
    s = torch.where((b >> 7) & 1 == 1, -1.0, 1.0).double()
    e = (b >> 3) & 0xF
    m = (b & 7).double()
    v = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    return s * v


def mxfp8_decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    vals = e4m3_bits_to_float(q.view(torch.uint8))
    n, k = q.shape
    mult = torch.pow(2.0, scale.to(torch.int64).double() - 127)
    return (vals.reshape(n, k // 32, 32) * mult.unsqueeze(-1)).reshape(n, k)


def tensor_location(ckpt: Path, name: str) -> tuple[Path, int, int]:
    """(file, absolute byte offset, nbytes) of a tensor, from the raw safetensors header."""
    for f in sorted(ckpt.glob("*.safetensors")):
        raw = f.read_bytes()[:8]
        (n,) = struct.unpack("<Q", raw)
        hdr = json.loads(f.read_bytes()[8 : 8 + n])
        if name in hdr:
            a, b = hdr[name]["data_offsets"]
            return f, 8 + n + a, b - a
    raise KeyError(name)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def patch_bytes(f: Path, off: int, data: bytes):
    with open(f, "r+b") as fh:
        fh.seek(off)
        fh.write(data)


@pytest.mark.parametrize("dialect", ["auto", "sglang", "modelopt"])
def test_verify_passes_good_conversion(demo, dialect):
    r = verify(str(demo["bf16"]), str(demo[dialect]))
    assert r.ok, r.failures
    assert (r.scheme, r.dialect) == ("mxfp8", dialect)
    assert len(r.tensors) == 84
    assert all(t.exact for t in r.tensors)
    assert r.kept_identical == 135 - 84
    assert r.checks.pop("format") == f"mxfp8 ({dialect})"
    assert all(v.startswith("ok") for v in r.checks.values()), r.checks
    # independent decode of one tensor gives the error verify reported
    sfx = "weight_scale_inv" if dialect == "sglang" else "weight_scale"
    mod = "model.layers.1.mlp.experts.3.down_proj"
    with safe_open(str(tensor_location(demo[dialect], f"{mod}.weight")[0]), "pt") as f:
        q, s = f.get_tensor(f"{mod}.weight"), f.get_tensor(f"{mod}.{sfx}")
    with safe_open(str(tensor_location(demo["bf16"], f"{mod}.weight")[0]), "pt") as f:
        x = f.get_tensor(f"{mod}.weight").double()
    deq = mxfp8_decode(q, s)
    rel = float((deq - x).norm() / x.norm())
    got = next(t for t in r.tensors if t.module == mod)
    assert got.rel_err == pytest.approx(rel, rel=1e-6)
    assert got.sqnr_db == pytest.approx(-20 * math.log10(rel), rel=1e-6)
    assert 0.01 < rel < 0.04
    groups = r.groups()
    assert groups["model.layers.*.mlp.experts.*.down_proj"]["count"] == 24
    assert groups["model.layers.*.self_attn.q_proj"]["count"] == 3


def test_verify_fails_on_one_corrupted_scale_byte(demo, tmp_path):
    dst = copy_ckpt(demo["auto"], tmp_path / "bad")
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    f, off, n = tensor_location(dst, name)
    raw = f.read_bytes()
    byte = raw[off + 37]
    patch_bytes(f, off + 37, bytes([byte + 1]))
    r = verify(str(demo["bf16"]), str(dst))
    assert not r.ok
    row, col = divmod(37, 256 // 32)
    named = [m for m in r.failures if name in m]
    assert named, r.failures
    assert f"block [{row}, {col}]" in named[0] and f"scale byte {byte + 1}" in named[0]
    assert any("sha256 differs" in m and f.name in m for m in r.failures)
    bad = [t for t in r.tensors if not t.ok]
    assert [t.module for t in bad] == ["model.layers.2.mlp.experts.5.up_proj"]
    # CLI: exit 1 and the tensor named
    res = CliRunner().invoke(main, ["verify", str(demo["bf16"]), str(dst)])
    assert res.exit_code == 1
    assert name in res.output and "FAILED" in res.output


def test_verify_reports_a_scale_that_decodes_to_nan(demo, tmp_path):
    """E8M0 byte 255 is NaN: the tensor fails with its block named (verify used to stop with a
    math domain error computing the SQNR of a non-finite decode)."""
    dst = copy_ckpt(demo["auto"], tmp_path / "nan")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    f, off, n = tensor_location(dst, name)
    patch_bytes(f, off + 9, bytes([255]))
    r = verify(str(demo["bf16"]), str(dst))
    assert not r.ok
    bad = [t for t in r.tensors if not t.ok]
    assert [t.module for t in bad] == ["model.layers.1.mlp.experts.3.down_proj"]
    assert bad[0].rel_err == math.inf and bad[0].sqnr_db == -math.inf
    res = CliRunner().invoke(main, ["verify", str(demo["bf16"]), str(dst)])
    assert res.exit_code == 1 and name in res.output and "Traceback" not in res.output


def test_verify_fails_on_swapped_tensor(demo, tmp_path):
    dst = copy_ckpt(demo["sglang"], tmp_path / "swap")
    a, b = "model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.1.gate_proj"
    for sfx in ("weight", "weight_scale_inv"):
        fa, oa, na = tensor_location(dst, f"{a}.{sfx}")
        fb, ob, nb = tensor_location(dst, f"{b}.{sfx}")
        da, db = fa.read_bytes()[oa : oa + na], fb.read_bytes()[ob : ob + nb]
        patch_bytes(fa, oa, db)
        patch_bytes(fb, ob, da)
    r = verify(str(demo["bf16"]), str(dst))
    assert not r.ok
    text = "\n".join(r.failures)
    assert f"{a}." in text and f"{b}." in text
    bad = {t.module: t for t in r.tensors if not t.ok}
    assert set(bad) == {a, b}
    assert bad[a].rel_err > 1.0  # decodes to a different random matrix: ~sqrt(2)


def _edit_lists(dst: Path, fn):
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    for k in ("ignored_layers", "modules_to_not_convert", "ignore"):
        if k in qc:
            qc[k] = fn(qc[k])
    (dst / "config.json").write_text(json.dumps(cfg))
    man = json.loads((dst / "qconvert.json").read_text())
    man["exclusions"] = fn(man["exclusions"])
    (dst / "qconvert.json").write_text(json.dumps(man))
    hq = dst / "hf_quant_config.json"
    if hq.exists():
        d = json.loads(hq.read_text())
        d["quantization"]["exclude_modules"] = fn(d["quantization"]["exclude_modules"])
        hq.write_text(json.dumps(d))


@pytest.mark.parametrize("dialect", ["auto", "modelopt"])
def test_verify_fails_on_wrong_exclusion_list_missing_bf16_layer(demo, tmp_path, dialect):
    dst = copy_ckpt(demo[dialect], tmp_path / "excl")
    _edit_lists(dst, lambda lst: [e for e in lst if not e.startswith("model.layers.3.")])
    r = verify(str(demo["bf16"]), str(dst))
    assert not r.ok
    assert r.checks["exclusions"] == "FAILED"
    text = "\n".join(r.failures)
    assert "'model.layers.3.self_attn.q_proj' is stored in BF16" in text
    assert "'model.layers.3.mlp.experts' is stored in BF16" in text
    assert "vLLM" in text
    # values are still fine: only the metadata is wrong
    assert all(t.ok for t in r.tensors)


def test_verify_fails_on_exclusion_list_hiding_a_quantized_module(demo, tmp_path):
    dst = copy_ckpt(demo["auto"], tmp_path / "excl2")
    _edit_lists(dst, lambda lst: sorted(lst + ["model.layers.1.self_attn.o_proj"]))
    r = verify(str(demo["bf16"]), str(dst))
    assert not r.ok
    assert any(
        "'model.layers.1.self_attn.o_proj' is quantized but the exclusion list excludes it" in m for m in r.failures
    )


def test_verify_fails_when_list_copies_disagree(demo, tmp_path):
    dst = copy_ckpt(demo["auto"], tmp_path / "excl3")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].remove("lm_head")
    (dst / "config.json").write_text(json.dumps(cfg))
    r = verify(str(demo["bf16"]), str(dst))
    assert any("modules_to_not_convert differs" in m and "'lm_head'" in m for m in r.failures), r.failures


def test_verify_structure_errors(demo, tmp_path):
    dst = copy_ckpt(demo["auto"], tmp_path / "struct")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["hidden_size"] = 512
    (dst / "config.json").write_text(json.dumps(cfg))
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    other = next(s for s in sorted(set(idx["weight_map"].values())) if s != idx["weight_map"][name])
    idx["weight_map"][name] = other
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = verify(str(demo["bf16"]), str(dst))
    text = "\n".join(r.failures)
    assert "'hidden_size' is 512" in text
    assert f"tensor {name!r} listed in {other}" in text


@pytest.mark.parametrize("dialect", ["modelopt", "compressed-tensors"])
def test_verify_handbuilt_nvfp4(tmp_path, dialect):
    src = tiny_source(tmp_path / "src")
    ck = nvfp4_checkpoint(tmp_path / dialect, src, dialect)
    r = verify(str(tmp_path / "src"), str(ck))
    assert r.ok, r.failures
    assert (r.scheme, r.dialect) == ("nvfp4", dialect)
    assert {t.module for t in r.tensors} == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    # independent E2M1 decode of down_proj
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        mod = "model.layers.0.mlp.down_proj"
        packed = f.get_tensor(f"{mod}.weight" if dialect == "modelopt" else f"{mod}.weight_packed")
        scale = f.get_tensor(f"{mod}.weight_scale")
        s2 = (
            float(f.get_tensor(f"{mod}.weight_scale_2"))
            if dialect == "modelopt"
            else 1 / float(f.get_tensor(f"{mod}.weight_global_scale")[0])
        )
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(64, 128).to(torch.int64)
    mag = torch.tensor(lut, dtype=torch.float64)[codes & 7] * torch.where(codes >> 3 == 1, -1.0, 1.0).double()
    sc = e4m3_bits_to_float(scale.view(torch.uint8)) * s2
    deq = (mag.reshape(64, 8, 16) * sc.unsqueeze(-1)).reshape(64, 128)
    x = src[f"{mod}.weight"].double()
    rel = float((deq - x).norm() / x.norm())
    got = next(t for t in r.tensors if t.module == mod)
    assert got.rel_err == pytest.approx(rel, rel=1e-5)
    assert 0.05 < rel < 0.16

    # one corrupted E4M3 block-scale byte: x2 (exponent field +1)
    name = f"{mod}.weight_scale"
    f, off, n = tensor_location(ck, name)
    raw = f.read_bytes()
    patch_bytes(f, off + 9, bytes([raw[off + 9] + 8]))
    r = verify(str(tmp_path / "src"), str(ck))
    assert not r.ok
    assert any(name in m and "block [1, 1]" in m for m in r.failures), r.failures


def test_verify_engine_flag_reports_unavailable_or_runs(demo, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm_compare(name, *a, **kw):
        if name.endswith("vllm_compare") or (a and a[2] and "vllm_compare" in (a[2] or ())):
            raise ImportError("no vllm_compare")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_vllm_compare)
    r = verify(str(demo["bf16"]), str(demo["auto"]), engine="vllm")
    assert r.ok
    assert r.engine["available"] is False and "unavailable" in r.engine["message"]
    assert r.checks["engine"].startswith("skipped")


def test_verify_engine_kl_bound(demo, monkeypatch):
    """A checkpoint that runs in the engine but drifts from its source fails on the KL bound."""
    import qconvert.verify as V

    def fake(src, dst, engine, log):
        return {"available": True, "mean_kl": 0.3, "top1_agreement": 0.5, "positions": 40}

    monkeypatch.setattr(V, "engine_compare", fake)
    r = verify(str(demo["bf16"]), str(demo["auto"]), engine="vllm")
    assert not r.ok and r.checks["engine"] == "FAILED"
    assert any("mean next-token KL 0.3000" in f and "exceeds 0.1" in f for f in r.failures), r.failures
    r = verify(str(demo["bf16"]), str(demo["auto"]), engine="vllm", max_kl=0.5)
    assert r.ok and r.checks["engine"] == "ok"


@pytest.mark.parametrize("flag,note", [("--check-in-engine", False), ("--engine", True)])
def test_check_in_engine_and_its_old_spelling(flag, note, monkeypatch, tmp_path):
    """``verify --check-in-engine vllm`` asks the library to run the engine; the old spelling
    ``--engine vllm`` does the same for one more release, with a one-line deprecation note."""
    import types

    import qconvert.verify as V

    seen = {}

    def fake(src, dst, **kw):
        seen.update(kw)
        return types.SimpleNamespace(ok=True, to_dict=lambda: {"ok": True})

    monkeypatch.setattr(V, "verify", fake)
    res = CliRunner().invoke(main, ["verify", str(tmp_path / "a"), str(tmp_path / "b"), "--json", flag, "vllm"])
    assert res.exit_code == 0, res.output
    assert seen["engine"] == "vllm"
    assert json.loads(res.stdout) == {"ok": True}
    notes = [ln for ln in res.stderr.splitlines() if "deprecated" in ln]
    assert notes == (
        ["note: `qconvert verify --engine` is deprecated and goes in the next release; use --check-in-engine vllm"]
        if note
        else []
    )
