"""One line about a failed Hugging Face Hub request, with what to do (push, and a SRC given as a Hub id).

Below both :mod:`qconvert.hub` and :mod:`qconvert.convert.checkpoint`, so neither imports the
other for it. No qconvert imports; huggingface_hub only inside :func:`hub_error_line`.
"""

from __future__ import annotations

import os
import re


def redact(text: str, limit: int = 300) -> str:
    """One bounded line of text from a server or an exception, without secrets or control characters."""
    first = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    first = re.sub(r"(?i)(\w+://)[^/\s@]*@", r"\1***@", first)
    first = re.sub(r"\bhf_[A-Za-z0-9]{6,}", "hf_***", first)
    first = re.sub(r"(?i)\b(bearer\s+|(?:token|api_key|password)[\"']?\s*[:=]\s*[\"']?)[^\s,;\"']+", r"\1***", first)
    first = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", " ", first).strip()
    return first if len(first) <= limit else first[:limit] + "..."


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_error_line(e: BaseException, endpoint: str | None = None) -> str:
    """What went wrong talking to the Hub, in one line with what to do; names HF_HUB_OFFLINE only
    when it is set (and so the cause)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    endpoint = redact(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    if offline_mode() or any(isinstance(x, OfflineModeIsEnabled) for x in chain):
        return "HF_HUB_OFFLINE is set, so the Hub is not contacted; unset it (or use a local directory)"
    http = next((x for x in chain if isinstance(x, HfHubHTTPError)), None)
    code = getattr(getattr(http, "response", None), "status_code", None) if http is not None else None
    if http is not None and code is not None:
        msg = redact(getattr(http, "server_message", None) or str(http), 200)
        hint = {
            401: "check HF_TOKEN (or `hf auth login`)",
            403: "check that your token may write to this repo",
            404: "check the repo id and that your token can see it",
        }.get(code, "re-run later; re-running resumes")
        return f"the Hub at {endpoint} answered HTTP {code} ({msg}); {hint}"
    net = next(
        (
            x
            for x in chain
            if type(x).__name__.endswith(
                (
                    "ConnectError",
                    "Timeout",
                    "TimeoutException",
                    "NetworkError",
                    "ProtocolError",
                    "ConnectionError",
                    "RemoteDisconnected",
                )
            )
        ),
        None,
    )
    net = net or next((x for x in chain if isinstance(x, OSError) and not isinstance(x, FileNotFoundError)), None)
    if net is not None:
        return (
            f"cannot reach the Hub at {endpoint} ({type(net).__name__}: {redact(net, 200)}); check the network "
            "and HF_ENDPOINT"
        )
    return f"Hub request to {endpoint} failed ({type(e).__name__}: {redact(e, 200)})"
