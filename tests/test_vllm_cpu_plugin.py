"""qconvert checkpoints in a real vLLM (CPU build) through the qconvert CPU emulation plugin.

All engine work for one architecture runs in ONE vLLM worker process (module-scoped fixture
calling ``qconvert.engine.vllm_compare.run_in_vllm``), on qconvert's tiny random Qwen3 /
Qwen3-MoE demo models, with every checkpoint written by qconvert's converter. Engine loads are the
cost (~10 s each on 2 cores), so each quantized format is loaded once and hot-reloaded: X, then
X_b -> X -> X_b (X_b: the same conversion of another seed, same layout). With A = X_b, B = X that
chain gives the reload properties (A -> B equals the fresh load of B, B -> A restores A); for
MXFP8 the first reload is also compared with a fresh load of X_b, which catches layers that keep
stale weights. BF16 references are fresh loads (reloading BF16 checkpoints into a BF16 engine
gave logprobs matching neither checkpoint on vLLM 0.32 CPU; see KNOWN_BROKEN_RELOAD).

Every quantized checkpoint is compared with (a) its ``dq_*`` reference (same weights, so where
activations are not quantized logprobs must be equal; MoE: the reference runs vLLM's CPU BF16 MoE
kernel, the plugin plain torch, so a small bound) and (b) the BF16 source (a stated bound).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qconvert.convert.numerics import mxfp8_dequantize, nvfp4_dequantize

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[3, 17, 42, 99, 7, 120], [200, 5, 64, 31], [9, 9, 150, 77, 2, 45, 88, 13]]
MAX_TOKENS = 6

# Bounds (mean KL per position over the top-20 partition, see vllm_compare) on qconvert's tiny
# random demo models; measured values are in the comments (dense / MoE).
MXFP8_VS_SOURCE_MEAN_KL = 0.05  # measured 0.015-0.018
MOE_VS_DEQUANT_MEAN_KL = 0.02  # plain-torch experts vs vLLM's CPU BF16 MoE kernel; ~0.003-0.006
NVFP4_W4A16_VS_SOURCE_MEAN_KL = 0.5  # measured 0.218 / 0.231 (CT dense 0.219)
NVFP4_W4A4_VS_SOURCE_MEAN_KL = 1.0  # measured 0.367 / 0.427 (--input-scale unit)
BROKEN_MIN_KL_RATIO = 10.0  # swapped layers vs correct MXFP8: measured 0.585 vs 0.018 / 0.643 vs 0.017

# quantized checkpoints per architecture: key -> (scheme, dialect, input mode, last_n_bf16)
FORMATS = {
    "auto": ("mxfp8", "auto", None, 0),
    "mo_last1": ("mxfp8", "modelopt", None, 1),
    "nv_a16": ("nvfp4", "modelopt", "weight-only", 0),
    "nv_a4": ("nvfp4", "modelopt", "unit", 0),
    "ct_a16": ("nvfp4", "compressed-tensors", "weight-only", 0),
}
# runs in this vLLM; everything else is expected to be refused (ct_* on MoE)
RUNS = {
    "qwen3": ["auto", "mo_last1", "nv_a16", "nv_a4", "ct_a16"],
    "qwen3-moe": ["auto", "mo_last1", "nv_a16", "nv_a4"],
}
REFUSED = {"qwen3": None, "qwen3-moe": "ct_a16"}
# checkpoints with a BF16 reference holding qconvert's dequantized weights (W4A4 has none:
# activations are quantized, so no BF16 checkpoint can equal it)
DEQUANT_REFS = ["auto", "mo_last1", "nv_a16"]
LINEAR_METHOD = {
    "auto": "ModelOptLinearMethod",
    "mo_last1": "ModelOptLinearMethod",
    "nv_a16": "CpuModelOptNvFp4W4A16LinearMethod",
    "nv_a4": "ModelOptLinearMethod",
    "ct_a16": "CompressedTensorsLinearMethod",
}
MOE_METHOD = {
    "auto": "CpuModelOptMxFp8FusedMoE",
    "mo_last1": "CpuModelOptMxFp8FusedMoE",
    "nv_a16": "CpuModelOptNvFp4FusedMoE",
    "nv_a4": "CpuModelOptNvFp4FusedMoE",
}


# --------------------------------------------------------------------------------------------
# checkpoints: qconvert's demo models and converter
# --------------------------------------------------------------------------------------------


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if (
            f.suffix != ".safetensors"
            and f.name
            not in (
                "model.safetensors.index.json",
                "config.json",
                "hf_quant_config.json",
                "qconvert.json",
            )
            and f.is_file()
        ):
            (dst / f.name).write_bytes(f.read_bytes())


def convert_with_qconvert(src: Path, dst: Path, key: str) -> Path:
    """``qconvert mxfp8|nvfp4 SRC DST`` with the options of ``FORMATS[key]``, as a library call."""
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    scheme, dialect, input_mode, last_n = FORMATS[key]
    opts = ConvertOptions(
        scheme=scheme,
        dialect=dialect,
        plan=PlanOptions(scheme=scheme, last_n_bf16=last_n),
        progress=False,
        fsync=False,
        **({"input_mode": input_mode} if input_mode else {}),
    )
    convert(str(src), dst, scheme, opts)
    return dst


def make_dequantized(qdir: Path, dst: Path) -> Path:
    """BF16 checkpoint holding the weights of a qconvert MXFP8 / NVFP4 checkpoint as qconvert's
    own ``mxfp8_dequantize`` / ``nvfp4_dequantize`` decode them (all three dialects)."""
    sd = _load_all(qdir)
    out = {}
    for name, w in sd.items():
        if name.endswith(".weight_packed"):  # compressed-tensors NVFP4
            base = name[: -len("weight_packed")]
            s2 = 1.0 / sd[base + "weight_global_scale"].float()
            out[base + "weight"] = nvfp4_dequantize(w, sd[base + "weight_scale"], s2, torch.bfloat16)
        elif not name.endswith(".weight"):
            continue
        elif w.dtype == torch.float8_e4m3fn:
            out[name] = mxfp8_dequantize(w, sd[name + "_scale"], torch.bfloat16)
        elif w.dtype == torch.uint8:  # ModelOpt NVFP4
            s2 = sd[name + "_scale_2"].float()
            out[name] = nvfp4_dequantize(w, sd[name + "_scale"], s2, torch.bfloat16)
        else:
            out[name] = w
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config")
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    _copy_side_files(qdir, dst)
    return dst


SWAP = ("model.layers.1.mlp", "model.layers.2.mlp")


def make_swapped(qdir: Path, dst: Path) -> Path:
    """A broken copy of an MXFP8 checkpoint: every tensor of layer 1's MLP swapped with layer
    2's (same names, shapes and dtypes, so it loads and even hot-reloads)."""
    shutil.copytree(qdir, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    a, b = SWAP
    sd = {}
    for f in sorted(dst.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    swapped = {}
    for name in sd:
        if name.startswith(a + "."):
            other = b + name[len(a) :]
            swapped[name], swapped[other] = sd[other], sd[name]
    assert swapped, "nothing swapped"
    for f in sorted(dst.glob("*.safetensors")):
        part = load_file(str(f))
        hit = {n: swapped[n] for n in part if n in swapped}
        if hit:
            part.update(hit)
            save_file(part, str(f), metadata={"format": "pt"})
    assert all(index[n] for n in swapped)
    return dst


_CK_CACHE: dict[str, dict] = {}


def checkpoints(root: Path, arch: str) -> dict[str, Path]:
    """All checkpoints of one architecture (built once per session)."""
    if arch in _CK_CACHE:
        return _CK_CACHE[arch]
    from qconvert.convert.demo import build_demo_model

    src = build_demo_model(root / "bf16", arch=arch, seed=0)
    src_b = build_demo_model(root / "bf16_b", arch=arch, seed=1)
    ck = {"src": src, "src_b": src_b}
    for key in RUNS[arch] + ([REFUSED[arch]] if REFUSED[arch] else []):
        ck[key] = convert_with_qconvert(src, root / key, key)
        if key in RUNS[arch]:
            ck[key + "_b"] = convert_with_qconvert(src_b, root / (key + "_b"), key)
    for key in DEQUANT_REFS:
        if key in RUNS[arch]:
            ck["dq_" + key] = make_dequantized(ck[key], root / ("dq_" + key))
    ck["broken"] = make_swapped(ck["auto"], root / "broken")
    _CK_CACHE[arch] = ck
    return ck


# --------------------------------------------------------------------------------------------
# one vLLM worker per architecture
# --------------------------------------------------------------------------------------------


def _family(tmp_path_factory, arch: str) -> dict:
    from qconvert.client.compat import check_reload_compatible
    from qconvert.engine.vllm_compare import run_in_vllm

    ck = checkpoints(tmp_path_factory.mktemp(arch), arch)
    dq = [k for k in DEQUANT_REFS if k in RUNS[arch]]
    # BF16 references are fresh loads: reload_weights of BF16 checkpoints does not take on
    # vLLM 0.32 CPU (see test_hot_reload_every_format), so they cannot share one engine
    jobs = [{"model": ck["src"]}] + [{"model": ck["dq_" + k]} for k in dq]
    jobs.append({"model": ck["auto_b"]})  # the fresh load of B for the MXFP8 reload check
    for key in RUNS[arch]:
        chain = [ck[key + "_b"], ck[key], ck[key + "_b"]]
        if key == "auto":
            chain.append(ck["broken"])
        jobs.append({"model": ck[key], "inspect": True, "reload": chain})
    if REFUSED[arch]:
        jobs.append({"model": ck[REFUSED[arch]], "expect_error": True})
    # every reload above is one qconvert's reload clients would accept
    for j in jobs:
        for r in j.get("reload", []):
            check_reload_compatible(j["model"], r)
    res = run_in_vllm(jobs, PROMPTS, MAX_TOKENS, top_k=20, score_with_first=True)
    runs = {"src": res["jobs"][0]}
    stages = {"src": res["jobs"][0]["stages"][0]}
    for i, k in enumerate(dq):
        stages["dq_" + k] = res["jobs"][1 + i]["stages"][0]
    stages["auto_b_fresh"] = res["jobs"][1 + len(dq)]["stages"][0]
    for i, key in enumerate(RUNS[arch]):
        job = res["jobs"][2 + len(dq) + i]
        runs[key] = job
        st = job["stages"]
        stages[key], stages[key + "_b"], stages[key + "_re"], stages[key + "_b_re"] = st[:4]
        if key == "auto":
            stages["broken"] = st[4]
    refused = res["jobs"][-1].get("error") if REFUSED[arch] else None
    return {"ck": ck, "runs": runs, "stages": stages, "arch": arch, "refused": refused}


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def family(request, tmp_path_factory):
    return _family(tmp_path_factory, request.param)


def _cmp(fam, ref, other):
    from qconvert.engine.vllm_compare import compare_logprobs

    return compare_logprobs(fam["stages"][ref]["score"], fam["stages"][other]["score"])


def _all_finite(stage) -> bool:
    vals = [v for seq in stage["score"] for pos in seq if pos for v in pos.values()]
    vals += [v for seq in stage["gen_logprobs"] for pos in seq if pos for v in pos.values()]
    return bool(vals) and all(math.isfinite(v) for v in vals)


def test_converted_checkpoints_load_generate_and_use_cpu_methods(family):
    for key in RUNS[family["arch"]]:
        stage = family["stages"][key]
        assert [len(t) for t in stage["tokens"]] == [MAX_TOKENS] * len(PROMPTS), key
        assert _all_finite(stage), key
        layers = family["runs"][key]["layers"]
        assert layers["model.layers.0.self_attn.qkv_proj"] == LINEAR_METHOD[key], key
        # compressed-tensors leaves an unquantized lm_head to vLLM's embedding method
        assert layers["lm_head"] in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
        if family["arch"] == "qwen3-moe":
            assert layers["model.layers.0.mlp.experts.routed_experts"] == MOE_METHOD[key], key
            assert layers["model.layers.0.mlp.gate"] == "UnquantizedLinearMethod"
        else:
            assert layers["model.layers.0.mlp.gate_up_proj"] == LINEAR_METHOD[key], key


# dense compressed-tensors NVFP4 runs (the tests above); only MoE is refused
@pytest.mark.parametrize("family", ["qwen3-moe"], indirect=True)
def test_compressed_tensors_nvfp4_moe_is_refused(family):
    err = family["refused"]
    assert err and err.startswith("NotImplementedError"), err
    assert "compressed-tensors NVFP4 MoE" in err and "vLLM 0.32.0" in err, err
    assert "--dialect modelopt" in err, err


def test_equals_bf16_of_qconverts_dequantized_weights(family):
    """Weights-only formats (MXFP8, NVFP4 W4A16) against a BF16 checkpoint of qconvert's own
    dequantized weights. Dense: bit-identical logprobs. MoE: plain-torch experts vs vLLM's CPU
    BF16 MoE kernel."""
    for q in DEQUANT_REFS:
        if q not in RUNS[family["arch"]]:
            continue
        m = _cmp(family, "dq_" + q, q)
        if family["arch"] == "qwen3":
            assert m["max_abs_logprob_diff"] == 0.0, (q, m["max_abs_logprob_diff"])
            assert family["stages"][q]["tokens"] == family["stages"]["dq_" + q]["tokens"], q
        else:
            # different expert kernels: rounding can flip a near-tie (measured 0.97-1.0)
            assert m["top1_agreement"] >= 0.9, (q, m["top1_agreement"])
            assert m["mean_kl"] < MOE_VS_DEQUANT_MEAN_KL, (q, m["mean_kl"])


def test_close_to_source(family):
    bound = {
        "mxfp8": MXFP8_VS_SOURCE_MEAN_KL,
        "weight-only": NVFP4_W4A16_VS_SOURCE_MEAN_KL,
        "unit": NVFP4_W4A4_VS_SOURCE_MEAN_KL,
    }
    for q in RUNS[family["arch"]]:
        scheme, _, mode, _ = FORMATS[q]
        m = _cmp(family, "src", q)
        assert 0.0 < m["mean_kl"] < bound[mode or scheme], (q, m["mean_kl"])
        if scheme == "mxfp8":
            assert m["top1_agreement"] >= 0.6, (q, m["top1_agreement"])
    # activation quantization must actually happen in W4A4: it differs from W4A16
    assert family["stages"]["nv_a4"]["score"] != family["stages"]["nv_a16"]["score"]
    if "ct_a16" in RUNS[family["arch"]]:
        # same codes and block scales as ModelOpt W4A16; the global scale is stored as its
        # reciprocal, so decoded weights may differ in the last bit (measured KL 3e-4)
        assert _cmp(family, "nv_a16", "ct_a16")["mean_kl"] < 0.01


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


def _same(a, b) -> bool:
    return a["tokens"] == b["tokens"] and a["gen_logprobs"] == b["gen_logprobs"] and a["score"] == b["score"]


# reload_weights into vLLM 0.32 CPU's own BF16 MoE kernel (UnquantizedFusedMoEMethod, here the
# last-N-BF16 layer) does not take: the layer keeps stale weights (measured KL 0.47 to the fresh
# load). The test asserts it stays broken so that a fix is noticed.
KNOWN_BROKEN_RELOAD = {("qwen3-moe", "mo_last1")}


def test_hot_reload_every_format(family):
    """Per format, engine loaded with X, then reload_weights X_b, X, X_b. With A = X_b, B = X:
    A -> B changes outputs and equals a fresh load of B; B -> A restores A exactly. MXFP8
    (auto): the first reload also equals a fresh load of X_b."""
    st = family["stages"]
    assert _same(st["auto_b"], st["auto_b_fresh"])
    broken = set()
    for key in RUNS[family["arch"]]:
        fresh_b, a, b, a_again = st[key], st[key + "_b"], st[key + "_re"], st[key + "_b_re"]
        assert _all_finite(a) and _all_finite(b), key
        assert a["tokens"] != b["tokens"], key
        if not (_same(b, fresh_b) and _same(a_again, a)):
            broken.add((family["arch"], key))
    assert broken == {k for k in KNOWN_BROKEN_RELOAD if k[0] == family["arch"]}


def test_swapped_layers_are_far_from_source(family):
    """A broken conversion (layer 1 and 2 MLP tensors swapped) loads, but its KL to the source
    is far above the correct conversion's."""
    good, bad = _cmp(family, "src", "auto"), _cmp(family, "src", "broken")
    assert bad["mean_kl"] > BROKEN_MIN_KL_RATIO * good["mean_kl"], (bad["mean_kl"], good["mean_kl"])
    assert bad["top1_agreement"] < good["top1_agreement"]


# --------------------------------------------------------------------------------------------
# qconvert verify --engine vllm (the CLI, in its own vLLM process)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_ck(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _verify_cli(src, dst, *extra):
    from click.testing import CliRunner

    from qconvert.cli import main

    r = CliRunner().invoke(main, ["verify", str(src), str(dst), "--json", *extra])
    out = r.stdout
    start = 0 if out.startswith("{") else out.find("\n{") + 1
    report = json.loads(out[start:]) if "{" in out else None
    return r, report


def test_verify_engine_vllm_reports_agreement_and_kl(dense_ck):
    r, rep = _verify_cli(dense_ck["src"], dense_ck["auto"], "--check-in-engine", "vllm")
    assert r.exit_code == 0, r.output[-3000:]
    eng = rep["engine"]
    assert eng["available"] and "error" not in eng, eng
    assert rep["checks"]["engine"] == "ok"
    assert eng["positions"] > 10
    # MXFP8 of the dense demo model on VERIFY_PROMPTS: measured top-1 0.873, mean KL 0.0227 (71 pos.)
    assert 0.6 <= eng["top1_agreement"] <= 1.0, eng
    assert 0.0 < eng["mean_kl"] < MXFP8_VS_SOURCE_MEAN_KL, eng


def test_verify_fails_swapped_layers(dense_ck):
    """The swapped-layer checkpoint fails verify's own checks (no engine needed; its engine KL is
    checked in test_swapped_layers_are_far_from_source, in the shared vLLM process; through
    ``verify --check-in-engine vllm`` it measured top-1 0.38, mean KL 0.83)."""
    r, rep = _verify_cli(dense_ck["src"], dense_ck["broken"])
    assert r.exit_code == 1, r.output[-3000:]
    assert any(SWAP[0] in f or SWAP[1] in f for f in rep["failures"]), rep["failures"][:5]


# --------------------------------------------------------------------------------------------
# plugin itself
# --------------------------------------------------------------------------------------------


def test_version_pin(monkeypatch):
    import vllm

    from qconvert.engine import vllm_cpu_plugin as plugin

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


def test_plugin_classes_unpickle_in_another_process():
    """vLLM's CPU build spawns its engine core and pickles the config into it: every class the
    plugin defines pickles by qualified name and unpickles, in a fresh process that has not
    registered anything, to the class that process's plugin module defines."""
    import pickle
    import subprocess
    import sys

    from qconvert.engine import vllm_cpu_plugin as plugin

    blobs = {name: pickle.dumps(getattr(plugin, name)).hex() for name in plugin.CLASS_NAMES}
    assert "CpuMxfp8Config" in blobs and "CpuNvfp4Config" in blobs
    code = (
        "import json, pickle, sys\n"
        "blobs = json.loads(sys.stdin.read())\n"
        "out = {n: pickle.loads(bytes.fromhex(b)) for n, b in blobs.items()}\n"
        "from qconvert.engine import vllm_cpu_plugin as p\n"
        "print(json.dumps({n: [c is getattr(p, n), c.__module__, c.__qualname__] for n, c in out.items()}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(blobs), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {n: [True, plugin.__name__, n] for n in plugin.CLASS_NAMES}


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("qconvert_cpu_emulation") == "qconvert.engine.vllm_cpu_plugin:register"


# --------------------------------------------------------------------------------------------
# vLLM's default settings: engine core in its own (spawned) process, compiled model
# --------------------------------------------------------------------------------------------

# MoE demo checkpoints: between them every class of the plugin but the compressed-tensors one
# (MXFP8 linear + experts, NVFP4 W4A16 linear + experts, NVFP4 W4A4 linear + experts)
DEFAULT_SETTINGS_FORMATS = ["auto", "nv_a16", "nv_a4"]
DEFAULT_SETTINGS_TOP_K = 5

# What a user writes: LLM(model=...) and nothing else. Each model is loaded, hot-reloaded to its
# _b twin and back (reload_weights under the compiled model); then the twin is loaded fresh.
_DEFAULT_SETTINGS_SCRIPT = r"""
import gc, json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

spec = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_k"],
                        ignore_eos=True)


def generate(llm):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "gen_logprobs": [[{str(t): float(lp.logprob) for t, lp in d.items()}
                          for d in o.outputs[0].logprobs] for o in outs],
    }


result = []
for model, other in spec["models"]:
    llm = LLM(model=model)
    stages = [generate(llm)]
    for weights in (other, model):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights})
        stages.append(generate(llm))
    del llm
    gc.collect()
    llm = LLM(model=other)
    stages.append(generate(llm))
    del llm
    gc.collect()
    result.append(stages)
print("RESULT " + json.dumps(result))
"""


@pytest.mark.slow
def test_default_settings_llm_loads_generates_and_reloads(tmp_path):
    """``LLM(model=...)`` with vLLM's defaults (no ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no
    ``enforce_eager``): the plugin's config classes are pickled into the spawned engine core
    and the MoE experts run inside vLLM's compiled model. A hot reload to the _b twin equals a
    fresh load of the twin exactly, reloading back restores the first outputs exactly, and the
    outputs are close to the eager in-process run (:func:`run_in_vllm`) of the same checkpoint."""
    import os
    import subprocess
    import sys

    from qconvert.convert.demo import build_demo_model
    from qconvert.engine.vllm_compare import compare_logprobs, run_in_vllm

    src = build_demo_model(tmp_path / "bf16", arch="qwen3-moe", seed=0)
    src_b = build_demo_model(tmp_path / "bf16_b", arch="qwen3-moe", seed=1)
    pairs = [
        (convert_with_qconvert(src, tmp_path / k, k), convert_with_qconvert(src_b, tmp_path / f"{k}_b", k))
        for k in DEFAULT_SETTINGS_FORMATS
    ]
    spec = {
        "models": [[str(a), str(b)] for a, b in pairs],
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "top_k": DEFAULT_SETTINGS_TOP_K,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    # vLLM CPU's default KV cache is 90 % of the machine's RAM and refuses to start unless that
    # much is free (the README's server command sets the same variable); the compile cache goes
    # to tmp_path so the model is really compiled, not read from an earlier run's cache
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    p = subprocess.run(
        [sys.executable, "-c", _DEFAULT_SETTINGS_SCRIPT, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "RESULT " in p.stdout, out[-4000:]
    default = json.loads(p.stdout.split("RESULT ", 1)[1])

    for i, key in enumerate(DEFAULT_SETTINGS_FORMATS):
        loaded, reloaded, back, fresh_b = default[i]
        assert _all_finite_gen(loaded) and _all_finite_gen(fresh_b), key
        # the reload under the compiled model computes what a fresh load of the twin computes
        assert reloaded == fresh_b, key
        assert reloaded["tokens"] != loaded["tokens"], key
        assert back == loaded, key
    # compiled default mode vs the eager in-process run of the MXFP8 checkpoint: same greedy
    # tokens, but logprobs differ (measured mean KL 0.039 over the top-5, largest logprob
    # difference 2.6; cause not investigated), so only a loose bound
    eager = run_in_vllm([str(pairs[0][0])], PROMPTS, MAX_TOKENS, top_k=DEFAULT_SETTINGS_TOP_K)["jobs"]
    fresh, loaded = eager[0]["stages"][0], default[0][0]
    assert fresh["tokens"] == loaded["tokens"]
    m = compare_logprobs(fresh["gen_logprobs"], loaded["gen_logprobs"])
    assert m["mean_kl"] < 0.1, m["mean_kl"]


def _all_finite_gen(stage) -> bool:
    vals = [v for seq in stage["gen_logprobs"] for pos in seq for v in pos.values()]
    return bool(vals) and all(math.isfinite(v) for v in vals)


# --------------------------------------------------------------------------------------------
# the README's server command, as written
# --------------------------------------------------------------------------------------------


def readme_server_commands() -> tuple[str, str]:
    """The README's vLLM server command (continuation lines joined) and the reload command that
    follows it, read from README.md so that the two cannot drift apart."""
    lines = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    start = next(
        i for i, ln in enumerate(lines) if ln.startswith("    ") and "vllm.entrypoints.openai.api_server" in ln
    )
    server, i = "", start
    while True:
        part = lines[i].strip()
        server += part.removesuffix("\\").rstrip() + " "
        i += 1
        if not part.endswith("\\"):
            break
    reload_cmd = lines[i].strip()
    assert reload_cmd.startswith("qconvert reload vllm http://127.0.0.1:8000 "), reload_cmd
    return server.strip(), reload_cmd


@pytest.mark.slow
def test_readme_server_command_serves_and_reloads(tmp_path):
    """README's two hot-reload lines, run as written in a directory holding ``./q`` (the MXFP8 MoE
    checkpoint of ``qconvert demo``) and ``./q-step-42`` (the same conversion of another seed),
    with only the port changed: the server starts with vLLM's defaults (compiled model, engine
    core in its own process), answers a completion, and the reload changes its answer."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import requests
    from click.testing import CliRunner

    from qconvert.cli import main
    from qconvert.convert.demo import build_demo_model

    server_cmd, reload_cmd = readme_server_commands()
    r = CliRunner().invoke(main, ["demo", str(tmp_path / "demo")])
    assert r.exit_code == 0, r.output
    (tmp_path / "demo" / "mxfp8-last1-bf16").rename(tmp_path / "q")
    src_b = build_demo_model(tmp_path / "bf16_b", arch="qwen3-moe", seed=1)
    r = CliRunner().invoke(main, ["mxfp8", str(src_b), str(tmp_path / "q-step-42"), "--last-n-bf16", "1"])
    assert r.exit_code == 0, r.output

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # a shell as a user has it after activating the venv: its bin/ first on PATH; no VLLM_* set
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")  # compile for real, not from a cache
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            ["bash", "-c", f"{server_cmd} --port {port}"],
            cwd=tmp_path,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.time() < deadline, f"no /health in 900 s:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)

        def complete() -> str:
            model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            resp = requests.post(
                url + "/v1/completions",
                timeout=300,
                json={
                    "model": model,
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["usage"]["completion_tokens"] == 8, body
            return body["choices"][0]["text"]

        before = complete()
        rel = subprocess.run(
            ["bash", "-c", reload_cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert rel.returncode == 0, rel.stdout + rel.stderr
        after = complete()
        assert after != before, (before, after)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
