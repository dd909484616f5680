"""The CLI's error handling, shared by every command module (kept apart from the group in
``cli/__init__.py`` so that command modules can import it without importing the group).

Two layers: :func:`handle_errors` on each command prints a :class:`QConvertError` (a user's
mistake, with its fix) and a Ctrl-C as one line; :class:`GuardedGroup`, the ``qconvert`` group
itself, is the top-level guard: a usage error, or any other exception that escapes a command (a
bug), is printed as one line naming the command, exit 1; Ctrl-C anywhere exits 130. With
``QCONVERT_DEBUG=1`` the traceback is printed as well.
"""

from __future__ import annotations

import concurrent.futures._base
import concurrent.futures.thread
import dis
import functools
import os
import queue
import signal
import sys
import threading
import time
import traceback

import click

from ..errors import QConvertError
from ..interrupts import mark_stopping  # imported here: the Ctrl-C handler must import nothing

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
    standard library's thread bookkeeping (:func:`_raise_when_safe`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mark_stopping()  # code that waits on a server while stopping may take a second Ctrl-C (interrupts.py)
    _raise_when_safe(frame)


#: Python raises a signal handler's exception wherever the main thread is. Inside these files it
#: can leave a lock held for good: ``concurrent.futures.wait`` interrupted between acquiring the
#: futures' conditions leaves them acquired, every pool thread then blocks in ``set_result`` and
#: the cleanup that joins them hangs (seen in CI: the SIGINT test's process never exited); the
#: same holds for ``queue``, ``threading.Condition`` and the import machinery's module locks.
_UNSAFE_FILES = frozenset(
    {m.__file__ for m in (threading, queue, concurrent.futures._base, concurrent.futures.thread)}
    | {"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"}
)


def _blocking_lines(*fns) -> frozenset:
    """(code, line) of each lock acquire or join in ``fns``: where a thread blocks waiting, and
    where the standard library itself cleans up after an exception (``Condition.wait``'s
    ``finally``; ``Thread._wait_for_tstate_lock``, bpo-45274)."""
    return frozenset(
        (fn.__code__, ins.positions.lineno)
        for fn in fns
        for ins in dis.get_instructions(fn)
        if ins.argval in ("acquire", "join") and ins.positions is not None
    )


#: the places inside _UNSAFE_FILES where a Ctrl-C is raised at once: the main thread waiting on a
#: condition, an event, a future, a queue or a thread spends its time there, and a Ctrl-C must not
#: wait DEFER_LIMIT_S for it
_WAIT_POINTS = _blocking_lines(
    threading.Condition.wait,
    threading.Thread.join,
    *[f for f in (getattr(threading.Thread, "_wait_for_tstate_lock", None),) if f is not None],
)
DEFER_PERIOD_S = 0.002  # how often a deferred Ctrl-C looks again whether the main thread has left
DEFER_LIMIT_S = 1.0  # after this, raise wherever it is (a thread blocked for good must still stop)
_deferred_since: list[float] = []  # when the pending (deferred) Ctrl-C arrived; empty if none


def _in_bookkeeping(frame) -> bool:
    """The main thread is running the standard library's own thread or import bookkeeping (its
    innermost frame is in _UNSAFE_FILES), other than waiting at one of _WAIT_POINTS."""
    if frame is None or frame.f_code.co_filename not in _UNSAFE_FILES:
        return False
    return (frame.f_code, frame.f_lineno) not in _WAIT_POINTS


def _raise_when_safe(frame):
    """Raise KeyboardInterrupt now, unless the main thread is in the standard library's thread
    bookkeeping (:func:`_in_bookkeeping`): then look again every DEFER_PERIOD_S (SIGALRM) and raise
    once it has left it (or after DEFER_LIMIT_S, or at once where there is no interval timer)."""
    now = time.monotonic()
    if not _deferred_since:
        _deferred_since.append(now)
    late = now - _deferred_since[0] >= DEFER_LIMIT_S
    if late or not hasattr(signal, "setitimer") or not _in_bookkeeping(frame):
        _cancel_deferred()
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, _deferred_sigint)
    signal.setitimer(signal.ITIMER_REAL, DEFER_PERIOD_S)


def _deferred_sigint(signum, frame):
    _raise_when_safe(frame)


def _cancel_deferred():
    _deferred_since.clear()
    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _stray_threads() -> list[threading.Thread]:
    """Daemon threads still running: one that runs Python or torch code while the interpreter
    tears down aborts the process. tqdm's monitor only sleeps and is left out."""
    return [t for t in threading.enumerate() if t.daemon and t.is_alive() and type(t).__name__ != "TMonitor"]


def _exit_process(code: int):
    # the command is done (its outcome printed): a Ctrl-C from here on has nothing to interrupt, and
    # one during interpreter exit would end the process by the signal (exit -2) instead of `code`
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _cancel_deferred()
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
