"""CLI commands ``qconvert reload vllm|sglang`` and ``qconvert stage create|list|drop``."""

from __future__ import annotations

import functools
import sys

import click

from ..errors import QConvertError
from .guard import handle_errors
from .options import CONTROL_TIMEOUT, RELOAD, RELOAD_TIMEOUT


def _errors(fn):
    @functools.wraps(fn)
    def interrupted(*a, **kw):
        from qconvert.client.reload import ReloadInterrupted

        try:
            return fn(*a, **kw)
        except ReloadInterrupted as e:  # says per server whether it was resumed
            click.echo(f"error: {e}", err=True)
            sys.exit(130)

    # a Ctrl-C outside the reload threads comes before any pause or after every resume
    return handle_errors(interrupted, interrupted="interrupted; no server was left paused")


def _timeouts(timeout: float | None, reload_timeout: float | None) -> dict:
    for name, v in (("--timeout", timeout), ("--reload-timeout", reload_timeout)):
        if v is not None and not v > 0:
            raise click.BadParameter(f"{v}: give a number of seconds above 0", param_hint=name)
    control = CONTROL_TIMEOUT if timeout is None else timeout
    long = reload_timeout if reload_timeout is not None else (RELOAD_TIMEOUT if timeout is None else timeout)
    return {"timeout": control, "reload_timeout": long}


def _split(targets: tuple[str, ...]) -> tuple[list[str], str]:
    if len(targets) < 2:
        raise click.UsageError("give at least one server URL and the checkpoint: URL [URL ...] CKPT")
    return list(targets[:-1]), targets[-1]


def _report(results, engine: str) -> None:
    for r in results:
        line = f"{engine} {r.url}: reloaded, weight version {r.weight_version} ({r.seconds:.1f} s)"
        if r.verify:
            line += f"; verified ({r.verify.get('norms_checked', 'checksums')} checks)"
        click.echo(line)
        if not r.cache_flushed:
            click.echo(
                f"note: {r.url}: its prefix cache was kept (--pause in_place): requests that share a prefix with "
                "earlier ones may reuse KV computed with the previous weights; --pause retract flushes it",
                err=True,
            )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def reload():
    """Hot-swap a checkpoint into running vLLM or SGLang servers (data-parallel replicas concurrently)."""


@reload.command("vllm")
@RELOAD
@click.option(
    "--pause",
    type=click.Choice(["wait", "abort", "keep"]),
    default="wait",
    show_default=True,
    help="wait: finish running requests, queue new ones; abort: abort running; keep: freeze them "
    "(they finish on the new weights).",
)
@click.option(
    "--rollback",
    default=None,
    metavar="CKPT",
    help="Checkpoint the servers serve now, reloaded if the reload fails (default: found automatically).",
)
@_errors
def reload_vllm_cmd(
    targets,
    via,
    weight_version,
    api_key,
    verify,
    stage_name,
    keep_staged,
    retries,
    timeout,
    reload_timeout,
    pause,
    rollback,
):
    """Reload CKPT into vLLM servers started with VLLM_SERVER_DEV_MODE=1 (vLLM 0.32/0.33)."""
    from qconvert.client.vllm_client import reload_vllm

    urls, ckpt = _split(targets)
    _report(
        reload_vllm(
            urls,
            ckpt,
            via=via,
            pause=pause,
            weight_version=weight_version,
            api_key=api_key,
            verify=verify,
            stage_name=stage_name,
            rollback=rollback,
            retries=retries,
            keep_staged=keep_staged,
            **_timeouts(timeout, reload_timeout),
        ),
        "vllm",
    )


@reload.command("sglang")
@RELOAD
@click.option(
    "--pause",
    type=click.Choice(["abort", "retract", "in_place"]),
    default="retract",
    show_default=True,
    help="abort: abort running requests; retract: re-queue them (recomputed on the new weights); "
    "in_place: keep them and their KV cache (cache not flushed).",
)
@_errors
def reload_sglang_cmd(
    targets, via, weight_version, api_key, verify, stage_name, keep_staged, retries, timeout, reload_timeout, pause
):
    """Reload CKPT into SGLang servers (0.5.23) through /update_weights_from_disk."""
    from qconvert.client.sglang_client import reload_sglang

    urls, ckpt = _split(targets)
    _report(
        reload_sglang(
            urls,
            ckpt,
            via=via,
            pause=pause,
            weight_version=weight_version,
            api_key=api_key,
            verify=verify,
            stage_name=stage_name,
            retries=retries,
            keep_staged=keep_staged,
            **_timeouts(timeout, reload_timeout),
        ),
        "sglang",
    )


class _StageGroup(click.Group):
    """``stage`` takes subcommands (as ``reload`` does); the flag forms of earlier releases still work,
    hidden: ``stage CKPT NAME`` = ``stage create``, ``stage --list`` = ``stage list``,
    ``stage --drop NAME`` = ``stage drop NAME``."""

    def parse_args(self, ctx, args):
        if args and args[0] in ("--list", "--drop"):
            args = [args[0][2:], *args[1:]]
        elif args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["create", *args]
        return super().parse_args(ctx, args)


@click.group("stage", cls=_StageGroup, context_settings={"help_option_names": ["-h", "--help"]})
def stage():
    """Shared-memory staging areas (/dev/shm/qconvert/NAME, mode 0600) that servers reload from."""


@stage.command("create")
@click.argument("ckpt")
@click.argument("name")
@_errors
def stage_create(ckpt, name):
    """Copy CKPT into the staging area NAME."""
    from qconvert.client import staging

    area = staging.stage_checkpoint(ckpt, name)
    click.echo(
        f"staged {ckpt} as {area.path} ({area.nbytes / 1e6:.1f} MB, "
        f"{len(area.manifest['tensors'])} tensors, 256-byte aligned; those under 256 bytes to their element size)"
    )


@stage.command("list")
@_errors
def stage_list():
    """List the staging areas."""
    from qconvert.client import staging

    areas = staging.list_areas()
    if not areas:
        click.echo(f"no staging areas under {staging.staging_root()}")
    for a in areas:
        if a["ok"]:
            click.echo(f"{a['name']}\t{a['bytes'] / 1e6:.1f} MB\t{a['source']}")
        else:
            click.echo(f"{a['name']}\tBROKEN\t{a['problem']}")


@stage.command("drop")
@click.argument("name")
@_errors
def stage_drop(name):
    """Remove the staging area NAME."""
    from qconvert.client import staging

    if not staging.drop_area(name):
        raise QConvertError(f"no staging area {name!r} under {staging.staging_root()}; see `qconvert stage list`")
    click.echo(f"dropped {name}")


COMMANDS = (reload, stage)
