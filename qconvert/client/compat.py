"""Is a checkpoint safe to hot-reload into an engine that is serving another one?

An engine's ``reload_weights`` writes new bytes into the parameters it built for the *served*
checkpoint; it does not rebuild layers. If the new checkpoint quantizes a different set of
modules (other exclusions, last-N-BF16 layers), uses another format or dialect, or holds tensors
with other names, shapes or dtypes, vLLM does not necessarily fail: it was seen to load partially
and return NaN logprobs. :func:`check_reload_compatible` refuses such a pair up front, from the
two directories' metadata only (config.json, hf_quant_config.json, qconvert.json and the
safetensors headers; no tensor data is read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qconvert.errors import QConvertError
from qconvert.formats.exclusions import ANY_LIST_KEYS, first_list
from qconvert.formats.manifest import MANIFEST_NAME

#: quantization_config keys that describe the producer, not the layout.
_VOLATILE_QC_KEYS = frozenset({"producer", "version", "global_compression_ratio"})


class ReloadIncompatible(QConvertError):
    """The new checkpoint cannot be reloaded into the engine serving the old one."""


def _open(d: Path):
    """The checkpoint reader's view of ``d`` (lenient; guarded: config.json, index, shard headers;
    hf_quant_config.json and qconvert.json on first use)."""
    from qconvert.convert.checkpoint import open_checkpoint

    return open_checkpoint(d, strict=False)


def _quant_config(ck) -> dict | None:
    qc = ck.config.get("quantization_config")
    if qc is None:
        # ModelOpt exports may carry the config only in hf_quant_config.json
        hf = ck.hf_quant_config
        if isinstance(hf, dict) and isinstance(hf.get("quantization"), dict):
            qc = {"quant_method": "modelopt", **hf["quantization"]}
    return qc if isinstance(qc, dict) else None


def _tensors(ck) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (e.dtype, tuple(e.shape)) for h in ck.shards for name, e in h.entries.items()}


def _leaf_diff(a: Any, b: Any, path: str) -> tuple[str, Any, Any]:
    """The first differing leaf of two JSON values (dotted path, value a, value b)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _leaf_diff(a.get(k), b.get(k), f"{path}.{k}")
    return path, a, b


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= n else s[: n - 3] + "..."


def _first(items) -> str:
    items = sorted(items)
    more = f" (+{len(items) - 1} more)" if len(items) > 1 else ""
    return f"{items[0]}{more}"


def _diff_reason(served: Path, new: Path) -> str | None:
    served, new = _open(served), _open(new)
    qa, qb = _quant_config(served), _quant_config(new)
    if (qa is None) != (qb is None):
        which = "served" if qa is None else "new"
        return f"quantization differs: the {which} checkpoint is unquantized, the other is not"
    if qa is not None:
        for key in ("quant_method", "quant_algo", "format"):
            if qa.get(key) != qb.get(key):
                return f"quantization_config {key} differs: served {qa.get(key)!r}, new {qb.get(key)!r}"
        ea, eb = first_list(qa), first_list(qb)
        if ea != eb:
            sa, sb = set(ea or []), set(eb or [])
            if sa - sb:
                return f"exclusion list differs: {_first(sa - sb)} excluded only in the served checkpoint"
            if sb - sa:
                return f"exclusion list differs: {_first(sb - sa)} excluded only in the new checkpoint"
            return "exclusion list differs (one checkpoint has none)"
        rest = sorted((set(qa) | set(qb)) - _VOLATILE_QC_KEYS - set(ANY_LIST_KEYS))
        for key in rest:
            if qa.get(key) != qb.get(key):
                path, va, vb = _leaf_diff(qa.get(key), qb.get(key), key)
                return f"quantization_config {path} differs: served {_short(va)}, new {_short(vb)}"
    ma, mb = served.manifest, new.manifest
    if ma is not None and mb is not None:
        for key in ("scheme", "dialect", "layout"):
            if ma.get(key) != mb.get(key):
                return f"{MANIFEST_NAME} {key} differs: served {ma.get(key)!r}, new {mb.get(key)!r}"
        fa = {m: (v or {}).get("format") for m, v in (ma.get("tensors") or {}).items()}
        fb = {m: (v or {}).get("format") for m, v in (mb.get("tensors") or {}).items()}
        diff = [m for m in set(fa) | set(fb) if fa.get(m) != fb.get(m)]
        if diff:
            m = sorted(diff)[0]
            more = f" (+{len(diff) - 1} more modules)" if len(diff) > 1 else ""
            return f"module {m} is {fa.get(m)} in the served checkpoint but {fb.get(m)} in the new one{more}"
    ta, tb = _tensors(served), _tensors(new)
    if set(ta) - set(tb):
        return f"tensor {_first(set(ta) - set(tb))} is missing from the new checkpoint"
    if set(tb) - set(ta):
        return f"tensor {_first(set(tb) - set(ta))} is not in the served checkpoint"
    bad = sorted(n for n in ta if ta[n] != tb[n])
    if bad:
        n = bad[0]
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        (da, sa), (db, sb) = ta[n], tb[n]
        return f"tensor {n} is {da}{list(sa)} served but {db}{list(sb)} new{more}"
    return None


def check_reload_compatible(served_dir: str | Path, new_dir: str | Path) -> None:
    """Raise :class:`ReloadIncompatible` (a ``QConvertError``, one line) unless ``new_dir`` can be
    hot-reloaded into an engine built for ``served_dir``.

    Compared: ``quantization_config`` (method, algo/format, exclusion list as a set, every other
    layout key; producer/version ignored; ``hf_quant_config.json`` when config.json has none);
    when both have ``qconvert.json``: scheme, dialect, layout and every module's format; and the
    set of tensor names with each tensor's dtype and shape. Values are not compared.
    """
    served, new = Path(served_dir), Path(new_dir)
    reason = _diff_reason(served, new)
    if reason:
        raise ReloadIncompatible(
            f"cannot hot-reload {new} into the engine serving {served}: {reason}; "
            "reload needs the same quantization layout and tensor set (restart the engine to switch)"
        )
