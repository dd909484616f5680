"""The thread pool the CPU quantizers share: the C-kernel chunks (``cpu_kernels.py``) and the
torch op chains' chunks (``mxfp8.py``, ``nvfp4.py``) run on it, and every call waits for all of
its chunks, Ctrl-C included, before it returns.

Python threads rather than torch's intra-op pool: the C calls and each torch op release the GIL
for their work, and each pool thread runs torch single-threaded, so one OpenMP fork/join per
small op does not cost more than the op on a busy machine."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch

#: the pool threads' name prefix (tests and scripts/profile_threads.py find the threads by it)
THREAD_PREFIX = "qconvert-mxfp8"

_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _single_thread():
    torch.set_num_threads(1)  # per-thread setting: this worker's ops run on this worker only


def pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool of ``workers`` threads (one per distinct count, made at first use)."""
    with _pool_lock:
        p = _pools.get(workers)
        if p is None:
            p = _pools[workers] = ThreadPoolExecutor(
                workers, thread_name_prefix=THREAD_PREFIX, initializer=_single_thread
            )
        return p


def run_all(workers: int, calls: list[tuple]) -> list:
    """Run each ``(fn, *args)`` of ``calls`` on the shared pool of ``workers`` threads and return the
    results in order. Every call has finished before this returns or raises (Ctrl-C included: see
    :func:`wait_all`)."""
    futures = []
    try:
        for fn, *args in calls:
            futures.append(pool(workers).submit(fn, *args))
    finally:
        wait_all(futures)
    return [fut.result() for fut in futures]


def run_chunks(fn, n: int, workers: int, min_step: int = 4096) -> list:
    """``fn(b0, b1)`` over [0, n) in chunks on ``workers`` threads (the C calls release the GIL);
    the results in chunk order."""
    workers = max(1, workers)
    if workers == 1 or n < 2 * min_step:
        return [fn(0, n)]
    step = max(min_step, -(-n // (workers * 4)))  # a few chunks per worker: balance across cores
    return run_all(workers, [(fn, b0, min(n, b0 + step)) for b0 in range(0, n, step)])


def wait_all(futures) -> None:
    """Wait until every future has finished, even through a KeyboardInterrupt (raised afterwards).
    The C calls get raw pointers: a caller that went on while a chunk still ran (Ctrl-C during
    ``fut.result()``) would free the tensors the kernel is writing into (a segfault), and a
    thread still in a kernel at interpreter exit can abort the process."""
    interrupted = None
    while True:
        try:
            wait(futures)
            break
        except KeyboardInterrupt as e:
            interrupted = e
            _release_conditions(futures)
    if interrupted is not None:
        raise interrupted


def _release_conditions(futures) -> None:
    """Release the futures' conditions that this thread still holds. ``concurrent.futures.wait``
    acquires every future's condition in turn; a KeyboardInterrupt raised between those acquires
    (Python raises a Ctrl-C wherever the main thread is) leaves them held, the pool threads then
    block for good in ``set_result`` and the wait above never ends (the CLI defers its own Ctrl-C
    out of that code, ``cli/guard.py``; a library caller keeps Python's handler). The conditions
    are re-entrant locks, so the holder is known; nothing else in this thread holds them here."""
    for fut in futures:
        cond = fut._condition  # the one private name used: stable since Python 3.2
        while cond._is_owned():
            cond.release()
