"""`qconvert reload` against misbehaving servers: one row per hostile behaviour.

Each row names what a fake server (127.0.0.1, threads in this process) does on one route, the
command, the expected exit code and a substring of the one-line error, and whether the client must
call the resume route. Every row also checks what holds for all of them: no traceback, the error is
one line of bounded length with no control characters, no secret (API key, URL password) is
printed, and the command ends within a bound derived from ``--timeout`` (a correctness bound with
3 s of slack for a loaded machine, not a performance threshold). New reload behaviours get a row.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from qconvert.cli import main

KEY = "sk-SECRET-KEY-123"
PASSWORD = "pa55-SECRET-word"
TIMEOUT = 1.5
SLACK = 3.0


# ---------------------------------------------------------------------------- behaviours


def js(status: int, obj, headers=()):
    return raw(status, json.dumps(obj).encode(), [("Content-Type", "application/json"), *headers])


def raw(status: int, body: bytes, headers=()):
    def send(h, srv):
        h.send_response(status)
        for k, v in headers:
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return send


def hang(h, srv):
    """Read the request, never answer (until the test server closes)."""
    srv.stop.wait(120)


def trickle_body(h, srv):
    """Headers at once, then one byte of a never-ending body every 0.1 s."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    while not srv.stop.wait(0.1):
        h.wfile.write(b" ")
        h.wfile.flush()


def trickle_headers(h, srv):
    """The status line and headers one byte every 0.1 s, never finished."""
    for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10000:
        if srv.stop.wait(0.1):
            return
        h.wfile.write(bytes([b]))
        h.wfile.flush()


def drop(h, srv):
    """Close the connection without an answer."""
    h.close_connection = True


def redirect_self(h, srv):
    raw(302, b"", [("Location", srv.url + urlparse(h.path).path)])(h, srv)


def echo_secrets(h, srv):
    """A 401 whose body echoes the request's headers and the URL with credentials."""
    js(
        401,
        {
            "error": {
                "message": f"unauthorized: got {dict(h.headers.items())} for "
                f"http://alice:{PASSWORD}@{h.headers.get('Host')}{h.path}"
            }
        },
    )(h, srv)


FORGED = "\n\x1b[2K\rvllm http://x: reloaded, weight version v9 (0.1 s)\n" * 3
HUGE = ("boom " + FORGED + "x" * (5 << 20)).encode()


class Hostile:
    """A vLLM 0.32 dev-mode (or SGLang) server that answers correctly except where ``overrides``
    say otherwise; records (method, path) of every request it read."""

    def __init__(self, engine: str, overrides: dict):
        self.stop = threading.Event()
        self.calls: list[tuple[str, str]] = []
        routes = dict(vllm_routes() if engine == "vllm" else sglang_routes())
        routes.update(overrides)
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _do(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                self.body = self.rfile.read(n) if n else b""
                path = urlparse(self.path).path
                srv.calls.append((method, path))
                fn = routes.get((method, path)) or js(404, {"detail": "Not Found"})
                try:
                    fn(self, srv)
                except OSError:
                    pass

            def do_GET(self):
                self._do("GET")

            def do_POST(self):
                self._do("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def called(self, path: str) -> bool:
        return any(p == path for _, p in self.calls)

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def vllm_routes() -> dict:
    return {
        ("GET", "/version"): js(200, {"version": "0.32.0"}),
        ("GET", "/is_paused"): js(200, {"is_paused": False}),
        ("GET", "/v1/models"): js(200, {"data": [{"id": "m", "root": "/nowhere"}]}),
        ("GET", "/weight_info"): js(200, {"weight_version": "default"}),
        ("GET", "/server_info"): js(200, {"vllm_config": "device_config=cuda"}),
        ("POST", "/pause"): js(200, {"status": "paused"}),
        ("POST", "/resume"): js(200, {"status": "resumed"}),
        ("POST", "/collective_rpc"): js(200, {"results": [None]}),
        ("POST", "/update_weight_version"): js(200, {"success": True}),
    }


def sglang_routes() -> dict:
    ok = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    return {
        ("GET", "/model_info"): js(200, {"model_path": "/models/launch", "weight_version": "default"}),
        ("POST", "/pause_generation"): js(200, {}),
        ("POST", "/continue_generation"): js(200, {}),
        ("POST", "/update_weights_from_disk"): js(200, ok),
    }


def rpc_by_method(methods: dict, default=js(200, {"results": [None]})):
    """/collective_rpc behaviour chosen by the request's ``method``."""

    def send(h, srv):
        method = json.loads(h.body or b"{}").get("method")
        (methods.get(method) or default)(h, srv)

    return send


MISSING = js(
    500,
    {
        "error": {
            "message": "Call to collective_rpc method failed: Worker failed with error "
            "'Method 'qconvert_ping' is not implemented.', please check the stack "
            "trace above for the root cause"
        }
    },
)


# ---------------------------------------------------------------------------- the table

# id, engine, {route: behaviour}, extra args, exit code, substring of the error line (None: success),
# resume called (True / False), bound in units of TIMEOUT (+ SLACK), options
ROWS = [
    # --- hangs and trickles: bounded by --timeout, resumed once a pause was sent
    ("vllm-pause-hangs", "vllm", {("POST", "/pause"): hang}, [], 1, "pausing failed", True, 2, {}),
    (
        "vllm-pause-trickles-body",
        "vllm",
        {("POST", "/pause"): trickle_body},
        [],
        1,
        "no complete answer within",
        True,
        2,
        {},
    ),
    (
        "vllm-pause-trickles-headers",
        "vllm",
        {("POST", "/pause"): trickle_headers},
        [],
        1,
        "no complete answer within",
        True,
        2,
        {},
    ),
    (
        "vllm-reload-hangs",
        "vllm",
        {("POST", "/collective_rpc"): hang},
        [],
        1,
        "the server may still be loading it",
        True,
        2,
        {},
    ),
    (
        "vllm-reload-trickles",
        "vllm",
        {("POST", "/collective_rpc"): trickle_body},
        [],
        1,
        "no complete answer within",
        True,
        2,
        {},
    ),
    (
        "vllm-version-trickles-headers",
        "vllm",
        {("GET", "/version"): trickle_headers},
        [],
        1,
        "/version: no complete answer within",
        False,
        1,
        {},
    ),
    ("vllm-resume-hangs", "vllm", {("POST", "/resume"): hang}, [], 1, "the server may still be paused", True, 2, {}),
    (
        "vllm-set-version-hangs",
        "vllm",
        {("POST", "/update_weight_version"): hang},
        [],
        1,
        "/update_weight_version: no complete answer",
        True,
        2,
        {},
    ),
    # --- failures after the pause request was sent
    (
        "vllm-pause-500",
        "vllm",
        {("POST", "/pause"): js(500, {"error": "Failed to pause generation: engine dead"})},
        [],
        1,
        "Failed to pause generation: engine dead; server resumed",
        True,
        1,
        {},
    ),
    (
        "vllm-pause-drops",
        "vllm",
        {("POST", "/pause"): drop},
        ["--retries", "0"],
        1,
        "connection broken before a complete answer",
        True,
        1,
        {},
    ),
    (
        "vllm-pause-and-resume-500",
        "vllm",
        {("POST", "/pause"): js(500, {"error": "pause: no"}), ("POST", "/resume"): js(500, {"error": "resume: no"})},
        [],
        1,
        "may still be paused (",
        True,
        1,
        {"resume_cmd": True},
    ),
    (
        "vllm-reload-500-huge-forged-body",
        "vllm",
        {("POST", "/collective_rpc"): raw(500, HUGE)},
        [],
        1,
        "boom \\n\\x1b[2K\\rvllm http://x: reloaded",
        True,
        1,
        {},
    ),
    (
        "vllm-error-echoes-secrets",
        "vllm",
        {("POST", "/collective_rpc"): echo_secrets},
        [],
        1,
        "unauthorized: got",
        True,
        1,
        {"userinfo": True},
    ),
    (
        "vllm-unauthorized-before-pause",
        "vllm",
        {("GET", "/is_paused"): js(401, {"detail": "Unauthorized"})},
        [],
        1,
        "/is_paused: HTTP 401: Unauthorized",
        False,
        1,
        {},
    ),
    # --- malformed replies: one line naming the server, the route and what was wrong
    (
        "vllm-models-not-json",
        "vllm",
        {("GET", "/v1/models"): raw(200, b"<html>hello</html>")},
        [],
        1,
        "/v1/models: HTTP 200: reply is not JSON",
        False,
        1,
        {},
    ),
    (
        "vllm-models-list",
        "vllm",
        {("GET", "/v1/models"): js(200, [{"id": "m"}])},
        [],
        1,
        "/v1/models: HTTP 200: reply is a JSON list, expected a JSON object",
        False,
        1,
        {},
    ),
    (
        "vllm-models-empty",
        "vllm",
        {("GET", "/v1/models"): js(200, {"object": "list", "data": []})},
        [],
        1,
        "/v1/models: HTTP 200: the server lists no model",
        False,
        1,
        {},
    ),
    (
        "vllm-models-no-id",
        "vllm",
        {("GET", "/v1/models"): js(200, {"data": [{"root": 3}]})},
        [],
        1,
        "/v1/models: HTTP 200: reply has no 'data[0].id'",
        False,
        1,
        {},
    ),
    ("vllm-is-paused-null", "vllm", {("GET", "/is_paused"): raw(200, b"")}, [], 0, None, True, 1, {}),
    (
        "vllm-weight-info-gzip-garbage",
        "vllm",
        {("GET", "/weight_info"): raw(200, b"\x1f\x8bnot gzip at all", [("Content-Encoding", "gzip")])},
        [],
        1,
        "/weight_info: HTTP 200: reply body is not valid gzip data",
        False,
        1,
        {},
    ),
    (
        "vllm-weight-info-real-gzip",
        "vllm",
        {
            ("GET", "/weight_info"): raw(
                200, gzip.compress(b'{"weight_version": "default"}'), [("Content-Encoding", "gzip")]
            )
        },
        [],
        0,
        None,
        True,
        1,
        {},
    ),
    (
        "vllm-version-redirect-loop",
        "vllm",
        {("GET", "/version"): redirect_self},
        [],
        1,
        "/version: HTTP 302: redirects to http://127.0.0.1:",
        False,
        1,
        {},
    ),
    ("vllm-invalid-port", "vllm", {}, [], 1, "invalid server URL", False, 1, {"url": "http://127.0.0.1:99999"}),
    ("vllm-port-not-a-number", "vllm", {}, [], 1, "invalid server URL", False, 1, {"url": "http://127.0.0.1:80a"}),
    ("vllm-ftp-url", "vllm", {}, [], 1, "unsupported URL scheme 'ftp'", False, 1, {"url": "ftp://127.0.0.1:21"}),
    # --- item 17: the extension flag only when the method is really missing
    (
        "vllm-moe-cpu-no-extension",
        "vllm",
        {
            ("GET", "/server_info"): js(200, {"vllm_config": "device_config=cpu"}),
            ("POST", "/collective_rpc"): rpc_by_method({"qconvert_ping": MISSING}),
        },
        [],
        1,
        "--worker-extension-cls qconvert.engine.vllm_worker.WorkerExtension",
        False,
        1,
        {"moe": True},
    ),
    (
        "vllm-moe-cpu-rpc-fails-otherwise",
        "vllm",
        {
            ("GET", "/server_info"): js(200, {"vllm_config": "device_config=cpu"}),
            ("POST", "/collective_rpc"): rpc_by_method(
                {
                    "qconvert_ping": js(
                        500, {"error": {"message": "Call to collective_rpc method failed: CUDA error: out of memory"}}
                    )
                }
            ),
        },
        [],
        1,
        "/collective_rpc: HTTP 500: Call to collective_rpc method failed: CUDA error: out of memory",
        False,
        1,
        {"moe": True, "no_flag": True},
    ),
    # --- SGLang
    ("sglang-pause-hangs", "sglang", {("POST", "/pause_generation"): hang}, [], 1, "pausing failed", True, 2, {}),
    (
        "sglang-update-hangs",
        "sglang",
        {("POST", "/update_weights_from_disk"): hang},
        [],
        1,
        "the server may still be loading it",
        True,
        2,
        {},
    ),
    (
        "sglang-update-trickles",
        "sglang",
        {("POST", "/update_weights_from_disk"): trickle_body},
        [],
        1,
        "no complete answer within",
        True,
        2,
        {},
    ),
    (
        "sglang-pause-500",
        "sglang",
        {("POST", "/pause_generation"): js(500, {"detail": "scheduler gone"})},
        [],
        1,
        "scheduler gone; server resumed",
        True,
        1,
        {},
    ),
    (
        "sglang-update-not-json",
        "sglang",
        {("POST", "/update_weights_from_disk"): raw(200, b"OK")},
        [],
        1,
        "/update_weights_from_disk: HTTP 200: reply is not a JSON object",
        True,
        1,
        {},
    ),
    (
        "sglang-model-info-list",
        "sglang",
        {("GET", "/model_info"): js(200, ["/models/launch"])},
        [],
        1,
        "/model_info: HTTP 200: reply is a JSON list, expected a JSON object",
        False,
        1,
        {},
    ),
    (
        "sglang-continue-500",
        "sglang",
        {("POST", "/continue_generation"): js(500, {"detail": "nope"})},
        [],
        1,
        "may still be paused",
        True,
        1,
        {"resume_cmd": True},
    ),
]


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
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))


def resume_route(engine: str) -> str:
    return "/resume" if engine == "vllm" else "/continue_generation"


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_hostile_server(row, ckpt):
    name, engine, overrides, extra, code, message, resumed, bound, opts = row
    if opts.get("moe"):
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, "num_experts": 4}))
    srv = Hostile(engine, overrides)
    try:
        url = opts.get("url", srv.url)
        if opts.get("userinfo"):
            url = f"http://alice:{PASSWORD}@127.0.0.1:{srv.port}"
        args = ["reload", engine, url, str(ckpt), "--timeout", str(TIMEOUT), "--api-key", KEY, *extra]
        t0 = time.monotonic()
        res = CliRunner().invoke(main, args, catch_exceptions=False)
        wall = time.monotonic() - t0
    finally:
        srv.close()
    out, err = res.stdout, res.stderr
    assert res.exit_code == code, (out, err)
    assert wall < bound * TIMEOUT + SLACK, f"{name}: took {wall:.1f} s with --timeout {TIMEOUT}"
    for text in (out, err):
        assert KEY not in text and PASSWORD not in text and "Traceback" not in text
        assert "\x1b" not in text and "\r" not in text
    if message is None:
        assert err == "" and "reloaded" in out
    else:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert message in lines[0], lines[0]
        assert len(lines[0]) < 2000
        assert "127.0.0.1" in lines[0]  # names the server
    assert srv.called(resume_route(engine)) is resumed, srv.calls
    if opts.get("resume_cmd"):
        assert "resume it with: curl -X POST " in err and "-H 'Authorization: Bearer $QCONVERT_API_KEY'" in err
        assert f"{srv.url}{resume_route(engine)}" in err
    if opts.get("no_flag"):
        assert "--worker-extension-cls" not in err


def test_ctrl_c_cancels_and_resumes(ckpt, tmp_path):
    """Ctrl-C while /pause hangs (and --timeout is long): the command stops within seconds, resumes
    the server, says so, and exits 130."""
    srv = Hostile("vllm", {("POST", "/pause"): hang})
    env = dict(
        os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), QCONVERT_STATE_DIR=str(tmp_path / "state")
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from qconvert.cli import main; main()",
            "reload",
            "vllm",
            srv.url,
            str(ckpt),
            "--timeout",
            "300",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not srv.called("/pause") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert srv.called("/pause"), proc.communicate(timeout=10)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        wall = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert wall < SLACK + 2, f"Ctrl-C took {wall:.1f} s to end the command"
    assert proc.returncode == 130, err
    assert srv.called("/resume")
    assert "Traceback" not in err and "server resumed" in err and len(err.splitlines()) == 1, err


def test_via_shm_removes_its_staging_area(ckpt, tmp_path):
    """--via shm: the area the reload created is gone afterwards, unless --keep-staged; an area given
    as shm:NAME is the user's and stays."""
    shm = tmp_path / "shm"
    for keep in (False, True):
        srv = Hostile("vllm", {})
        try:
            args = ["reload", "vllm", srv.url, str(ckpt), "--via", "shm", "--stage-name", f"a{int(keep)}"]
            res = CliRunner().invoke(main, args + (["--keep-staged"] if keep else []), catch_exceptions=False)
        finally:
            srv.close()
        assert res.exit_code == 0, res.stderr
        assert (shm / f"a{int(keep)}").exists() is keep
    srv = Hostile("vllm", {})
    try:
        res = CliRunner().invoke(main, ["reload", "vllm", srv.url, "shm:a1"], catch_exceptions=False)
    finally:
        srv.close()
    assert res.exit_code == 0, res.stderr
    assert (shm / "a1").exists()
    assert not [p for p in shm.iterdir() if p.name.startswith(".")]


def test_via_shm_removes_area_after_failed_reload(ckpt, tmp_path):
    srv = Hostile("vllm", {("POST", "/collective_rpc"): js(500, {"error": {"message": "no"}})})
    try:
        res = CliRunner().invoke(
            main, ["reload", "vllm", srv.url, str(ckpt), "--via", "shm", "--stage-name", "f"], catch_exceptions=False
        )
    finally:
        srv.close()
    assert res.exit_code == 1 and "no" in res.stderr
    assert not (tmp_path / "shm" / "f").exists()


def test_via_shm_cleanup_failure_is_one_line(ckpt, tmp_path, monkeypatch, caplog):
    """(The CLI configures no logging: Python's last-resort handler prints the warning to stderr.)"""
    from qconvert.client import staging

    def refuse(name, root=None):
        raise PermissionError(13, "Permission denied", str(tmp_path / "shm" / name))

    monkeypatch.setattr(staging, "drop_area", refuse)
    srv = Hostile("vllm", {})
    try:
        res = CliRunner().invoke(
            main, ["reload", "vllm", srv.url, str(ckpt), "--via", "shm", "--stage-name", "g"], catch_exceptions=False
        )
    finally:
        srv.close()
    assert res.exit_code == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"could not remove the staging area {tmp_path / 'shm'}/g ([Errno 13] Permission denied: "
        f"'{tmp_path / 'shm' / 'g'}'); remove it with: qconvert stage drop g"
    ]


def test_second_ctrl_c_stops_waiting_and_says_how_to_resume(ckpt, tmp_path):
    """Ctrl-C while /pause hangs, then again while /resume hangs too: the command ends at once, exit
    130, one line saying the server may still be paused and the command that resumes it."""
    srv = Hostile("vllm", {("POST", "/pause"): hang, ("POST", "/resume"): hang})
    env = dict(
        os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), QCONVERT_STATE_DIR=str(tmp_path / "state")
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from qconvert.cli import main; main()",
            "reload",
            "vllm",
            srv.url,
            str(ckpt),
            "--timeout",
            "300",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        for route in ("/pause", "/resume"):
            while not srv.called(route) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert srv.called(route), proc.communicate(timeout=10)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        wall = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert wall < SLACK, f"the second Ctrl-C took {wall:.1f} s to end the command"
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "may still be paused" in err and f"curl -X POST {srv.url}/resume" in err, err
