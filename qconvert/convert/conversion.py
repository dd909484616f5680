"""The conversion job: resolve the source, plan, build the jobs, run them, write the metadata,
install DST. Each step lives in a module of its own (options, jobs, runner, metadata, destination).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import OutputError, QConvertError
from ..formats import dialects
from ..interrupts import ctrl_c_safe
from . import decode, destination, fp8_source, fused, kernels
from . import resume as _resume
from .checkpoint import Checkpoint, load_checkpoint
from .jobs import BuiltJobs, build_jobs, plan_rows
from .metadata import write_metadata
from .options import ConvertOptions, ConvertResult, resolve_scheme
from .plan import Plan, build_plan
from .runner import Runner


@ctrl_c_safe
def convert(
    src: str,
    dst: str | os.PathLike | None,
    scheme: str | None = None,
    opts: ConvertOptions | None = None,
    log: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst``. With ``opts.dry_run`` only plans.

    The scheme is ``opts.scheme``; ``scheme``, if given, must be the same (or ``opts`` omitted)."""
    opts = resolve_scheme(scheme, opts)
    t0 = time.perf_counter()
    if opts.device != "cpu" and not torch.cuda.is_available():
        raise QConvertError(f"--device {opts.device}: CUDA is not available here; use --device cpu")
    if not opts.dry_run:
        if dst is None:
            raise OutputError("DST is required unless --dry-run")
        dst = Path(dst).expanduser().absolute()
        destination.check_dst(dst, opts.force, src)
    pickled = _materialize_pickles(src, dst, opts)
    try:
        return _convert(src if pickled is None else str(pickled), src, dst, opts, t0)
    finally:
        if pickled is not None:
            shutil.rmtree(pickled, ignore_errors=True)


def prepare(src: str, opts: ConvertOptions) -> tuple[Checkpoint, Plan, str, BuiltJobs]:
    """Resolve and plan: the checkpoint, its plan, the dialect and the jobs."""
    to_bf16 = opts.scheme == "bf16"
    ckpt = load_checkpoint(src, decode=to_bf16)
    if to_bf16 and not opts.layout:  # a quantized source decoded to BF16 (decode.py)
        plan, built = decode.prepare(ckpt, opts)
        return ckpt, plan, dialects.resolve_dialect(opts.scheme, opts.dialect), built
    inventory = {n: (e.dtype, e.shape) for n, e in ckpt.tensors.items()}
    if to_bf16 and decode.source_of(ckpt.config, inventory, ckpt.root / "config.json")[0] is not None:
        raise QConvertError(
            f"{ckpt.root}: a quantized checkpoint; --layout re-lays out BF16 experts: decode it first "
            "(qconvert bf16 SRC DECODED, without --layout), then lay out DECODED "
            "(docs/formats.md#quantized-sources-decoded-to-bf16)"
        )
    qsrc = fp8_source.detect(ckpt.config, inventory, ckpt.root / "config.json")
    if qsrc is not None:  # FP8 block-scaled source: planned as BF16, decoded by the jobs
        inventory = qsrc.logical_inventory(inventory)
    # fused expert tensors planned as their per-expert matrices (fused.py)
    inventory, views = fused.expand(inventory, ckpt.config, ckpt.root / "config.json")
    if views and qsrc is not None:
        raise QConvertError(
            f"tensor {next(iter(views.values())).source!r}: fused expert tensors in an FP8 source are "
            "not supported; convert a BF16 (or per-expert FP8) checkpoint"
        )
    popts = opts.plan
    if views and popts.keep_bf16:  # --keep-bf16 naming a fused tensor keeps its layer's experts
        popts = dataclasses.replace(popts, keep_bf16=fused.keep_patterns(popts.keep_bf16, views))
    plan = build_plan(inventory, ckpt.config, popts, config_path=ckpt.root / "config.json")
    dialect = dialects.resolve_dialect(opts.scheme, opts.dialect)
    built = build_jobs(plan, opts.scheme, dialect, opts)
    built.jobs = fused.merge_jobs(built.jobs, views)
    if views:
        plan.notes.append(fused.plan_note(views))
    if qsrc is not None:
        built.jobs, built.source = qsrc.wrap_jobs(built.jobs), qsrc
        plan.notes.extend(qsrc.describe(plan, opts.scheme, fp8_source.scale_reader(ckpt)))
    return ckpt, plan, dialect, built


def _convert(read_src: str, src: str, dst, opts: ConvertOptions, t0: float) -> ConvertResult:
    scheme = opts.scheme
    ckpt, plan, dialect, built = prepare(read_src, opts)
    jobs = built.jobs
    if read_src != src:
        ckpt.source_id = src  # the manifest names what the user converted, not the safetensors copy
    elif dst is not None and not opts.dry_run:
        # a Hub source, now resolved: its whole repo cache (snapshots/ and the blobs/ they point into)
        root = ckpt.root.resolve().parents[1] if ckpt.revision is not None else ckpt.root
        destination.check_not_overlapping(root, dst)
    rows = plan_rows(ckpt, plan, jobs)
    bytes_in = sum(r.bytes_in for r in rows)
    bytes_out = sum(r.bytes_out for r in rows)
    result = ConvertResult(
        None if opts.dry_run else dst,
        plan,
        scheme,
        dialect,
        rows,
        bytes_in,
        bytes_out,
        notes=list(plan.notes),
        options=opts,
    )
    if opts.dry_run:
        result.seconds = time.perf_counter() - t0
        return result

    slow = kernels.slow_quantizer_note(scheme, opts.device) if any(j.fmt in ("mxfp8", "nvfp4") for j in jobs) else None
    if slow:
        result.notes.append(slow)
    # Resumable partial dir beside DST (resume.py): kept on output errors and interrupts.
    part = _resume.open_partial(dst, ckpt, scheme, dialect, opts)
    result.notes.extend(part.notes)
    tmp = part.dir
    try:
        input_sha, output_sha = Runner(ckpt, jobs, tmp, opts, bytes_in, journal=part).run()
        if isinstance(built.source, decode.DecodedSource):  # rounded counts of resumed shards, the notes
            result.notes.extend(built.source.finish(fp8_source.scale_reader(ckpt)))
        write_metadata(
            ckpt,
            plan,
            jobs,
            built.layout_layers,
            scheme,
            dialect,
            tmp,
            opts,
            input_sha,
            output_sha,
            created=part.created,
            source=built.source,
        )
        part.finish()
        try:
            destination.install(tmp, dst, opts.force)  # under the lock: released only once DST is in place
        except (OSError, OutputError) as e:
            part.unfinish()  # the journal back, so that --resume keeps every shard
            if isinstance(e, OutputError):
                raise
            raise OutputError(f"{dst}: cannot move the finished output into place ({e.strerror})") from None
        part.release()
    except OutputError as e:
        part.release()
        raise OutputError(
            f"{e} [finished shards kept in {tmp}: fix this and rerun with --resume, or delete it]"
        ) from None
    except KeyboardInterrupt:
        part.release()
        raise
    except BaseException:
        part.discard()
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _materialize_pickles(src: str, dst: Path | None, opts: ConvertOptions) -> Path | None:
    from .checkpoint import pickle_files, pickle_to_safetensors

    if not opts.allow_pickle or not pickle_files(src):
        return None
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="qconvert-pickle-")) if dst is None else dst.parent
    out = base / (f".{dst.name}.qconvert-pickle-src" if dst is not None else "src")
    st = destination.lstat(out)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputError(
            f"{out}: exists and is not a directory (a symbolic link?); qconvert writes its "
            "safetensors copy of the pickles there: move it away"
        )
    shutil.rmtree(out, ignore_errors=True)
    try:
        return pickle_to_safetensors(src, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
