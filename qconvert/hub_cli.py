"""CLI commands ``inspect``, ``verify``, ``push``, and the push step of ``--push-to-hub``."""

from __future__ import annotations

import json
import sys

import click

from .cli_errors import handle_errors
from .errors import QConvertError


@click.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report (every module, not collapsed).")
@click.option("--limit", type=int, default=0, show_default=True, help="Show at most N table rows (0: all).")
@handle_errors
def inspect(ckpt, as_json, limit):
    """Detect the format and dialect of CKPT and list its modules, sizes and engines."""
    from .inspect import format_report, inspect_checkpoint

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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--max-rel-err", type=float, default=None,
              help="Fail a quantized tensor whose relative error exceeds X (default: 0.06 MXFP8, 0.16 NVFP4).")
@click.option("--engine", type=click.Choice(["vllm"]), default=None,
              help="Also run SRC and DST in the engine and compare next-token distributions.")
@click.option("--max-kl", type=float, default=None,
              help="With --engine: fail when the mean next-token KL exceeds X (default: 0.1 MXFP8, 0.55 NVFP4).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
@handle_errors
def verify(src, dst, as_json, max_rel_err, engine, max_kl, progress):
    """Dequantize DST, compare it with its BF16 source SRC, and check its metadata; exit 1 on failure."""
    from .verify import format_report, verify as run_verify

    log = (lambda s: click.echo(s, err=True)) if as_json else (lambda s: click.echo(s, err=True))
    r = run_verify(src, dst, max_rel_err=max_rel_err, progress=progress, log=log, engine=engine, max_kl=max_kl)
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2, default=str))
    else:
        click.echo(format_report(r))
    if not r.ok:
        sys.exit(1)


@click.command("push")
@click.argument("dst")
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
@click.option("--src", default=None, help="BF16 source to verify against (default: the one in qconvert.json).")
@click.option("--base-model", default=None,
              help="base_model for the card (default: the source's Hub repo id; a local source has none).")
@click.option("--max-rel-err", type=float, default=None)
@click.option("--force", is_flag=True, help="Push even if verify fails or cannot run.")
@click.option("--progress/--no-progress", default=None)
@handle_errors(interrupted="interrupted; DST was not changed (re-run push to resume the upload)")
def push(dst, repo, private, revision, token, src, base_model, max_rel_err, force, progress):
    """Verify DST, build its model card and upload both to the Hub as REPO (DST is not modified)."""
    from .hub import push as run_push

    url = run_push(dst, repo, private=private, revision=revision, token=token, force=force, src=src,
                   base_model=base_model, max_rel_err=max_rel_err, progress=progress,
                   log=lambda s: click.echo(s, err=True))
    click.echo(f"pushed {dst} to {url}" + (f" (revision {revision})" if revision else ""))


def push_after_convert(src: str, dst, repo: str, private: bool = False, revision: str | None = None,
                       progress: bool | None = None):
    """``--push-to-hub``: verify the fresh conversion, then push it (refused if verify fails)."""
    from .hub import push as run_push
    from .verify import format_report, verify as run_verify

    click.echo("")
    r = run_verify(src, str(dst), progress=progress, log=lambda s: click.echo(s, err=True))
    click.echo(format_report(r))
    if not r.ok:
        raise QConvertError(f"{dst}: verify failed ({r.failures[0]}); not pushed — fix it, then run "
                            f"`qconvert push {dst} {repo} --force` to push anyway")
    url = run_push(dst, repo, private=private, revision=revision, src=src, verify_report=r,
                   log=lambda s: click.echo(s, err=True))
    click.echo(f"pushed {dst} to {url}" + (f" (revision {revision})" if revision else ""))
