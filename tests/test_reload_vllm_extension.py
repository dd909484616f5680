"""`qconvert reload vllm` names `--worker-extension-cls` only when a real vLLM server says
qconvert's worker method is missing (issue 24 item 17): a MoE model on a vLLM CPU server started
without the extension is refused before pausing, naming the flag, with the server's own words for
the missing method recognised."""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from test_reload_vllm import Server, _make_pair  # noqa: E402

from qconvert.client.vllm_client import EXTENSION_FLAG, ReloadError, VllmClient, reload_vllm  # noqa: E402


def test_moe_on_cpu_without_extension_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_STATE_DIR", str(tmp_path / "state"))
    a, b, _ = _make_pair(tmp_path, "qwen3-moe:bf16")
    srv = Server(a, tmp_path / "server.log", extension=False)
    try:
        client = VllmClient(srv.url)
        assert client.has_extension() is False  # the server's real "not implemented" answer
        with pytest.raises(ReloadError, match=EXTENSION_FLAG.replace(".", r"\.")):
            reload_vllm([srv.url], b, weight_version="B")
        assert requests.get(srv.url + "/is_paused", timeout=10).json()["is_paused"] is False
        assert requests.get(srv.url + "/weight_info", timeout=10).json()["weight_version"] == "default"
    finally:
        srv.stop()
