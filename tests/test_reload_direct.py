"""The direct in-place reload of a staging area (qconvert/engine/vllm_direct.py,
docs/reload.md#vllm-direct-load) against real vLLM (CPU build).

Oracle: vLLM itself. A server started fresh on checkpoint B gives the greedy tokens and their
log-probabilities; the same server, reloaded directly to A, must give what vLLM's own layerwise
reload of A gives, and reloaded directly to B (from A's tensors) and again A -> B, exactly the
fresh server's tokens and logprobs. The
model is the Qwen3-MoE demo in MXFP8 (both dialects vLLM serves it from: ``auto``, ``quant_method:
mxfp8``, and ModelOpt) with its last layer BF16 (``_make_pair``'s default), so every direct form
runs: BF16 CPU experts, the CPU plugin's MXFP8 experts and the dense MXFP8 linear layers (q/k/v and
o on vLLM's ``EmulationMxfp8LinearKernel``, ``cpu-mxfp8-linear``: each one of them); the BF16
linear layers, the router, embeddings and attention take vLLM's layerwise reload in the same pass. A second check runs vLLM's offline
``LLM(...)`` with its default multiprocessing engine core and the worker extension: the direct load
equals vLLM's layerwise reload of the same area in the same engine.
"""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from qconvert.client import staging  # noqa: E402
from qconvert.client.vllm_client import reload_vllm  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):"]


def _greedy_logprobs(url: str) -> list[tuple[str, list[float], list[dict]]]:
    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    out = []
    for p in PROMPTS:
        r = requests.post(
            url + "/v1/completions",
            json={
                "model": model,
                "prompt": p,
                "max_tokens": 10,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 3,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        out.append((ch["text"], ch["logprobs"]["token_logprobs"], ch["logprobs"]["top_logprobs"]))
    return out


def _mxfp8_linear_modules(ckpt) -> int:
    """The dense MXFP8 linear modules vLLM builds from ``ckpt``: the modules of its block scales
    outside the experts, q/k/v fused into one (Qwen3-MoE has no dense gate/up)."""
    from safetensors import safe_open

    mods = set()
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith(".weight_scale") and ".experts." not in name:
                    mod = name.rsplit(".", 1)[0]
                    assert mod.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj", "o_proj"), name
                    mods.add(mod.replace(".k_proj", ".q_proj").replace(".v_proj", ".q_proj"))
    return len(mods)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8-modelopt"])
def test_direct_reload_equals_fresh_server(tmp_path, monkeypatch, fmt):
    from test_reload_vllm import Server, _make_pair

    from qconvert.client.vllm_client import VllmClient
    from qconvert.engine import STAGED_RPC

    monkeypatch.setenv("QCONVERT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    a, b, _ = _make_pair(tmp_path, f"qwen3-moe:{fmt}")
    n_linear = _mxfp8_linear_modules(a)
    assert n_linear >= 2
    area_a = staging.stage_checkpoint(a, "a").path
    staging.stage_checkpoint(b, "b")
    srv = Server(b, tmp_path / "server.log")

    plans = []

    def direct(name: str) -> list:
        res = reload_vllm([srv.url], f"shm:{name}", weight_version=name)
        (stats,) = res[0].load
        assert stats["path"] == "direct", stats
        plans.append(
            (stats["plan"], stats["modules"]["planned-tensors"], stats["replay"], stats["modules"]["replayed-modules"])
        )
        # every direct form ran, the dense MXFP8 layers each in theirs; the BF16 linear layers,
        # router, embeddings and attention went through vLLM's layerwise reload
        assert stats["modules"].get("cpu-moe", 0) == 1 and stats["modules"].get("cpu-mxfp8-moe", 0) >= 1, stats
        assert stats["modules"].get("cpu-mxfp8-linear", 0) == n_linear, stats
        assert any(k.startswith("layerwise:") for k in stats["modules"]), stats
        assert stats["mappings_released"] is True
        assert stats["modules"]["direct-deferred"] == 0, stats  # no direct module went through vLLM's wrapper
        return _greedy_logprobs(srv.url)

    try:
        fresh_b = _greedy_logprobs(srv.url)
        direct_a = direct("a")  # from B's served tensors: every expert tensor must change
        assert direct_a != fresh_b
        c = VllmClient(srv.url)
        (st,) = c.collective_rpc(STAGED_RPC, area=str(area_a), direct=False)  # vLLM's own layerwise reload
        c.collective_rpc("qconvert_repack_cpu_moe")
        assert st["path"] == "layerwise" and st["why"] == "direct-disabled"
        assert _greedy_logprobs(srv.url) == direct_a  # tokens and logprobs, exactly
        # every served tensor after vLLM's layerwise reload of A: vLLM's own checksums (its
        # /weight_checker, parameters) and the worker extension's digests (parameters and buffers)
        layerwise_a = (c.checksums(), c.collective_rpc("qconvert_weights_digest"))
        assert len(layerwise_a[0]) > 10 and len(layerwise_a[1][0]) >= len(layerwise_a[0])
        assert direct("b") == fresh_b  # from A's served tensors (rebuilt by vLLM)
        assert direct("a") == direct_a
        # the replayed load (copy plan and loader calls) leaves every served tensor as vLLM's
        # layerwise reload of the same area leaves it, byte for byte
        assert plans[-1][2] == "replayed"
        assert (c.checksums(), c.collective_rpc("qconvert_weights_digest")) == layerwise_a
        assert direct("b") == fresh_b
        # the first direct load recorded the copy plan; the last ones replayed it (the staged tensors
        # of the direct modules copied to their recorded places, not through load_weights)
        # and vLLM's layerwise modules' loader calls were recorded, then replayed (vllm_replay):
        # every module vLLM processed, none through load_weights
        assert plans[0] == ("recorded", 0, "recorded", 0), plans
        assert plans[-1][0] == plans[-2][0] == "replayed" and plans[-1][1] > 0, plans
        assert plans[-1][2] == plans[-2][2] == "replayed" and plans[-1][3] > 0, plans
    finally:
        srv.stop()
        for n in ("a", "b"):
            staging.drop_area(n)


def test_offline_llm_multiprocessing_direct_equals_layerwise(tmp_path, monkeypatch):
    """vLLM's default ``LLM(...)`` (engine core in its own process) with the worker extension: the
    direct load runs there and gives what vLLM's layerwise reload of the same area gives."""
    from test_reload_vllm import _make_pair
    from vllm import LLM, SamplingParams

    from qconvert.engine import WORKER_EXTENSION

    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # vLLM's default: on
    a, b, _ = _make_pair(tmp_path, "qwen3-moe:bf16")
    areas = {n: str(staging.stage_checkpoint(c, f"llm-{n}").path) for n, c in (("a", a), ("b", b))}
    llm = LLM(
        model=str(a),
        worker_extension_cls=WORKER_EXTENSION,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        dtype="bfloat16",
    )
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run() -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(PROMPTS, sp)]

    def load(area: str, direct: bool) -> dict:
        (st,) = llm.collective_rpc("qconvert_load_staged", kwargs={"area": area, "direct": direct})
        llm.collective_rpc("qconvert_repack_cpu_moe")
        return st

    try:
        original = run()
        st = load(areas["b"], True)
        assert st["path"] == "direct" and st["modules"].get("cpu-moe") == 4, st
        assert st["plan"] == "recorded", st
        assert st["modules"]["direct-deferred"] == 0, st
        direct_b = run()
        assert direct_b != original
        st = load(areas["a"], False)
        assert st["path"] == "layerwise" and st["why"] == "direct-disabled"
        assert run() == original
        load(areas["b"], False)
        assert run() == direct_b  # vLLM's layerwise reload of B: the oracle
        st = load(areas["a"], True)
        assert st["plan"] in ("recorded", "replayed"), st
        assert run() == original
        st = load(areas["b"], True)
        assert st["plan"] == "replayed" and st["modules"]["planned-tensors"] > 0, st
        assert run() == direct_b
    finally:
        llm = None  # the engine core process ends with the LLM
        for n in ("a", "b"):
            staging.drop_area(f"llm-{n}")


def test_nvfp4_experts_direct_and_replayed_equal_layerwise(tmp_path, monkeypatch):
    """NVFP4 experts on the CPU build, two ways, each against vLLM's own layerwise reload of the
    same area (every served tensor, and greedy tokens with logprobs), A after B and B after A:

    * with their direct form turned off for the load (``direct`` a list of forms), they are rebuilt
      by vLLM's layerwise reload, as every module is on a GPU server, and the loader replay
      (docs/reload.md#loader-replay) hands vLLM's per-expert weight loaders the recorded calls;
    * in their direct form (``cpu-nvfp4-moe``, docs/reload.md#vllm-direct-load) the loaded NVFP4
      tensors land in the served ones and the plugin re-derives the BF16 experts in place."""
    from test_reload_vllm import Server, _make_pair

    from qconvert.client.vllm_client import VllmClient
    from qconvert.engine import STAGED_RPC

    monkeypatch.setenv("QCONVERT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    a, b, _ = _make_pair(tmp_path, "qwen3-moe:nvfp4")
    areas = {n: str(staging.stage_checkpoint(c, f"nv-{n}").path) for n, c in (("a", a), ("b", b))}
    srv = Server(b, tmp_path / "server.log")
    c = VllmClient(srv.url)
    no_nvfp4 = ["plain", "cpu-moe", "cpu-mxfp8-moe", "cpu-mxfp8-linear"]  # every form but cpu-nvfp4-moe

    def load(name: str, direct) -> dict:
        (st,) = c.collective_rpc(STAGED_RPC, area=areas[name], direct=direct)
        c.collective_rpc("qconvert_repack_cpu_moe")
        return st

    def digests() -> dict:
        (d,) = c.collective_rpc("qconvert_weights_digest")
        return {**{f"vllm:{k}": v for k, v in c.checksums().items()}, **d}

    unloaded: set = set()

    def served() -> tuple:
        d = digests()
        return {k: v for k, v in d.items() if k not in unloaded}, _greedy_logprobs(srv.url)

    try:
        # vLLM's own reload of one area twice: the W4A16 experts' input scales, which no checkpoint
        # tensor loads, are fresh uninitialized memory at every reload (unused by W4A16); every
        # other served tensor is the same
        load("a", False)
        first = digests()
        load("a", False)
        unloaded = {k for k, v in digests().items() if first.get(k) != v}
        assert unloaded and all(k.endswith(("w13_input_scale", "w2_input_scale")) for k in unloaded), unloaded
        want = {}
        for n in ("a", "b"):
            st = load(n, False)
            assert st["path"] == "layerwise", st
            want[n] = served()
        assert want["a"] != want["b"]
        # the experts layerwise, their loader calls replayed
        got = [load(n, no_nvfp4) for n in ("a", "b", "a")]
        assert [(st["plan"], st["replay"]) for st in got] == [
            ("recorded", "recorded"),
            ("replayed", "replayed"),
            ("replayed", "replayed"),
        ], got
        mods = got[-1]["modules"]
        assert "cpu-nvfp4-moe" not in mods and mods["layerwise:form-disabled"] >= 2, mods  # the MoE layers
        # the MoE layers are among the replayed modules (every layerwise module with loaded tensors)
        assert mods["replayed-modules"] >= mods["layerwise:form-disabled"] + mods["layerwise:quant-method-transforms"]
        # and the MoE layers' per-expert loader calls made as their recorded copies, batched
        # (docs/reload.md#loader-copies); the recording says why any module keeps its calls
        made = got[0]["copies_recorded"]
        assert made["refused"] == {} and made["modules"] == mods["replayed-modules"], made
        assert mods["copied-modules"] == mods["replayed-modules"], mods
        # the experts' copies batched: per MoE layer, 8 experts' 6 weight and block-scale tensors
        # in 6 batches, their 24 per-tensor scales (packed after them in the layer's file) in a few
        assert made["copies"] - made["batches"] >= 60 * mods["layerwise:form-disabled"], made
        assert served() == want["a"]
        load("b", no_nvfp4)
        assert served() == want["b"]
        # the experts in their direct form (a new plan: the forms differ), B then A then B
        got = [load(n, True) for n in ("a", "b", "a")]
        assert [(st["path"], st["plan"]) for st in got] == [
            ("direct", "recorded"),
            ("direct", "replayed"),
            ("direct", "replayed"),
        ], got
        mods = got[-1]["modules"]
        assert mods["cpu-nvfp4-moe"] >= 2 and "layerwise:form-disabled" not in mods, mods
        assert mods["direct-deferred"] == 0 and mods["planned-tensors"] > 0, mods
        assert served() == want["a"]
        load("b", True)
        assert served() == want["b"]
        with pytest.raises(Exception, match="unknown direct-load form 'cpu-nvfp4'"):
            load("a", ["cpu-nvfp4"])
        assert served() == want["b"]  # the refused load loaded nothing
    finally:
        srv.stop()
        for n in ("a", "b"):
            staging.drop_area(f"nv-{n}")
