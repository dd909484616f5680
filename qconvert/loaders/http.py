"""Small JSON-over-HTTP helper shared by the vLLM and SGLang reload clients.

* Connection errors, timeouts and gateway errors (502/503/504) are retried with exponential
  backoff, then reported as :class:`ServerUnreachable`.
* Any other non-2xx answer is a :class:`ServerError` whose text is the server's own message,
  verbatim (``error.message``, ``error``, ``detail`` or ``message`` of a JSON body, else the body).
* An API key is sent as ``Authorization: Bearer KEY`` (what vLLM ``--api-key`` and SGLang
  ``--api-key`` / ``--admin-api-key`` check).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import requests

from qconvert.errors import QConvertError

RETRY_STATUS = (502, 503, 504)


class ServerUnreachable(QConvertError):
    """The server could not be reached (after retries)."""


class ServerError(QConvertError):
    """The server answered with a failure; ``message`` is its text, verbatim."""

    def __init__(self, url: str, status: int | None, message: str):
        self.url = url
        self.status = status
        self.message = message
        where = f"{url}: HTTP {status}" if status is not None else url
        super().__init__(f"{where}: {message}")


def server_message(body: Any, text: str) -> str:
    """The server's own failure message from a response body, unmodified."""
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


@dataclass
class HttpClient:
    """JSON client for one server. ``base_url`` like ``http://host:port``."""

    base_url: str
    api_key: str | None = None
    timeout: float = 30.0
    retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0
    sleep: Callable[[float], None] = time.sleep
    session: requests.Session = field(default_factory=requests.Session)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if "://" not in self.base_url:
            self.base_url = "http://" + self.base_url

    def headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

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
    ) -> tuple[int, Any]:
        """Send one request; return ``(status, parsed JSON or text)``.

        Retries transport failures and 502/503/504. Raises :class:`ServerError` for other
        non-2xx statuses not listed in ``ok_status``.
        """
        url = self.base_url + path
        attempts = 1 + (self.retries if retries is None else retries)
        delay = self.backoff
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                self.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
            try:
                resp = self.session.request(
                    method,
                    url,
                    json=json_body,
                    params=params,
                    headers=self.headers(),
                    timeout=self.timeout if timeout is None else timeout,
                )
            except requests.Timeout as exc:
                last = f"timed out ({exc.__class__.__name__})"
                continue
            except requests.ConnectionError as exc:
                last = f"connection failed ({exc.__class__.__name__})"
                continue
            try:
                body: Any = resp.json()
            except ValueError:
                body = resp.text
            if resp.status_code in RETRY_STATUS and resp.status_code not in ok_status:
                last = f"HTTP {resp.status_code}: {server_message(body, resp.text)}"
                continue
            if resp.ok or resp.status_code in ok_status:
                return resp.status_code, body
            raise ServerError(url, resp.status_code, server_message(body, resp.text))
        raise ServerUnreachable(
            f"{url}: {last} after {attempts} attempt(s); check that the server is running "
            f"and reachable, or raise --retries"
        )

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)[1]

    def post(self, path: str, json_body: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, json_body=json_body, **kw)[1]


class ServerClient:
    """Base of the engine clients: one server's URL, key, timeouts and retry policy."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 30.0,
                 reload_timeout: float = 3600.0, retries: int = 3, backoff: float = 0.5,
                 sleep: Callable[[float], None] | None = None):
        kw = {} if sleep is None else {"sleep": sleep}
        self.http = HttpClient(url, api_key=api_key, timeout=timeout, retries=retries, backoff=backoff, **kw)
        self.reload_timeout = reload_timeout

    @property
    def url(self) -> str:
        return self.http.base_url
