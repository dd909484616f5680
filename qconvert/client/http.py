"""JSON-over-HTTP layer shared by the vLLM and SGLang reload clients (Python standard library only).

* **Deadline**: a request (connect, send, every byte of the answer, and its retries) ends within its
  timeout. A watchdog shuts the socket down when the time is up, so a server that never answers,
  or trickles its answer a byte at a time, cannot hold the client longer.
* **Retries**: connection failures and 502/503/504 are retried with exponential backoff while the
  deadline leaves time for another attempt; then :class:`ServerUnreachable`. A timed-out request
  is not retried (its deadline is spent).
* **Cancel**: :meth:`HttpClient.cancel` (Ctrl-C) aborts the client's requests in flight at once;
  requests sent with ``cancellable=False`` (the resume after a pause) still run.
* **Failures**: any other non-2xx answer is a :class:`ServerError` carrying the server's own
  message (``error.message``, ``error``, ``detail`` or ``message`` of a JSON body, else the body);
  a reply that is not what the route returns (not JSON, a list for an object, bad gzip, too large)
  is a :class:`BadReply`; redirects are not followed (a 3xx is an error naming where it pointed).
* **Secrets**: an API key is sent as ``Authorization: Bearer KEY`` (vLLM ``--api-key``, SGLang
  ``--api-key`` / ``--admin-api-key``); ``user:password@`` in the URL as HTTP Basic auth. Neither is
  ever printed: :attr:`HttpClient.url` has no user part, and every text taken from a server passes
  through :func:`clean` (secrets replaced by ``***``, control characters and newlines escaped so a
  reply cannot forge a line, at most :data:`MAX_SHOWN` characters).
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import time
import unicodedata
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit

from qconvert.errors import QConvertError

RETRY_STATUS = (502, 503, 504)
#: characters of server text shown in a message
MAX_SHOWN = 300
#: largest reply body read (the weight checksums of a large model are a few MB)
MAX_BODY = 64 << 20
#: of an error reply, only this much is read
MAX_ERROR_BODY = 64 << 10

_URL_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
_AUTH_VALUE = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")


def clean(text: Any, limit: int = MAX_SHOWN, secrets: tuple[str, ...] = ()) -> str:
    """``text`` safe to print on one line: ``secrets`` and anything that looks like a credential
    (``scheme://user:pass@``, ``Bearer``/``Basic`` values) replaced by ``***``, control and format
    characters escaped (``\\n``, ``\\x1b``, ``\\u202e``), cut to ``limit`` characters."""
    s = _URL_USER.sub(r"\1***@", str(text))
    s = _AUTH_VALUE.sub(r"\1\2***", s)
    for sec in sorted(secrets, key=len, reverse=True):
        if sec:
            s = s.replace(sec, "***")
    out, n = [], 0
    for i, ch in enumerate(s):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            ch = ch.encode("unicode_escape").decode("ascii")
        if n + len(ch) > limit:
            out.append(f"... ({len(s) - i} more characters)")
            break
        out.append(ch)
        n += len(ch)
    return "".join(out)


def redact_url(url: str) -> str:
    """``url`` without its ``user:password@`` part."""
    return _URL_USER.sub(r"\1", str(url))


class ServerUnreachable(QConvertError):
    """No complete answer (after retries). ``sent``: whether the request may have reached the server."""

    def __init__(self, message: str, sent: bool = False):
        super().__init__(message)
        self.sent = sent


class RequestCancelled(ServerUnreachable):
    """The request was aborted by :meth:`HttpClient.cancel` (Ctrl-C)."""


class ServerError(QConvertError):
    """The server answered with a failure; ``message`` is its own text, cleaned by :func:`clean`."""

    sent = True

    def __init__(self, url: str, status: int | None, message: str):
        self.url = url
        self.status = status
        self.message = message
        where = f"{url}: HTTP {status}" if status is not None else url
        super().__init__(f"{where}: {message}")


class BadReply(ServerError):
    """The server answered, but not with what the route returns (not JSON, wrong shape, bad encoding)."""


def server_message(body: Any, text: str) -> str:
    """The server's own failure message from a response body (not yet cleaned)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for key in ("error", "detail", "message"):
            val = body.get(key)
            if isinstance(val, str) and val:
                return val
            if val is not None and key == "detail":
                return json.dumps(val)
    return text.strip() or "(empty response)"


def describe(body: Any, text: str = "") -> str:
    """What a reply is, for a message: 'a JSON list', 'not JSON (starts '...')'."""
    if body is _NOT_JSON:
        return f"not JSON (starts {clean(text, 60)!r})" if text.strip() else "empty"
    return {
        dict: "a JSON object",
        list: "a JSON list",
        str: "a JSON string",
        bool: "a JSON boolean",
        type(None): "JSON null",
    }.get(type(body), "a JSON number")


_NOT_JSON = object()


class _Watched:
    """Mixin for http.client connections: records whether the connection was made (so the request
    may have reached the server) and lets another thread abort it."""

    connected = False
    aborted = False

    def connect(self):
        super().connect()  # type: ignore[misc]
        self.connected = True

    def abort(self) -> None:
        self.aborted = True
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _HTTP(_Watched, http.client.HTTPConnection):
    pass


class _HTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _Attempt(Exception):
    """One failed attempt: ``kind`` is 'timeout', 'cancelled' or 'connection'."""

    def __init__(self, kind: str, what: str, sent: bool):
        super().__init__(what)
        self.kind, self.what, self.sent = kind, what, sent


class HttpClient:
    """JSON client for one server. ``base_url`` like ``http://host:port`` (``https``, a path prefix
    and ``user:password@`` are accepted). An invalid URL is a one-line :class:`QConvertError`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        sleep: Callable[[float], None] | None = None,
    ):
        raw = str(base_url).strip()
        if "://" not in raw:
            raw = "http://" + raw
        shown = redact_url(raw)
        try:
            parts = urlsplit(raw)
            port = parts.port
        except ValueError as e:
            raise QConvertError(
                f"{clean(shown)}: invalid server URL ({clean(e)}); give http://HOST:PORT with a port from 1 to 65535"
            ) from None
        if parts.scheme not in ("http", "https"):
            raise QConvertError(
                f"{clean(shown)}: unsupported URL scheme {clean(parts.scheme)!r}; "
                "give http://HOST:PORT or https://HOST:PORT"
            )
        if not parts.hostname:
            raise QConvertError(f"{clean(shown)}: no host in the server URL; give http://HOST:PORT")
        if port == 0:
            raise QConvertError(f"{clean(shown)}: invalid port 0 in the server URL; give a port from 1 to 65535")
        if parts.query or parts.fragment:
            raise QConvertError(f"{clean(shown)}: give the server's base URL, without '?' or '#'")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        netloc = host if parts.port is None else f"{host}:{self.port}"
        #: the URL as shown in every message (no credentials)
        self.base_url = f"{parts.scheme}://{netloc}{self.prefix}"
        self.api_key = api_key
        self.secrets: tuple[str, ...] = tuple(s for s in (api_key,) if s)
        self._basic: str | None = None
        if parts.username is not None or parts.password is not None:
            user, pw = unquote(parts.username or ""), unquote(parts.password or "")
            self._basic = base64.b64encode(f"{user}:{pw}".encode()).decode()
            self.secrets += tuple(s for s in (pw, parts.password, f"{user}:{pw}", self._basic) if s)
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._sleep = sleep
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._active: set = set()

    @property
    def url(self) -> str:
        return self.base_url

    def clean(self, text: Any, limit: int = MAX_SHOWN) -> str:
        return clean(text, limit, self.secrets)

    def headers(self) -> dict[str, str]:
        h = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "qconvert"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        elif self._basic:
            h["Authorization"] = f"Basic {self._basic}"
        return h

    def curl_auth(self) -> str:
        """The curl option a user needs to repeat a request by hand (placeholders, never the secret)."""
        if self.api_key:
            return " -H 'Authorization: Bearer $QCONVERT_API_KEY'"
        return " -u USER:PASSWORD" if self._basic else ""

    # ---------------------------------------------------------------------------------- cancel

    def cancel(self) -> None:
        """Abort every cancellable request in flight and refuse new ones (Ctrl-C)."""
        self._cancel.set()
        with self._lock:
            for conn in list(self._active):
                conn.abort()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # ---------------------------------------------------------------------------------- request

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        ok_status: tuple[int, ...] = (),
        expect: type | None = None,
        cancellable: bool = True,
    ) -> tuple[int, Any]:
        """Send one request; return ``(status, parsed JSON, or the text if the body is not JSON)``.

        The whole request, retries included, ends within ``timeout`` seconds (default: the client's).
        ``expect`` (``dict`` or ``list``): a 2xx reply must be JSON of that type, else :class:`BadReply`.
        Raises :class:`ServerError` for non-2xx statuses not in ``ok_status``.
        """
        limit = self.timeout if timeout is None else float(timeout)
        target = self.prefix + (path if path.startswith("/") else "/" + path)
        if params:
            target += "?" + urlencode(params)
        shown = self.base_url + path
        data = None if json_body is None else json.dumps(json_body).encode()
        headers = self.headers()
        if data is not None:
            headers["Content-Type"] = "application/json"
        attempts_max = 1 + (self.retries if retries is None else retries)
        t0 = time.monotonic()
        deadline = t0 + limit
        delay = self.backoff
        last, sent, attempts = "", False, 0
        while True:
            if cancellable and self.cancelled:
                raise RequestCancelled(f"{shown}: cancelled (Ctrl-C)", sent=sent)
            attempts += 1
            try:
                status, hdrs, raw = self._attempt(method, target, data, headers, deadline, cancellable)
            except _Attempt as a:
                sent = sent or a.sent
                if a.kind == "cancelled":
                    raise RequestCancelled(f"{shown}: cancelled (Ctrl-C)", sent=sent) from None
                last = a.what
                if a.kind == "timeout":
                    break
            else:
                sent = True
                body, text = self._decode(shown, status, hdrs, raw)
                if status in RETRY_STATUS and status not in ok_status:
                    last = f"HTTP {status}: {self.clean(server_message(body, text) if body is not _NOT_JSON else text)}"
                elif 300 <= status < 400 and status not in ok_status:
                    where = self.clean(redact_url(hdrs.get("Location") or "(no Location)"), 120)
                    raise ServerError(
                        shown,
                        status,
                        f"redirects to {where}; qconvert does not follow redirects: give the server's own URL",
                    )
                elif 200 <= status < 300 or status in ok_status:
                    if body is _NOT_JSON:
                        if expect is not None and status < 300:
                            raise BadReply(
                                shown,
                                status,
                                f"reply is {describe(body, text)}, expected a JSON "
                                f"{'object' if expect is dict else 'list'}",
                            )
                        return status, text
                    if expect is not None and status < 300 and not isinstance(body, expect):
                        raise BadReply(
                            shown,
                            status,
                            f"reply is {describe(body)}, expected a JSON {'object' if expect is dict else 'list'}",
                        )
                    return status, body
                else:
                    msg = server_message(body if body is not _NOT_JSON else None, text)
                    raise ServerError(shown, status, self.clean(msg))
            if attempts >= attempts_max:
                break
            if time.monotonic() + delay >= deadline:
                last += f" (no time left for a retry within {limit:g} s)"
                break
            self._wait(delay, cancellable)
            delay = min(delay * 2, self.max_backoff)
        raise ServerUnreachable(
            f"{shown}: {last} after {attempts} attempt(s) in {time.monotonic() - t0:.1f} s; check that the "
            "server is running and reachable, or raise --timeout / --retries",
            sent=sent,
        )

    def _wait(self, delay: float, cancellable: bool) -> None:
        if self._sleep is not None:
            self._sleep(delay)
        elif cancellable:
            self._cancel.wait(delay)
        else:
            time.sleep(delay)

    def _attempt(
        self, method: str, target: str, data: bytes | None, headers: dict, deadline: float, cancellable: bool
    ) -> tuple[int, Any, bytes]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Attempt("timeout", "no time left", False)
        cls = _HTTPS if self.https else _HTTP
        conn = cls(self.host, self.port, timeout=remaining)
        fired = threading.Event()

        def expire():
            fired.set()
            conn.abort()

        timer = threading.Timer(remaining, expire)
        timer.daemon = True
        if cancellable:
            with self._lock:
                self._active.add(conn)
        timer.start()
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            status = resp.status
            cap = MAX_BODY if 200 <= status < 300 else MAX_ERROR_BODY
            chunks, n = [], 0
            while True:
                chunk = resp.read(min(1 << 16, cap + 1 - n))
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if n > cap:
                    break
            raw = b"".join(chunks)
            if fired.is_set():
                raise OSError("deadline")
            if n > cap and 200 <= status < 300:
                raise _Attempt("connection", f"reply larger than {MAX_BODY >> 20} MiB", True)
            return status, resp.headers, raw[:cap]
        except _Attempt:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            sent = conn.connected
            if cancellable and self.cancelled:
                raise _Attempt("cancelled", "cancelled", sent) from None
            if fired.is_set() or isinstance(exc, (socket.timeout, TimeoutError)):
                what = (
                    f"no complete answer within {remaining:.1f} s"
                    if sent
                    else f"no connection within {remaining:.1f} s"
                )
                raise _Attempt("timeout", what, sent) from None
            if not sent:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc.__class__.__name__
                raise _Attempt("connection", f"connection failed ({self.clean(reason, 80)})", False) from None
            raise _Attempt(
                "connection", f"connection broken before a complete answer ({exc.__class__.__name__})", True
            ) from None
        finally:
            timer.cancel()
            if cancellable:
                with self._lock:
                    self._active.discard(conn)
            conn.close()

    def _decode(self, shown: str, status: int, hdrs, raw: bytes) -> tuple[Any, str]:
        enc = (hdrs.get("Content-Encoding") or "identity").strip().lower()
        if enc in ("gzip", "x-gzip", "deflate"):
            try:
                d = zlib.decompressobj(47)  # gzip or zlib header
                raw = d.decompress(raw, MAX_BODY + 1)
                if len(raw) > MAX_BODY or not d.eof:
                    raise zlib.error("truncated or too large")
            except zlib.error as e:
                raise BadReply(
                    shown, status, f"reply body is not valid {enc} data (Content-Encoding {enc}: {self.clean(e, 80)})"
                ) from None
        elif enc not in ("identity", ""):
            raise BadReply(
                shown, status, f"reply uses Content-Encoding {self.clean(enc, 40)!r}, which qconvert does not read"
            )
        text = raw.decode("utf-8", "replace")
        try:
            return json.loads(text), text
        except (ValueError, RecursionError):
            return _NOT_JSON, text

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)[1]

    def post(self, path: str, json_body: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, json_body=json_body, **kw)[1]


def reply_field(client: HttpClient, route: str, body: Any, *keys: str | int, types: type | tuple = object) -> Any:
    """``body[k0][k1]...`` of a reply from ``route``, of type ``types``; a missing or mistyped field is
    a one-line :class:`BadReply` naming the server, the route and the field."""
    cur, trail = body, ""
    for k in keys:
        trail += f"[{k}]" if isinstance(k, int) else (f".{k}" if trail else str(k))
        if isinstance(k, int):
            ok = isinstance(cur, list) and -len(cur) <= k < len(cur)
        else:
            ok = isinstance(cur, dict) and k in cur
        if not ok:
            raise BadReply(client.url + route, 200, f"reply has no {trail!r} (got {describe(body)})")
        cur = cur[k]
    if not isinstance(cur, types):
        raise BadReply(client.url + route, 200, f"reply field {trail!r} is {describe(cur)}")
    return cur


class ServerClient:
    """Base of the engine clients: one server's URL, key, timeouts and retry policy.

    ``timeout``: deadline of each control request; ``reload_timeout``: of the requests that may
    legitimately last long (the pause, which drains running requests, and the weight load)."""

    RESUME_ROUTE = "/resume"

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        reload_timeout: float = 3600.0,
        retries: int = 3,
        backoff: float = 0.5,
        sleep: Callable[[float], None] | None = None,
    ):
        self.http = HttpClient(url, api_key=api_key, timeout=timeout, retries=retries, backoff=backoff, sleep=sleep)
        self.reload_timeout = float(reload_timeout)

    @property
    def url(self) -> str:
        return self.http.base_url

    def resume_command(self) -> str:
        """The exact command that resumes this server by hand (no secret in it)."""
        return f"curl -X POST{self.http.curl_auth()} {quote(self.url + self.RESUME_ROUTE, safe=':/[]@%')}"
