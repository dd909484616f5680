"""Reload clients against a fake HTTP server: retries with backoff, server messages verbatim,
API key sent, and a server is never left paused on any error path (vLLM and SGLang)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import torch
from safetensors.torch import save_file

from qconvert.client.http import HttpClient, ServerError, ServerUnreachable
from qconvert.client.vllm_client import ReloadError, VllmClient, reload_vllm
from qconvert.errors import QConvertError


class FakeServer:
    """routes: {(method, path): fn(body, query, headers) -> (status, json)}; records every request."""

    def __init__(self, routes: dict):
        self.routes = routes
        self.calls: list[tuple[str, str, dict, dict, dict]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _do(self, method):
                u = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                hdrs = dict(self.headers.items())
                fake.calls.append((method, u.path, body, q, hdrs))
                fn = fake.routes.get((method, u.path))
                status, out = fn(body, q, hdrs) if fn else (404, {"detail": "Not Found"})
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._do("GET")

            def do_POST(self):
                self._do("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [p for _, p, *_ in self.calls]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    save_file({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}, d / "model.safetensors")
    return d


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_STATE_DIR", str(tmp_path / "state"))


def vllm_routes(state: dict, reload_fn=None, resume_fn=None) -> dict:
    """A vLLM 0.32 dev-mode server, enough for the client."""
    state.setdefault("paused", False)
    state.setdefault("version", "default")

    def pause(body, q, h):
        state["paused"] = True
        state["pause_mode"] = q.get("mode")
        return 200, {"status": "paused"}

    def resume(body, q, h):
        if resume_fn:
            r = resume_fn()
            if r:
                return r
        state["paused"] = False
        return 200, {"status": "resumed"}

    def rpc(body, q, h):
        if body["method"] == "reload_weights":
            state.setdefault("reloads", []).append(body["kwargs"]["weights_path"])
            if reload_fn:
                r = reload_fn(body)
                if r:
                    return r
        return 200, {"results": [None]}

    def set_version(body, q, h):
        state["version"] = body["new_version"]
        return 200, {"success": True}

    return {
        ("GET", "/version"): lambda b, q, h: (200, {"version": "0.32.0"}),
        ("GET", "/is_paused"): lambda b, q, h: (200, {"is_paused": state["paused"]}),
        ("GET", "/v1/models"): lambda b, q, h: (200, {"data": [{"id": "m", "root": state.get("root", "/nowhere")}]}),
        ("GET", "/weight_info"): lambda b, q, h: (200, {"weight_version": state["version"]}),
        ("GET", "/server_info"): lambda b, q, h: (200, {"vllm_config": "device_config=cpu"}),
        ("POST", "/pause"): pause,
        ("POST", "/resume"): resume,
        ("POST", "/collective_rpc"): rpc,
        ("POST", "/update_weight_version"): set_version,
    }


# ---------------------------------------------------------------------------- http helper


def test_retries_with_backoff_then_reports():
    sleeps = []
    c = HttpClient("http://127.0.0.1:9", retries=3, backoff=0.25, sleep=sleeps.append, timeout=5)
    with pytest.raises(ServerUnreachable) as ei:
        c.get("/health")
    assert sleeps == [0.25, 0.5, 1.0]
    assert "after 4 attempt(s)" in str(ei.value) and "127.0.0.1:9/health" in str(ei.value)


def test_retries_503_then_succeeds():
    n = {"k": 0}

    def flaky(b, q, h):
        n["k"] += 1
        return (503, {"error": "busy"}) if n["k"] < 3 else (200, {"ok": 1})

    srv = FakeServer({("GET", "/x"): flaky})
    try:
        sleeps = []
        assert HttpClient(srv.url, sleep=sleeps.append, backoff=0.1).get("/x") == {"ok": 1}
        assert n["k"] == 3 and sleeps == [0.1, 0.2]
    finally:
        srv.close()


@pytest.mark.parametrize(
    "body,expect",
    [
        (
            {"error": {"message": "Call to collective_rpc method failed: boom", "code": 500}},
            "Call to collective_rpc method failed: boom",
        ),
        ({"error": "Failed to pause generation: x"}, "Failed to pause generation: x"),
        ({"detail": "Missing 'method' in request body"}, "Missing 'method' in request body"),
        (
            {"success": False, "message": "Weights were updated, but the cache was not flushed"},
            "Weights were updated, but the cache was not flushed",
        ),
    ],
)
def test_server_message_verbatim(body, expect):
    srv = FakeServer({("POST", "/x"): lambda b, q, h: (500, body)})
    try:
        with pytest.raises(ServerError) as ei:
            HttpClient(srv.url, retries=0).post("/x", {})
        assert ei.value.message == expect and ei.value.status == 500
        assert str(ei.value).endswith(expect)
    finally:
        srv.close()


# ---------------------------------------------------------------------------- vLLM client


def test_vllm_reload_sequence_and_api_key(ckpt):
    state: dict = {}
    srv = FakeServer(vllm_routes(state))
    try:
        res = reload_vllm([srv.url], ckpt, pause="wait", weight_version="v7", api_key="k-123")
        assert res[0].ok and state["version"] == "v7" and state["paused"] is False
        assert state["pause_mode"] == "wait"
        assert state["reloads"] == [str(ckpt.resolve())]
        posts = [p for m, p, *_ in srv.calls if m == "POST"]
        assert posts == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
        rpc = next(b for m, p, b, *_ in srv.calls if p == "/collective_rpc")
        assert rpc["method"] == "reload_weights"
        assert rpc["kwargs"] == {"weights_path": str(ckpt.resolve()), "is_checkpoint_format": True}
        assert all(h.get("Authorization") == "Bearer k-123" for *_, h in srv.calls)
    finally:
        srv.close()


def test_vllm_not_dev_mode_names_the_flag(ckpt):
    routes = vllm_routes({})
    del routes[("GET", "/is_paused")], routes[("POST", "/pause")]
    srv = FakeServer(routes)
    try:
        with pytest.raises(ReloadError, match="VLLM_SERVER_DEV_MODE=1"):
            reload_vllm([srv.url], ckpt)
        assert "/pause" not in srv.paths()
    finally:
        srv.close()


def test_vllm_without_weight_versions_refused_before_pause(ckpt):
    """vLLM 0.26.0's dev mode: /pause and /collective_rpc but no weight-version routes
    (docs/reload.md#vllm-weight-versions): one line naming the version, the server untouched."""
    state = {}
    routes = vllm_routes(state)
    del routes[("GET", "/weight_info")], routes[("POST", "/update_weight_version")]
    routes[("GET", "/version")] = lambda b, q, h: (200, {"version": "0.26.0"})
    srv = FakeServer(routes)
    try:
        with pytest.raises(ReloadError) as ei:
            reload_vllm([srv.url], ckpt)
        msg = str(ei.value)
        assert "\n" not in msg and "/weight_info" in msg and "vLLM 0.26.0" in msg, msg
        assert "upgrade the server's vLLM" in msg, msg
        assert "/pause" not in srv.paths() and "/collective_rpc" not in srv.paths(), srv.paths()
        assert state["paused"] is False
    finally:
        srv.close()


def test_vllm_failed_reload_message_rollback_and_resume(ckpt, tmp_path):
    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "config.json").write_text((ckpt / "config.json").read_text())
    (launch / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    state = {"root": str(launch)}
    msg = (
        "Call to collective_rpc method failed: Worker failed with error 'Error while deserializing header: "
        "MetadataIncompleteBuffer', please check the stack trace above for the root cause"
    )

    def fail_new(body):
        if body["kwargs"]["weights_path"] == str(ckpt.resolve()):
            return 500, {"error": {"message": msg, "type": "InternalServerError", "code": 500}}

    srv = FakeServer(vllm_routes(state, reload_fn=fail_new))
    try:
        with pytest.raises(ReloadError) as ei:
            reload_vllm([srv.url], ckpt, weight_version="new", retries=0)
        assert msg in str(ei.value) and f"rolled back to {launch}" in str(ei.value)
        assert state["reloads"] == [str(ckpt.resolve()), str(launch)]
        assert state["paused"] is False and state["version"] == "default"
    finally:
        srv.close()


@pytest.mark.parametrize("where", ["reload", "set_version", "rollback", "drop", "interrupt"])
def test_vllm_never_left_paused(ckpt, where):
    state: dict = {}

    def reload_fn(body):
        if where == "drop":
            raise RuntimeError("handler crash: connection dropped without an answer")
        if where in ("reload", "rollback"):
            return 500, {"error": {"message": "boom"}}

    routes = vllm_routes(state, reload_fn=reload_fn)
    if where == "set_version":
        routes[("POST", "/update_weight_version")] = lambda b, q, h: (400, {"detail": "bad version"})
    if where != "rollback":
        state["root"] = None  # no known previous weights: no rollback attempt
    srv = FakeServer(routes)

    class Interrupted(VllmClient):
        def reload_weights(self, path):
            raise KeyboardInterrupt

    factory = (lambda u: Interrupted(u, retries=0)) if where == "interrupt" else None
    try:
        with pytest.raises(KeyboardInterrupt if where == "interrupt" else QConvertError):
            reload_vllm([srv.url], ckpt, retries=0, check_contract=False, client_factory=factory)
        assert "/resume" in srv.paths() and state["paused"] is False
    finally:
        srv.close()


def test_vllm_resume_is_retried(ckpt):
    n = {"k": 0}

    def resume_fn():
        n["k"] += 1
        if n["k"] < 3:
            return 503, {"error": "engine busy"}

    state: dict = {}
    srv = FakeServer(vllm_routes(state, resume_fn=resume_fn))
    try:
        reload_vllm([srv.url], ckpt, client_factory=lambda u: VllmClient(u, sleep=lambda s: None))
        assert n["k"] == 3 and state["paused"] is False
    finally:
        srv.close()


def test_vllm_replicas_reloaded_and_failures_listed(ckpt):
    s1, s2 = {}, {}
    ok = FakeServer(vllm_routes(s1))
    bad = FakeServer(vllm_routes(s2, reload_fn=lambda b: (500, {"error": {"message": "replica 2 says no"}})))
    try:
        with pytest.raises(ReloadError) as ei:
            reload_vllm([ok.url, bad.url], ckpt, retries=0, weight_version="w")
        assert "replica 2 says no" in str(ei.value) and bad.url in str(ei.value) and ok.url not in str(ei.value)
        assert s1["version"] == "w" and not s1["paused"] and not s2["paused"]
    finally:
        ok.close()
        bad.close()


def test_vllm_moe_on_cpu_needs_extension(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_experts"] = 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    state: dict = {}

    def no_ext(body):
        return None

    routes = vllm_routes(state, reload_fn=no_ext)
    orig = routes[("POST", "/collective_rpc")]

    def rpc(body, q, h):
        if body["method"].startswith("qconvert_"):
            return 500, {
                "error": {
                    "message": "Call to collective_rpc method failed: Worker failed with error "
                    f"'Method {body['method']!r} is not implemented.', please check the "
                    "stack trace above for the root cause"
                }
            }
        return orig(body, q, h)

    routes[("POST", "/collective_rpc")] = rpc
    srv = FakeServer(routes)
    try:
        with pytest.raises(ReloadError, match="--worker-extension-cls qconvert.engine.vllm_worker.WorkerExtension"):
            reload_vllm([srv.url], ckpt, retries=0)
        assert "/pause" not in srv.paths()
    finally:
        srv.close()


def test_vllm_contract_mismatch_refused_before_pause(ckpt, tmp_path):
    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, launch / "model.safetensors")
    save_file({"w": torch.zeros(4, 8, dtype=torch.bfloat16)}, ckpt / "model.safetensors")
    srv = FakeServer(vllm_routes({"root": str(launch)}))
    try:
        with pytest.raises(ReloadError, match=r"tensor w is BF16\[4, 4\] served but BF16\[4, 8\] new"):
            reload_vllm([srv.url], ckpt)
        assert "/pause" not in srv.paths()
    finally:
        srv.close()


def test_unreachable_url_with_credentials_is_not_printed():
    c = HttpClient("http://alice:pw-SECRET@127.0.0.1:9", api_key=None, retries=1, sleep=lambda s: None, timeout=5)
    assert c.url == "http://127.0.0.1:9" and c.headers()["Authorization"].startswith("Basic ")
    with pytest.raises(ServerUnreachable) as ei:
        c.get("/health")
    assert "pw-SECRET" not in str(ei.value) and "alice" not in str(ei.value)
    assert str(ei.value).startswith("http://127.0.0.1:9/health: connection failed") and not ei.value.sent


def test_clean_bounds_and_escapes():
    from qconvert.client.http import clean

    s = clean("ok\n\x1b[31mFAKE\u202e line Bearer abc.def and http://u:p@h/x" + "y" * 1000, secrets=("abc",))
    assert s.startswith("ok\\n\\x1b[31mFAKE\\u202e line Bearer *** and http://***@h/x")
    assert s.endswith("more characters)") and len(s) < 340 and "\n" not in s


def test_extension_flag_names_an_importable_worker_extension():
    """The class the error messages and the README tell users to pass to vLLM
    (``--worker-extension-cls``) exists at that path, with the methods the client calls."""
    import importlib

    from qconvert.client.vllm_client import EXTENSION_FLAG
    from qconvert.engine import PRESHUFFLED_RPC, STAGED_RPC, WORKER_EXTENSION

    assert EXTENSION_FLAG == "--worker-extension-cls qconvert.engine.vllm_worker.WorkerExtension"
    module, _, name = WORKER_EXTENSION.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    for method in (
        "qconvert_ping",
        "qconvert_clear_failed_reload",
        "qconvert_repack_cpu_moe",
        PRESHUFFLED_RPC,
        STAGED_RPC,
    ):
        assert callable(getattr(cls, method)), method
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert EXTENSION_FLAG in " ".join(readme.split())


def test_vllm_served_refit_area_is_checked_against_the_next_reload(ckpt, tmp_path):
    """A server whose weights are a refit area (version 2) is checked against what is reloaded
    next, from the contract the area records: a checkpoint of another layout is refused before
    pausing, one of the same layout is reloaded."""
    from qconvert.client.staging import checkpoint_contract
    from qconvert.formats import staging as fs

    area = tmp_path / "area"
    area.mkdir()
    (area / "config.json").write_text((ckpt / "config.json").read_text())
    spec = fs.AreaSpec(checkpoint_contract(ckpt), fs.DIGEST_XXH3, 1, 1, (), ("config.json",))
    fs.write_json_atomic(area / fs.AREA_JSON, spec.to_json())
    assert checkpoint_contract(area) == checkpoint_contract(ckpt)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({"model.norm.weight": torch.ones(16, dtype=torch.bfloat16)}, other / "model.safetensors")
    state = {"root": str(area)}
    srv = FakeServer(vllm_routes(state))
    try:
        with pytest.raises(ReloadError, match=r"does not match the layout of the served checkpoint .*area"):
            reload_vllm([srv.url], other)
        assert "/pause" not in srv.paths() and "reloads" not in state
        reload_vllm([srv.url], ckpt)
        assert state["reloads"] == [str(ckpt.resolve())]
    finally:
        srv.close()
