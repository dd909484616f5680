"""Ctrl-C while qconvert's threads run, and while a command stops.

Python raises a SIGINT handler's KeyboardInterrupt wherever the main thread is; raised inside the
standard library's own thread bookkeeping it can leave a lock held for good (see
:data:`_UNSAFE_FILES`). :func:`raise_when_safe` raises it only outside that code; the CLI's guard
(``qconvert.cli.guard``) calls it from its handler, and :func:`ctrl_c_safe` gives library callers
that keep Python's own handler the same for the length of one public call.

The CLI's guard turns the first Ctrl-C into a KeyboardInterrupt and ignores later ones while the
command ends its threads (a second KeyboardInterrupt there would leave them running). Code whose
clean-up may wait on something outside the process, such as a reload waiting for a server to
resume, marks that wait with :func:`second_interrupt_allowed`, so that a second Ctrl-C stops the
wait. No click or torch here: the library imports it.
"""

from __future__ import annotations

import concurrent.futures._base
import concurrent.futures.thread
import dis
import functools
import queue
import signal
import threading
import time
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


def raise_when_safe(frame):
    """Raise KeyboardInterrupt now, unless the main thread is in the standard library's thread
    bookkeeping (:func:`_in_bookkeeping`): then look again every DEFER_PERIOD_S (SIGALRM) and raise
    once it has left it (or after DEFER_LIMIT_S, or at once where there is no interval timer)."""
    now = time.monotonic()
    if not _deferred_since:
        _deferred_since.append(now)
    late = now - _deferred_since[0] >= DEFER_LIMIT_S
    if late or not hasattr(signal, "setitimer") or not _in_bookkeeping(frame):
        cancel_deferred()
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, _deferred_sigint)
    signal.setitimer(signal.ITIMER_REAL, DEFER_PERIOD_S)


def _deferred_sigint(signum, frame):
    raise_when_safe(frame)


def cancel_deferred():
    _deferred_since.clear()
    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _library_sigint(signum, frame):
    """Python's own Ctrl-C (a KeyboardInterrupt at every Ctrl-C), raised outside the standard
    library's thread bookkeeping: the handler :func:`ctrl_c_safe` installs."""
    raise_when_safe(frame)


def _alarm_free() -> bool:
    """SIGALRM and the real-time interval timer, which a deferred Ctrl-C uses, are not the
    caller's."""
    return (
        hasattr(signal, "setitimer")
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )


@contextmanager
def safe_ctrl_c():
    """Inside this block, a Ctrl-C still raises KeyboardInterrupt as Python's own handler does, but
    only once the main thread is out of the standard library's thread bookkeeping
    (:func:`raise_when_safe`): raised there it could leave a pool's lock held and the caller's
    clean-up would hang. Applies only where the caller keeps Python's handler, on the main thread,
    with SIGALRM unused; otherwise (the CLI, a framework's own handler) a no-op. A Ctrl-C still
    deferred when the block ends is raised then."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        or not _alarm_free()
    ):
        yield
        return
    signal.signal(signal.SIGINT, _library_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _library_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        pending = bool(_deferred_since)
        cancel_deferred()
        if pending:
            raise KeyboardInterrupt


def ctrl_c_safe(fn):
    """The library's public entry points that run threads: their body runs in :func:`safe_ctrl_c`."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with safe_ctrl_c():
            return fn(*a, **kw)

    wrapper.ctrl_c_safe = True
    return wrapper
