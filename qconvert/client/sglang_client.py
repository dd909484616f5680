"""Hot reload into running SGLang servers (0.5.23 HTTP API).

Sequence per server (replicas in parallel): ``POST /pause_generation {"mode"}`` →
``POST /update_weights_from_disk {"model_path", "flush_cache", "abort_all_requests",
"weight_version"}`` → ``POST /continue_generation {}``. Field names and defaults are those of
SGLang's own request structs (``sglang/srt/managers/io_struct.py``: ``PauseGenerationReqInput``,
``UpdateWeightFromDiskReqInput``/``...ReqOutput``, ``ContinueGenerationReqInput``); routes from
``sglang/srt/entrypoints/http_server.py``. Not run against a live SGLang (it needs a GPU); the
tests check every request body against those structs (parsed from the sglang package source when
it is available, else the fields in docs/reload.md#sglang-endpoints).

* ``{"success": false, "message": ...}`` (HTTP 400) is an error carrying the server's message.
* ``flush_cache``: true with ``--pause abort`` or ``retract`` (no running requests, the flush
  succeeds); false with ``in_place``, because SGLang refuses to flush with requests in the
  running batch and then reports ``success=false`` although the weights changed.
* Rollback: SGLang's own update path re-loads on failure, but ``model_path`` was already moved
  (docs/reload.md#sglang-disk-update), so after a failure the client reloads the checkpoint the server reported in
  ``/model_info`` before the attempt, then continues generation.
* ``--via shm`` works as for vLLM: SGLang's ``DefaultModelLoader`` reads the staging area's
  safetensors shards like any checkpoint directory.
* A refit's staging area (version 2, ``shm:NAME``, its path, or ``Refitter(..., engine="sglang")``)
  is sent as its committed slot's directory while this client holds that slot's shared lock, from
  before ``update_weights_from_disk`` until SGLang answers it, so no refit overwrites the files SGLang
  reads (docs/reload.md#sglang-disk-update).
* Pre-shuffled (kernel-layout) checkpoints are not supported (:class:`Unreadable`): ``update_weights_from_disk`` runs
  ``model.load_weights`` and then ``process_weights_after_loading`` on checkpoint-format tensors;
  the only path that skips that processing (``update_weights_from_tensor`` with
  ``load_format="direct"``) still re-runs it at ``end_weight_update``, which would shuffle
  already shuffled tensors again (docs/reload.md#sglang-quantized-reload). The client refuses such checkpoints.
* ``--verify``: ``/weights_checker {"action": "checksum"}`` must succeed on every server, the
  per-engine checksums must agree across replicas, and a fixed greedy prompt (``/generate``) must
  give the same text on every replica.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import uuid
from pathlib import Path

from qconvert.client.http import ServerClient, ServerError, clean, reply_field
from qconvert.client.reload import (
    ReloadError,
    ReloadResult,
    drop_staged,
    fan_out,
    load_paused,
    refuse_layout_mismatch,
    resolve_source,
)
from qconvert.client.staging import read_layout
from qconvert.errors import QConvertError
from qconvert.interrupts import ctrl_c_safe

log = logging.getLogger("qconvert.reload")

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
PAUSE_MODES = ("abort", "retract", "in_place")
VERIFY_PROMPT = "The capital of France is"
VERIFY_TOKENS = 12


class Unreadable(enum.Enum):
    """Why SGLang cannot hot-reload a checkpoint or staging area, decided from values
    (:func:`unreadable`); the one-line refusal is rendered from it (:func:`refusal`)."""

    PRESHUFFLED = "preshuffled"  # kernel-layout experts: docs/reload.md#sglang-quantized-reload
    PER_RANK = "per-rank"  # per-rank files: every SGLang rank reads all files (docs/reload.md#sglang-disk-update)


def unreadable(*, layout: bool, per_rank: bool) -> Unreadable | None:
    """None when SGLang can read it; else why not (per-rank files are pre-shuffled too: named first)."""
    if per_rank:
        return Unreadable.PER_RANK
    if layout:
        return Unreadable.PRESHUFFLED
    return None


def refusal(what: str, why: Unreadable) -> str:
    """The one line naming ``what`` (a checkpoint, area or refit), why SGLang cannot load it, and the fix."""
    if why is Unreadable.PER_RANK:
        return (
            f"{what}: holds per-rank (pre-shuffled) files, which SGLang cannot load (every SGLang rank "
            "reads all files and re-runs weight processing); convert or refit without a layout for SGLang"
        )
    return (
        f"{what}: a pre-shuffled (kernel-layout) checkpoint cannot be hot-reloaded into SGLang (its update "
        "paths re-run weight processing); reload the plain checkpoint, or refit without a layout for SGLang"
    )


def area_unreadable(path: str | os.PathLike) -> Unreadable | None:
    """:func:`unreadable` for a checkpoint directory or staging area (either version): its manifest's
    kernel layout, and for an area whether any file is per-rank (``area.json`` / the v1 manifest are
    written once, so the answer holds for every version of the area)."""
    from qconvert.formats import staging as fmt

    p = Path(path)
    per_rank = fmt.is_area(p) and any(f.rank is not None for f in fmt.read_area(p).files)
    return unreadable(layout=read_layout(p) is not None, per_rank=per_rank)


class SglangClient(ServerClient):
    """The weight-update routes of one SGLang server."""

    def model_info(self) -> dict:
        status, body = self.http.request("GET", "/model_info", ok_status=(404,), expect=dict)
        route = "/model_info"
        if status == 404:  # older servers
            route = "/get_model_info"
            body = self.http.get(route, expect=dict)
        if not isinstance(body, dict):
            raise ServerError(self.url + route, status, "reply is not a JSON object")
        mp = body.get("model_path")
        if mp is not None and not isinstance(mp, str):
            reply_field(self.http, route, body, "model_path", types=str)
        return body

    def version(self) -> str | None:
        try:
            body = self.http.get("/version")
        except ServerError:
            return None
        return clean(body.get("version"), 40) if isinstance(body, dict) else None

    def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise QConvertError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self.http.post("/pause_generation", {"mode": mode}, timeout=self.reload_timeout)

    RESUME_ROUTE = "/continue_generation"

    def resume(self) -> None:
        self.http.post(self.RESUME_ROUTE, {}, retries=max(self.http.retries, 5), cancellable=False)

    def resume_command(self) -> str:
        return (
            super()
            .resume_command()
            .replace("curl -X POST", "curl -X POST -H 'Content-Type: application/json' -d '{}'", 1)
        )

    def update_weights_from_disk(
        self, path: str, *, flush_cache: bool = True, weight_version: str | None = None, load_format: str | None = None
    ) -> dict:
        body: dict = {"model_path": str(path), "flush_cache": flush_cache, "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        status, out = self.http.request(
            "POST", "/update_weights_from_disk", json_body=body, timeout=self.reload_timeout, ok_status=(400,)
        )
        return self._success(out, status, "/update_weights_from_disk")

    def _success(self, out, status: int, route: str) -> dict:
        if not isinstance(out, dict):
            raise ServerError(self.url + route, status, f"reply is not a JSON object: {self.http.clean(out, 120)}")
        if not out.get("success"):
            msg = out.get("message")
            raise ServerError(self.url + route, status, self.http.clean(msg) if msg else "success=false")
        return out

    def weights_checksum(self) -> dict:
        status, out = self.http.request(
            "POST", "/weights_checker", json_body={"action": "checksum"}, timeout=self.reload_timeout, ok_status=(400,)
        )
        return self._success(out, status, "/weights_checker")

    def generate(self, prompt: str, max_tokens: int = VERIFY_TOKENS) -> str:
        out = self.http.post(
            "/generate",
            {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}},
            timeout=self.reload_timeout,
        )
        if isinstance(out, list) and out:
            out = out[0]
        return reply_field(self.http, "/generate", out, "text", types=str)


def _reload_one(
    client: SglangClient, path: str, pause: str, version: str, flush: bool, contract: dict | None, check_contract: bool
) -> ReloadResult:
    import time

    t0 = time.perf_counter()
    info = client.model_info()
    previous = info.get("model_path")
    if check_contract:
        refuse_layout_mismatch(client.url, path, previous, contract)

    def load() -> None:
        from qconvert.formats import staging as fmt

        if os.path.lexists(Path(path) / fmt.AREA_JSON):  # a version 2 area (a refit's): its committed slot,
            with fmt.committed(Path(path)) as view:  # which no refit overwrites until SGLang has answered
                out = client.update_weights_from_disk(str(view.directory), flush_cache=flush, weight_version=version)
        else:
            out = client.update_weights_from_disk(path, flush_cache=flush, weight_version=version)
        log.info("%s: %s", client.url, out.get("message"))

    def restore(prev: str) -> None:
        client.update_weights_from_disk(prev, flush_cache=flush, weight_version=info.get("weight_version"))

    return load_paused(
        client,
        path,
        pause=pause,
        version=version,
        t0=t0,
        load=load,
        previous=previous if previous != path else None,
        rollback=restore,
        not_restored="previous weights not restored; reload a good checkpoint or restart the server",
    )


@ctrl_c_safe
def reload_sglang(
    urls: list[str],
    ckpt: str | os.PathLike,
    *,
    via: str = "disk",
    pause: str = "retract",
    weight_version: str | None = None,
    api_key: str | None = None,
    verify: bool = False,
    stage_name: str | None = None,
    timeout: float = 30.0,
    reload_timeout: float = 3600.0,
    retries: int = 3,
    keep_staged: bool = False,
    check_contract: bool = True,
    client_factory=None,
) -> list[ReloadResult]:
    """Reload ``ckpt`` into every SGLang server in ``urls`` (data-parallel replicas, concurrently).
    ``via``, ``keep_staged``, ``timeout``, ``reload_timeout`` and ``check_contract`` as for
    :func:`reload_vllm`: a checkpoint whose layout contract differs from what the server reports
    serving (a directory or refit area readable here) is refused before pausing."""
    from qconvert.client.staging import open_area, stage_checkpoint

    if pause not in PAUSE_MODES:
        raise QConvertError(f"--pause {pause!r} is not valid for SGLang; use one of {', '.join(PAUSE_MODES)}")
    make = client_factory or (
        lambda u: SglangClient(u, api_key=api_key, timeout=timeout, reload_timeout=reload_timeout, retries=retries)
    )
    clients = [make(u) for u in urls]  # an invalid URL is refused before anything is staged
    # a staging area's data digests are recomputed only with --verify (as for vLLM)
    path, contract, staged = resolve_source(
        ckpt, via, stage_name, stage_checkpoint, lambda name: open_area(name, verify_data=verify)
    )
    try:
        why = area_unreadable(path)
        if why is not None:
            raise QConvertError(refusal(str(ckpt), why))
        version = weight_version or f"qconvert-{uuid.uuid4().hex[:12]}"
        flush = pause != "in_place"
        results, errors = fan_out(
            clients, lambda c: _reload_one(c, path, pause, version, flush, contract, check_contract)
        )
        if errors:
            raise ReloadError("; ".join(errors))
        for r in results:
            r.cache_flushed = flush
        if verify:
            sums, texts = {}, {}
            for c in clients:
                out = c.weights_checksum()
                sums[c.url] = json.dumps(out.get("per_engine_checksum"), sort_keys=True)
                texts[c.url] = c.generate(VERIFY_PROMPT)
            if len(set(sums.values())) > 1:
                raise ReloadError(f"--verify: replicas report different weight checksums: {clean(sums)}")
            if len(set(texts.values())) > 1:
                raise ReloadError(f"--verify: replicas disagree on the greedy prompt {VERIFY_PROMPT!r}: {clean(texts)}")
            for r in results:
                r.verify = {"greedy_text": next(iter(texts.values()), None)}
    finally:
        if staged and not keep_staged:
            drop_staged(staged)
    return results
