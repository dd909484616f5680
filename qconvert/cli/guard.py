"""The CLI's error handling, shared by every command module (kept apart from the group in
``cli/__init__.py`` so that command modules can import it without importing the group).

Two layers: :func:`handle_errors` on each command prints a :class:`QConvertError` (a user's
mistake, with its fix) and a Ctrl-C as one line; :class:`GuardedGroup`, the ``qconvert`` group
itself, is the top-level guard: a usage error, or any other exception that escapes a command (a
bug), is printed as one line naming the command, exit 1; Ctrl-C anywhere exits 130. With
``QCONVERT_DEBUG=1`` the traceback is printed as well.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import traceback

import click

from ..errors import QConvertError
from ..interrupts import cancel_deferred, mark_stopping, raise_when_safe  # the Ctrl-C handler imports nothing

DEBUG_VAR = "QCONVERT_DEBUG"
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def one_line(text: str, limit: int = 2000) -> str:
    """``text`` on one line (its lines joined by " / "), at most ``limit`` characters."""
    s = " / ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _debug() -> bool:
    return os.environ.get(DEBUG_VAR, "") not in ("", "0")


def handle_errors(
    fn=None,
    *,
    interrupted: str = "interrupted; nothing was installed at DST (rerun the same command with --resume to continue)",
):
    """Print a QConvertError as one line and exit 1; Ctrl-C exits 130 without a traceback."""
    if fn is None:
        return functools.partial(handle_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except QConvertError as e:
            if _debug():
                traceback.print_exc()
            click.echo(f"error: {one_line(e)}", err=True)
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            click.echo(interrupted, err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def _command_path(ctx: click.Context | None, fallback: str) -> str:
    """``qconvert mxfp8``: the deepest command that was resolved."""
    if ctx is None:
        return fallback
    sub = ctx.invoked_subcommand
    return f"{ctx.command_path} {sub}" if sub else ctx.command_path


def internal_error_line(command: str, e: BaseException) -> str:
    what = one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, 600)
    return (
        f"error: {command}: internal error: {what} (this is a bug in qconvert; set {DEBUG_VAR}=1 "
        "to see the traceback and report it)"
    )


class GuardedGroup(click.Group):
    """The top-level guard (see the module docstring). As the process's entry point it also makes
    sure no thread of a command can abort the process at interpreter exit: if a daemon thread is
    still alive once the command is done (a bug: every command joins its threads), the process
    exits at once with its exit code, without interpreter teardown."""

    def invoke(self, ctx: click.Context):
        try:
            super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as e:  # SystemExit and KeyboardInterrupt are not Exceptions
            if _debug():
                traceback.print_exc()
            click.echo(internal_error_line(_command_path(ctx, "qconvert"), e), err=True)
            sys.exit(EXIT_ERROR)
        return None  # the exit code is 0; a command's return value is for library callers

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        entry_point = args is None  # the `qconvert` process itself (CliRunner passes args)
        if entry_point and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _first_sigint)
        code = 0
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0  # click's Exit code
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
            if not isinstance(e.code, (int, type(None))):
                click.echo(f"error: {one_line(e.code)}", err=True)
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            code = e.exit_code
        except click.ClickException as e:
            cmd = e.ctx.command_path if getattr(e, "ctx", None) is not None else (prog_name or "qconvert")
            hint = f" (see `{cmd} --help`)" if isinstance(e, click.UsageError) else ""
            click.echo(f"error: {cmd}: {one_line(e.format_message())}{hint}", err=True)
            code = EXIT_ERROR
        except (click.Abort, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            code = EXIT_INTERRUPTED
        except Exception as e:  # raised before or after a command ran (parsing, start-up)
            if _debug():
                traceback.print_exc()
            click.echo(internal_error_line(prog_name or "qconvert", e), err=True)
            code = EXIT_ERROR
        if entry_point:
            _exit_process(code)
        sys.exit(code)


def _first_sigint(signum, frame):
    """The first Ctrl-C interrupts the command; later ones are ignored while it stops (its threads
    are being joined: a second KeyboardInterrupt there would leave them running, and one during
    interpreter exit ends the process by the signal instead of exit 130), except inside
    ``interrupts.second_interrupt_allowed`` (a reload waiting for its servers to resume). Ctrl-\\
    still quits. It imports nothing: a Ctrl-C that lands while a module is being imported would
    find it half initialized (seen: ``cannot import name 'mark_stopping' from partially initialized
    module``, exit 1 instead of 130). The KeyboardInterrupt itself is raised only outside the
    standard library's thread bookkeeping (:func:`qconvert.interrupts.raise_when_safe`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mark_stopping()  # code that waits on a server while stopping may take a second Ctrl-C (interrupts.py)
    raise_when_safe(frame)


def _stray_threads() -> list[threading.Thread]:
    """Daemon threads still running: one that runs Python or torch code while the interpreter
    tears down aborts the process. tqdm's monitor only sleeps and is left out."""
    return [t for t in threading.enumerate() if t.daemon and t.is_alive() and type(t).__name__ != "TMonitor"]


def _exit_process(code: int):
    # the command is done (its outcome printed): a Ctrl-C from here on has nothing to interrupt, and
    # one during interpreter exit would end the process by the signal (exit -2) instead of `code`
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cancel_deferred()
    stray = _stray_threads()
    if not stray:
        sys.exit(code)
    if _debug():
        click.echo(f"qconvert: threads still running at exit: {', '.join(t.name for t in stray)}", err=True)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
