"""End to end: convert the demo models and check every byte that lands on disk.

Decoding here is independent of qconvert's dequantize: torch's own fp8 -> fp32 cast and
``2 ** (byte - 127)`` in float64. Quantized bytes are compared with vLLM's own MXFP8 quantizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import have
from safetensors import safe_open

from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions


def load_dir(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checkpoint dir, read with the safetensors library; and name -> file."""
    tensors, where = {}, {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                assert k not in tensors, f"{k} stored twice"
                tensors[k] = s.get_tensor(k)
                where[k] = f.name
    return tensors, where


def decode_mxfp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    mult = torch.pow(torch.tensor(2.0, dtype=torch.float64), s.to(torch.float64) - 127)
    return (q.to(torch.float64).view(n, k // 32, 32) * mult.unsqueeze(-1)).view(n, k)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def converted(demo_moe, tmp_path_factory):
    dst = tmp_path_factory.mktemp("out") / "mxfp8-last1"
    res = convert(str(demo_moe), dst, "mxfp8", ConvertOptions(plan=PlanOptions(last_n_bf16=1), progress=False))
    return demo_moe, dst, res


def test_every_tensor_accounted_for(converted):
    src, dst, res = converted
    s_t, _ = load_dir(src)
    d_t, where = load_dir(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    # the index covers every stored tensor exactly once, in the file that holds it
    assert index["weight_map"] == where
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in d_t.values())
    expected = set()
    for name in s_t:
        if res.plan.tensors[name].action == "quantize":
            mod = name[: -len(".weight")]
            expected |= {f"{mod}.weight", f"{mod}.weight_scale"}
        else:
            expected.add(name)
    assert set(d_t) == expected


def test_quantized_bytes_equal_vllm_and_error_is_small(converted):
    if not have("vllm"):
        pytest.skip("vLLM not installed")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    src, dst, res = converted
    s_t, _ = load_dir(src)
    d_t, _ = load_dir(dst)
    n_q = 0
    for name, x in s_t.items():
        if res.plan.tensors[name].action != "quantize":
            continue
        mod = name[: -len(".weight")]
        q, s = d_t[f"{mod}.weight"], d_t[f"{mod}.weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
        assert s.shape == (x.shape[0], x.shape[1] // 32)
        vq, vs = _mxfp8_e4m3_quantize_torch(x)
        assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)), name
        assert torch.equal(s, vs), name
        deq = decode_mxfp8(q, s)
        xf = x.to(torch.float64)
        rel = ((deq - xf).norm() / xf.norm()).item()
        assert 0 < rel < 0.04, (name, rel)  # E4M3: 3 mantissa bits, ~2% rms for Gaussian weights
        n_q += 1
    assert n_q == res.n_quantized == 84  # 3 layers x (4 attention + 8 experts x 3)


def test_bf16_layers_and_other_files_are_byte_identical(converted):
    src, dst, res = converted
    s_t, _ = load_dir(src)
    d_t, _ = load_dir(dst)
    kept = [n for n, tp in res.plan.tensors.items() if tp.action == "keep"]
    assert any(n.startswith("model.layers.3.mlp.experts.") for n in kept)
    assert all(not n.startswith("model.layers.3.") or res.plan.tensors[n].action == "keep" for n in s_t)
    for n in kept:
        assert d_t[n].dtype == s_t[n].dtype and torch.equal(d_t[n].view(torch.uint8), s_t[n].view(torch.uint8)), n
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()


def test_config_and_manifest(converted):
    src, dst, res = converted
    cfg = json.loads((dst / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg
    assert qc["quant_method"] == "mxfp8" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [1, 32] and qc["scale_fmt"] == "ue8m0"
    assert qc["ignored_layers"] == qc["modules_to_not_convert"]
    assert "model.layers.3." in qc["ignored_layers"] and "lm_head" in qc["ignored_layers"]
    assert all(f"model.layers.{i}.mlp.gate" in qc["ignored_layers"] for i in range(4))
    assert not any("*" in e for e in qc["ignored_layers"])
    assert not (dst / "hf_quant_config.json").exists()
    man = json.loads((dst / "qconvert.json").read_text())
    assert man["scheme"] == "mxfp8" and man["recipe"] == "rceil" and man["zero_block_scale_byte"] == 1
    for f in sorted(src.glob("*.safetensors")):
        assert man["source"]["sha256"][f.name] == sha(f)
    for f in sorted(dst.glob("*.safetensors")):
        assert man["outputs"]["sha256"][f.name] == sha(f)
    assert man["tensors"]["model.layers.0.self_attn.q_proj"]["format"] == "mxfp8"
    assert man["tensors"]["model.layers.3.self_attn.q_proj"]["format"] == "bf16"
    assert man["tensors"]["lm_head"]["format"] == "bf16"


@pytest.mark.parametrize("dialect", ["sglang", "modelopt"])
def test_other_dialects(demo_dense, tmp_path, dialect):
    dst = tmp_path / dialect
    convert(str(demo_dense), dst, "mxfp8", ConvertOptions(dialect=dialect, progress=False))
    d_t, _ = load_dir(dst)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    scale = "weight_scale_inv" if dialect == "sglang" else "weight_scale"
    assert d_t[f"model.layers.0.self_attn.q_proj.{scale}"].dtype == torch.uint8
    other = "weight_scale" if dialect == "sglang" else "weight_scale_inv"
    assert not any(k.endswith("." + other) for k in d_t)
    if dialect == "sglang":
        assert qc["quant_method"] == "mxfp8" and "ignored_layers" not in qc
        assert qc["modules_to_not_convert"] == ["lm_head", *qc["modules_to_not_convert"][1:]]
    else:
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8"
        hq = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == "MXFP8" and hq["exclude_modules"] == qc["ignore"]
        assert "kv_cache_quant_algo" in hq


def test_single_file_checkpoint_and_first_n(tmp_path):
    from qconvert.convert.demo import build_demo_model

    src = build_demo_model(tmp_path / "one", arch="qwen3", n_shards=1)
    dst = tmp_path / "out"
    res = convert(
        str(src),
        dst,
        "mxfp8",
        ConvertOptions(plan=PlanOptions(first_n_bf16=1, keep_bf16=("*.o_proj",)), progress=False),
    )
    assert (dst / "model.safetensors").exists() and not (dst / "model.safetensors.index.json").exists()
    d_t, _ = load_dir(dst)
    assert d_t["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert d_t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert d_t["model.layers.2.self_attn.o_proj.weight"].dtype == torch.bfloat16
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert "model.layers.0." in qc["ignored_layers"] and "model.layers.2.self_attn.o_proj" in qc["ignored_layers"]
    assert res.plan.bf16_layers == [0]


def test_dry_run_writes_nothing(demo_moe, tmp_path):
    dst = tmp_path / "never"
    res = convert(str(demo_moe), dst, "mxfp8", ConvertOptions(dry_run=True, progress=False))
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    assert res.bytes_out < res.bytes_in and res.n_quantized == 4 * (4 + 8 * 3)


def test_hub_repo_id_from_offline_cache(demo_dense, tmp_path, monkeypatch):
    """A repo id resolves through huggingface_hub's cache with HF_HUB_OFFLINE=1 (no network)."""
    import shutil

    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--acme--tiny" / "snapshots" / rev
    shutil.copytree(demo_dense, snap)
    (cache / "models--acme--tiny" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny" / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    dst = tmp_path / "out"
    convert("acme/tiny", dst, "mxfp8", ConvertOptions(progress=False))
    man = json.loads((dst / "qconvert.json").read_text())
    assert man["source"]["id"] == "acme/tiny" and man["source"]["revision"] == rev
