"""The threaded run of a conversion's jobs: read shard by shard, quantize, write.

Stages overlap on threads of their own: a reader thread reads tensors in file order from up to
``READ_STREAMS`` input shards at once; source shards are hashed by reading each file on a hash
thread (``HASH_STREAMS`` at once); the calling thread hands each job whose sources have arrived to
a job thread (small CPU jobs) or runs it itself split over all cores (torch releases the GIL); a
writer thread ``pwrite``s each output tensor at its precomputed offset, in job order; and a closer
thread per finished output shard fsyncs it and finishes its digest. Peak memory is the tensors in
flight, bounded by ``queue_bytes``, plus fused-group members waiting for their partners.

Each output shard corresponds to one input shard (same file name), so output shards keep the
source's proportions and a tensor's bytes are found where a reader of the source expects them.

Whatever happens (an error on any thread, a Ctrl-C), every thread a run started has ended when
:meth:`Runner.run` returns or raises.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import CheckpointError, OutputError
from . import kernels
from . import resume as _resume
from .checkpoint import Checkpoint
from .jobs import Job, source_for_outputs
from .options import ConvertOptions
from .safetensors_io import BackgroundSha256, ShardReader, ShardWriter, hub_cache_sha256, local_dir_sha256, sha256_file

_WAKE = object()  # put on the read queue when a job thread finishes


class Progress:
    def __init__(self, total: int, enabled: bool | None, desc: str):
        self.bar = None
        if enabled is None:
            import os

            enabled = os.isatty(2)
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=desc,
                dynamic_ncols=True,
                smoothing=0.1,
                leave=False,
            )

    def update(self, n: int):
        if self.bar:
            self.bar.update(n)

    def close(self):
        if self.bar:
            self.bar.close()


class HashingWriter:
    """ShardWriter plus a sha256 of the file, computed while tensors are written. A tensor that
    arrives before its predecessors in the file (its job finished early, e.g. a fused group that
    spans input shards read side by side) is written at once and hashed once they have arrived,
    from the file (page cache), so no tensor is held back in memory."""

    def __init__(self, path: Path, specs, hashed: bool = True):
        self.w = ShardWriter(path, specs)
        self._order = list(self.w.names)
        self._next = 0
        self._early: set[str] = set()
        self._hash = BackgroundSha256(self.w.header_bytes) if hashed else None
        self.closed = False

    def abort(self):
        """Give up on this shard (an error or interrupt): close its file unless :meth:`close` did,
        and end its hash thread, waiting for it, so no thread outlives the conversion."""
        if not self.closed:
            self.closed = True
            self.w.abort()
        if self._hash is not None:
            self._hash.close(wait=True)

    def write(self, name: str, t: torch.Tensor):
        if self._hash is None:
            self.w.write(name, t)
            return
        if self._order[self._next] != name:
            self.w.write(name, t)
            self._early.add(name)
            return
        self.w.write(name, t, before=self._hash.update)  # hashed while being written
        self._next += 1
        while self._next < len(self._order) and self._order[self._next] in self._early:
            early = self._order[self._next]
            self._early.discard(early)
            for chunk in self.w.read_back(early):
                self._hash.update(chunk)
            self._next += 1

    @property
    def complete(self):
        return self.w.complete

    def close(self, fsync: bool) -> str:
        """The shard's sha256, or "" (not recorded) when unhashed."""
        self.closed = True  # the file is closed whether or not this succeeds
        try:
            self.w.close(fsync)
        except BaseException:
            self.abort()
            raise
        if self._hash is None:
            return ""
        if self._next != len(self._order):
            raise AssertionError(
                f"internal: {self.w.path} closed with {len(self._order) - self._next} tensors unhashed"
            )
        return self._hash.hexdigest()


class Runner:
    """One run of ``jobs`` from ``ckpt`` into the directory ``tmp``: :meth:`run` returns the sha256
    of each input and output shard (shard order), "" where not recorded. ``journal``: the resumable
    partial directory's journal (resume.py); output shards it verified are not rewritten."""

    def __init__(
        self,
        ckpt: Checkpoint,
        jobs: list[Job],
        tmp: Path,
        opts: ConvertOptions,
        bytes_in: int,
        journal: _resume.Partial | None = None,
    ):
        self.ckpt, self.jobs, self.tmp, self.opts, self.bytes_in, self.journal = (
            ckpt,
            jobs,
            tmp,
            opts,
            bytes_in,
            journal,
        )
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.read_q: queue.Queue = queue.Queue()
        self.write_q: queue.Queue = queue.Queue(maxsize=64)  # jobs' outputs; memory is bounded by `inflight`
        self.inflight = 0  # input bytes read whose outputs are not yet written (under `cond`)
        self.cond = threading.Condition()
        self.input_sha: dict[str, str] = {}
        self.output_sha: dict[str, str] = {}
        self.closers: list[threading.Thread] = []
        self.pending: deque = deque()  # (future of outputs, job, input bytes to release, source bytes), in job order
        self.waiting: dict[str, torch.Tensor] = {}  # sources parked until their job's other sources arrive
        self.pool: ThreadPoolExecutor | None = None
        self.hashers: ThreadPoolExecutor | None = None
        self.n_job = 0
        self.bar: Progress | None = None
        self.writers: list[HashingWriter | None] = []

    # ---- the whole run ---------------------------------------------------------------------------

    def run(self) -> tuple[dict[str, str], dict[str, str]]:
        """The run, leaving the caller's torch thread count as it was, with Python's cyclic garbage
        collector paused: the conversion makes no reference cycles, and its many short-lived
        objects set off collections that scan the whole heap (3% of a CPU profile)."""
        prev = torch.get_num_threads()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            torch.set_num_threads(prev)
            if gc_was_on:
                gc.enable()

    def _run(self):
        # The calling thread runs only small torch ops: one OpenMP fork/join each costs milliseconds
        # on a busy machine (measured: 18 ms per tiny op with 2 threads under load). The heavy work
        # runs on the quantizers' worker threads (CPU_WORKERS), each single-threaded in torch.
        torch.set_num_threads(1)
        self._place_outputs()
        self._open_writers()
        self._setup_device()
        self.rt = threading.Thread(target=self._reader, name="qconvert-reader", daemon=True)
        self.wt = threading.Thread(target=self._writer, name="qconvert-writer", daemon=True)
        self.bar = Progress(self.bytes_in, self.opts.progress, "convert")
        self.bar.update(self.skipped_bytes)
        # CPU: small jobs run on job threads, several at once (SMALL_JOB_BYTES); their outputs still
        # reach the writer in job order, so output shards are hashed while written.
        cpu_workers = kernels.CPU_WORKERS
        self.n_job = min(cpu_workers, 32) if self.opts.device == "cpu" and cpu_workers > 1 else 0
        self.failed = True  # until the main loop has finished: then threads end by themselves
        try:
            self.rt.start()
            self.wt.start()
            if self.n_job:
                self.pool = ThreadPoolExecutor(
                    self.n_job, thread_name_prefix="qconvert-job", initializer=kernels.single_threaded_job_thread
                )
            self.hashers = ThreadPoolExecutor(kernels.HASH_STREAMS, thread_name_prefix="qconvert-input-sha")
            self._start_input_digests()
            self._dispatch()
            self.failed = False
        finally:
            self._end_threads()
        if self.errors:
            raise self.errors[0]
        if self.side is not None:  # the reader's copies are done: hand the page-locked buffers back
            self.side.synchronize()
            release_pinned()
        self._close_remaining_outputs()
        order = [h.path.name for h in self.ckpt.shards]  # shard order, whatever order shards finished in
        return {n: self.input_sha[n] for n in order}, {n: self.output_sha[n] for n in order}

    # ---- set-up ----------------------------------------------------------------------------------

    def _place_outputs(self):
        """Output tensor -> output shard: the shard of the source it came from, in job order of the
        sources' places in the files."""
        ckpt = self.ckpt
        shard_of = ckpt.shard_of()
        self.job_of = {s: j for j in self.jobs for s in j.sources}
        self.specs: list[list] = [[] for _ in ckpt.shards]
        self.out_shard: dict[str, int] = {}
        entries = ckpt.tensors
        order = {name: (shard_of[name], entries[name].start) for name in entries}
        for j in sorted(self.jobs, key=lambda j: max(order[s] for s in j.sources)):
            for o, srcname in zip(j.outputs, source_for_outputs(j)):
                i = shard_of[srcname]
                self.specs[i].append((o.name, o.dtype, o.shape))
                self.out_shard[o.name] = i

    def _open_writers(self):
        # Resume: output shards the journal verified are not rewritten (writer None); only jobs with an
        # output in another shard run, and only input shards holding their sources are read.
        done = self.journal.done if self.journal is not None else set()
        writers = self.writers
        try:
            for i, h in enumerate(self.ckpt.shards):
                writers.append(
                    None
                    if h.path.name in done
                    else HashingWriter(self.tmp / h.path.name, self.specs[i], self.opts.output_checksums)
                )
        except BaseException:
            kernels.settle([w.abort for w in writers if w is not None])  # their hash threads end here too
            raise
        self.needed = {
            s
            for j in self.jobs
            if any(writers[self.out_shard[o.name]] is not None for o in j.outputs)
            for s in j.sources
        }
        self.skipped_bytes = sum(e.nbytes for n, e in self.ckpt.tensors.items() if n not in self.needed)

    def _setup_device(self):
        opts = self.opts
        # CUDA: the reader thread reads quantizer inputs into page-locked memory and moves them to the
        # device on a side stream, so the transfer overlaps the calling thread's compute; the writer
        # thread copies outputs back, also through page-locked memory (see to_host).
        self.side = torch.cuda.Stream(device=opts.device) if opts.device != "cpu" else None
        # the stream the calling thread's kernels run on (a library caller's own, if it set one): the
        # reader's copies are waited for on it, and the writer copies results back on it
        self.main_stream = torch.cuda.current_stream(opts.device) if self.side is not None else None
        self.to_device = {s for j in self.jobs if j.device_input for s in j.sources} if self.side is not None else set()

    # ---- source digests --------------------------------------------------------------------------

    def _start_input_digests(self):
        journal = self.journal
        for h in self.ckpt.shards:
            name = h.path.name
            if journal is not None and name in journal.inputs and not any(n in self.needed for n in h.entries):
                self.input_sha[name] = journal.inputs[name]  # resumed and not read again
            elif not self.opts.source_checksums:
                self._input_digest(h, "")
            elif (known := hub_cache_sha256(h.path) or local_dir_sha256(h.path)) is not None:
                self._input_digest(h, known)
            else:
                self.hashers.submit(self._input_digest, h, None)

    def _input_digest(self, h, known: str | None):
        """Source digests: each shard hashed by reading the file on a thread of its own (HASH_STREAMS
        at once), so neither the reader nor the writer waits for a digest (one sha256 stream runs
        at 1.2-1.7 GB/s, slower than the page cache on a many-core host)."""
        try:
            name = h.path.name
            if known is None:
                try:
                    known = sha256_file(h.path, cancel=self.stop)
                except OSError as e:
                    raise CheckpointError(f"{h.path}: cannot read ({e.strerror}); check the file and rerun") from None
                if known is None:  # cancelled
                    return
            self.input_sha[name] = known  # "": not recorded
            if self.journal is not None:
                self.journal.input_done(name, known)
        except BaseException as ex:
            self.errors.append(ex)
            self.stop.set()

    # ---- the reader thread -----------------------------------------------------------------------

    def _streams(self):
        """(shard, reader, tensor iterator) for each shard still to read, opened lazily."""
        for h in self.ckpt.shards:
            only = {n for n in h.entries if n in self.needed}
            if not only:
                continue
            r = ShardReader(h, hash_file=False, mapped=True, pinned=self.to_device)
            yield h, r, r.iter_tensors(only if len(only) < len(h.entries) else None)

    def _reader(self):
        # READ_STREAMS shards are read at once, a tensor from each in turn, so that as many output
        # shards fill side by side (their sha256 streams run in parallel).
        active: deque = deque()
        todo = self._streams()
        cond, stop, opts = self.cond, self.stop, self.opts
        read_streams = kernels.READ_STREAMS
        try:
            while True:
                while len(active) < read_streams:
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    active.append(nxt)
                if not active:
                    break
                h, r, it = active.popleft()
                item = next(it, None)
                if item is None:
                    r.close()
                    continue
                active.append((h, r, it))
                e, t = item
                with cond:
                    while self.inflight > 0 and self.inflight + e.nbytes > opts.queue_bytes and not stop.is_set():
                        cond.wait(0.2)
                    if stop.is_set():
                        return
                    self.inflight += e.nbytes
                if e.name in self.to_device:
                    with torch.cuda.stream(self.side):
                        t = t.to(opts.device, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.side)
                    t = (t, ev)
                self.read_q.put((e, t))
        except BaseException as ex:  # surfaced by the main loop
            self.errors.append(ex)
        finally:
            for _, r, _ in active:
                r.close()
            self.read_q.put(None)

    # ---- the writer thread and the output-shard closers ------------------------------------------

    def _close_output(self, i: int, w: HashingWriter):
        try:
            name = self.ckpt.shards[i].path.name
            self.output_sha[name] = w.close(self.opts.fsync)
            if self.journal is not None:
                self.journal.output_done(name, self.output_sha[name], w.w.size)
        except BaseException as ex:
            self.errors.append(ex)
            self.stop.set()

    def _writer(self):
        try:
            while True:
                item = self.write_q.get()
                if item is None:
                    return
                outputs, release = item  # one job's outputs, then its input bytes leave the budget
                for name, t in outputs:
                    if t.device.type != "cpu":
                        with torch.cuda.stream(self.main_stream):  # after the kernels that made t
                            t = to_host(t)
                    i = self.out_shard[name]
                    w = self.writers[i]
                    w.write(name, t)
                    if w.complete:  # fsync and digest on another thread: the writer goes on
                        ct = threading.Thread(
                            target=self._close_output, args=(i, w), name="qconvert-output-close", daemon=True
                        )
                        ct.start()
                        self.closers.append(ct)
                outputs = t = None  # drop the references before waiting for the next job
                with self.cond:
                    self.inflight -= release
                    self.cond.notify()
        except BaseException as ex:
            self.errors.append(ex)
            self.stop.set()

    # ---- the calling thread: jobs ----------------------------------------------------------------

    def _emit(self):
        """Hand the oldest pending job's outputs to the writer (waiting for the job if needed)."""
        fut, j, release, nsrc = self.pending.popleft()
        out = fut.result()
        item = (
            [
                (o.name, out[o.name]) for o in j.outputs if self.writers[self.out_shard[o.name]] is not None
            ],  # resumed: shard already complete
            release,
        )  # released by the writer once the outputs are written
        del out
        while True:
            try:
                self.write_q.put(item, timeout=0.2)
                break
            except queue.Full:
                if self.errors:
                    raise self.errors[0] from None  # a job's error, not the full queue
        self.bar.update(nsrc)

    def _dispatch(self):
        """The main loop: each tensor read joins its job; a job whose sources are all here runs on a
        job thread (small CPU jobs) or here; finished jobs go to the writer in job order."""
        pending, waiting, errors, read_q = self.pending, self.waiting, self.errors, self.read_q
        small = kernels.SMALL_JOB_BYTES
        while True:
            item = read_q.get()
            if item is None:
                break
            if errors:
                break
            if item is _WAKE:  # a job thread finished: write what is done, in job order
                while pending and pending[0][0].done():
                    self._emit()
                continue
            e, t = item
            if isinstance(t, tuple):  # moved to the device by the reader on the side stream
                t, ev = t
                self.main_stream.wait_event(ev)
                t.record_stream(self.main_stream)
            j = self.job_of[e.name]
            waiting[e.name] = t
            if all(s in waiting for s in j.sources):
                src = {s: waiting.pop(s) for s in j.sources}
                nsrc = sum(x.numel() * x.element_size() for x in src.values())
                if self.pool is not None and nsrc <= small:
                    fut = self.pool.submit(j.fn, src)
                    # wakes this loop even when the reader is blocked on the memory budget, which
                    # only the writer (fed from here) can release
                    fut.add_done_callback(lambda _: read_q.put(_WAKE))
                else:
                    fut = Future()
                    fut.set_result(j.fn(src))
                pending.append((fut, j, e.nbytes, nsrc))
                del src
                while pending and (pending[0][0].done() or len(pending) > 2 * self.n_job):
                    self._emit()
            else:  # parked until its fused partners arrive: not counted, so partners can be read
                with self.cond:
                    self.inflight -= e.nbytes
                    self.cond.notify()
        while pending and not errors:
            self._emit()
        if errors:
            raise errors[0]
        if waiting:
            raise CheckpointError(f"tensor {next(iter(waiting))!r}: its fused partners never arrived (internal)")

    # ---- the end ---------------------------------------------------------------------------------

    def _end_threads(self):
        """Every thread this run started has ended when it returns or raises, whatever happened: a
        thread still running at interpreter exit aborts the process as it drops a torch tensor
        ("terminate called without an active exception", exit -6), and one still quantizing
        writes into freed memory. A Ctrl-C while waiting here is held until they have ended."""
        kernels.settle(
            [
                self._stop_all,
                self._end_pool,
                self._end_writer,
                self._end_closers,
                self._end_reader,
                self._end_hashers,
                self.bar.close,
                self._abort_writers,
            ]
        )

    def _stop_all(self):
        if self.failed:
            self.stop.set()
            with self.cond:
                self.cond.notify_all()

    def _end_pool(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _end_writer(self):
        self.pending.clear()
        while self.wt.is_alive():  # a writer that failed leaves the queue as it was: do not wait on it
            try:
                self.write_q.put(None, timeout=0.2)
                break
            except queue.Full:
                pass
        if self.wt.ident is not None:
            self.wt.join()

    def _end_closers(self):
        for ct in self.closers:
            ct.join()

    def _end_reader(self):
        if self.rt.ident is not None:
            self.rt.join()  # it checks `stop` at least every 0.2 s

    def _end_hashers(self):
        if self.hashers is not None:  # a set stop also ends running digests
            self.hashers.shutdown(wait=True, cancel_futures=self.stop.is_set())

    def _abort_writers(self):
        if self.failed or self.errors:
            for w in self.writers:
                if w is not None:
                    w.abort()

    def _close_remaining_outputs(self):
        """Output shards no closer thread finished: resumed ones (their journaled digest) and shards
        with no tensor (header only)."""
        try:
            for i, w in enumerate(self.writers):
                name = self.ckpt.shards[i].path.name
                if w is None:
                    self.output_sha[name] = self.journal.outputs[name]["sha256"]
                elif name not in self.output_sha:
                    if w.w.names:
                        raise OutputError(f"{self.tmp / name}: output shard incomplete (internal)")
                    self.output_sha[name] = w.close(self.opts.fsync)  # empty shard: header only
                    if self.journal is not None:
                        self.journal.output_done(name, self.output_sha[name], w.w.size)
        except BaseException:
            kernels.settle([w.abort for w in self.writers if w is not None])  # no hash thread outlives the run
            raise


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into page-locked host memory: 55 GB/s on an H200 host against 5 GB/s
    for ``t.cpu()`` (pageable). torch's caching host allocator reuses the buffer once written."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)
    return h


def release_pinned():
    """Return the caching host allocator's page-locked buffers to the system (a library caller's
    process goes on after the conversion)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
