"""CLI command ``push``, and the push step of ``--push-to-hub``."""

from __future__ import annotations

import click

from ..errors import QConvertError
from .guard import handle_errors
from .options import ALLOW_UNVERIFIED, MAX_REL_ERR, PRIVATE, PROGRESS, REVISION


@click.command("push")
@click.argument("dst")
@click.argument("repo")
@PRIVATE
@REVISION
@click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
@click.option("--src", default=None, help="BF16 source to verify against (default: the one in qconvert.json).")
@click.option(
    "--base-model",
    default=None,
    help="base_model for the card (default: the source's Hub repo id; a local source has none).",
)
@MAX_REL_ERR
@ALLOW_UNVERIFIED
@PROGRESS
@handle_errors(interrupted="interrupted; DST was not changed (re-run push to resume the upload)")
def push(dst, repo, private, revision, token, src, base_model, max_rel_err, allow_unverified, old_force, progress):
    """Verify DST, build its model card and upload both to the Hub as REPO (DST is not modified)."""
    from ..hub import push as run_push

    url = run_push(
        dst,
        repo,
        private=private,
        revision=revision,
        token=token,
        allow_unverified=allow_unverified or old_force,
        src=src,
        base_model=base_model,
        max_rel_err=max_rel_err,
        progress=progress,
        log=lambda s: click.echo(s, err=True),
    )
    click.echo(f"pushed {dst} to {url}" + (f" (revision {revision})" if revision else ""))


def push_after_convert(
    src: str, dst, repo: str, private: bool = False, revision: str | None = None, progress: bool | None = None
):
    """``--push-to-hub``: verify the fresh conversion, then push it (refused if verify fails)."""
    from ..hub import push as run_push
    from ..verify import format_report
    from ..verify import verify as run_verify

    click.echo("")
    r = run_verify(src, str(dst), progress=progress, log=lambda s: click.echo(s, err=True))
    click.echo(format_report(r))
    if not r.ok:
        raise QConvertError(
            f"{dst}: verify failed ({r.failures[0]}); not pushed — fix it, then run "
            f"`qconvert push {dst} {repo} --allow-unverified` to push anyway"
        )
    url = run_push(
        dst, repo, private=private, revision=revision, src=src, verify_report=r, log=lambda s: click.echo(s, err=True)
    )
    click.echo(f"pushed {dst} to {url}" + (f" (revision {revision})" if revision else ""))
