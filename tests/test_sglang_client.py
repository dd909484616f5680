"""SGLang reload client against a fake SGLang server that checks every request body against
SGLang's own request structs.

SGLang cannot run on a CPU-only machine and its ``io_struct`` module does not import without
its GPU dependencies, so the struct definitions are read from the sglang package *source*
(``sglang/srt/managers/io_struct.py``, parsed with ``ast``: field names, which have defaults, and
annotations) when the package, or an unpacked wheel named by ``QCONVERT_SGLANG_SRC``, is
present. Otherwise the fields in docs/reload.md#sglang-endpoints (SGLang 0.5.23) are used;
``test_struct_source`` reports which.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qconvert.client.sglang_client import SglangClient, reload_sglang
from qconvert.client.vllm_client import ReloadError
from qconvert.errors import QConvertError
from tests.test_reload_clients import FakeServer

STRUCTS = (
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput",
    "CheckWeightsReqInput",
)

# docs/reload.md#sglang-endpoints (SGLang 0.5.23): name -> (required?, python types accepted)
DOCUMENTED = {
    "PauseGenerationReqInput": {"mode": (False, (str,))},
    "ContinueGenerationReqInput": {"torch_empty_cache": (False, (bool,))},
    "UpdateWeightFromDiskReqInput": {
        "model_path": (True, (str,)),
        "load_format": (False, (str, type(None))),
        "abort_all_requests": (False, (bool,)),
        "weight_version": (False, (str, type(None))),
        "flush_cache": (False, (bool,)),
        "torch_empty_cache": (False, (bool,)),
        "recapture_cuda_graph": (False, (bool,)),
        "is_async": (False, (bool,)),
        "keep_pause": (False, (bool,)),
        "token_step": (False, (int,)),
        "manifest": (False, (dict, type(None))),
    },
    "UpdateWeightFromDiskReqOutput": {
        "success": (True, (bool,)),
        "message": (True, (str,)),
        "num_paused_requests": (False, (int,)),
    },
    "CheckWeightsReqInput": {
        "action": (False, (str,)),
        "allow_quant_error": (False, (bool,)),
        "skip_tensor_list": (False, (list, type(None))),
        "selector": (False, (str,)),
    },
}
PAUSE_LITERALS = ("abort", "retract", "in_place")


def _io_struct_source() -> Path | None:
    root = os.environ.get("QCONVERT_SGLANG_SRC")
    if root and Path(root, "sglang/srt/managers/io_struct.py").is_file():
        return Path(root, "sglang/srt/managers/io_struct.py")
    spec = importlib.util.find_spec("sglang")
    if spec and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0], "srt/managers/io_struct.py")
        if p.is_file():
            return p
    return None


def _types_of(ann: str) -> tuple:
    base = {"str": str, "bool": bool, "int": int, "float": float}
    out = [t for k, t in base.items() if k in ann]
    if "Optional" in ann or "None" in ann:
        out.append(type(None))
    if "Dict" in ann or "dict" in ann:
        out.append(dict)
    if "List" in ann or "list" in ann:
        out.append(list)
    if "Literal" in ann:
        out.append(str)
    return tuple(out) or (object,)


def load_structs() -> tuple[str, dict]:
    src = _io_struct_source()
    if src is None:
        return "documented fields (docs/reload.md#sglang-endpoints)", DOCUMENTED
    tree = ast.parse(src.read_text())
    out: dict = {}
    literals: dict = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in STRUCTS:
            fields = {}
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    ann = ast.unparse(st.annotation)
                    fields[st.target.id] = (st.value is None, _types_of(ann))
                    if "Literal" in ann:
                        literals[(node.name, st.target.id)] = ann
            out[node.name] = fields
    missing = set(STRUCTS) - set(out)
    assert not missing, f"{src}: structs {missing} not found; the client needs updating for this SGLang"
    if ("PauseGenerationReqInput", "mode") in literals:
        for m in PAUSE_LITERALS:
            assert repr(m) in literals[("PauseGenerationReqInput", "mode")].replace('"', "'")
    return f"sglang source {src}", out


SOURCE, FIELDS = load_structs()


def check_body(struct: str, body: dict) -> None:
    fields = FIELDS[struct]
    assert isinstance(body, dict), f"{struct}: body {body!r} is not an object"
    unknown = set(body) - set(fields)
    assert not unknown, f"{struct}: fields {unknown} do not exist in SGLang ({SOURCE})"
    for name, (required, types) in fields.items():
        if required:
            assert name in body, f"{struct}: required field {name!r} missing"
        if name in body:
            assert isinstance(body[name], types), f"{struct}.{name}: {body[name]!r} is not {types}"


def test_struct_source():
    print(f"SGLang request structs from: {SOURCE}")
    assert "model_path" in FIELDS["UpdateWeightFromDiskReqInput"]
    assert FIELDS["UpdateWeightFromDiskReqInput"]["model_path"][0] is True


def sglang_routes(state: dict, update_fn=None) -> dict:
    state.setdefault("paused", False)
    state.setdefault("model_path", "/models/launch")
    state.setdefault("weight_version", "default")

    def pause(b, q, h):
        check_body("PauseGenerationReqInput", b)
        state["paused"] = True
        state["mode"] = b.get("mode", "abort")
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def cont(b, q, h):
        check_body("ContinueGenerationReqInput", b)
        state["paused"] = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def update(b, q, h):
        check_body("UpdateWeightFromDiskReqInput", b)
        state.setdefault("updates", []).append(b)
        if update_fn and (r := update_fn(b)):
            out = r
        else:
            state["model_path"] = b["model_path"]
            state["weight_version"] = b.get("weight_version") or state["weight_version"]
            out = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        check_body("UpdateWeightFromDiskReqOutput", out)
        return (200 if out["success"] else 400), out

    def checker(b, q, h):
        check_body("CheckWeightsReqInput", b)
        return 200, {"success": True, "message": "", "per_engine_checksum": {"target": "abc"}}

    return {
        ("GET", "/model_info"): lambda b, q, h: (
            200,
            {"model_path": state["model_path"], "weight_version": state["weight_version"]},
        ),
        ("POST", "/pause_generation"): pause,
        ("POST", "/continue_generation"): cont,
        ("POST", "/update_weights_from_disk"): update,
        ("POST", "/weights_checker"): checker,
        ("POST", "/generate"): lambda b, q, h: (200, {"text": " Paris", "meta_info": {}}),
    }


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    save_file({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}, d / "model.safetensors")
    return d


@pytest.mark.parametrize("mode,flush", [("abort", True), ("retract", True), ("in_place", False)])
def test_sequence_fields_and_api_key(ckpt, mode, flush):
    state: dict = {}
    srv = FakeServer(sglang_routes(state))
    try:
        res = reload_sglang([srv.url], ckpt, pause=mode, weight_version="step-3", api_key="admin-k")
        assert res[0].ok and state["paused"] is False and state["mode"] == mode
        assert [p for m, p, *_ in srv.calls if m == "POST"] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        upd = state["updates"][0]
        assert upd["model_path"] == str(ckpt.resolve()) and upd["weight_version"] == "step-3"
        assert upd["flush_cache"] is flush and upd["abort_all_requests"] is False
        assert res[0].cache_flushed is flush  # the CLI prints a note when it is False
        assert all(h.get("Authorization") == "Bearer admin-k" for *_, h in srv.calls)
    finally:
        srv.close()


def test_success_false_message_rollback_continue(ckpt):
    msg = "Failed to update weights: Error while deserializing header: MetadataIncompleteBuffer. Rolling back."
    state: dict = {}

    def fail(b):
        if b["model_path"] == str(ckpt.resolve()):
            return {"success": False, "message": msg, "num_paused_requests": 0}

    srv = FakeServer(sglang_routes(state, fail))
    try:
        with pytest.raises(ReloadError) as ei:
            reload_sglang([srv.url], ckpt, retries=0)
        assert msg in str(ei.value) and "rolled back to /models/launch" in str(ei.value)
        assert [u["model_path"] for u in state["updates"]] == [str(ckpt.resolve()), "/models/launch"]
        assert state["paused"] is False and state["model_path"] == "/models/launch"
    finally:
        srv.close()


def test_cache_not_flushed_is_an_error_and_generation_continues(ckpt):
    msg = "Weights were updated, but the cache was not flushed because there are running requests."
    state: dict = {}
    srv = FakeServer(sglang_routes(state, lambda b: {"success": False, "message": msg, "num_paused_requests": 2}))
    try:
        with pytest.raises(ReloadError, match="cache was not flushed"):
            reload_sglang([srv.url], ckpt, retries=0)
        assert state["paused"] is False
    finally:
        srv.close()


def test_unreachable_server_retried_then_reported(ckpt):
    sleeps: list[float] = []
    with pytest.raises(ReloadError, match="connection failed"):
        reload_sglang(
            ["http://127.0.0.1:9"],
            ckpt,
            client_factory=lambda u: SglangClient(u, retries=2, backoff=0.1, sleep=sleeps.append),
        )
    assert sleeps == [0.1, 0.2]


def test_verify_and_replicas(ckpt):
    s1, s2 = {}, {}
    a, b = FakeServer(sglang_routes(s1)), FakeServer(sglang_routes(s2))
    try:
        res = reload_sglang([a.url, b.url], ckpt, verify=True, weight_version="v2")
        assert [r.verify["greedy_text"] for r in res] == [" Paris", " Paris"]
        assert s1["weight_version"] == s2["weight_version"] == "v2"
        gen = next(body for m, p, body, *_ in a.calls if p == "/generate")
        assert gen["sampling_params"]["temperature"] == 0.0
    finally:
        a.close()
        b.close()


def test_preshuffled_refused(ckpt):
    (ckpt / "qconvert.json").write_text(json.dumps({"layout": {"layout": "flashinfer-trtllm", "layout_version": 1}}))
    with pytest.raises(QConvertError, match="pre-shuffled"):
        reload_sglang(["http://127.0.0.1:9"], ckpt)


def test_invalid_pause_mode(ckpt):
    with pytest.raises(QConvertError, match="abort, retract, in_place"):
        reload_sglang(["http://127.0.0.1:9"], ckpt, pause="wait")


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_cli_says_when_the_prefix_cache_was_kept(ckpt, mode):
    """``--pause in_place`` updates without flushing SGLang's radix cache (it refuses to flush with
    requests running): the command says so, naming the server and the mode that flushes it."""
    from click.testing import CliRunner

    from qconvert.cli import main

    state: dict = {}
    srv = FakeServer(sglang_routes(state))
    try:
        r = CliRunner().invoke(main, ["reload", "sglang", srv.url, str(ckpt), "--pause", mode])
        assert r.exit_code == 0, r.output
        note = f"note: {srv.url}: its prefix cache was kept (--pause in_place)"
        assert (note in r.output) is (mode == "in_place"), r.output
        assert state["updates"][0]["flush_cache"] is (mode != "in_place")
    finally:
        srv.close()


def test_layout_mismatch_refused_before_pause(ckpt, tmp_path):
    """What the server reports serving is checked against what is reloaded, before pausing: a
    checkpoint directory, and after a refit the slot directory of a refit area (by the contract
    the area records). SGLang itself loads another layout without a word."""
    from qconvert.client.staging import checkpoint_contract
    from qconvert.formats import staging as fs

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({"model.norm.weight": torch.ones(16, dtype=torch.bfloat16)}, other / "model.safetensors")
    area = tmp_path / "area"
    area.mkdir()
    spec = fs.AreaSpec(checkpoint_contract(ckpt), fs.DIGEST_XXH3, 1, 1, (), ())
    fs.write_json_atomic(area / fs.AREA_JSON, spec.to_json())
    fs.slot_dir(area, 1).mkdir()
    # two directories: the tensor is named; an area records a digest of its tensors' names, dtypes
    # and shapes, which is what differs then
    for served, words in ((ckpt, r"model\.norm\.weight"), (fs.slot_dir(area, 1), r"\(tensors_sha256 differ\)")):
        state: dict = {"model_path": str(served)}
        srv = FakeServer(sglang_routes(state))
        try:
            with pytest.raises(ReloadError, match=words):
                reload_sglang([srv.url], other)
            assert "/pause_generation" not in srv.paths() and "updates" not in state
            # the same layout is reloaded; without the check, the other one too
            reload_sglang([srv.url], ckpt)
            reload_sglang([srv.url], other, check_contract=False)
            assert [u["model_path"] for u in state["updates"]] == [str(ckpt.resolve()), str(other.resolve())]
        finally:
            srv.close()
