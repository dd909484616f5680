"""CLI commands ``inspect`` and ``verify``: read a checkpoint, and check a conversion against its source."""

from __future__ import annotations

import json
import sys

import click

from .guard import handle_errors
from .options import CHECK_IN_ENGINE, JSON, MAX_REL_ERR, PROGRESS


@click.command("inspect")
@click.argument("ckpt")
@JSON
@click.option("--limit", type=int, default=0, show_default=True, help="Show at most N table rows (0: all).")
@handle_errors
def inspect(ckpt, as_json, limit):
    """Detect the format and dialect of CKPT and list its modules, sizes and engines."""
    from ..inspect import format_report, inspect_checkpoint

    r = inspect_checkpoint(ckpt)
    if as_json:
        d = r.to_dict()
        d["rows"] = r.rows()
        click.echo(json.dumps(d, indent=2, default=str))
    else:
        click.echo(format_report(r, limit or None))


@click.command("verify")
@click.argument("src")
@click.argument("dst")
@JSON
@MAX_REL_ERR
@CHECK_IN_ENGINE
@PROGRESS
@handle_errors
def verify(src, dst, as_json, max_rel_err, check_in_engine, old_engine, max_kl, progress):
    """Dequantize DST, compare it with its BF16 source SRC, and check its metadata; exit 1 on failure."""
    if check_in_engine and old_engine and check_in_engine != old_engine:
        raise click.UsageError("pass --check-in-engine only (--engine is its old spelling)")
    from ..verify import format_report
    from ..verify import verify as run_verify

    r = run_verify(
        src,
        dst,
        max_rel_err=max_rel_err,
        progress=progress,
        log=lambda s: click.echo(s, err=True),
        engine=check_in_engine or old_engine,
        max_kl=max_kl,
    )
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2, default=str))
    else:
        click.echo(format_report(r))
    if not r.ok:
        sys.exit(1)


COMMANDS = (inspect, verify)
