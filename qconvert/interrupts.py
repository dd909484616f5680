"""Ctrl-C while a command stops.

The CLI's guard (``qconvert.cli.guard``) turns the first Ctrl-C into a KeyboardInterrupt and ignores later
ones while the command ends its threads (a second KeyboardInterrupt there would leave them running).
Code whose clean-up may wait on something outside the process, such as a reload waiting for a
server to resume, marks that wait with :func:`second_interrupt_allowed`, so that a second Ctrl-C
stops the wait. No click or torch here: the library imports it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_stopping = threading.Event()  # set by the CLI's guard at the first Ctrl-C


def mark_stopping() -> None:
    _stopping.set()


@contextmanager
def second_interrupt_allowed():
    """Inside this block a further Ctrl-C raises KeyboardInterrupt, also after the CLI's guard
    started ignoring them. Outside the main thread, or when no guard is ignoring Ctrl-C, a no-op."""
    if not _stopping.is_set() or threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
