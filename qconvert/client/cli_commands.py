"""``qconvert reload`` and ``qconvert stage`` (added to the main CLI by ``qconvert.cli``)."""

from __future__ import annotations

import functools
import sys

import click

from qconvert.errors import QConvertError

#: deadlines when --timeout is not given: control requests / the pause and the weight load
CONTROL_TIMEOUT = 30.0
RELOAD_TIMEOUT = 3600.0


def _errors(fn):
    from qconvert.cli_errors import handle_errors

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


def _common(fn):
    opts = [
        click.argument("targets", nargs=-1, required=True, metavar="URL [URL ...] CKPT"),
        click.option("--via", type=click.Choice(["disk", "shm"]), default="disk", show_default=True,
                     help="disk: servers read CKPT; shm: stage CKPT in /dev/shm/qconvert first, servers read RAM."),
        click.option("--weight-version", default=None, help="Weight version label set on the servers."),
        click.option("--api-key", envvar="QCONVERT_API_KEY", default=None,
                     help="Sent as 'Authorization: Bearer KEY' (vLLM --api-key, SGLang --api-key/--admin-api-key)."),
        click.option("--verify", is_flag=True, help="Check the servers' weights and a greedy prompt after the reload."),
        click.option("--stage-name", default=None, help="Staging area name for --via shm (default: from CKPT)."),
        click.option("--keep-staged", is_flag=True,
                     help="With --via shm: keep the staging area after the reload (default: removed)."),
        click.option("--retries", type=click.IntRange(0, 100), default=3, show_default=True,
                     help="Retries (exponential backoff) on connection errors and 502/503/504, within --timeout."),
        click.option("--timeout", type=float, default=None, metavar="SECONDS",
                     help=f"Deadline of every request to a server, retries included [default: "
                          f"{CONTROL_TIMEOUT:g} s; {RELOAD_TIMEOUT:g} s for the pause and the weight load]."),
        click.option("--reload-timeout", type=float, default=None, metavar="SECONDS",
                     help="Deadline of the pause (which waits for running requests) and of the weight load "
                          "alone [default: --timeout if given, else 3600 s]."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def reload():
    """Hot-swap a checkpoint into running vLLM or SGLang servers (data-parallel replicas concurrently)."""


@reload.command("vllm")
@_common
@click.option("--pause", type=click.Choice(["wait", "abort", "keep"]), default="wait", show_default=True,
              help="wait: finish running requests, queue new ones; abort: abort running; keep: freeze them "
                   "(they finish on the new weights).")
@click.option("--rollback", default=None, metavar="CKPT",
              help="Checkpoint the servers serve now, reloaded if the reload fails (default: found automatically).")
@_errors
def reload_vllm_cmd(targets, via, weight_version, api_key, verify, stage_name, keep_staged, retries, timeout,
                    reload_timeout, pause, rollback):
    """Reload CKPT into vLLM servers started with VLLM_SERVER_DEV_MODE=1 (vLLM 0.32/0.33)."""
    from qconvert.client.vllm_client import reload_vllm

    urls, ckpt = _split(targets)
    _report(reload_vllm(urls, ckpt, via=via, pause=pause, weight_version=weight_version, api_key=api_key,
                        verify=verify, stage_name=stage_name, rollback=rollback, retries=retries,
                        keep_staged=keep_staged, **_timeouts(timeout, reload_timeout)), "vllm")


@reload.command("sglang")
@_common
@click.option("--pause", type=click.Choice(["abort", "retract", "in_place"]), default="retract",
              show_default=True,
              help="abort: abort running requests; retract: re-queue them (recomputed on the new weights); "
                   "in_place: keep them and their KV cache (cache not flushed).")
@_errors
def reload_sglang_cmd(targets, via, weight_version, api_key, verify, stage_name, keep_staged, retries, timeout,
                      reload_timeout, pause):
    """Reload CKPT into SGLang servers (0.5.23) through /update_weights_from_disk."""
    from qconvert.client.sglang_client import reload_sglang

    urls, ckpt = _split(targets)
    _report(reload_sglang(urls, ckpt, via=via, pause=pause, weight_version=weight_version, api_key=api_key,
                          verify=verify, stage_name=stage_name, retries=retries, keep_staged=keep_staged,
                          **_timeouts(timeout, reload_timeout)), "sglang")


@click.command("stage")
@click.argument("args", nargs=-1, metavar="CKPT NAME")
@click.option("--list", "do_list", is_flag=True, help="List staging areas.")
@click.option("--drop", "drop", default=None, metavar="NAME", help="Remove a staging area.")
@_errors
def stage(args, do_list, drop):
    """Copy CKPT into the shared-memory staging area NAME (/dev/shm/qconvert/NAME, mode 0600)."""
    from qconvert.client import staging

    if sum([bool(args), do_list, drop is not None]) != 1:
        raise click.UsageError("use one of: stage CKPT NAME | stage --list | stage --drop NAME")
    if do_list:
        areas = staging.list_areas()
        if not areas:
            click.echo(f"no staging areas under {staging.staging_root()}")
        for a in areas:
            if a["ok"]:
                click.echo(f"{a['name']}\t{a['bytes'] / 1e6:.1f} MB\t{a['source']}")
            else:
                click.echo(f"{a['name']}\tBROKEN\t{a['problem']}")
        return
    if drop is not None:
        if not staging.drop_area(drop):
            raise QConvertError(f"no staging area {drop!r} under {staging.staging_root()}; see `qconvert stage --list`")
        click.echo(f"dropped {drop}")
        return
    if len(args) != 2:
        raise click.UsageError("stage CKPT NAME")
    area = staging.stage_checkpoint(args[0], args[1])
    click.echo(f"staged {args[0]} as {area.path} ({area.nbytes / 1e6:.1f} MB, "
               f"{len(area.manifest['tensors'])} tensors, 256-byte aligned)")
