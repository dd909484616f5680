"""Publishing: the model card (README.md) and the upload through huggingface_hub.

The card carries Hub metadata (base_model, ``base_model_relation: quantized``, library_name,
tags, the source's license), what was done (scheme, recipe, scale rule, BF16 modules and why,
sizes, verify's per-group errors, versions) and launch commands for vLLM and SGLang with the
flags and GPU generations each format needs.

Metadata: only the keys of :data:`CARRIED_KEYS` (and tags) are taken from the source card, each
value checked (type, one line, bounded, a pattern); the front matter is written by
huggingface_hub's ``ModelCardData`` and read back with huggingface_hub's own pattern before the
card is used. The source card is kept whole under "Original model card": its front matter in a
code fence longer than any backtick run in it, its body verbatim, and an end marker (the card's
last line) giving both lengths, so rendering again from a qconvert card recovers the source card
exactly (no nesting, same bytes) whatever the source card contains.

Upload: ``push`` never writes into DST. The card and ``qconvert-verify.json`` are built in
memory and uploaded with DST's files from a temporary directory of symlinks (``upload_folder``,
which in huggingface_hub >= 1.x is the resumable multi-commit Xet pipeline; ``upload_large_folder``
on older versions). Re-running a push resumes: files already on the Hub are not sent again.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .convert.plan import index_ranges
from .errors import QConvertError
from .formats.dialects import DIALECT_TEXT, ENGINE_VERSIONS, engine_support
from .formats.schemes import SCHEME_TEXT
from .hub_errors import hub_error_line
from .inspect import InspectReport, fmt_bytes, inspect_checkpoint

CARD_MARKER = "<!-- qconvert-card v2 -->"
SRC_BEGIN = "<!-- qconvert-source-card:begin -->"
SRC_BODY = "<!-- qconvert-source-card:body -->"
SRC_END_V1 = "<!-- qconvert-source-card:end -->"
#: engine versions the formats were checked against
ENGINE_TARGETS = ENGINE_VERSIONS
VERIFY_NAME = "qconvert-verify.json"

# ---- source card --------------------------------------------------------------------------------

#: front-matter keys carried from the source card into ours, each with its check. Everything else
#: (and a value that fails its check) is left out of our metadata; the source's metadata stays
#: readable, verbatim, under "Original model card".
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_LANG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
_DATASET = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(?:/[\w.-]{1,96})?")
_LINK = re.compile(r"https?://[^\s<>()\[\]`\"'\\|]{1,500}|[A-Za-z0-9][\w.-]{0,99}(?:/[\w.-]{1,100}){0,8}")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_REVISION = re.compile(r"[\w.][\w./-]{0,199}")
MAX_TAGS = 64


def _text_ok(s, limit: int) -> bool:
    """A one-line printable string: no control, format or line/paragraph-separator characters."""
    import unicodedata

    return (
        isinstance(s, str)
        and 0 < len(s) <= limit
        and s == s.strip()
        and not any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for c in s)
    )


def _str_list(v, ok, limit: int):
    """A string or a list of strings, each passing ``ok``; None if any fails."""
    items = [v] if isinstance(v, str) else v
    if (
        not isinstance(items, list)
        or not items
        or len(items) > limit
        or not all(isinstance(x, str) and ok(x) for x in items)
    ):
        return None
    return v


CARRIED_KEYS = {
    "license": lambda v: v if isinstance(v, str) and _ID.fullmatch(v) else None,
    "license_name": lambda v: v if isinstance(v, str) and _ID.fullmatch(v) else None,
    "license_link": lambda v: v
    if isinstance(v, str) and _LINK.fullmatch(v) and ".." not in v.split("://")[-1].split("/")
    else None,
    "library_name": lambda v: v if isinstance(v, str) and _ID.fullmatch(v) else None,
    "pipeline_tag": lambda v: v if isinstance(v, str) and _ID.fullmatch(v) else None,
    "language": lambda v: _str_list(v, _LANG.fullmatch, 500),
    "datasets": lambda v: _str_list(v, _DATASET.fullmatch, 100),
    "inference": lambda v: v if isinstance(v, bool) else None,
}


def read_source_card(dst: Path, log: Callable[[str], None] | None = None) -> str:
    """The text of ``dst/README.md`` ("" when there is none). Only a regular file inside ``dst`` is
    read (a symlink leaving it, a directory or a FIFO is refused); bytes that are not UTF-8 are
    replaced by U+FFFD, with a warning, since a Hub card must be UTF-8."""
    import stat

    log = log or (lambda s: None)
    p = dst / "README.md"
    if not os.path.lexists(p):
        return ""
    real = Path(os.path.realpath(p))
    if p.is_symlink() and Path(os.path.realpath(dst)) not in real.parents:
        raise QConvertError(
            f"{p}: a symlink to {real}, outside {dst}; push reads only files inside DST — "
            "replace the link with a copy of the file"
        )
    try:
        st = os.stat(p)
    except OSError as e:
        raise QConvertError(
            f"{p}: cannot be read ({e.strerror}); replace it with the source model card (or remove it)"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise QConvertError(f"{p}: not a regular file; replace it with the source model card (or remove it)")
    with open(p, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", errors="replace")
        log(
            f"push: warning: {p} is not UTF-8 (first bad byte at offset {e.start}); invalid bytes are replaced "
            "by U+FFFD in the card"
        )
    return text[1:] if text.startswith("\ufeff") else text


def split_card(text: str) -> tuple[dict, str, str]:
    """(metadata, raw front matter, body) of a model card. The front matter is found with
    huggingface_hub's own pattern, so it is what the Hub reads as metadata; metadata that is not a
    YAML mapping (or not YAML) is {} and its raw text is kept."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    text = text[1:] if text.startswith("\ufeff") else text  # as huggingface_hub reads files (utf-8-sig)
    m = REGEX_YAML_BLOCK.search(text)
    if not m:
        return {}, "", text
    raw = m.group(2)
    try:
        meta = _safe_load(raw)
    except Exception:  # YAMLError, ValueError (bad dates), RecursionError (deep nesting)
        meta = {}
    return (meta if isinstance(meta, dict) else {}), raw, text[m.end() :]


def _safe_load(raw: str):
    import yaml

    return yaml.safe_load(raw)


_CARD_RE = re.compile(r"<!-- qconvert-card v(\d+) -->\n")
_SRC_END_RE = re.compile(r"\n<!-- qconvert-source-card:end meta=(\d+) body=(\d+) -->\n\Z")


def _own_card_version(text: str) -> int | None:
    """The version of qconvert's card format when ``text`` is a card qconvert wrote (its marker
    right after the front matter), else None."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    m = REGEX_YAML_BLOCK.search(text)
    c = _CARD_RE.match(text, m.end()) if m else None
    return int(c.group(1)) if c else None


def source_card(text: str) -> tuple[dict, str, str]:
    """Like :func:`split_card`, but a qconvert card yields the source card it preserved, exactly."""
    version = _own_card_version(text)
    if version is None:
        return split_card(text)
    got = _source_section(text) if version >= 2 else _source_section_v1(text)
    if got is None:
        return {}, "", ""
    raw, body = got
    try:
        meta = _safe_load(raw) if raw else {}
    except Exception:  # as in split_card
        meta = {}
    return (meta if isinstance(meta, dict) else {}), raw, body


def _source_section(text: str) -> tuple[str, str] | None:
    """(raw front matter, body) from a v2 card: the end marker, the card's last line, gives both
    lengths, so nothing in the source card can be mistaken for a delimiter."""
    m = _SRC_END_RE.search(text)
    if not m or SRC_BEGIN not in text:
        return None
    n_meta, n_body = int(m.group(1)), int(m.group(2))
    end = m.start()
    if n_body > end:
        return None
    body = text[end - n_body : end]
    pre = text[: end - n_body]
    if not pre.endswith("\n" + SRC_BODY + "\n"):
        return None
    pre = pre[: -len(SRC_BODY) - 1]
    if not n_meta:
        return ("", body) if pre.endswith(SRC_BEGIN + "\n") else None
    fence = pre[:-1].rsplit("\n", 1)[-1]
    if not re.fullmatch(r"`{3,}", fence):
        return None
    pre = pre[: -len(fence) - 2]
    raw = pre[len(pre) - n_meta :]
    return (raw, body) if len(raw) == n_meta and pre[:-n_meta].endswith(fence + "yaml\n") else None


def _source_section_v1(text: str) -> tuple[str, str] | None:
    """Cards written before the lengths were recorded (v1): delimiters found by search."""
    if SRC_BEGIN not in text:
        return None
    inner = text.split(SRC_BEGIN, 1)[1].rsplit(SRC_END_V1, 1)[0]
    head, _, body = inner.partition(SRC_BODY + "\n")
    m = re.search(r"```yaml\n(.*?)\n```", head, re.S)
    return (m.group(1) if m else ""), body.rstrip("\n") + ("\n" if body.strip() else "")


def _fence(raw: str) -> str:
    """A backtick fence longer than any backtick run in ``raw``, so no line of it closes the block."""
    longest = max((len(r) for r in re.findall(r"`+", raw)), default=0)
    return "`" * max(3, longest + 1)


def carried_metadata(smeta: dict) -> tuple[dict, list[str]]:
    """The allowed keys of the source's metadata whose values pass their checks, and the names of
    the keys left out for a bad value."""
    out, dropped = {}, []
    for k, check in CARRIED_KEYS.items():
        if k in smeta:
            v = check(smeta[k])
            if v is None:
                dropped.append(k)
            else:
                out[k] = v
    tags = smeta.get("tags")
    if tags is not None:
        items = [tags] if isinstance(tags, str) else tags if isinstance(tags, list) else []
        good = [t for t in items if _text_ok(t, 100)]
        if len(good) != len(items) or not items or len(good) > MAX_TAGS:
            dropped.append("tags" if not good else f"tags ({len(items) - min(len(good), MAX_TAGS)} of {len(items)})")
        out["tags"] = good[:MAX_TAGS]
    return out, dropped


# ---- card ---------------------------------------------------------------------------------------


def _repo_like(s: str | None) -> bool:
    return isinstance(s, str) and _REPO.fullmatch(s) is not None and ".." not in s and not Path(s).exists()


def _collapse(names: list[str]) -> list[str]:
    """``model.layers.{0-2}.input_layernorm``-style summaries; expert indices become ``*``."""
    out: dict[str, list[int]] = {}
    for n in names:
        k = re.sub(r"\.experts\.\d+\.", ".experts.*.", n)
        m = re.search(r"\.layers\.(\d+)\.", k)
        layer = int(m.group(1)) if m else -1
        k = re.sub(r"\.layers\.\d+\.", ".layers.{L}.", k, count=1)
        out.setdefault(k, []).append(layer)
    return [f"`{_md(k.replace('{L}', '{' + index_ranges(v) + '}'), 500)}`" for k, v in out.items()]


def launch_commands(
    repo: str, scheme: str, dialect: str, moe: bool, revision: str | None = None, layout: dict | None = None
) -> list[dict]:
    """Per engine: whether it loads, GPUs, and ready-to-paste commands [(gpus, command)]."""
    rev = ["--revision", revision] if revision else []
    out = []
    for e in engine_support(scheme, dialect, moe, layout):
        cmds = []
        if e.loads:
            if e.engine == "vllm":
                cmds.append((e.gpus, " ".join(["vllm", "serve", repo, *rev, *e.flags])))
            else:
                base = ["python", "-m", "sglang.launch_server", "--model-path", repo, *rev]
                cmds.append((e.gpus, " ".join(base + e.flags)))
                for gpus, flags in e.alt:
                    cmds.append((gpus, " ".join(base + flags)))
        out.append({"engine": e.engine, "loads": e.loads, "gpus": e.gpus, "note": e.note, "commands": cmds})
    return out


def _manifest(dst: Path) -> dict:
    from .convert.checkpoint import read_manifest

    try:
        return read_manifest(dst) or {}
    except QConvertError:  # corrupt, a link out of DST, a FIFO: the card says what it can without it
        return {}


def _md(v, limit: int = 200) -> str:
    """A value from the checkpoint (manifest, tensor names) as inline Markdown text in a table
    cell: one line, bounded, without the characters that end a cell or a code span."""
    s = re.sub(r"[\x00-\x1f\x7f\u2028\u2029]", " ", str(v))[:limit]
    return s.replace("|", "\\|").replace("`", "'")


def check_repo_id(repo_id, what: str = "repo id") -> str:
    if not isinstance(repo_id, str) or not _REPO.fullmatch(repo_id) or ".." in repo_id:
        raise QConvertError(f"{repo_id!r}: not a Hub {what}; use the form org/name (letters, digits, '-', '_', '.')")
    return repo_id


def check_revision(revision: str | None) -> str | None:
    if revision is not None and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise QConvertError(f"{revision!r}: not a branch name; use letters, digits, '-', '_', '.', '/'")
    return revision


def card_base_model(dst: Path, base_model: str | None, log: Callable[[str], None] | None = None) -> str | None:
    """``--base-model`` if given, else the manifest's source when it is a Hub repo id. A local
    source has no Hub id, and the source card's own ``base_model`` names the model *it* was made
    from (a fine-tune's parent), not the model quantized here, so it is not used: the card then has
    no ``base_model`` and ``log`` says how to add it."""
    log = log or (lambda s: None)
    if base_model:
        return check_repo_id(base_model, "model id for --base-model")
    src_id = (_manifest(dst).get("source") or {}).get("id")
    if isinstance(src_id, str) and _repo_like(src_id):
        return src_id
    log(
        f"push: the card has no base_model: the source ({src_id or 'unknown'}) is not a Hub repo id; pass "
        "--base-model ORG/NAME to name the model it was converted from"
    )
    return None


def render_card(
    dst: str | os.PathLike,
    repo_id: str,
    *,
    verify_report=None,
    base_model: str | None = None,
    revision: str | None = None,
    source_text: str | None = None,
    report: InspectReport | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """README.md for the checkpoint at ``dst`` published as ``repo_id``. Deterministic: the same
    inputs give the same bytes, and rendering from a card it wrote (``source_text``) gives it back."""
    log = log or (lambda s: None)
    dst = Path(dst)
    check_repo_id(repo_id)
    check_revision(revision)
    rep = report or inspect_checkpoint(dst)
    man = _manifest(dst)
    if source_text is None:
        source_text = read_source_card(dst, log)
    smeta, sraw, sbody = source_card(source_text)
    base = card_base_model(dst, base_model, log)
    scheme, dialect = rep.scheme, rep.dialect

    carried, dropped = carried_metadata(smeta)
    if dropped:
        log(
            "push: source card metadata not carried into the card's metadata (not a valid value): "
            + ", ".join(dropped)
            + "; it stays under 'Original model card'"
        )
    meta: dict = {}
    if base:
        meta["base_model"] = base
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = carried.get("library_name") or "transformers"
    lic = carried.get("license")
    license_name = carried.get("license_name")
    license_link = carried.get("license_link")
    if lic:
        meta["license"] = lic
        if license_name:
            meta["license_name"] = license_name
        if not license_link and (dst / "LICENSE").is_file():
            license_link = "LICENSE"
        if not license_link and base:
            license_link = f"https://huggingface.co/{base}"
        if license_link:
            meta["license_link"] = license_link
    for k in ("pipeline_tag", "language", "datasets", "inference"):
        if k in carried:
            meta[k] = carried[k]
    tags = ["qconvert", scheme] + ([dialect] if dialect not in (scheme, "bf16") else [])
    if rep.layouts:
        tags.append("flashinfer-trtllm")
    for t in carried.get("tags", []):
        if t not in tags:
            tags.append(t)
    meta["tags"] = tags
    front = _front_matter(meta)

    name = repo_id.split("/")[-1]
    L: list[str] = ["---", front, "---", CARD_MARKER, ""]
    L.append(f"# {name}")
    L.append("")
    q = (man.get("source") or {}).get("quantized") if isinstance(man.get("source"), dict) else None
    decoded = isinstance(q, dict) and q.get("decoded_to") == "bf16"  # qconvert bf16 of a quantized source
    of = (
        f"[{base}](https://huggingface.co/{base})"
        if base
        else ("its quantized source" if decoded else "its BF16 source")
    )
    L.append(
        (f"BF16 decode of {of}" if decoded else f"{scheme.upper()} quantization of {of}") + ", made with "
        f"qconvert {_md(man.get('qconvert_version', __version__))}. "
        f"Engines: " + ", ".join(e.engine for e in rep.engines if e.loads) + "."
    )
    L.append("")
    L.append("## Quantization")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    L.append(f"| scheme | {SCHEME_TEXT.get(scheme, scheme)} |")
    L.append(f"| on-disk dialect | `{dialect}`: {DIALECT_TEXT.get((scheme, dialect), dialect)} |")
    if man.get("recipe"):
        L.append(f"| recipe | `{_md(man['recipe'])}` |")
    from .convert.decode import summarize

    src_line = summarize((man.get("source") or {}).get("quantized") if isinstance(man.get("source"), dict) else None)
    if src_line:
        L.append(f"| source | {_md(src_line)} |")
    if man.get("scale_rule"):
        L.append(f"| scale rule | {_md(man['scale_rule'])} |")
    for k in ("zero_block_policy", "global_scale_rule", "nvfp4_formula"):
        if man.get(k):
            L.append(f"| {k.replace('_', ' ')} | {_md(man[k])} |")
    if rep.layouts:
        lay = rep.layouts[0]
        g = {
            k: _md(lay.get(k, ""))
            for k in ("layout", "layout_version", "engine", "engine_version", "tp", "ep", "flashinfer_version")
        }
        L.append(
            f"| expert layout | pre-shuffled `{g['layout']}` v{g['layout_version']} for {g['engine']} "
            f"{g['engine_version']} (tp={g['tp']}, ep={g['ep']}, FlashInfer {g['flashinfer_version']}) |"
        )
    opts = man.get("options") or {}
    if opts:
        L.append(
            "| options | "
            + ", ".join(f"`{_md(k)}={_md(v)}`" for k, v in opts.items() if v not in (None, (), [], False, 0))
            + " |"
        )
    L.append("")

    # BF16 modules and why
    kept: dict[str, list[str]] = {}
    for mod, info in (man.get("tensors") or {}).items():
        if (info or {}).get("format") == "bf16":
            why = info.get("reason") or "kept"
            kept.setdefault({"1-D": "1-D (norms; engines never quantize them)"}.get(why, why), []).append(mod)
    if not kept and not man:
        for m in rep.modules:
            if m.format in ("bf16", "f16", "f32"):
                kept.setdefault("stored in BF16", []).append(m.name)
    L.append("## Modules kept in BF16")
    L.append("")
    if man.get("bf16_layers"):
        L.append(f"Whole decoder layers kept in BF16: {_md(man['bf16_layers'])}.")
        L.append("")
    L.append("| why | modules |")
    L.append("|---|---|")
    for why, mods in sorted(kept.items()):
        L.append(f"| {_md(why)} | {', '.join(_collapse(mods))} |")
    excl = next(iter(rep.exclusions.values()), None)
    if excl is not None:
        L.append("")
        L.append(
            f"The exclusion list ({len(excl)} entries, in `"
            + "`, `".join(w.split(" ")[-1] for w in rep.exclusions)
            + "`) names these modules so both engines load them unquantized."
        )
    L.append("")

    t = rep.totals
    L.append("## Size")
    L.append("")
    L.append("| BF16 source | this checkpoint | ratio |")
    L.append("|---|---|---|")
    L.append(f"| {fmt_bytes(t['bf16_bytes'])} | {fmt_bytes(t['bytes'])} | {t['compression_ratio']:.2f}x smaller |")
    L.append("")

    L.append("## Accuracy (qconvert verify)")
    L.append("")
    if verify_report is None:
        L.append("Not verified against the source when this card was written.")
    else:
        v = verify_report
        L.append(
            f"`qconvert verify` {'passed' if v.ok else 'FAILED'}: {len(v.tensors)} quantized tensors dequantized and "
            f"compared with the BF16 source, {v.kept_identical} BF16 tensors byte-identical; config, index, "
            "manifest checksums and exclusion list consistent."
            if v.ok
            else f"`qconvert verify` FAILED ({len(v.failures)} problems); pushed with --allow-unverified."
        )
        L.append("")
        L.append("| module group | format | tensors | rel. error mean | rel. error max | min SQNR |")
        L.append("|---|---|---|---|---|---|")
        for g, d in v.groups().items():
            L.append(
                f"| `{g}` | {d['format']} | {d['count']} | {d['mean_rel_err']:.4f} | {d['max_rel_err']:.4f} | "
                f"{d['min_sqnr_db']:.1f} dB |"
            )
        if v.engine and v.engine.get("top1_agreement") is not None:
            L.append("")
            L.append(
                f"vLLM next-token agreement with the source: top-1 {v.engine['top1_agreement']:.3f}, "
                f"mean KL {v.engine['mean_kl']:.4g}."
            )
    L.append("")

    L.append("## Serving")
    L.append("")
    for e in launch_commands(repo_id, scheme, dialect, rep.moe, revision, rep.layouts[0] if rep.layouts else None):
        title = {"vllm": "vLLM", "sglang": "SGLang"}[e["engine"]]
        L.append(f"### {title} {ENGINE_TARGETS[e['engine']]}")
        L.append("")
        if not e["loads"]:
            L.append(f"Not loadable in {title}: {e['note']}.")
            L.append("")
            continue
        if e["note"]:
            L.append(e["note"] + ".")
            L.append("")
        for gpus, cmd in e["commands"]:
            L.append(f"GPUs: {gpus}")
            L.append("")
            L.append("```bash")
            L.append(cmd)
            L.append("```")
            L.append("")

    L.append("## Versions")
    L.append("")
    L.append(f"- qconvert {_md(man.get('qconvert_version', __version__))}")
    L.append(f"- made for vLLM {ENGINE_TARGETS['vllm']} and SGLang {ENGINE_TARGETS['sglang']}")
    if isinstance(man.get("source"), dict) and man["source"].get("revision"):
        L.append(f"- source revision `{_md(man['source']['revision'])}`")
    L.append("")
    if lic:
        L.append("## License")
        L.append("")
        link = f"[{license_link}]({license_link})" if license_link else ""
        L.append(
            f"`{lic}`{(' (' + license_name + ')') if license_name else ''}, inherited from "
            f"the source model{': ' + link if link else ''}."
        )
        L.append("")
    if sraw or sbody.strip():
        L.append("## Original model card")
        L.append("")
        L.append(SRC_BEGIN)
        if sraw:
            fence = _fence(sraw)
            L.append("Original metadata:")
            L.append("")
            L.append(fence + "yaml")
            L.append(sraw)
            L.append(fence)
        L.append(SRC_BODY)
        L.append(sbody)
        L.append(f"<!-- qconvert-source-card:end meta={len(sraw)} body={len(sbody)} -->")
    card = "\n".join(L) + "\n"
    _check_front_matter(card, meta)
    return card


def _front_matter(meta: dict) -> str:
    """The YAML of ``meta``, written by huggingface_hub's own ModelCardData (keys in our order)."""
    from huggingface_hub import ModelCardData

    return ModelCardData(**meta).to_yaml(original_order=list(meta))


def _check_front_matter(card: str, meta: dict) -> None:
    """What huggingface_hub reads from ``card`` must be exactly ``meta``, and our marker must follow it."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    m = REGEX_YAML_BLOCK.search(card)
    if not m or m.start() != 0 or _safe_load(m.group(2)) != meta or not card.startswith(CARD_MARKER, m.end()):
        raise QConvertError(
            "internal error: the model card's metadata does not read back as written; "
            "please report this with the source README.md"
        )


# ---- push ---------------------------------------------------------------------------------------


def _source_of(dst: Path) -> str | None:
    source = _manifest(dst).get("source")
    sid = source.get("id") if isinstance(source, dict) else None
    return sid if isinstance(sid, str) and sid and (Path(sid).is_dir() or _repo_like(sid)) else None


def push(
    dst: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    allow_unverified: bool = False,
    src: str | None = None,
    base_model: str | None = None,
    max_rel_err: float | None = None,
    verify_report=None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """Verify ``dst`` (unless a report is given), build README.md (the card) and qconvert-verify.json
    in memory, and upload them with ``dst``'s files. ``dst`` itself is never written: the card
    replaces ``dst/README.md`` on the Hub only. Returns the repo URL."""
    from .verify import format_report, verify

    log = log or (lambda s: None)
    dst = Path(dst).expanduser()
    check_repo_id(repo_id)
    check_revision(revision)
    if base_model:
        check_repo_id(base_model, "model id for --base-model")
    rep = inspect_checkpoint(dst)
    source_text = read_source_card(dst, log)
    vr = verify_report
    if vr is None:
        src = src or _source_of(dst)
        if src is None:
            if not allow_unverified:
                raise QConvertError(
                    f"{dst}: cannot verify before pushing because the BF16 source is unknown; "
                    "pass --src SRC (or --allow-unverified to push unverified)"
                )
            log("push: not verified (no source); --allow-unverified")
        else:
            log(f"push: verifying {dst} against {src}")
            vr = verify(src, str(dst), max_rel_err=max_rel_err, progress=progress, log=log)
            log(format_report(vr))
    if vr is not None and not vr.ok:
        if not allow_unverified:
            raise QConvertError(
                f"{dst}: verify failed ({vr.failures[0]}); fix the checkpoint, or pass "
                "--allow-unverified to push it anyway"
            )
        log(f"push: verify failed ({len(vr.failures)} problems); pushing anyway (--allow-unverified)")
    card = render_card(
        dst,
        repo_id,
        verify_report=vr,
        base_model=base_model,
        revision=revision,
        source_text=source_text,
        report=rep,
        log=log,
    )
    extra = {"README.md": card.encode("utf-8")}
    if vr is not None:
        extra[VERIFY_NAME] = (json.dumps(vr.to_dict(), indent=2, default=str) + "\n").encode("utf-8")
    return upload(dst, repo_id, private=private, revision=revision, token=token, log=log, extra=extra)


#: never uploaded: huggingface_hub's own metadata, qconvert's temporary files and locks
UPLOAD_IGNORE = [".cache/**", ".*.qconvert-tmp-*", "*.lock"]


def _stage(dst: Path, extra: dict[str, bytes], stage: Path) -> None:
    """Mirror ``dst`` into ``stage``: a symlink per file of ``dst`` (files only inside ``dst``) and
    the ``extra`` files, written from memory, in place of those of ``dst`` with the same names.
    A ``qconvert-verify.json`` in ``dst`` (written there by push before it stopped writing into
    DST) is never sent: the report uploaded is this push's, or none."""
    import stat

    root = Path(os.path.realpath(dst))
    for d, dirs, files in os.walk(dst, followlinks=False):
        rel = Path(d).relative_to(dst)
        for name in sorted(dirs):
            if (Path(d) / name).is_symlink():
                raise QConvertError(
                    f"{Path(d) / name}: a symlinked directory; push uploads only files inside "
                    "DST — replace the link with a copy"
                )
            (stage / rel / name).mkdir()
        for name in sorted(files):
            p = Path(d) / name
            if (rel / name).as_posix() in extra or (rel / name).as_posix() == VERIFY_NAME:  # push's own output
                continue
            real = Path(os.path.realpath(p))
            if root not in real.parents:
                raise QConvertError(
                    f"{p}: a symlink to {real}, outside {dst}; push uploads only files inside DST — "
                    "replace the link with a copy of the file"
                )
            try:
                regular = stat.S_ISREG(os.stat(real).st_mode)
            except OSError as e:
                raise QConvertError(f"{p}: cannot be read ({e.strerror}); remove it from DST before pushing") from None
            if not regular:
                raise QConvertError(f"{p}: not a regular file; remove it from DST before pushing")
            os.symlink(real, stage / rel / name)
    for name, data in extra.items():
        (stage / name).write_bytes(data)


def upload(
    dst: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    log: Callable[[str], None] | None = None,
    extra: dict[str, bytes] | None = None,
) -> str:
    """Create the repo (and branch) if needed and upload ``dst`` plus ``extra`` (name -> bytes, in
    place of ``dst``'s files of those names) from a temporary mirror of symlinks, so ``dst`` is only
    read. Files already on the Hub are not sent again, so re-running resumes."""
    import shutil
    import tempfile

    log = log or (lambda s: None)
    try:
        from huggingface_hub import HfApi
    except ImportError:  # pragma: no cover
        raise QConvertError("huggingface_hub is not installed; pip install huggingface_hub") from None
    dst = Path(dst)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    stage = Path(tempfile.mkdtemp(prefix="qconvert-push-"))
    try:
        _stage(dst, extra or {}, stage)
        api = HfApi(endpoint=endpoint, token=token)
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
            log(f"push: uploading {dst} to {repo_id}" + (f"@{revision}" if revision else ""))
            if hasattr(api, "upload_large_folder"):  # huggingface_hub < 1.0
                api.upload_large_folder(
                    repo_id=repo_id,
                    folder_path=str(stage),
                    repo_type="model",
                    revision=revision,
                    private=private,
                    ignore_patterns=UPLOAD_IGNORE,
                )
            else:
                api.upload_folder(
                    repo_id=repo_id,
                    folder_path=str(stage),
                    repo_type="model",
                    revision=revision,
                    commit_message=f"qconvert {__version__}: upload {dst.name}",
                    ignore_patterns=UPLOAD_IGNORE,
                )
        except KeyboardInterrupt:
            raise
        except Exception as e:
            raise QConvertError(
                f"{repo_id}: upload failed: {hub_error_line(e, endpoint)}; {dst} was not changed, re-run push to resume"
            ) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return str(url)
