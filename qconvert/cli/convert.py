"""Convert commands: ``qconvert mxfp8 | nvfp4 | bf16 | unshuffle | demo``, and the plan and
summary they print."""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..convert.plan import NOTABLE_REASONS, index_ranges
from ..errors import OutputError
from .guard import handle_errors
from .options import DEMO, DST, FORCE, LAYOUT, MXFP8_DIALECT, NEEDS, NVFP4, PLAN, QUANT_ONLY, SRC, given


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


_EXPERT_ROW = re.compile(r"^(?P<pre>.*\.layers\.)(?P<layer>\d+)(?P<mid>\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>\w+)$")


def plan_lines(rows) -> list[tuple[str, str, str, int, int, str]]:
    """(module, format, shape, bytes in, bytes out, reason) per printed line: one row per module,
    except MoE experts, grouped by format, shape and reason over layers and experts ("layers 0-47
    experts 0-127 gate_proj/up_proj (12288 tensors)"), so a 30B MoE plan is a screen, not 18,000 lines."""
    lines, groups = [], {}
    for r in rows:
        names = [n[: -len(".weight")] if n.endswith(".weight") else n for n in (r.sources or (r.module,))]
        ms = [_EXPERT_ROW.match(n) for n in names]
        if not all(ms):
            lines.append((r.module, r.fmt, str(list(r.shape)), r.bytes_in, r.bytes_out, r.reason))
            continue
        key = (ms[0]["pre"], ms[0]["mid"], r.fmt, tuple(r.shape), r.reason)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "at": len(lines),
                "layers": set(),
                "experts": set(),
                "projs": [],
                "n": 0,
                "in": 0,
                "out": 0,
            }
            lines.append(None)
        for m in ms:
            g["layers"].add(int(m["layer"]))
            g["experts"].add(int(m["e"]))
            if m["proj"] not in g["projs"]:
                g["projs"].append(m["proj"])
        g["n"] += len(ms)
        g["in"] += r.bytes_in
        g["out"] += r.bytes_out
    for (pre, _mid, fmt, shape, reason), g in groups.items():
        what = (
            f"{pre.rstrip('.')} {index_ranges(g['layers'])} experts {index_ranges(g['experts'])} "
            f"{'/'.join(g['projs'])} ({g['n']} tensors)"
        )
        lines[g["at"]] = (what, fmt, str(list(shape)), g["in"], g["out"], reason)
    return lines


def print_plan(result, limit: int | None = None):
    rows = plan_lines(result.rows)
    click.echo(f"{'module':<56} {'format':<7} {'shape':<16} {'in':>10} {'out':>10}  reason")
    shown = rows if limit is None else rows[:limit]
    for module, fmt, shape, b_in, b_out, reason in shown:
        click.echo(f"{module:<56} {fmt:<7} {shape:<16} {_fmt_bytes(b_in):>10} {_fmt_bytes(b_out):>10}  {reason}")
    if len(shown) < len(rows):
        click.echo(f"... {len(rows) - len(shown)} more rows")


def format_line(result) -> str:
    """What the quantized tensors are: scheme, recipe, and for NVFP4 whether activations are too."""
    o = result.options
    if result.scheme == "mxfp8":
        return "MXFP8 (E4M3, one E8M0 scale per 32; RCEIL); activations quantized by the engine at run time"
    if result.scheme == "nvfp4":
        recipe = getattr(o, "recipe", "te")
        mode = getattr(o, "input_mode", "weight-only")
        act = {
            "weight-only": "W4A16 (weights only; no input scales) -- the safe default",
            "unit": "W4A4, input scale 1.0 (run the engine in per-token activation mode)",
            "copied": f"W4A4, input scales copied from {getattr(o, 'input_scales_from', None)}",
        }[mode]
        return f"NVFP4 {act}; {recipe} recipe"
    if o is not None and not o.layout and result.scheme == "bf16":
        return "BF16, the source's quantized tensors decoded (nothing quantized)"
    return "BF16 (nothing quantized)"


def layout_line(result) -> str:
    o = result.options
    if o is None or not o.layout:
        return "plain (tensors as the engines' stock loaders read them)"
    return (
        f"{o.layout} for {o.engine}, --tp {o.tp} --ep {o.ep} (MoE experts pre-shuffled under "
        "'.trtllm' names, which stock loaders skip: see the README's kernel-ready MoE layouts)"
    )


def kept_line(result) -> str:
    """How many weights stay unquantized, and in which dtype: a source's FP32 or FP16 weights are
    written as they are (engines cast unquantized weights to the model's dtype when loading)."""
    p = result.plan
    kept = [t for t in p.tensors.values() if t.action == "keep" and t.module]
    dtypes: dict[str, int] = {}
    for t in kept:
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
    if set(dtypes) <= {"BF16"}:
        s = f"{len(kept)} weights, BF16"
    else:
        s = (
            f"{len(kept)} weights, in the source's dtype ({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))};"
            " not cast: engines cast them to the model's dtype when loading)"
        )
    return s + (f" (BF16 layers: {p.bf16_layers})" if p.bf16_layers else "")


def print_summary(result, dry_run: bool):
    p = result.plan
    q = [t for t in p.tensors.values() if t.action == "quantize"]
    click.echo("")
    click.echo(f"{'plan' if dry_run else 'converted'}: {p.arch_name} -> {result.scheme} ({result.dialect} dialect)")
    click.echo(f"  format            : {format_line(result)}")
    click.echo(f"  layout            : {layout_line(result)}")
    click.echo(f"  quantized tensors : {len(q)}")
    click.echo(f"  kept unquantized  : {kept_line(result)}")
    ratio = result.bytes_in / result.bytes_out if result.bytes_out else 0
    how = f"{ratio:.2f}x smaller" if ratio >= 1 or not ratio else f"{1 / ratio:.2f}x larger"  # larger: a decode
    click.echo(f"  size              : {_fmt_bytes(result.bytes_in)} -> {_fmt_bytes(result.bytes_out)} ({how})")
    click.echo(f"  exclusion list    : {len(p.exclusions)} entries")
    odd = sorted({t.reason for t in p.tensors.values() if t.code in NOTABLE_REASONS})
    for r in odd:
        click.echo(f"  note: kept BF16 because {r}")
    for n in result.notes:
        click.echo(f"  note: {n}")
    if not dry_run:
        rate = result.bytes_in / result.seconds / 1e9 if result.seconds else 0
        click.echo(f"  time              : {result.seconds:.1f} s ({rate:.2f} GB/s of input)")
        click.echo(f"  written to        : {result.dst}")


def _refuse_ignored_options(scheme: str, layout: str | None):
    """An option that would have no effect is refused with one line, not silently ignored."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.command.name != scheme:
        return
    flag = lambda n: "--" + n.replace("_", "-")  # noqa: E731
    for name, needs in NEEDS.items():
        if needs == "--layout" and layout:
            continue
        if needs == "--push-to-hub" and ctx.params.get("push_to_hub"):
            continue
        if name in ctx.params and given(ctx, name):
            raise click.UsageError(f"{flag(name)} has no effect without {needs}; pass {needs} or drop {flag(name)}")
    if scheme == "bf16":
        for name in QUANT_ONLY:
            if name in ctx.params and given(ctx, name):
                raise click.UsageError(
                    f"{flag(name)} chooses what is quantized, and qconvert bf16 quantizes "
                    f"nothing; drop it, or use qconvert mxfp8/nvfp4"
                )


def _refuse_existing(dst, force: bool):
    """An existing DST without --force, refused before torch is imported (4-6 s on a busy 2-core
    machine, against 0.1-0.2 s); the library checks DST again, fully."""
    p = Path(dst).expanduser()
    if not force and p.exists():
        raise OutputError(f"{p.absolute()}: already exists; choose another DST or pass --force to replace it")


def _run_convert(
    scheme,
    *,
    src,
    dst,
    last_n_bf16,
    first_n_bf16,
    keep_bf16,
    quantize_lm_head,
    dry_run,
    force,
    device,
    allow_non_finite,
    progress,
    dialect=None,
    push_to_hub=None,
    private=False,
    revision=None,
    **extra,
):
    """One convert command: the CLI's checks (before torch loads), the library's ``convert``, the report."""
    if dst is None and not dry_run:
        raise click.UsageError("DST is required unless --dry-run is given")
    _refuse_ignored_options(scheme, extra.get("layout"))
    if not dry_run:
        _refuse_existing(dst, force)
    from ..convert.pipeline import ConvertOptions, convert  # imports torch
    from ..convert.plan import PlanOptions

    popts = PlanOptions(
        scheme=scheme,
        last_n_bf16=last_n_bf16,
        first_n_bf16=first_n_bf16,
        keep_bf16=tuple(keep_bf16),
        quantize_lm_head=quantize_lm_head,
        experts_only=extra.pop("experts_only", False),
    )
    no_checksums = extra.pop("no_checksums", False)
    extra["source_checksums"] = not (extra.pop("no_source_checksums", False) or no_checksums)
    extra["output_checksums"] = not no_checksums
    opts = ConvertOptions(
        scheme=scheme,
        dialect=dialect,
        plan=popts,
        device=device,
        force=force,
        dry_run=dry_run,
        allow_non_finite=allow_non_finite,
        progress=progress,
        **extra,
    )
    result = convert(src, dst, scheme, opts)
    if dry_run:
        print_plan(result)
    print_summary(result, dry_run)
    if push_to_hub and not dry_run:
        from .hub import push_after_convert

        push_after_convert(src, result.dst, push_to_hub, private, revision, progress)
    return result


@click.command()
@PLAN
@LAYOUT
@MXFP8_DIALECT
@handle_errors
def mxfp8(**kw):
    """Convert SRC (directory or Hub repo id) to MXFP8 at DST."""
    _run_convert("mxfp8", **kw)


@click.command()
@PLAN
@LAYOUT
@NVFP4
@handle_errors
def nvfp4(input_mode, input_scale, input_scales_from, **kw):
    """Convert SRC (directory or Hub repo id) to NVFP4 at DST."""
    chosen = [m for m in (input_mode, input_scale and "unit", input_scales_from and "copied") if m]
    if len(chosen) > 1:
        raise click.UsageError("pass at most one of --weight-only, --input-scale unit, --input-scales-from")
    mode = chosen[0] if chosen else "weight-only"
    return _run_convert("nvfp4", input_mode=mode, input_scales_from=input_scales_from, **kw)


@click.command()
@PLAN
@LAYOUT
@handle_errors
def bf16(**kw):
    """Decode a quantized SRC (MXFP4 gpt-oss, FP8 block-scaled) to a BF16 checkpoint at DST; or, with
    --layout flashinfer-trtllm, copy a BF16 SRC with its MoE experts pre-shuffled."""
    if not kw.get("layout") and not _declares_quantization(kw["src"]):
        raise click.UsageError(
            "qconvert bf16 decodes quantized checkpoints (MXFP4, FP8 block-scaled), and SRC declares no "
            "quantization_config; to re-lay out a BF16 checkpoint's experts pass --layout flashinfer-trtllm"
        )
    _run_convert("bf16", **kw)


def _declares_quantization(src: str) -> bool:
    """False only for a local SRC whose config.json holds no ``quantization_config`` (read before
    torch loads; anything else, a Hub id included, is decided by the library)."""
    import json

    cfg = Path(src).expanduser() / "config.json"
    try:
        return "quantization_config" in json.loads(cfg.read_text())
    except (OSError, ValueError, TypeError):
        return True


@click.command()
@SRC
@DST
@FORCE
@handle_errors
def unshuffle(src, dst, force):
    """Invert a pre-shuffled (--layout) checkpoint SRC back to the plain checkpoint at DST, bit-exact."""
    _refuse_existing(dst, force)
    from ..convert.unshuffle import unshuffle_checkpoint  # imports torch

    res = unshuffle_checkpoint(src, dst, force=force)
    click.echo(f"unshuffled {res['layers']} MoE layers ({res['tensors']} tensors) into {dst}")


@click.command()
@DST
@DEMO
@FORCE
@handle_errors
def demo(dst, arch, scheme, last_n_bf16, seed, force):
    """Build the built-in tiny model (offline) in DST/bf16 and convert it to DST/<scheme>."""
    _refuse_existing(Path(dst) / "bf16", force)
    from ..convert.demo import convert_demo  # imports torch

    result = convert_demo(
        dst, arch=arch, scheme=scheme, last_n_bf16=last_n_bf16, force=force, log=click.echo, seed=seed
    )
    print_summary(result, dry_run=False)


COMMANDS = (mxfp8, nvfp4, bf16, unshuffle, demo)
