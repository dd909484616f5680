"""What the vLLM and SGLang reload clients share: the result and error types, the fan-out over
data-parallel replicas (threads, Ctrl-C handling), the pause -> load -> rollback -> resume sequence
of one server (:func:`load_paused`), resuming a paused server whatever happened, and resolving the checkpoint the servers read (a directory, a fresh staging area, or ``shm:NAME``)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from qconvert.client.http import ServerError, ServerUnreachable, clean
from qconvert.errors import QConvertError
from qconvert.interrupts import second_interrupt_allowed

log = logging.getLogger("qconvert.reload")


class ReloadError(QConvertError):
    """A reload failed; the message carries the server's own text (cleaned) where there is one."""


class ReloadInterrupted(ReloadError):
    """Ctrl-C during a reload; the message says, per server, whether it was resumed."""


@dataclass
class ReloadResult:
    url: str
    ok: bool
    weight_version: str | None = None
    seconds: float = 0.0
    error: str | None = None
    rolled_back: bool = False
    verify: dict = field(default_factory=dict)
    #: per server worker, what it loaded from a staging area through qconvert's worker extension
    #: (files, bytes, tensors, seconds, tp_rank, ep_rank; see qconvert.engine.vllm_staged); empty otherwise
    load: list = field(default_factory=list)
    #: False where the server kept its prefix (radix) cache across the reload, so later requests
    #: sharing a prefix with earlier ones may reuse KV computed with the previous weights (SGLang
    #: ``--pause in_place``: docs/reload.md#sglang-endpoints); True where it was flushed
    cache_flushed: bool = True


def resume_after(client, failure: BaseException | None) -> None:
    """Resume a server after a pause request was sent (vLLM or SGLang: ``client.RESUME_ROUTE``),
    whatever happened; say in the error whether it was resumed, and if not, how to resume it. A
    resume failure never hides the original error."""
    try:
        client.resume()
    except QConvertError as err:
        line = f"the server may still be paused ({err}); resume it with: {client.resume_command()}"
        if failure is None:
            raise ReloadError(f"{client.url}: reload done but {line}") from err
        if isinstance(failure, QConvertError):
            failure.args = (f"{failure}; {line}",)
        else:
            log.error("%s: %s", client.url, line)
        return
    if isinstance(failure, QConvertError):
        failure.args = (f"{failure}; server resumed",)


def load_paused(
    client,
    path: str,
    *,
    pause: str,
    version: str,
    t0: float,
    load,
    previous: str | None,
    rollback,
    not_restored: str,
    after=None,
) -> ReloadResult:
    """Pause the server behind ``client``, run ``load()`` (which loads ``path``), then ``after()``
    if given, and resume the server on every path (:func:`resume_after`); return the filled result
    (``t0``: ``time.perf_counter()`` when this server's reload began).

    If ``load()`` fails with the server's refusal, ``rollback(previous)`` restores the weights
    served before (when there is a ``previous`` and the server answered at all) while the server is
    still paused; the ReloadError names the server's message and what state the server was left
    in (``not_restored``: what to say when there was nothing to roll back to or the rollback failed)."""
    import time

    res = ReloadResult(client.url, ok=False)
    failure: BaseException | None = None
    maybe_paused = False  # whether a pause request may have reached the server
    try:
        try:
            client.pause(pause)
        except QConvertError as err:
            maybe_paused = getattr(err, "sent", True)
            raise ReloadError(f"pausing failed: {err}") from err
        maybe_paused = True
        try:
            load()
        except (ServerError, ServerUnreachable) as err:
            server_msg = err.message if isinstance(err, ServerError) else str(err)
            # no answer at all (timeout, Ctrl-C, connection lost): the server may still be loading
            # the checkpoint or be down; a rollback now would queue behind it or fail the same way
            no_answer = isinstance(err, ServerUnreachable)
            rolled, rollback_error = False, ""
            if previous and not no_answer:
                try:
                    rollback(previous)
                    rolled = True
                except QConvertError as err2:
                    rollback_error = f"rollback to {clean(previous, 200)} failed too: {err2}; "
            res.rolled_back = rolled
            tail = (
                f"rolled back to {clean(previous, 200)}"
                if rolled
                else "interrupted; the server may still finish loading it"
                if client.http.cancelled
                else "no answer: the server may still be loading it, or be down; check it, then reload a good "
                "checkpoint"
                if no_answer
                else not_restored
            )
            raise ReloadError(f"{client.url}: reload of {path} failed: {server_msg} ({rollback_error}{tail})") from err
        if after is not None:
            after()
    except BaseException as e:  # noqa: BLE001 - resume below on every path, then re-raise
        failure = e
        raise
    finally:
        if maybe_paused:
            resume_after(client, failure)
    res.ok = True
    res.weight_version = version
    res.seconds = time.perf_counter() - t0
    return res


def drop_staged(name: str) -> None:
    """Remove the staging area a reload created; one warning line if that fails."""
    from qconvert.client import staging

    try:
        staging.drop_area(name)
    except (OSError, QConvertError) as e:
        log.warning(
            "could not remove the staging area %s/%s (%s); remove it with: qconvert stage drop %s",
            staging.staging_root(),
            name,
            clean(e, 200),
            name,
        )


def refuse_layout_mismatch(url: str, path: str, previous: str | None, want: dict | None) -> None:
    """Before pausing: raise ReloadError when the server's current weights (``previous``, what it
    reports or qconvert recorded) are readable here and their layout contract differs from
    ``want`` (``path``'s, read from it when None), naming the tensor when both are checkpoint
    directories. Both engines load a checkpoint of another layout without a word and answer
    garbage or NaN. Nothing is compared when ``previous`` is not readable here."""
    from qconvert.client.staging import checkpoint_contract, contract_mismatch, served_contract
    from qconvert.formats import staging as fmt

    have = served_contract(previous)
    if have is None:
        return
    diff = contract_mismatch(want if want is not None else checkpoint_contract(path), have)
    if not diff:
        return
    if want is None and (Path(previous) / "config.json").is_file() and not fmt.is_area(Path(previous)):
        from qconvert.client.compat import ReloadIncompatible, check_reload_compatible

        try:
            check_reload_compatible(previous, path)
        except ReloadIncompatible as e:
            raise ReloadError(f"{url}: {e}") from None
    raise ReloadError(
        f"{url}: {path} does not match the layout of the served checkpoint {clean(previous, 200)} "
        f"({', '.join(diff)} differ); convert it with the same options or restart the server on it"
    )


def resolve_source(ckpt, via, stage_name, stage_checkpoint, open_area) -> tuple[str, dict | None, str | None]:
    """(path the servers read, layout contract of a staging area or None, name of the staging area
    this call created or None)."""
    from qconvert.formats import staging as fmt

    s = str(ckpt)
    if s.startswith("shm:"):
        fmt.check_name(s[4:])
        root = fmt.staging_root() / s[4:]
        if os.path.islink(root):
            raise fmt.StagingError(
                f"{root}: is a symbolic link, not a staging area; qconvert does not follow links "
                "in the staging root (move the link away)"
            )
        if os.path.lexists(root / fmt.AREA_JSON):  # version 2 (a refit's): the committed view, checked
            return str(root), fmt.read_area(root).contract, None
        area = open_area(s[4:])
        return str(area.path), area.contract, None
    p = Path(s)
    if fmt.is_area(p):  # a staging area named by its path (a refit's): read where it is, never restaged
        return str(p.resolve()), fmt.read_area(p).contract, None
    if not p.is_dir() or not (p / "config.json").is_file():
        raise QConvertError(
            f"{p}: not a checkpoint directory with config.json; pass the converted checkpoint "
            "(the server must see the same path)"
        )
    if via == "disk":
        return str(p.resolve()), None, None
    if via != "shm":
        raise QConvertError(f"--via {via!r}: use disk or shm")
    name = stage_name or default_stage_name(p)
    stage_checkpoint(p, name)
    try:
        area = open_area(name)
    except BaseException:
        drop_staged(name)
        raise
    return str(area.path), area.contract, name


def default_stage_name(p: Path) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "-", p.resolve().name).lstrip(".-") or "ckpt"
    return f"{base[:100]}-{hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:8]}"


def wait_all(done: list[threading.Event]) -> None:
    # Event waits, not Thread.join: a join interrupted by Ctrl-C can mark a running thread as
    # stopped (CPython before 3.13); short waits let Ctrl-C reach the main thread between them
    for ev in done:
        while not ev.wait(0.1):
            pass


def fan_out(clients, fn) -> tuple[list, list[str]]:
    """Run ``fn(client)`` for every client on its own thread; return (results, error lines) in the
    clients' order. Ctrl-C cancels every request in flight; each thread then resumes its server (a
    resume is not cancelled) and the call raises :class:`ReloadInterrupted` saying, per server, what
    state it was left in. A second Ctrl-C stops waiting for the resumes."""
    n = len(clients)
    results: list = [None] * n
    errors: list = [None] * n
    fatal: list = [None] * n

    done = [threading.Event() for _ in clients]

    def run(i: int) -> None:
        try:
            results[i] = fn(clients[i])
        except QConvertError as e:
            errors[i] = str(e)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            fatal[i] = e
        finally:
            done[i].set()

    # daemon threads: the interpreter never waits at exit for a server that does not answer
    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"qconvert-reload-{i}") for i in range(n)]
    for t in threads:
        t.start()
    try:
        wait_all(done)
    except KeyboardInterrupt:
        for c in clients:
            c.http.cancel()
        try:
            with second_interrupt_allowed():
                wait_all(done)
        except KeyboardInterrupt:
            pending = [c for c, ev in zip(clients, done) if not ev.is_set()]
            raise ReloadInterrupted(
                "interrupted twice; not waiting for " + ", ".join(c.url for c in pending) + " to resume: each may "
                "still be paused; resume with: " + " ; ".join(c.resume_command() for c in pending)
            ) from None
        lines = [
            e if e else f"{c.url}: {'reloaded' if r is not None else f'interrupted ({clean(x, 200)})'}"
            for c, r, e, x in zip(clients, results, errors, fatal)
        ]
        raise ReloadInterrupted("interrupted (Ctrl-C): " + "; ".join(lines)) from None
    for e in fatal:
        if e is not None:
            raise e
    return [r for r in results if r is not None], [e for e in errors if e]
