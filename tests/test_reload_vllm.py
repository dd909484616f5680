"""`qconvert reload vllm` against real vLLM (CPU build) servers.

One server per model kind (module-scoped, reused by every check of that kind), started in dev
mode on checkpoint A of the demo model. Checks: reloading checkpoint B (other seed, same
architecture) changes greedy outputs; reloading A restores the original outputs exactly; a
stream of concurrent requests during a ``--pause wait`` reload: zero failures and every response
carries exactly one weight version (vLLM's own per-token ``weight_versions`` spans); a truncated
shard fails with the server's message and the server is resumed and serves A correctly.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from qconvert.client.vllm_client import EXTENSION_FLAG, ReloadError, reload_vllm  # noqa: E402
from qconvert.convert.demo import build_demo_model  # noqa: E402
from scripts.vllm_server import CPU_TEST_FLAGS, VllmServer  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "MXFP8 stores", "def add(a, b):"]
MAX_TOKENS = 12


def _convert(src: Path, dst: Path, last_n_bf16: int = 1, fmt: str = "mxfp8") -> Path:
    """fmt: mxfp8 (auto dialect), mxfp8-modelopt, nvfp4 (ModelOpt W4A16), nvfp4-w4a4 (unit input scales)."""
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    scheme = fmt.split("-")[0]
    opts = ConvertOptions(
        scheme=scheme, plan=PlanOptions(scheme=scheme, last_n_bf16=last_n_bf16), fsync=False, progress=False
    )
    if fmt == "mxfp8-modelopt":
        opts.dialect = "modelopt"
    if fmt == "nvfp4-w4a4":
        opts.input_mode = "unit"
    convert(str(src), dst, scheme, opts)
    return dst


def _make_pair(root: Path, kind: str) -> tuple[Path, Path, Path]:
    arch, fmt = kind.split(":")
    a = build_demo_model(root / f"{arch}-a-bf16", arch=arch, seed=0)
    b = build_demo_model(root / f"{arch}-b-bf16", arch=arch, seed=1)
    if fmt == "bf16":
        return a, b, b
    return _convert(a, root / f"{arch}-a-{fmt}", fmt=fmt), _convert(b, root / f"{arch}-b-{fmt}", fmt=fmt), b


class Server(VllmServer):
    """The tests' CPU server: dev mode (weight-version routes) and qconvert's worker extension unless told otherwise."""

    def __init__(
        self, model: Path, log: Path, env_extra: dict | None = None, dev_mode: bool = True, extension: bool = True
    ):
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0", **(env_extra or {})}
        flags = [*CPU_TEST_FLAGS, *(EXTENSION_FLAG.split() if extension else [])]
        super().__init__(model, log, flags, env=env, timeout=300)

    def model(self) -> str:
        return requests.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def greedy(self) -> list[str]:
        out = []
        for p in PROMPTS:
            r = requests.post(
                self.url + "/v1/completions",
                json={
                    "model": self.model(),
                    "prompt": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out


# Every format the vLLM CPU build executes with qconvert's plugin; the heavier checks below run on a
# subset, the reload round trip on all of them.
KINDS = [
    "qwen3:bf16",
    "qwen3-moe:bf16",
    "qwen3:mxfp8",
    "qwen3-moe:mxfp8",
    "qwen3:mxfp8-modelopt",
    "qwen3:nvfp4",
    "qwen3-moe:nvfp4",
    "qwen3:nvfp4-w4a4",
]


def _kind_id(kind: str) -> str:
    return kind.replace(":", "-")


def on_kinds(*kinds: str):
    """Run a test on these kinds only (the same module-scoped servers, reused)."""
    return pytest.mark.parametrize("served", kinds, indirect=True, ids=_kind_id)


@pytest.fixture(scope="module", params=KINDS, ids=_kind_id)
def served(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind.replace(":", "-"))
    a, b, b_src = _make_pair(root, kind)
    os.environ["QCONVERT_STATE_DIR"] = str(root / "state")
    t0 = time.perf_counter()
    srv = Server(a, root / "server.log")
    start_s = time.perf_counter() - t0
    try:
        original = srv.greedy()
        yield {
            "kind": kind,
            "a": a,
            "b": b,
            "b_src": b_src,
            "srv": srv,
            "original": original,
            "root": root,
            "start_s": start_s,
        }
    finally:
        srv.stop()


def test_reload_changes_then_restores_outputs(served):
    srv, a, b = served["srv"], served["a"], served["b"]
    res = reload_vllm([srv.url], b, weight_version="B1")
    assert [r.ok for r in res] == [True]
    assert requests.get(srv.url + "/weight_info", timeout=10).json()["weight_version"] == "B1"
    out_b = srv.greedy()
    assert out_b != served["original"], "reloading other weights did not change the greedy outputs"
    # B again through shared memory: same outputs as B from disk, and --verify passes
    os.environ["QCONVERT_SHM_ROOT"] = str(served["root"] / "shm")
    res = reload_vllm([srv.url], b, via="shm", weight_version="B2", verify=True)
    assert res[0].verify["norms_checked"] > 0
    assert srv.greedy() == out_b
    reload_vllm([srv.url], a, weight_version="A1")
    assert srv.greedy() == served["original"], "reloading the first checkpoint did not restore its outputs"
    assert requests.get(srv.url + "/is_paused", timeout=10).json()["is_paused"] is False


@on_kinds("qwen3-moe:bf16", "qwen3-moe:mxfp8")  # one fresh-server comparison per MoE kind
def test_reload_b_equals_fresh_server_on_b(served):
    """The reloaded engine computes exactly what a server started on B computes (catches kernels
    that keep state from the first load, e.g. prepacked experts)."""
    srv, b = served["srv"], served["b"]
    reload_vllm([srv.url], b, weight_version="B-fresh")
    reloaded = srv.greedy()
    reload_vllm([srv.url], served["a"], weight_version="A-fresh")
    fresh = Server(b, served["root"] / "server-b.log")
    try:
        assert fresh.greedy() == reloaded
    finally:
        fresh.stop()


def _generate(url: str, token_ids: list[int], max_tokens: int = 24) -> dict:
    r = requests.post(
        url + "/inference/v1/generate",
        json={
            "token_ids": token_ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        },
        timeout=300,
    )
    return {
        "status": r.status_code,
        "body": r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text,
    }


@on_kinds("qwen3-moe:bf16")
def test_concurrent_requests_during_wait_reload(served):
    srv = served["srv"]
    reload_vllm([srv.url], served["a"], weight_version="V-old")
    results: list[dict] = []
    stop = threading.Event()

    def client(seed: int) -> None:
        i = 0
        while not stop.is_set():
            results.append(_generate(srv.url, [3 + seed, 17 + i % 50, 42, 99]))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    reload_vllm([srv.url], served["b"], pause="wait", weight_version="V-new")
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(300)
    failed = [r for r in results if r["status"] != 200]
    assert not failed, failed[:3]
    versions = []
    for r in results:
        spans = r["body"]["choices"][0]["weight_versions"]
        assert len(spans) == 1, f"response generated with several weight versions: {spans}"
        assert spans[0]["start"] == 0 and spans[0]["end"] == 24
        versions.append(spans[0]["version"])
    assert {"V-old", "V-new"} <= set(versions), set(versions)
    # once a response saw the new weights, no later-started... (order is by completion): every
    # response is one of the two versions only
    assert set(versions) <= {"V-old", "V-new"}
    reload_vllm([srv.url], served["a"], weight_version="A2")


def _generated(r: dict) -> tuple[list[int], list[dict]]:
    assert r["status"] == 200, r
    c = r["body"]["choices"][0]
    return c["token_ids"], c["weight_versions"]


@on_kinds("qwen3:bf16")
def test_keep_reload_continues_requests_on_the_new_weights(served):
    """``--pause keep`` on vLLM 0.32: requests in flight are neither aborted nor drained; vLLM
    preempts them at the pause and clears the prefix cache, so after the reload each one goes on
    from its tokens so far with KV recomputed under the new weights: the rest of its tokens are
    exactly B's greedy continuation of (prompt + the tokens A generated). A prefix cached under A
    is not reused after the reload either (a prompt longer than one KV block on the CPU backend)."""
    srv = served["srv"]
    long_prompt = [100 + (i * 7) % 300 for i in range(140)]  # > 128 tokens: one full CPU KV block
    reload_vllm([srv.url], served["b"], weight_version="B-ref")
    want_long, _ = _generated(_generate(srv.url, long_prompt))
    reload_vllm([srv.url], served["a"], weight_version="K-old")
    _generate(srv.url, long_prompt)  # A's blocks for this prefix now in the prefix cache
    n = 200
    prompts = [[3 + k, 17, 42, 99] for k in range(8)]

    def one_round(i: int) -> list[tuple[int, list[int], list[dict]]]:
        """8 requests of ``n`` tokens from A, and a keep reload to B while they run."""
        if i:
            reload_vllm([srv.url], served["a"], weight_version="K-old")
        results: dict[int, dict] = {}

        def client(k: int) -> None:
            results[k] = _generate(srv.url, prompts[k], max_tokens=n)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        # a longer wait each round: on a loaded machine the requests were not yet scheduled after
        # 0.05 s in any of 5 rounds (every request then ran on B alone); 0.8 s is still well
        # inside the 200 tokens
        time.sleep(0.05 * 2**i)
        res = reload_vllm([srv.url], served["b"], pause="keep", weight_version="K-new")
        for t in threads:
            t.join(300)
        assert [r.ok for r in res] == [True]
        return [(k, *_generated(r)) for k, r in sorted(results.items())]

    switched = 0
    for i in range(5):  # a round where every request ended before the pause (or began after it) tests nothing
        for k, tokens, spans in one_round(i):
            assert len(tokens) == n
            assert [s["version"] for s in spans] in (["K-old"], ["K-new"], ["K-old", "K-new"]), spans
            if len(spans) == 2:
                switched += 1
                cut = spans[0]["end"]
                # every token after the cut (a fixed-length reference longer than what is left
                # after a late cut could never equal the shorter rest)
                cont, _ = _generated(_generate(srv.url, prompts[k] + tokens[:cut], max_tokens=n - cut))
                assert cont == tokens[cut:], f"request {k}: not B's continuation after token {cut}"
        if switched:
            break
    assert switched, "in 5 rounds no request was in flight during the reload; nothing was tested"
    got_long, _ = _generated(_generate(srv.url, long_prompt))
    assert got_long == want_long, "a prefix cached under the old weights was reused after the reload"
    reload_vllm([srv.url], served["a"], weight_version="A-after-keep")


@on_kinds("qwen3:bf16", "qwen3-moe:mxfp8")  # one dense and one quantized MoE kind
def test_truncated_shard_fails_with_server_message_and_rolls_back(served):
    srv, b = served["srv"], served["b"]
    reload_vllm([srv.url], served["a"], weight_version="A-before-broken")
    broken = served["root"] / "broken"
    shutil.copytree(b, broken)
    shard = sorted(broken.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    # default: the layout-contract check reads every shard header and refuses it before pausing
    with pytest.raises(ReloadError, match="truncated") as ei:
        reload_vllm([srv.url], broken, weight_version="BROKEN")
    assert requests.get(srv.url + "/weight_info", timeout=10).json()["weight_version"] == "A-before-broken"
    # without the client-side check the server itself fails; the client rolls back and resumes
    with pytest.raises(ReloadError) as ei:
        reload_vllm([srv.url], broken, weight_version="BROKEN", check_contract=False)
    msg = str(ei.value)
    # the server's own words (vLLM reports the worker exception text)
    assert "Call to collective_rpc method failed" in msg, msg
    assert "rolled back to" in msg and "server resumed" in msg, msg
    assert requests.get(srv.url + "/is_paused", timeout=10).json()["is_paused"] is False
    assert srv.greedy() == served["original"], "after a failed reload the server must serve the old weights"
    assert requests.get(srv.url + "/weight_info", timeout=10).json()["weight_version"] == "A-before-broken"


@on_kinds("qwen3-moe:mxfp8")
def test_refit_live_weights_equal_converted_reload(served):
    """qconvert.refit quantizes B's BF16 weights on the trainer side, stages them in shared memory
    and reloads them: the server's outputs equal reloading the converted B checkpoint."""
    from safetensors.torch import load_file

    from qconvert.convert.pipeline import ConvertOptions
    from qconvert.convert.plan import PlanOptions
    from qconvert.trainer.refit import refit

    srv = served["srv"]
    os.environ["QCONVERT_SHM_ROOT"] = str(served["root"] / "shm")
    reload_vllm([srv.url], served["b"], weight_version="B-converted")
    want = srv.greedy()

    def stream():
        for f in sorted(served["b_src"].glob("*.safetensors")):
            yield from load_file(f).items()

    def refit_b(version: str):
        return refit(
            stream(),
            reference=served["b_src"],
            urls=[srv.url],
            stage_name="policy",
            options=ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), progress=False),
            weight_version=version,
        )

    res = refit_b("B-refit")
    assert res.reload[0].ok
    assert srv.greedy() == want
    # a second refit while the server serves the area (checked against the contract it records),
    # then a checkpoint directory of the same layout
    res = refit_b("B-refit-2")
    assert res.reload[0].ok and res.area.version == 2
    assert srv.greedy() == want
    reload_vllm([srv.url], served["a"], weight_version="A-after-refit")
    assert srv.greedy() == served["original"]
