"""qconvert checkpoints in a real vLLM (CPU build) through the qconvert CPU emulation plugin.

All engine work runs in ONE vLLM worker process per format family (module-scoped fixtures
calling ``qconvert.loaders.vllm_compare.run_in_vllm``), on tiny random Qwen3 / Qwen3-MoE models.
Every quantized checkpoint is compared with (a) a BF16 checkpoint holding the dequantized weights
(the engine sees the same weights, so where activations are not quantized logprobs must be
equal; MoE: the BF16 reference runs vLLM's CPU MoE kernel, the plugin plain torch, so a small
bound) and (b) the BF16 source (quantization error, a stated bound).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qconvert.convert.numerics import mxfp8_dequantize, mxfp8_quantize

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[3, 17, 42, 99, 7, 120], [200, 5, 64, 31], [9, 9, 150, 77, 2, 45, 88, 13]]
MAX_TOKENS = 6

# Bounds (mean KL per position over the top-20 partition, see vllm_compare) on qconvert's tiny
# random demo models; measured values are in the comments.
MXFP8_VS_SOURCE_MEAN_KL = 0.05  # measured 0.015-0.02
MOE_VS_DEQUANT_MEAN_KL = 0.02  # plain-torch experts vs vLLM's CPU BF16 MoE kernel; ~0.003-0.006
NVFP4_W4A16_VS_SOURCE_MEAN_KL = 0.5  # measured ~0.23 (MoE)
NVFP4_W4A4_VS_SOURCE_MEAN_KL = 1.0  # measured ~0.5 (MoE), input_scale = 16/2688 uncalibrated


# --------------------------------------------------------------------------------------------
# checkpoints: qconvert's demo models and converter (MXFP8); NVFP4 built here until the NVFP4
# converter lands (vLLM's reference quantizer as the oracle, ModelOpt layout of formats.md §5.5)
# --------------------------------------------------------------------------------------------


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "model.safetensors.index.json",
            "config.json",
            "hf_quant_config.json",
        ) and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())


def make_source(dst: Path, arch: str) -> Path:
    from qconvert.convert.demo import build_demo_model

    return build_demo_model(dst, arch=arch, seed=0)


def make_mxfp8(src: Path, dst: Path, dialect: str, last_n_bf16: int = 0) -> Path:
    """MXFP8 checkpoint written by qconvert's converter (``auto`` = §4.1, or ``modelopt``)."""
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    opts = ConvertOptions(
        scheme="mxfp8",
        dialect=dialect,
        plan=PlanOptions(scheme="mxfp8", last_n_bf16=last_n_bf16),
        progress=False,
        fsync=False,
    )
    convert(str(src), dst, "mxfp8", opts)
    return dst


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nvfp4_quantize(w: torch.Tensor, amax: torch.Tensor):
    """NVFP4 via vLLM's reference quantizer (oracle) + nibble packing. Returns u8, e4m3, s2."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant,
    )

    gs = (448.0 * 6.0 / amax.float()).reshape(1)
    vals, scale = ref_nvfp4_quant(w.float(), gs, 16)
    idx = (vals.abs().unsqueeze(-1) == _E2M1).float().argmax(-1)
    codes = (idx | ((vals < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale.to(torch.float8_e4m3fn), (1.0 / gs).reshape(())


def make_nvfp4(src: Path, dst: Path, a16: bool, last_n_bf16: int = 0) -> Path:
    """ModelOpt NVFP4 checkpoint; q/k/v and (per expert) gate/up share weight_scale_2."""
    cfg = json.loads((src / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    moe = "num_experts" in cfg

    def quantizable(name):
        return name.endswith("_proj.weight") and int(name.split(".")[2]) < n_layers - last_n_bf16

    sd = _load_all(src)
    groups: dict[str, list[str]] = {}
    for name in sd:
        if quantizable(name):
            key = name
            for a, b in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
                key = key.replace(a, b)
            groups.setdefault(key, []).append(name)
    out = {n: w for n, w in sd.items() if not quantizable(n)}
    for members in groups.values():
        amax = max(sd[m].float().abs().max() for m in members)
        for m in members:
            q, s, s2 = _nvfp4_quantize(sd[m], amax)
            base = m[: -len("weight")]
            out[m], out[base + "weight_scale"], out[base + "weight_scale_2"] = q, s, s2
            if not a16:
                out[base + "input_scale"] = torch.tensor(16.0 / 2688.0)
    ex = ["lm_head", "model.embed_tokens", "model.norm"]
    ex += [f"model.layers.{i}." for i in range(n_layers - last_n_bf16, n_layers)]
    if moe:
        ex += [f"model.layers.{i}.mlp.gate" for i in range(n_layers)]
    wq = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": ex,
        "config_groups": {
            "group_0": {
                "weights": wq,
                "input_activations": None if a16 else dict(wq),
                "targets": ["Linear"],
            }
        },
    }
    hfq = {
        "producer": {"name": "qconvert-test", "version": "0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ex,
        },
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "hf_quant_config.json").write_text(json.dumps(hfq, indent=1))
    _copy_side_files(src, dst)
    return dst


def make_dequantized(qdir: Path, dst: Path) -> Path:
    """BF16 checkpoint holding the dequantized weights of an MXFP8 or NVFP4 checkpoint
    (MXFP8: qconvert's ``mxfp8_dequantize``; NVFP4: vLLM's ``dequantize_to_dtype``)."""
    sd = _load_all(qdir)
    out = {}
    for name, w in sd.items():
        base = name[: -len("weight")]
        if name.endswith(".weight") and w.dtype == torch.float8_e4m3fn:
            out[name] = mxfp8_dequantize(w, sd[base + "weight_scale"], torch.bfloat16)
        elif name.endswith(".weight") and w.dtype == torch.uint8:
            from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
                dequantize_to_dtype,
            )

            s2 = sd[base + "weight_scale_2"].float().reshape(1)
            out[name] = dequantize_to_dtype(
                w, sd[base + "weight_scale"], s2, torch.bfloat16, 16, swizzle=False
            )
        elif name.endswith(".weight"):
            out[name] = w
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config")
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    _copy_side_files(qdir, dst)
    return dst


# --------------------------------------------------------------------------------------------
# one vLLM worker per architecture
# --------------------------------------------------------------------------------------------


def _family(tmp_path_factory, arch: str) -> dict:
    from qconvert.loaders.vllm_compare import run_in_vllm

    root = tmp_path_factory.mktemp(arch)
    src = make_source(root / "bf16", arch)
    from qconvert.convert.demo import build_demo_model

    src_b = build_demo_model(root / "bf16_b", arch=arch, seed=1)
    ck = {
        "src": src,
        "auto": make_mxfp8(src, root / "mx_auto", "auto"),
        "auto_b": make_mxfp8(src_b, root / "mx_auto_b", "auto"),
        "mo_last1": make_mxfp8(src, root / "mx_mo_last1", "modelopt", last_n_bf16=1),
        "nv_a4": make_nvfp4(src, root / "nv_a4", a16=False),
        "nv_a16": make_nvfp4(src, root / "nv_a16", a16=True),
    }
    ck["dq_auto"] = make_dequantized(ck["auto"], root / "dq_auto")
    ck["dq_mo_last1"] = make_dequantized(ck["mo_last1"], root / "dq_mo_last1")
    ck["dq_nv_a16"] = make_dequantized(ck["nv_a16"], root / "dq_nv_a16")
    order = ["src", "auto", "mo_last1", "dq_auto", "dq_mo_last1", "auto_b",
             "nv_a4", "nv_a16", "dq_nv_a16"]
    jobs = []
    for key in order:
        job = {"model": str(ck[key]), "inspect": key in ("auto", "mo_last1", "nv_a4", "nv_a16")}
        if key == "auto":
            job["reload"] = [str(ck["auto_b"]), str(ck["auto"])]
        jobs.append(job)
    res = run_in_vllm(jobs, PROMPTS, MAX_TOKENS, top_k=20, score_with_first=True)
    runs = {key: res["jobs"][i] for i, key in enumerate(order)}
    return {"ck": ck, "runs": runs, "arch": arch}


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def family(request, tmp_path_factory):
    return _family(tmp_path_factory, request.param)


def _score(fam, key, stage=0):
    return fam["runs"][key]["stages"][stage]["score"]


def _cmp(fam, ref, other, stage=0):
    from qconvert.loaders.vllm_compare import compare_logprobs

    return compare_logprobs(_score(fam, ref), _score(fam, other, stage))


def test_mxfp8_loads_generates_and_uses_emulation(family):
    for key in ("auto", "mo_last1"):
        stage = family["runs"][key]["stages"][0]
        assert [len(t) for t in stage["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
        layers = family["runs"][key]["layers"]
        assert layers["model.layers.0.self_attn.qkv_proj"] == "ModelOptLinearMethod"
        assert layers["lm_head"] == "UnquantizedLinearMethod"
        if family["arch"] == "qwen3-moe":
            assert layers["model.layers.0.mlp.experts.routed_experts"] == "CpuModelOptMxFp8FusedMoE"
            assert layers["model.layers.0.mlp.gate"] == "UnquantizedLinearMethod"
        else:
            assert layers["model.layers.0.mlp.gate_up_proj"] == "ModelOptLinearMethod"


def test_mxfp8_equals_dequantized_bf16(family):
    """Dense: bit-identical logprobs. MoE: plain-torch experts vs vLLM's CPU BF16 MoE kernel."""
    for q, dq in (("auto", "dq_auto"), ("mo_last1", "dq_mo_last1")):
        m = _cmp(family, dq, q)
        if family["arch"] == "qwen3":
            assert m["max_abs_logprob_diff"] == 0.0, (q, m["max_abs_logprob_diff"])
            assert family["runs"][q]["stages"][0]["tokens"] == family["runs"][dq]["stages"][0]["tokens"]
        else:
            # different expert kernels: rounding can flip a near-tie (measured 0.97-1.0)
            assert m["top1_agreement"] >= 0.9, (q, m["top1_agreement"])
            assert m["mean_kl"] < MOE_VS_DEQUANT_MEAN_KL, (q, m["mean_kl"])


def test_mxfp8_close_to_source(family):
    for q in ("auto", "mo_last1"):
        m = _cmp(family, "src", q)
        assert m["mean_kl"] < MXFP8_VS_SOURCE_MEAN_KL, (q, m["mean_kl"])
        assert m["top1_agreement"] >= 0.6, (q, m["top1_agreement"])


def test_last_n_bf16_layers_run_unquantized(family):
    layers = family["runs"]["mo_last1"]["layers"]
    last = 3  # demo models have 4 layers; the last one is BF16
    for name in ("self_attn.qkv_proj", "self_attn.o_proj"):
        assert layers[f"model.layers.{last}.{name}"] == "UnquantizedLinearMethod"
        assert layers[f"model.layers.0.{name}"] == "ModelOptLinearMethod"
    if family["arch"] == "qwen3-moe":
        assert layers[f"model.layers.{last}.mlp.experts.routed_experts"] == "UnquantizedFusedMoEMethod"
    else:
        assert layers[f"model.layers.{last}.mlp.gate_up_proj"] == "UnquantizedLinearMethod"
        assert layers[f"model.layers.{last}.mlp.down_proj"] == "UnquantizedLinearMethod"


def test_mxfp8_hot_reload_a_b_a(family):
    """reload_weights(B) equals a fresh load of B; reloading A restores A exactly."""
    st = family["runs"]["auto"]["stages"]
    a0, b, a1 = st
    fresh_b = family["runs"]["auto_b"]["stages"][0]
    assert b["tokens"] != a0["tokens"]
    assert b["tokens"] == fresh_b["tokens"]
    assert b["gen_logprobs"] == fresh_b["gen_logprobs"]
    assert b["score"] == fresh_b["score"]
    assert a1["tokens"] == a0["tokens"]
    assert a1["gen_logprobs"] == a0["gen_logprobs"]
    assert a1["score"] == a0["score"]


def test_nvfp4_loads_and_generates(family):
    for key in ("nv_a4", "nv_a16"):
        stage = family["runs"][key]["stages"][0]
        assert [len(t) for t in stage["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
        layers = family["runs"][key]["layers"]
        want = "ModelOptLinearMethod" if key == "nv_a4" else "CpuModelOptNvFp4W4A16LinearMethod"
        assert layers["model.layers.0.self_attn.qkv_proj"] == want
        if family["arch"] == "qwen3-moe":
            assert layers["model.layers.0.mlp.experts.routed_experts"] == "CpuModelOptNvFp4FusedMoE"


def test_nvfp4_w4a16_equals_dequantized_bf16(family):
    m = _cmp(family, "dq_nv_a16", "nv_a16")
    if family["arch"] == "qwen3":
        assert m["max_abs_logprob_diff"] == 0.0, m["max_abs_logprob_diff"]
    else:
        assert m["top1_agreement"] >= 0.9
        assert m["mean_kl"] < MOE_VS_DEQUANT_MEAN_KL, m["mean_kl"]


def test_nvfp4_close_to_source(family):
    for key, bound in (("nv_a16", NVFP4_W4A16_VS_SOURCE_MEAN_KL), ("nv_a4", NVFP4_W4A4_VS_SOURCE_MEAN_KL)):
        m = _cmp(family, "src", key)
        assert m["mean_kl"] < bound, (key, m["mean_kl"])
    # activation quantization must actually happen in W4A4: it differs from W4A16
    assert _score(family, "nv_a4") != _score(family, "nv_a16")


# --------------------------------------------------------------------------------------------
# plugin itself
# --------------------------------------------------------------------------------------------


def test_version_pin(monkeypatch):
    import vllm

    from qconvert.loaders import vllm_cpu_plugin as plugin

    assert plugin.check_vllm_version("0.32.0") == "0.32.0"
    assert vllm.__version__.split("+")[0] in plugin.SUPPORTED_VLLM_VERSIONS
    monkeypatch.delenv(plugin.ANY_VERSION_ENV, raising=False)
    with pytest.raises(plugin.UnsupportedVllmVersion, match="0.33.0"):
        plugin.check_vllm_version("0.33.0")
    # register() itself refuses (before touching any vLLM registry)
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    with pytest.raises(plugin.UnsupportedVllmVersion, match="0.31.1"):
        plugin.register()
    monkeypatch.setenv(plugin.ANY_VERSION_ENV, "1")
    assert plugin.check_vllm_version("0.31.1") == "0.31.1"


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("qconvert_cpu_emulation") == "qconvert.loaders.vllm_cpu_plugin:register"

