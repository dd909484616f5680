"""Publishing: the model card (README.md) and the upload through huggingface_hub.

The card carries Hub metadata (base_model, ``base_model_relation: quantized``, library_name,
tags, the source's license), what was done (scheme, recipe, scale rule, BF16 modules and why,
sizes, verify's per-group errors, versions) and launch commands for vLLM and SGLang with the
flags and GPU generations each format needs (formats.md §4.2, §4.3, §5.5, §7). The source card is
kept whole under "Original model card" (its metadata as a YAML block, its body verbatim), so
rendering again from a directory that already holds a qconvert card recovers it instead of
nesting cards.

Upload: ``upload_large_folder`` where huggingface_hub has it, else ``upload_folder`` (which in
huggingface_hub >= 1.x is the resumable multi-commit Xet pipeline). Re-running a push resumes:
files already on the Hub are not sent again.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from . import __version__
from .errors import QConvertError
from .inspect import MANIFEST_NAME, InspectReport, engine_support, fmt_bytes, inspect_checkpoint

CARD_MARKER = "<!-- qconvert-card v1 -->"
SRC_BEGIN = "<!-- qconvert-source-card:begin -->"
SRC_BODY = "<!-- qconvert-source-card:body -->"
SRC_END = "<!-- qconvert-source-card:end -->"
#: engine versions the formats were checked against (formats.md §0)
ENGINE_TARGETS = {"vllm": "0.33.0", "sglang": "0.5.23"}
VERIFY_NAME = "qconvert-verify.json"

SCHEME_TEXT = {
    "mxfp8": "MXFP8: FP8 E4M3 elements with one E8M0 (power-of-two) scale per 1x32 block along the input dimension",
    "nvfp4": "NVFP4: FP4 E2M1 elements with one FP8 E4M3 scale per 1x16 block and one FP32 global scale per tensor",
    "bf16": "BF16 (not quantized)",
}
DIALECT_TEXT = {
    ("mxfp8", "auto"): "`quant_method: mxfp8`, `weight_scale` uint8 [N, K/32], exclusions in `ignored_layers` and "
                       "`modules_to_not_convert` (loads in vLLM and SGLang)",
    ("mxfp8", "sglang"): "SGLang/miles: `quant_method: mxfp8`, `weight_scale_inv` uint8 [N, K/32] (an E8M0 byte, not an "
                         "inverse), exclusions in `modules_to_not_convert` (SGLang only)",
    ("mxfp8", "modelopt"): "ModelOpt: `quant_method: modelopt`, `quant_algo: MXFP8`, `weight_scale` uint8 [N, K/32], "
                           "`ignore` + `hf_quant_config.json`",
    ("nvfp4", "modelopt"): "ModelOpt `modelopt_fp4`: packed `weight` uint8 [N, K/2], `weight_scale` E4M3 [N, K/16], "
                           "`weight_scale_2` = amax/2688 (decode), `input_scale`",
    ("nvfp4", "compressed-tensors"): "compressed-tensors `nvfp4-pack-quantized`: `weight_packed` uint8 [N, K/2], "
                                     "`weight_scale` E4M3 [N, K/16], `weight_global_scale` = 2688/amax (encode)",
}


# ---- source card --------------------------------------------------------------------------------

def split_card(text: str) -> tuple[dict, str, str]:
    """(metadata, raw front matter, body) of a model card."""
    import yaml

    m = re.match(r"^\ufeff?---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|$)", text, re.S)
    if not m:
        return {}, "", text
    raw = m.group(1)
    try:
        meta = yaml.safe_load(raw) or {}
    except yaml.YAMLError:
        meta = {}
    return (meta if isinstance(meta, dict) else {}), raw, text[m.end():]


def source_card(text: str) -> tuple[dict, str, str]:
    """Like :func:`split_card`, but a qconvert card yields the source card it preserved."""
    if CARD_MARKER not in text:
        return split_card(text)
    if SRC_BEGIN not in text:
        return {}, "", ""
    inner = text.split(SRC_BEGIN, 1)[1].split(SRC_END, 1)[0]
    head, _, body = inner.partition(SRC_BODY + "\n")
    m = re.search(r"```yaml\n(.*?)\n```", head, re.S)
    raw = m.group(1) if m else ""
    if raw:
        meta, _, _ = split_card(f"---\n{raw}\n---\n")
    else:
        meta = {}
    return meta, raw, body.rstrip("\n") + ("\n" if body.strip() else "")


# ---- card ---------------------------------------------------------------------------------------

def _repo_like(s: str | None) -> bool:
    return bool(s) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not Path(s).exists()


def _ranges(nums: list[int]) -> str:
    nums = sorted(set(nums))
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def _collapse(names: list[str]) -> list[str]:
    """``model.layers.{0-2}.input_layernorm``-style summaries; expert indices become ``*``."""
    out: dict[str, list[int]] = {}
    for n in names:
        k = re.sub(r"\.experts\.\d+\.", ".experts.*.", n)
        m = re.search(r"\.layers\.(\d+)\.", k)
        layer = int(m.group(1)) if m else -1
        k = re.sub(r"\.layers\.\d+\.", ".layers.{L}.", k, count=1)
        out.setdefault(k, []).append(layer)
    return [f"`{k.replace('{L}', '{' + _ranges(v) + '}')}`" if "{L}" in k else f"`{k}`" for k, v in out.items()]


def launch_commands(repo: str, scheme: str, dialect: str, moe: bool, revision: str | None = None,
                    layout: dict | None = None) -> list[dict]:
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


def render_card(dst: str | os.PathLike, repo_id: str, *, verify_report=None, base_model: str | None = None,
                revision: str | None = None, source_text: str | None = None,
                report: InspectReport | None = None) -> str:
    """README.md for the checkpoint at ``dst`` published as ``repo_id``."""
    import yaml

    dst = Path(dst)
    rep = report or inspect_checkpoint(dst)
    man = json.loads((dst / MANIFEST_NAME).read_text()) if (dst / MANIFEST_NAME).is_file() else {}
    if source_text is None:
        source_text = (dst / "README.md").read_text() if (dst / "README.md").is_file() else ""
    smeta, sraw, sbody = source_card(source_text)
    src_id = (man.get("source") or {}).get("id")
    base = base_model or (src_id if _repo_like(src_id) else None)
    scheme, dialect = rep.scheme, rep.dialect

    meta: dict = {}
    if base:
        meta["base_model"] = base
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = smeta.get("library_name") or "transformers"
    lic = smeta.get("license")
    license_link = smeta.get("license_link")
    if lic:
        meta["license"] = lic
        if smeta.get("license_name"):
            meta["license_name"] = smeta["license_name"]
        if not license_link and (dst / "LICENSE").is_file():
            license_link = "LICENSE"
        if not license_link and base:
            license_link = f"https://huggingface.co/{base}"
        if license_link:
            meta["license_link"] = license_link
    for k in ("pipeline_tag", "language", "datasets", "inference"):
        if k in smeta:
            meta[k] = smeta[k]
    tags = ["qconvert", scheme] + ([dialect] if dialect not in (scheme, "bf16") else [])
    if rep.layouts:
        tags.append("flashinfer-trtllm")
    for t in smeta.get("tags") or []:
        if isinstance(t, str) and t not in tags:
            tags.append(t)
    meta["tags"] = tags

    name = repo_id.split("/")[-1]
    L: list[str] = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip("\n"), "---", CARD_MARKER, ""]
    L.append(f"# {name}")
    L.append("")
    of = f"[{base}](https://huggingface.co/{base})" if base else "its BF16 source"
    L.append(f"{scheme.upper()} quantization of {of}, made with "
             f"qconvert {man.get('qconvert_version', __version__)}. "
             f"Engines: " + ", ".join(e.engine for e in rep.engines if e.loads) + ".")
    L.append("")
    L.append("## Quantization")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    L.append(f"| scheme | {SCHEME_TEXT.get(scheme, scheme)} |")
    L.append(f"| on-disk dialect | `{dialect}`: {DIALECT_TEXT.get((scheme, dialect), dialect)} |")
    if man.get("recipe"):
        L.append(f"| recipe | `{man['recipe']}` |")
    if man.get("scale_rule"):
        L.append(f"| scale rule | {man['scale_rule']} |")
    for k in ("zero_block_policy", "global_scale_rule", "nvfp4_formula"):
        if man.get(k):
            L.append(f"| {k.replace('_', ' ')} | {man[k]} |")
    if rep.layouts:
        lay = rep.layouts[0]
        L.append(f"| expert layout | pre-shuffled `{lay.get('layout')}` v{lay.get('layout_version')} for {lay.get('engine')} "
                 f"{lay.get('engine_version', '')} (tp={lay.get('tp')}, ep={lay.get('ep')}, FlashInfer "
                 f"{lay.get('flashinfer_version')}) |")
    opts = man.get("options") or {}
    if opts:
        L.append("| options | " + ", ".join(f"`{k}={v}`" for k, v in opts.items() if v not in (None, (), [], False, 0))
                 + " |")
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
        L.append(f"Whole decoder layers kept in BF16: {man['bf16_layers']}.")
        L.append("")
    L.append("| why | modules |")
    L.append("|---|---|")
    for why, mods in sorted(kept.items()):
        L.append(f"| {why} | {', '.join(_collapse(mods))} |")
    excl = next(iter(rep.exclusions.values()), None)
    if excl is not None:
        L.append("")
        L.append(f"The exclusion list ({len(excl)} entries, in `" + "`, `".join(
            w.split(" ")[-1] for w in rep.exclusions) + "`) names these modules so both engines load them unquantized.")
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
        L.append(f"`qconvert verify` {'passed' if v.ok else 'FAILED'}: {len(v.tensors)} quantized tensors dequantized and "
                 f"compared with the BF16 source, {v.kept_identical} BF16 tensors byte-identical; config, index, "
                 "manifest checksums and exclusion list consistent." if v.ok else
                 f"`qconvert verify` FAILED ({len(v.failures)} problems); pushed with --force.")
        L.append("")
        L.append("| module group | format | tensors | rel. error mean | rel. error max | min SQNR |")
        L.append("|---|---|---|---|---|---|")
        for g, d in v.groups().items():
            L.append(f"| `{g}` | {d['format']} | {d['count']} | {d['mean_rel_err']:.4f} | {d['max_rel_err']:.4f} | "
                     f"{d['min_sqnr_db']:.1f} dB |")
        if v.engine and v.engine.get("top1_agreement") is not None:
            L.append("")
            L.append(f"vLLM next-token agreement with the source: top-1 {v.engine['top1_agreement']:.3f}, "
                     f"mean KL {v.engine['mean_kl']:.4g}.")
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
    L.append(f"- qconvert {man.get('qconvert_version', __version__)}")
    L.append(f"- made for vLLM {ENGINE_TARGETS['vllm']} and SGLang {ENGINE_TARGETS['sglang']}")
    if man.get("source", {}).get("revision"):
        L.append(f"- source revision `{man['source']['revision']}`")
    L.append("")
    if lic:
        L.append("## License")
        L.append("")
        link = f"[{license_link}]({license_link})" if license_link else ""
        L.append(f"`{lic}`{(' (' + smeta['license_name'] + ')') if smeta.get('license_name') else ''}, inherited from "
                 f"the source model{': ' + link if link else ''}.")
        L.append("")
    if sraw or sbody.strip():
        L.append("## Original model card")
        L.append("")
        L.append(SRC_BEGIN)
        if sraw:
            L.append("Original metadata:")
            L.append("")
            L.append("```yaml")
            L.append(sraw)
            L.append("```")
        L.append(SRC_BODY)
        L.append(sbody.rstrip("\n"))
        L.append(SRC_END)
    return "\n".join(L) + "\n"


# ---- push ---------------------------------------------------------------------------------------

def _source_of(dst: Path) -> str | None:
    p = dst / MANIFEST_NAME
    if not p.is_file():
        return None
    try:
        sid = (json.loads(p.read_text()).get("source") or {}).get("id")
    except ValueError:
        return None
    return sid if sid and (Path(sid).is_dir() or _repo_like(sid)) else None


def push(dst: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
         token: str | None = None, force: bool = False, src: str | None = None, base_model: str | None = None,
         max_rel_err: float | None = None, verify_report=None, progress: bool | None = None,
         log: Callable[[str], None] | None = None) -> str:
    """Verify ``dst`` (unless a report is given), write README.md and upload. Returns the repo URL."""
    from .verify import format_report, verify

    log = log or (lambda s: None)
    dst = Path(dst).expanduser()
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id or ""):
        raise QConvertError(f"{repo_id!r}: not a Hub repo id; use the form org/name")
    rep = inspect_checkpoint(dst)
    vr = verify_report
    if vr is None:
        src = src or _source_of(dst)
        if src is None:
            if not force:
                raise QConvertError(f"{dst}: cannot verify before pushing because the BF16 source is unknown; "
                                    "pass --src SRC (or --force to push unverified)")
            log("push: not verified (no source); --force")
        else:
            log(f"push: verifying {dst} against {src}")
            vr = verify(src, str(dst), max_rel_err=max_rel_err, progress=progress, log=log)
            log(format_report(vr))
    if vr is not None and not vr.ok:
        if not force:
            raise QConvertError(f"{dst}: verify failed ({vr.failures[0]}); fix the checkpoint, or pass --force to push it anyway")
        log(f"push: verify failed ({len(vr.failures)} problems); pushing anyway (--force)")
    readme = dst / "README.md"
    source_text = readme.read_text() if readme.is_file() else ""
    card = render_card(dst, repo_id, verify_report=vr, base_model=base_model, revision=revision,
                       source_text=source_text, report=rep)
    readme.write_text(card)
    if vr is not None:
        (dst / VERIFY_NAME).write_text(json.dumps(vr.to_dict(), indent=2, default=str) + "\n")
    return upload(dst, repo_id, private=private, revision=revision, token=token, log=log)


def upload(dst: Path, repo_id: str, *, private: bool = False, revision: str | None = None, token: str | None = None,
           log: Callable[[str], None] | None = None) -> str:
    """Create the repo (and branch) if needed and upload ``dst``; resumable by re-running."""
    log = log or (lambda s: None)
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # pragma: no cover
        raise QConvertError("huggingface_hub is not installed; pip install huggingface_hub") from None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    ignore = [".cache/**", ".*.qconvert-tmp-*", "*.lock"]
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        log(f"push: uploading {dst} to {repo_id}" + (f"@{revision}" if revision else ""))
        if hasattr(api, "upload_large_folder"):
            api.upload_large_folder(repo_id=repo_id, folder_path=str(dst), repo_type="model", revision=revision,
                                    private=private, ignore_patterns=ignore)
        else:
            api.upload_folder(repo_id=repo_id, folder_path=str(dst), repo_type="model", revision=revision,
                              commit_message=f"qconvert {__version__}: upload {dst.name}", ignore_patterns=ignore)
    except HfHubHTTPError as e:
        raise QConvertError(f"{repo_id}: Hub upload failed ({str(e).splitlines()[0]}); check HF_TOKEN and the repo "
                            "id, then re-run push to resume") from None
    except OSError as e:
        raise QConvertError(f"{repo_id}: Hub upload failed ({e.__class__.__name__}: {e}); check the network and re-run "
                            "push to resume") from None
    return str(url)
