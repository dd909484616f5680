"""The ``qconvert`` command: a thin click layer over the library."""

from __future__ import annotations

import re
from pathlib import Path

import click

from . import __version__
from .cli_errors import GuardedGroup, handle_errors
from .errors import OutputError, QConvertError


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def plan_options(fn):
    """Options shared by every conversion command."""
    opts = [
        click.argument("src"),
        click.argument("dst", required=False),
        click.option("--last-n-bf16", type=click.IntRange(min=0), default=0, show_default=True, help="Keep the last N decoder layers in BF16."),
        click.option("--first-n-bf16", type=click.IntRange(min=0), default=0, show_default=True, help="Keep the first M decoder layers in BF16."),
        click.option("--keep-bf16", multiple=True, metavar="PATTERN", help="Keep modules matching this glob in BF16 (repeatable)."),
        click.option("--quantize-lm-head", is_flag=True, help="Quantize lm_head too (engines usually keep it BF16)."),
        click.option("--dry-run", is_flag=True, help="Print the per-layer plan and projected size; write nothing."),
        click.option("--force", is_flag=True, help="Replace DST if it exists (only after the new output is complete)."),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                     help="Where to quantize. cpu: one-pass C kernels built at first use with $CC/cc "
                          "(QCONVERT_CPU_KERNELS=0: torch code); cuda: Triton kernels "
                          "(QCONVERT_CUDA_QUANTIZER=eager|compile: torch code). Same bytes either way."),
        click.option("--allow-non-finite", is_flag=True, help="Convert weights holding NaN/Inf (recorded in the manifest)."),
        click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal)."),
        click.option("--allow-pickle", is_flag=True, help="Read a .bin/.pt checkpoint with torch.load(weights_only=True) "
                     "(tensors only; no code runs), via a safetensors copy beside DST."),
        click.option("--push-to-hub", default=None, metavar="REPO", help="After converting, verify DST and push it to this Hub repo."),
        click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private."),
        click.option("--revision", default=None, help="With --push-to-hub: branch to push to."),
        click.option("--resume", is_flag=True, help="Continue an interrupted run of the same command from its last "
                     "complete output shard (verified by sha256); the result is byte-identical to an uninterrupted run."),
        click.option("--no-source-checksums", is_flag=True, help="Do not sha256 the source shards (the manifest then "
                     "records none, and verify cannot tell whether DST came from SRC); saves a core-second per 1.5-2 GB "
                     "read, for loops that convert a fresh checkpoint every step. Output shards are still hashed (see --no-checksums); "
                     "Hub-cache sources cost nothing either way (the digest is the cached file's name)."),
        click.option("--no-checksums", is_flag=True, help="Hash nothing: neither source nor output shards (implies "
                     "--no-source-checksums). verify then cannot detect a shard changed after conversion, and "
                     "--resume keeps finished shards by size. Saves a core-second per 1.5-2 GB of output: for "
                     "loops that write a fresh checkpoint every step and load it at once."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def layout_options(fn):
    """Kernel-ready MoE expert layouts (issue: pre-shuffled checkpoints)."""
    opts = [
        click.option("--layout", type=click.Choice(["flashinfer-trtllm"]), default=None,
                     help="Write MoE experts pre-shuffled for the FlashInfer TRT-LLM MoE kernels."),
        click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
                     help="With --layout: engine whose post-processing the layout reproduces (padding, names, shapes)."),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="With --layout: tensor-parallel size; write per-rank tensors."),
        click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
                     help="With --layout: expert-parallel size; write per-rank tensors."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


_EXPERT_ROW = re.compile(r"^(?P<pre>.*\.layers\.)(?P<layer>\d+)(?P<mid>\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>\w+)$")


def _ranges(ns) -> str:
    """0,1,2,5,7,8 -> "0-2,5,7-8"."""
    ns = sorted(set(ns))
    out, i = [], 0
    while i < len(ns):
        j = i
        while j + 1 < len(ns) and ns[j + 1] == ns[j] + 1:
            j += 1
        out.append(str(ns[i]) if i == j else f"{ns[i]}-{ns[j]}")
        i = j + 1
    return ",".join(out)


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
            g = groups[key] = {"at": len(lines), "layers": set(), "experts": set(), "projs": [], "n": 0,
                               "in": 0, "out": 0}
            lines.append(None)
        for m in ms:
            g["layers"].add(int(m["layer"]))
            g["experts"].add(int(m["e"]))
            if m["proj"] not in g["projs"]:
                g["projs"].append(m["proj"])
        g["n"] += len(ms)
        g["in"] += r.bytes_in
        g["out"] += r.bytes_out
    for (pre, mid, fmt, shape, reason), g in groups.items():
        what = (f"{pre.rstrip('.')} {_ranges(g['layers'])} experts {_ranges(g['experts'])} "
                f"{'/'.join(g['projs'])} ({g['n']} tensors)")
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
        act = {"weight-only": "W4A16 (weights only; no input scales) -- the safe default",
               "unit": "W4A4, input scale 1.0 (run the engine in per-token activation mode)",
               "copied": f"W4A4, input scales copied from {getattr(o, 'input_scales_from', None)}"}[mode]
        return f"NVFP4 {act}; {recipe} recipe"
    return "BF16 (nothing quantized)"


def layout_line(result) -> str:
    o = result.options
    if o is None or not o.layout:
        return "plain (tensors as the engines' stock loaders read them)"
    return (f"{o.layout} for {o.engine}, --tp {o.tp} --ep {o.ep} (MoE experts pre-shuffled under "
            "'.trtllm' names, which stock loaders skip: see the README's kernel-ready MoE layouts)")


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
        s = (f"{len(kept)} weights, in the source's dtype ({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))};"
             " not cast: engines cast them to the model's dtype when loading)")
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
    click.echo(f"  size              : {_fmt_bytes(result.bytes_in)} -> {_fmt_bytes(result.bytes_out)} ({ratio:.2f}x smaller)")
    click.echo(f"  exclusion list    : {len(p.exclusions)} entries")
    odd = sorted({t.reason for t in p.tensors.values() if t.reason.startswith(("K=", "fused", "experts of"))})
    for r in odd:
        click.echo(f"  note: kept BF16 because {r}")
    for n in result.notes:
        click.echo(f"  note: {n}")
    if not dry_run:
        rate = result.bytes_in / result.seconds / 1e9 if result.seconds else 0
        click.echo(f"  time              : {result.seconds:.1f} s ({rate:.2f} GB/s of input)")
        click.echo(f"  written to        : {result.dst}")


#: options that only mean something with another one; refused without it instead of ignored
_NEEDS = {"tp": "--layout", "ep": "--layout", "engine": "--layout", "private": "--push-to-hub",
          "revision": "--push-to-hub"}
#: options of the plan that choose what is quantized: meaningless for `qconvert bf16`
_QUANT_ONLY = ("last_n_bf16", "first_n_bf16", "keep_bf16", "quantize_lm_head")


def _given(ctx: click.Context, name: str) -> bool:
    """True when the user passed option ``name`` (on the command line or from the environment)."""
    src = ctx.get_parameter_source(name)
    return src is not None and src not in (click.core.ParameterSource.DEFAULT,
                                           click.core.ParameterSource.DEFAULT_MAP)


def _refuse_ignored_options(scheme: str, layout: str | None):
    """An option that would have no effect is refused with one line, not silently ignored."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.command.name != scheme:  # called from `qconvert demo`: fixed options
        return
    flag = lambda n: "--" + n.replace("_", "-")  # noqa: E731
    for name, needs in _NEEDS.items():
        if needs == "--layout" and layout:
            continue
        if needs == "--push-to-hub" and ctx.params.get("push_to_hub"):
            continue
        if name in ctx.params and _given(ctx, name):
            raise click.UsageError(f"{flag(name)} has no effect without {needs}; pass {needs} or drop {flag(name)}")
    if scheme == "bf16":
        for name in _QUANT_ONLY:
            if name in ctx.params and _given(ctx, name):
                raise click.UsageError(f"{flag(name)} chooses what is quantized, and qconvert bf16 quantizes "
                                       f"nothing; drop it, or use qconvert mxfp8/nvfp4")


def _refuse_existing(dst, force: bool):
    """An existing DST without --force, refused before torch is imported (4-6 s on a busy 2-core
    machine, against 0.1-0.2 s); the library checks DST again, fully."""
    p = Path(dst).expanduser()
    if not force and p.exists():
        raise OutputError(f"{p.absolute()}: already exists; choose another DST or pass --force to replace it")


def _run_convert(scheme, src, dst, last_n_bf16, first_n_bf16, keep_bf16, quantize_lm_head, dry_run, force,
                 device, allow_non_finite, progress, dialect=None, push_to_hub=None, private=False, revision=None,
                 **extra):
    if dst is None and not dry_run:
        raise click.UsageError("DST is required unless --dry-run is given")
    _refuse_ignored_options(scheme, extra.get("layout"))
    if not dry_run:
        _refuse_existing(dst, force)
    from .convert.pipeline import ConvertOptions, convert  # imports torch
    from .convert.plan import PlanOptions

    popts = PlanOptions(scheme=scheme, last_n_bf16=last_n_bf16, first_n_bf16=first_n_bf16,
                        keep_bf16=tuple(keep_bf16), quantize_lm_head=quantize_lm_head,
                        experts_only=extra.pop("experts_only", False))
    no_checksums = extra.pop("no_checksums", False)
    extra["source_checksums"] = not (extra.pop("no_source_checksums", False) or no_checksums)
    extra["output_checksums"] = not no_checksums
    opts = ConvertOptions(scheme=scheme, dialect=dialect, plan=popts, device=device, force=force, dry_run=dry_run,
                          allow_non_finite=allow_non_finite, progress=progress, **extra)
    result = convert(src, dst, scheme, opts)
    if dry_run:
        print_plan(result)
    print_summary(result, dry_run)
    if push_to_hub and not dry_run:
        from .hub_cli import push_after_convert
        push_after_convert(src, result.dst, push_to_hub, private, revision, progress)
    return result


@click.group(cls=GuardedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconvert")
def main():
    """Convert BF16 Hugging Face checkpoints to MXFP8 / NVFP4 for vLLM and SGLang, and hot-reload them."""


@main.command()
@plan_options
@layout_options
@click.option("--dialect", type=click.Choice(["auto", "sglang", "modelopt"]), default="auto", show_default=True,
              help="auto: loads in vLLM and SGLang; sglang: miles-style weight_scale_inv; modelopt: ModelOpt MXFP8.")
@handle_errors
def mxfp8(**kw):
    """Convert SRC (directory or Hub repo id) to MXFP8 at DST."""
    _run_convert("mxfp8", **kw)


@main.command()
@plan_options
@layout_options
@click.option("--dialect", type=click.Choice(["modelopt", "compressed-tensors"]), default="modelopt", show_default=True)
@click.option("--recipe", type=click.Choice(["te", "modelopt"]), default="te", show_default=True,
              help="te: TransformerEngine / FlashInfer (no fast math) operation order; modelopt: ModelOpt's.")
@click.option("--weight-only", "input_mode", flag_value="weight-only",
              help="W4A16: no activation scales; engines run weight-only NVFP4 (the default).")
@click.option("--input-scale", "input_scale", type=click.Choice(["unit"]),
              help="unit: W4A4 with input scale 1.0 (for engines in per-token activation mode).")
@click.option("--input-scales-from", type=click.Path(), default=None, metavar="CKPT",
              help="W4A4 with calibrated input scales copied from an NVFP4 checkpoint of the same model.")
@click.option("--experts-only", is_flag=True, help="Quantize only MoE experts; attention and dense layers stay BF16.")
@handle_errors
def nvfp4(input_mode, input_scale, input_scales_from, **kw):
    """Convert SRC (directory or Hub repo id) to NVFP4 at DST."""
    chosen = [m for m in (input_mode, input_scale and "unit", input_scales_from and "copied") if m]
    if len(chosen) > 1:
        raise click.UsageError("pass at most one of --weight-only, --input-scale unit, --input-scales-from")
    mode = chosen[0] if chosen else "weight-only"
    return _run_convert("nvfp4", input_mode=mode, input_scales_from=input_scales_from, **kw)


@main.command()
@plan_options
@layout_options
@handle_errors
def bf16(**kw):
    """Copy SRC to DST in BF16, with MoE experts pre-shuffled (use with --layout flashinfer-trtllm)."""
    if not kw.get("layout"):
        raise click.UsageError("qconvert bf16 only re-lays out experts: pass --layout flashinfer-trtllm")
    _run_convert("bf16", **kw)


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@handle_errors
def unshuffle(src, dst, force):
    """Invert a pre-shuffled (--layout) checkpoint SRC back to the plain checkpoint at DST, bit-exact."""
    _refuse_existing(dst, force)
    from .convert.unshuffle import unshuffle_checkpoint  # imports torch

    res = unshuffle_checkpoint(src, dst, force=force)
    click.echo(f"unshuffled {res['layers']} MoE layers ({res['tensors']} tensors) into {dst}")


@main.command()
@click.argument("dst")
@click.option("--arch", type=click.Choice(["qwen3-moe", "qwen3"]), default="qwen3-moe", show_default=True)
@click.option("--scheme", type=click.Choice(["mxfp8", "nvfp4"]), default="mxfp8", show_default=True)
@click.option("--last-n-bf16", type=int, default=1, show_default=True)
@click.option("--force", is_flag=True)
@handle_errors
def demo(dst, arch, scheme, last_n_bf16, force):
    """Build the built-in tiny model (offline) in DST/bf16 and convert it to DST/<scheme>."""
    root = Path(dst)
    src = root / "bf16"
    out = root / f"{scheme}-last{last_n_bf16}-bf16" if last_n_bf16 else root / scheme
    if src.exists() and not force:
        raise QConvertError(f"{src}: already exists; choose another DST or pass --force")
    if src.is_symlink():
        raise QConvertError(f"{src}: is a symbolic link; demo writes its model there and does not follow links: "
                            "choose another DST")
    from .convert.demo import build_demo_model  # imports torch
    if src.exists():
        import shutil
        shutil.rmtree(src)
    build_demo_model(src, arch=arch)
    click.echo(f"built demo model {arch} at {src}")
    _run_convert(scheme, str(src), str(out), last_n_bf16, 0, (), False, False, force, "cpu", False, None,
                 **({"input_mode": "weight-only"} if scheme == "nvfp4" else {}))


def _add_subsystem_commands():
    """Commands that live beside their library code (loaders, hub, inspect). Imported after
    ``main`` and ``handle_errors`` exist, since those modules use them."""
    from .hub_cli import inspect, push, verify
    from .client.cli_commands import reload, stage

    for cmd in (reload, stage, inspect, verify, push):
        main.add_command(cmd)


_add_subsystem_commands()

if __name__ == "__main__":
    main()
