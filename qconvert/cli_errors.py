"""The CLI's error handling, shared by every command module (kept apart from cli.py so that
command modules can import it without importing the command group)."""

from __future__ import annotations

import functools
import sys

import click

from .errors import QConvertError


def handle_errors(fn=None, *, interrupted: str = "interrupted; nothing was installed at DST "
                                                  "(rerun the same command with --resume to continue)"):
    """Print a QConvertError as one line and exit 1; Ctrl-C exits 130 without a traceback."""
    if fn is None:
        return functools.partial(handle_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except QConvertError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo(interrupted, err=True)
            sys.exit(130)
    return wrapper
