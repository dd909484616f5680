"""Model card rendering and Hub upload.

The real Hub is not reachable from the test machines, so uploads go to a tiny Hub-compatible HTTP
endpoint started here (``HF_ENDPOINT``) that implements just the routes huggingface_hub's
upload path calls: repo and branch creation, README YAML validation, preupload, the LFS batch API
with basic PUT transfers, and the ndjson commit endpoint. Xet is disabled so the client uses
that path."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from huggingface_hub import ModelCard
from test_inspect import demo_conversions, nvfp4_checkpoint, tiny_source
from test_verify import patch_bytes, tensor_location

from qconvert.errors import QConvertError
from qconvert.hub import CARD_MARKER, push, render_card, source_card

SOURCE_CARD = """---
license: other
license_name: qwen-research
license_link: https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/LICENSE
library_name: transformers
pipeline_tag: text-generation
tags:
- qwen3
---

# Qwen3 tiny

Some *important* text: benchmarks, citation and usage notes.

```bibtex
@misc{qwen3, title={Qwen3}}
```
"""


class LocalHub:
    """In-memory Hub: repos[repo_id] = {"private", "branches": {rev: {path: bytes}}}, lfs[oid] = bytes."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.puts = 0
        self.commits: list[dict] = []
        #: route name ("create", "preupload", "commit") -> (HTTP status, JSON body) to answer instead
        self.fail: dict[str, tuple[int, dict]] = {}
        hub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_POST(self):
                p = self.path.split("?")[0]
                body = self._body()
                route = (
                    "create"
                    if p == "/api/repos/create"
                    else "preupload"
                    if "/preupload/" in p
                    else "commit"
                    if "/commit/" in p
                    else None
                )
                if route in hub.fail:
                    return self._send(*hub.fail[route])
                if p == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                if p == "/api/repos/create":
                    d = json.loads(body)
                    rid = f"{d['organization']}/{d['name']}" if d.get("organization") else d["name"]
                    if rid in hub.repos:
                        return self._send(
                            409, {"error": "You already created this model repo", "url": f"{hub.url}/{rid}"}
                        )
                    hub.repos[rid] = {
                        "private": d.get("visibility") == "private" or bool(d.get("private")),
                        "branches": {"main": {}},
                    }
                    return self._send(200, {"url": f"{hub.url}/{rid}"})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", p)
                if m:
                    repo = hub.repos[m.group(1)]
                    if m.group(2) in repo["branches"]:
                        return self._send(409, {"error": "branch exists"})
                    repo["branches"][m.group(2)] = dict(repo["branches"]["main"])
                    return self._send(200, {})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", p)
                if m:
                    if m.group(1) not in hub.repos:
                        return self._send(404, {"error": "Repository not found"})
                    files = json.loads(body)["files"]
                    return self._send(
                        200,
                        {
                            "files": [
                                {
                                    "path": f["path"],
                                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                                    "shouldIgnore": False,
                                    "oid": None,
                                }
                                for f in files
                            ]
                        },
                    )
                m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", p)
                if m:
                    objs = []
                    for o in json.loads(body)["objects"]:
                        d = {"oid": o["oid"], "size": o["size"]}
                        if o["oid"] not in hub.lfs:
                            d["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                        objs.append(d)
                    return self._send(200, {"transfer": "basic", "objects": objs})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", p)
                if m:
                    repo = hub.repos[m.group(1)]
                    files = repo["branches"].setdefault(m.group(2), {})
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    for ln in lines:
                        v = ln["value"]
                        if ln["key"] == "file":
                            files[v["path"]] = base64.b64decode(v["content"])
                        elif ln["key"] == "lfsFile":
                            files[v["path"]] = hub.lfs[v["oid"]]
                        elif ln["key"] == "deletedFile":
                            files.pop(v["path"], None)
                    oid = hashlib.sha1(body).hexdigest()
                    hub.commits.append(
                        {
                            "repo": m.group(1),
                            "revision": m.group(2),
                            "oid": oid,
                            "summary": lines[0]["value"].get("summary"),
                        }
                    )
                    return self._send(
                        200,
                        {"commitUrl": f"{hub.url}/{m.group(1)}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None},
                    )
                return self._send(404, {"error": f"no route POST {p}"})

            def do_PUT(self):
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
                data = self._body()
                if not m or hashlib.sha256(data).hexdigest() != m.group(1):
                    return self._send(400, {"error": "bad upload"})
                hub.lfs[m.group(1)] = data
                hub.puts += 1
                return self._send(200, {})

            def do_GET(self):
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", self.path.split("?")[0])
                if m and m.group(1) in hub.repos:
                    rev = m.group(2) or "main"
                    sha = next((c["oid"] for c in reversed(hub.commits) if c["repo"] == m.group(1)), "0" * 40)
                    return self._send(
                        200,
                        {
                            "id": m.group(1),
                            "sha": sha,
                            "private": hub.repos[m.group(1)]["private"],
                            "siblings": [{"rfilename": f} for f in hub.repos[m.group(1)]["branches"].get(rev, {})],
                        },
                    )
                return self._send(404, {"error": "Repository not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as c

    h = LocalHub()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    yield h
    h.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("hdemo")
    out = demo_conversions(root)
    return out


def _front(card: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", card, re.S)
    assert m, card[:200]
    return yaml.safe_load(m.group(1))


def _code_blocks(card: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", card, re.S)


# ---- card ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["auto", "sglang", "modelopt"])
def test_card_mxfp8_yaml_and_commands(demo, dialect):
    card = render_card(demo[dialect], "org/tiny-mxfp8", base_model="Qwen/Qwen3-30B-A3B", source_text=SOURCE_CARD)
    meta = _front(card)
    assert meta["base_model"] == "Qwen/Qwen3-30B-A3B"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "other" and meta["license_name"] == "qwen-research"
    assert meta["license_link"] == "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/LICENSE"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["tags"][:2] == ["qconvert", "mxfp8"] and "qwen3" in meta["tags"]
    # huggingface_hub parses the same metadata
    data = ModelCard(card).data
    assert data.base_model == "Qwen/Qwen3-30B-A3B" and data.license == "other"
    cmds = _code_blocks(card)
    sgl = [c for c in cmds if "sglang.launch_server" in c]
    vll = [c for c in cmds if c.startswith("vllm serve")]
    assert sgl == [
        "python -m sglang.launch_server --model-path org/tiny-mxfp8 --fp8-gemm-backend flashinfer_trtllm "
        "--moe-runner-backend flashinfer_trtllm_routed"
    ]
    assert "SM100+ only" in card and "marlin" not in " ".join(cmds)
    if dialect == "sglang":
        assert vll == [] and "Not loadable in vLLM" in card and "weight_scale_inv" in card
    else:
        assert vll == ["vllm serve org/tiny-mxfp8"]
        assert "SM80-SM90 via Marlin" in card
    assert "| recipe | `rceil` |" in card and "RCEIL: E = ceil(log2(amax/448))" in card
    assert "`model.layers.{3}.self_attn.q_proj`" in card and "BF16 layer (last layers)" in card
    assert "| MoE router | `model.layers.{0-3}.mlp.gate` |" in card
    assert re.search(r"\| 8\.\d MB \| 5\.\d MB \| 1\.5\dx smaller \|", card)
    assert "qconvert 0.1.0" in card and "vLLM 0.33.0" in card and "SGLang 0.5.23" in card
    # nothing of the source card is lost
    body = SOURCE_CARD.split("---\n", 2)[2]
    assert body.rstrip("\n") in card
    for line in SOURCE_CARD.split("---\n")[1].splitlines():
        assert line in card


def test_card_revision_flag_and_rerender_keeps_source(demo, tmp_path):
    card = render_card(demo["auto"], "org/x", base_model="a/b", revision="v2", source_text=SOURCE_CARD)
    assert "vllm serve org/x --revision v2" in _code_blocks(card)
    again = render_card(demo["auto"], "org/x", base_model="a/b", revision="v2", source_text=card)
    assert again == card  # rendering from our own card recovers the source card, no nesting
    assert again.count(CARD_MARKER) == 1
    meta, raw, body = source_card(card)
    assert meta["license_name"] == "qwen-research" and body.strip() == SOURCE_CARD.split("---\n", 2)[2].strip()


@pytest.mark.parametrize("dialect", ["modelopt", "compressed-tensors"])
def test_card_nvfp4_commands(tmp_path, dialect):
    src = tiny_source(tmp_path / "src")
    ck = nvfp4_checkpoint(tmp_path / dialect, src, dialect)
    card = render_card(ck, "org/tiny-nvfp4", base_model="org/tiny", source_text="# no metadata\n")
    meta = _front(card)
    assert meta["tags"][:2] == ["qconvert", "nvfp4"] and dialect in meta["tags"]
    assert "license" not in meta
    cmds = _code_blocks(card)
    assert "vllm serve org/tiny-nvfp4" in cmds
    assert "SM80-SM90 via Marlin W4A16" in card
    marlin = "python -m sglang.launch_server --model-path org/tiny-nvfp4 --fp4-gemm-backend marlin"
    assert (marlin in cmds) is (dialect == "modelopt")
    assert "python -m sglang.launch_server --model-path org/tiny-nvfp4" in cmds
    assert "# no metadata" in card


# ---- upload --------------------------------------------------------------------------------------


def test_push_to_local_endpoint(demo, tmp_path, hub):
    dst = shutil.copytree(demo["auto"], tmp_path / "up")
    (dst / "README.md").write_text(SOURCE_CARD)
    url = push(dst, "org/tiny-mxfp8", private=True, src=str(demo["bf16"]), base_model="Qwen/Qwen3-30B-A3B")
    assert url.endswith("org/tiny-mxfp8")
    repo = hub.repos["org/tiny-mxfp8"]
    assert repo["private"] is True
    files = repo["branches"]["main"]
    local = {p.name for p in dst.iterdir() if p.is_file()}
    # push never writes into DST: the card and the verify report go to the Hub only
    assert (dst / "README.md").read_text() == SOURCE_CARD and not (dst / "qconvert-verify.json").exists()
    assert set(files) == local | {"qconvert-verify.json"}
    assert "qconvert.json" in files
    for name in local - {"README.md"}:
        assert hashlib.sha256(files[name]).hexdigest() == hashlib.sha256((dst / name).read_bytes()).hexdigest(), name
    readme = files["README.md"].decode()
    meta = _front(readme)
    assert meta["base_model"] == "Qwen/Qwen3-30B-A3B" and meta["base_model_relation"] == "quantized"
    assert "`qconvert verify` passed: 84 quantized tensors" in readme
    assert re.search(r"\| `model\.layers\.\*\.mlp\.experts\.\*\.down_proj` \| mxfp8 \| 24 \| 0\.02\d\d \|", readme)
    assert "Some *important* text" in readme
    assert hub.puts == 3  # the three shards went through LFS
    vr = json.loads(files["qconvert-verify.json"])
    assert vr["ok"] is True and len(vr["tensors"]) == 84

    # re-running resumes: nothing is uploaded again
    push(dst, "org/tiny-mxfp8", src=str(demo["bf16"]), base_model="Qwen/Qwen3-30B-A3B")
    assert hub.puts == 3

    # a branch
    assert repo["branches"]["main"]["README.md"].decode() == readme  # the same card again
    push(dst, "org/tiny-mxfp8", revision="v1", src=str(demo["bf16"]), base_model="Qwen/Qwen3-30B-A3B")
    assert set(repo["branches"]["v1"]) == local | {"qconvert-verify.json"}
    assert "vllm serve org/tiny-mxfp8 --revision v1" in repo["branches"]["v1"]["README.md"].decode()


def test_push_refuses_checkpoint_failing_verify(demo, tmp_path, hub):
    dst = shutil.copytree(demo["auto"], tmp_path / "bad")
    name = "model.layers.0.self_attn.v_proj.weight_scale"
    f, off, _ = tensor_location(dst, name)
    patch_bytes(f, off, bytes([f.read_bytes()[off] + 2]))
    with pytest.raises(QConvertError, match=r"verify failed .*" + re.escape(name) + ".*--allow-unverified"):
        push(dst, "org/bad", src=str(demo["bf16"]))
    assert hub.repos == {} and hub.commits == []
    push(dst, "org/bad", src=str(demo["bf16"]), allow_unverified=True)
    readme = hub.repos["org/bad"]["branches"]["main"]["README.md"].decode()
    assert "`qconvert verify` FAILED" in readme and "pushed with --allow-unverified" in readme


def test_push_needs_source_or_force(demo, tmp_path, hub):
    dst = shutil.copytree(demo["auto"], tmp_path / "nosrc")
    man = json.loads((dst / "qconvert.json").read_text())
    man["source"]["id"] = str(tmp_path / "gone")
    (dst / "qconvert.json").write_text(json.dumps(man))
    with pytest.raises(QConvertError, match="source is unknown; pass --src"):
        push(dst, "org/nosrc")
    with pytest.raises(QConvertError, match="not a Hub repo id"):
        push(dst, "no-slash", src=str(demo["bf16"]))


def test_cli_convert_with_push_to_hub(demo, tmp_path, hub):
    """`qconvert mxfp8 SRC DST --push-to-hub` in a subprocess that reaches the endpoint via HF_ENDPOINT."""
    src = shutil.copytree(demo["bf16"], tmp_path / "src")
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_test_token")
    dst = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "qconvert.cli",
            "mxfp8",
            str(src),
            str(dst),
            "--dialect",
            "modelopt",
            "--last-n-bf16",
            "1",
            "--push-to-hub",
            "org/cli",
            "--private",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASSED" in p.stdout and "pushed" in p.stdout
    files = hub.repos["org/cli"]["branches"]["main"]
    assert hub.repos["org/cli"]["private"] is True
    assert {"config.json", "hf_quant_config.json", "qconvert.json", "README.md", "model.safetensors.index.json"} <= set(
        files
    )
    readme = files["README.md"].decode()
    assert "`modelopt`: ModelOpt" in readme and "qconvert-demo" in _front(readme)["tags"]


# ---- Hub errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("offline", [False, True], ids=["online", "HF_HUB_OFFLINE=1"])
def test_hub_source_error_is_one_line_and_names_offline_only_when_set(tmp_path, offline):
    """A Hub id that is not cached, with the Hub unreachable: one line saying why; HF_HUB_OFFLINE is
    named only when it is set (it used to be advised in both cases)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{port}")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    p = subprocess.run(
        [sys.executable, "-m", "qconvert.cli", "mxfp8", "org/not-cached", str(tmp_path / "out"), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and p.stderr.splitlines()[-1] == errors[0], p.stderr
    if offline:
        assert re.fullmatch(
            r"error: org/not-cached: not a local directory, and not downloaded: HF_HUB_OFFLINE is "
            r"set, so the Hub is not contacted; unset it \(or use a local directory\)",
            errors[0],
        ), errors[0]
    else:
        assert re.fullmatch(
            rf"error: org/not-cached: not a local directory, and not downloaded: cannot reach the Hub "
            rf"at http://127\.0\.0\.1:{port} \(ConnectError: .*\); check the network and HF_ENDPOINT",
            errors[0],
        ), errors[0]
    assert not (tmp_path / "out").exists()


def test_card_written_by_v1_still_yields_its_source_card(demo):
    """Cards qconvert wrote before the lengths were recorded (v1) are still recognised as ours."""
    v1 = (
        "---\nlibrary_name: transformers\ntags:\n- qconvert\n---\n<!-- qconvert-card v1 -->\n\n# x\n\n"
        "## Original model card\n\n<!-- qconvert-source-card:begin -->\nOriginal metadata:\n\n```yaml\n"
        "license: mit\ntags:\n- a\n```\n<!-- qconvert-source-card:body -->\n# Source\n\ntext\n"
        "<!-- qconvert-source-card:end -->\n"
    )
    assert source_card(v1) == ({"license": "mit", "tags": ["a"]}, "license: mit\ntags:\n- a", "# Source\n\ntext\n")
    card = render_card(demo["auto"], "org/x", base_model="a/b", source_text=v1)
    assert card.count("qconvert-card v") == 1 and "# Source\n\ntext\n" in card
    assert render_card(demo["auto"], "org/x", base_model="a/b", source_text=card) == card


def test_card_base_model_local_and_hub_sources(demo, tmp_path):
    """base_model: --base-model, else the manifest's source when it is a Hub id. A local source has
    none; its card's own base_model (the model *it* came from) is not taken, and the log says so."""
    logs: list[str] = []
    src_card = "---\nbase_model: Org/Parent-Base\nlicense: mit\n---\n# A fine-tune\n"
    card = render_card(demo["auto"], "org/x", source_text=src_card, log=logs.append)
    meta = ModelCard(card).data.to_dict()
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert any("no base_model" in m and "--base-model ORG/NAME" in m for m in logs), logs
    assert "base_model: Org/Parent-Base" in card  # still readable under "Original model card"
    hub_src = shutil.copytree(demo["auto"], tmp_path / "hubsrc")
    man = json.loads((hub_src / "qconvert.json").read_text())
    man["source"]["id"] = "Qwen/Qwen3-30B-A3B"
    (hub_src / "qconvert.json").write_text(json.dumps(man))
    meta = ModelCard(render_card(hub_src, "org/x", source_text=src_card)).data.to_dict()
    assert meta["base_model"] == "Qwen/Qwen3-30B-A3B" and meta["base_model_relation"] == "quantized"
    meta = ModelCard(render_card(hub_src, "org/x", source_text=src_card, base_model="Org/Other")).data.to_dict()
    assert meta["base_model"] == "Org/Other"
    with pytest.raises(QConvertError, match="not a Hub model id for --base-model"):
        render_card(hub_src, "org/x", base_model="Org/Other) [x](javascript:1)")


def test_push_unverified_does_not_send_a_stale_verify_report(demo, tmp_path, hub):
    dst = shutil.copytree(demo["auto"], tmp_path / "stale")
    (dst / "qconvert-verify.json").write_text('{"ok": true, "stale": true}\n')  # left by an older push
    man = json.loads((dst / "qconvert.json").read_text())
    man["source"]["id"] = str(tmp_path / "gone")
    (dst / "qconvert.json").write_text(json.dumps(man))
    push(dst, "org/stale", allow_unverified=True)
    files = hub.repos["org/stale"]["branches"]["main"]
    assert "qconvert-verify.json" not in files
    assert "Not verified against the source" in files["README.md"].decode()
    assert (dst / "qconvert-verify.json").read_text() == '{"ok": true, "stale": true}\n'


@pytest.mark.parametrize(
    "flag,note",
    [("--allow-unverified", False), ("--force", True), (None, None)],
    ids=["allow-unverified", "deprecated-force", "neither"],
)
def test_cli_push_allow_unverified_and_deprecated_force(flag, note, demo, tmp_path, hub):
    """`push --allow-unverified` pushes a checkpoint that cannot be verified; `--force`, its old
    spelling, does the same after a one-line deprecation note; neither refuses, naming the new flag."""
    from click.testing import CliRunner

    from qconvert.cli import main

    dst = shutil.copytree(demo["auto"], tmp_path / "unv")
    man = json.loads((dst / "qconvert.json").read_text())
    man["source"]["id"] = str(tmp_path / "gone")
    (dst / "qconvert.json").write_text(json.dumps(man))
    r = CliRunner().invoke(main, ["push", str(dst), "org/unv", "--no-progress", *([flag] if flag else [])])
    notes = [line for line in r.stderr.splitlines() if "deprecated" in line]
    if flag is None:
        assert r.exit_code == 1 and "--allow-unverified" in r.output and "org/unv" not in hub.repos
        assert notes == []
        return
    assert r.exit_code == 0, r.output
    assert notes == (
        ["note: `qconvert push --force` is deprecated and goes in the next release; use --allow-unverified"]
        if note
        else []
    )
    assert "Not verified against the source" in hub.repos["org/unv"]["branches"]["main"]["README.md"].decode()
