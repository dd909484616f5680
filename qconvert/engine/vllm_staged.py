"""Engine side: load a shared-memory staging area into a running vLLM worker without copying it.

``WorkerExtension.qconvert_load_staged(area, verify=False)`` (``qconvert/engine/vllm_worker.py``)
calls :func:`load_staged_into_worker`. The area (version 1, written by ``qconvert stage``, or
version 2, written by a refit: docs/reload.md#staging-area-format) is read through
``qconvert.formats.staging``, never re-parsed from the safetensors headers:

1. ``committed(area)`` gives the committed files with every tensor's dtype, shape and data offset
   and, for a version 2 area, holds the committed slot's shared ``flock`` until the load ends, so a
   refit can never overwrite the slot being read (it waits, docs/reload.md#staging-area-format).
2. This server rank reads only its own files (docs/reload.md#per-rank-files): every ``rank: null``
   file and the files of its (tp_rank, ep_rank), taken from the MoE layers' parallel config (the
   ranks the pre-shuffled layout is written for), else vLLM's tensor parallel rank.
3. Each file is mapped once, private and read-only in effect (``ACCESS_COPY``: a write would copy
   the page and never reach the area); every tensor is a view of that mapping
   (``torch.frombuffer`` sliced at the manifest's offset): no header parse, no allocation and no
   copy per tensor. vLLM's layerwise reload then copies each view into the layer it rebuilds
   (docs/reload.md#vllm-staged-load says which copies are vLLM's own).
4. Plain areas go through ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``;
   pre-shuffled areas (``qconvert.json`` with a ``layout`` beside the files) through the
   pre-shuffled loader (``vllm_layout_loader``) fed with the same views.

The mappings are released before the call returns; the result says whether every one could be
(``mappings_released``: no tensor of vLLM's kept a reference into the area).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from qconvert import host_memory
from qconvert.engine import vllm_marlin
from qconvert.errors import QConvertError
from qconvert.formats.manifest import MANIFEST_NAME


class StagedLoadError(QConvertError):
    """The staging area cannot be loaded by this server rank; nothing was loaded."""


@dataclass
class MappedFile:
    """One staging file mapped into the worker: ``base`` is a uint8 tensor over the whole file."""

    name: str
    path: Path
    mm: mmap.mmap
    base: torch.Tensor
    spec: object  # formats.staging.FileSpec

    typed: dict | None = None  # dtype -> the mapping as that dtype (whole elements), made on first use
    kept: bool = False  # a mapping of :class:`KeptMaps`: outlives the load, close() leaves it mapped
    pinned: bool = False  # registered with CUDA (page-locked): host-to-device copies at full speed
    views: dict | None = None  # name -> (dtype, shape, strides, offset, nbytes), made on first use

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The mapping as a 1-D tensor of ``dtype`` (its whole elements), storage offset 0."""
        if self.typed is None:
            self.typed = {}
        got = self.typed.get(dtype)
        if got is None:
            size = dtype.itemsize
            got = self.typed[dtype] = self.base[: self.base.numel() // size * size].view(dtype)
        return got

    def names(self) -> list[str]:
        """The file's tensor names in data-offset order."""
        return sorted(self.spec.tensors, key=lambda n: self.spec.tensors[n].offset)

    def view_table(self) -> dict:
        """Per tensor name: (torch dtype, shape, contiguous strides, offset, bytes), from the spec once."""
        if self.views is None:
            self.views = view_table_of(self.spec)
        return self.views

    def tensor(self, tname: str, start: int = 0) -> torch.Tensor:
        """The view of ``tname``; ``base`` holds the file's bytes from ``start`` on (a device chunk)."""
        dtype, shape, strides, offset, nbytes = self.view_table()[tname]
        if not nbytes:
            return torch.empty(shape, dtype=dtype, device=self.base.device)
        size = dtype.itemsize
        off = offset - start
        if off % size:
            return self.base[off : off + nbytes].view(dtype).reshape(shape)
        # one view op per tensor (a slice, a dtype view and a reshape cost 3x as much per tensor)
        return torch.as_strided(self.whole(dtype), shape, strides, off // size)

    def close(self) -> bool:
        """Drop the mapping; False when a tensor still refers to it (it is then unmapped when the last goes).
        A kept mapping stays mapped (:class:`KeptMaps` owns it); this load only lets go of it."""
        self.base = None  # type: ignore[assignment]
        self.typed = None
        if self.kept:
            return True
        try:
            self.mm.close()
            return True
        except BufferError:
            return False


def _model_device(model: torch.nn.Module) -> torch.device:
    """Where the served model lives (CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def view_table_of(spec) -> dict:
    """Per tensor name of a ``formats.staging.FileSpec``: (torch dtype, shape, contiguous strides,
    offset, bytes)."""
    from qconvert.convert.safetensors_io import DTYPES

    return {
        n: (DTYPES[t.dtype][0], tuple(t.shape), _contiguous_strides(t.shape), t.offset, t.nbytes)
        for n, t in spec.tensors.items()
    }


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _open_staged(path: Path, spec) -> tuple[int, os.stat_result]:
    """A read-only descriptor of a staging file and its stat, its size checked against the area's
    description (the caller closes it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StagedLoadError(f"{path}: cannot open the staged file ({e.strerror}); restage the area") from None
    st = os.fstat(fd)
    if st.st_size != spec.size or st.st_size == 0:
        os.close(fd)
        what = "empty staged file" if st.st_size == 0 else f"{st.st_size} bytes, the staging area says {spec.size}"
        raise StagedLoadError(f"{path}: {what} (truncated or rewritten); restage the area")
    return fd, st


def map_file(directory: Path, spec) -> MappedFile:
    """Map one staging file (its size checked against the area's description first)."""
    path = Path(directory) / spec.name
    fd, st = _open_staged(path, spec)
    try:
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    return MappedFile(spec.name, path, mm, base, spec)


#: Server environment variable: a GPU server keeps a refit area's files mapped and registered
#: between loads (:class:`KeptMaps`) unless it is ``0`` (docs/reload.md#kept-mappings): every load
#: then maps the files afresh
KEEP_ENV = "QCONVERT_STAGED_KEEP_MAPS"


@dataclass
class _Kept:
    ident: tuple[int, int, int]  # (st_dev, st_ino, st_size) of the file when it was mapped
    mm: mmap.mmap
    base: torch.Tensor
    pinned: bool
    writable: bool = False  # registered through a writable mapping (no read-only registration here)
    pin_tried: bool = False
    device: int = 0  # the CUDA device whose context registered it
    views_of: object = None  # the FileSpec ``views`` was made from (the area's spec is kept parsed)
    views: dict | None = None  # its view_table_of, reused by every load of the same spec


class KeptMaps:
    """The files of refit areas (version 2) as a GPU server keeps them between loads
    (docs/reload.md#kept-mappings): each slot file is mapped once, shared and read-only (a
    write through it faults instead of reaching the area), and registered with CUDA read-only, so
    every later load copies it to the device from page-locked memory (the trainer overwrites the
    same pages in place, and the slot lock keeps it off the slot being read). An entry is used only
    while the path still names the same file (device, inode, size); :meth:`prune` lets go of the
    files that were replaced or removed (every load calls it), :meth:`release` of all."""

    def __init__(self):
        self._maps: dict[str, _Kept] = {}
        self.pin_error: str | None = None  # why a registration of this load failed (a fallback may have followed)

    def __len__(self) -> int:
        return len(self._maps)

    def __contains__(self, path: str) -> bool:
        return path in self._maps

    def get(self, directory: Path, spec, pin: int | None) -> MappedFile:
        """The kept mapping of ``directory/spec.name`` (mapped now if new or replaced); ``pin``: the
        CUDA device index to register it for (once per mapping), None for none."""
        path = Path(directory) / spec.name
        fd, st = _open_staged(path, spec)
        try:
            ident = (st.st_dev, st.st_ino, st.st_size)
            k = self._maps.get(str(path))
            if k is not None and k.ident != ident:
                self._drop(str(path))
                k = None
            if k is None:
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
                k = self._maps[str(path)] = _Kept(ident, mm, _readonly_bytes(mm), False)
        finally:
            os.close(fd)
        if pin is not None and not k.pin_tried:
            k.pin_tried, k.device = True, pin  # once per mapping: a refusal is not retried at every load
            self._pin(path, k)
        if k.views_of is not spec:
            k.views_of, k.views = spec, view_table_of(spec)
        return MappedFile(spec.name, path, k.mm, k.base, spec, kept=True, pinned=k.pinned, views=k.views)

    def _pin(self, path: Path, k: _Kept) -> None:
        """Register ``k`` read-only; where the platform refuses read-only registration, map the
        file again writable (shared) and register that (the worker still only reads it)."""
        if self._register(k.base, host_memory.READ_ONLY, k.device):
            k.pinned = True
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size) != k.ident:
                return
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        if not self._register(base, 0, k.device):
            del base
            mm.close()
            return
        old = k.mm
        k.mm, k.base, k.pinned, k.writable = mm, base, True, True
        try:
            old.close()
        except BufferError:
            pass

    def _register(self, t: torch.Tensor, flags: int, device: int) -> bool:
        rc = host_memory.register(t.data_ptr(), t.numel(), flags, device)
        if rc != 0:
            self.pin_error = f"cudaHostRegister(flags={flags}) error {rc}"
            return False
        return True

    def _drop(self, key: str) -> None:
        k = self._maps.pop(key)
        if k.pinned:
            host_memory.unregister(k.base.data_ptr(), k.device)
        k.base = None  # type: ignore[assignment]
        try:
            k.mm.close()
        except BufferError:  # a tensor of vLLM's still refers to it: unmapped when the last goes
            pass

    def prune(self) -> int:
        """Let go of every kept file whose path no longer names it (the area was dropped or made
        again); returns how many."""
        gone = []
        for key, k in self._maps.items():
            try:
                st = os.stat(key, follow_symlinks=False)
                same = (st.st_dev, st.st_ino, st.st_size) == k.ident
            except OSError:
                same = False
            if not same:
                gone.append(key)
        for key in gone:
            self._drop(key)
        return len(gone)

    def release(self, root: Path | None = None) -> int:
        """Let go of the kept files of the area at ``root`` (every area when None); returns how many."""
        prefix = None if root is None else str(Path(root)) + os.sep
        keys = [key for key in self._maps if prefix is None or key.startswith(prefix)]
        for key in keys:
            self._drop(key)
        return len(keys)


def _readonly_bytes(mm: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a read-only mapping (torch warns that it is not writable: it is not)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter(action="ignore", category=UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


#: the kept mappings of this worker process (one served model per worker)
KEPT = KeptMaps()


def _kept_files(view, files: list, device: torch.device) -> list[MappedFile]:
    """This rank's ``files`` of the committed slot of a refit area from :data:`KEPT` (after letting
    go of replaced or removed files); the first time, the other slot's are mapped (and registered)
    too, so that the first load pays for both, as the trainer's first refit does."""
    from qconvert.formats import staging as fmt

    KEPT.prune()
    KEPT.pin_error = None
    pin = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    got = [KEPT.get(view.directory, f, pin=pin) for f in files]
    other = fmt.slot_dir(view.root, 1 - view.slot)
    for f in files:
        if str(other / f.name) not in KEPT:
            try:
                KEPT.get(other, f, pin=pin)
            except StagedLoadError:  # not made yet or replaced: mapped by the load that reads it
                pass
    return got


def keep_maps_enabled() -> bool:
    """Whether a GPU server keeps refit areas' mappings by default: yes unless
    ``QCONVERT_STAGED_KEEP_MAPS=0`` (docs/reload.md#kept-mappings)."""
    return os.environ.get(KEEP_ENV, "1") != "0"


def iter_tensors(maps: list[MappedFile]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor, file by file, in data-offset order (layer order across files)."""
    for m in maps:
        for tname in m.names():
            yield tname, m.tensor(tname)


#: a GPU server's load copies the mapped files to the GPU in chunks of about this many bytes (runs
#: of whole tensors; a larger tensor is a chunk of its own), at most PREFETCH_CHUNKS ahead
CHUNK_BYTES = 256 << 20
PREFETCH_CHUNKS = 2
#: Server environment variable: ``0`` hands a GPU server host views as on CPU (no device chunks)
DEVICE_CHUNKS_ENV = "QCONVERT_STAGED_DEVICE_CHUNKS"


def _chunks(m: MappedFile) -> list[tuple[int, int, list[str]]]:
    """(start, end, names): runs of whole tensors of ``m`` in offset order, each spanning at most
    CHUNK_BYTES (or one larger tensor)."""
    out: list[tuple[int, int, list[str]]] = []
    table = m.view_table()
    for n in m.names():
        *_, offset, nbytes = table[n]
        end = offset + nbytes
        if out and end - out[-1][0] <= CHUNK_BYTES:
            start, _, names = out[-1]
            names.append(n)
            out[-1] = (start, end, names)
        else:
            out.append((offset, end, [n]))
    return out


def iter_tensors_to_device(maps: list[MappedFile], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_tensors` for a model on a CUDA device: the same (name, tensor) pairs, in the same
    order, as views of device copies of the files. A thread copies each chunk of CHUNK_BYTES from
    the mapping to the device (a host-to-device copy of pageable memory blocks the calling thread,
    so it runs beside the loader's Python) on its own stream, up to PREFETCH_CHUNKS ahead; the
    consumer's stream waits for a chunk's copy before its views are handed out. vLLM's per-tensor
    copies are then device-to-device. Exhausting or closing the generator waits for every copy;
    close it before unmapping ``maps`` or releasing the slot (docs/reload.md#vllm-staged-load)."""
    from collections import deque

    stream = torch.cuda.Stream(device)
    pool = ThreadPoolExecutor(1, thread_name_prefix="qconvert-h2d")
    todo = deque((m, c) for m in maps for c in _chunks(m))
    pending: deque = deque()

    def fetch(src: torch.Tensor, dst: torch.Tensor, pinned: bool) -> torch.cuda.Event:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=pinned)  # from a registered mapping: the DMA engine reads it
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def submit() -> None:
        if todo:
            m, (a, b, names) = todo.popleft()
            buf = torch.empty(b - a, dtype=torch.uint8, device=device)  # on the consumer's stream
            view = MappedFile(m.name, m.path, m.mm, buf, m.spec, views=m.view_table())
            pending.append((view, a, names, pool.submit(fetch, m.base[a:b], buf, m.pinned)))

    try:
        for _ in range(PREFETCH_CHUNKS):
            submit()
        while pending:
            view, a, names, fut = pending.popleft()
            torch.cuda.current_stream(device).wait_event(fut.result())
            submit()
            for n in names:
                yield n, view.tensor(n, start=a)
    finally:
        for *_, fut in pending:  # the thread reads the mappings: nothing may unmap them before it stops
            fut.exception()
        pool.shutdown(wait=True)
        # Every copy done before the caller goes on, also after the last chunk: a copy from a
        # registered mapping is asynchronous to the host (the loading stream only waits for it on
        # the device), and once the load returns, the files may be unmapped or, for a kept refit
        # area, released to the trainer, whose next refit overwrites those pages; closed early, no
        # chunk buffer goes back to the allocator while its copy runs.
        stream.synchronize()


class StagedTensors:
    """The tensors of the mapped files as the direct load takes them (qconvert/engine/vllm_direct.py):
    iterating gives (name, view) in :func:`iter_tensors`'s order; :meth:`others` the same less some
    names, without making their views; :meth:`whole` a file's mapping as one tensor of a dtype (what
    the copy plan's recorded sources are views of); :attr:`layout` what a load of these files
    sends, less the bytes (file names and sizes, every tensor's name, dtype, shape and offset: the
    plan's key); :meth:`file_of` the file a tensor is in."""

    def __init__(self, maps: list[MappedFile], device: torch.device | None = None):
        self.maps = {m.name: m for m in maps}
        self.device = device  # a CUDA device: iterating gives views of device chunks
        self._open: list = []  # the iterators handed out, closed by close()
        self.order = [(m, m.names()) for m in maps]
        self._file = {n: m.name for m, names in self.order for n in names}
        self.layout = tuple(
            (
                m.name,
                m.spec.size,
                tuple((n, t.dtype, tuple(t.shape), t.offset) for n, t in sorted(m.spec.tensors.items())),
            )
            for m in maps
        )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.others(())

    def others(self, skip) -> Iterator[tuple[str, torch.Tensor]]:
        it = self._others(skip)
        self._open.append(it)
        return it

    def close(self) -> None:
        """Close every iterator handed out (device chunks: waits for the copies in flight); call it
        before the files are unmapped."""
        for it in self._open:
            it.close()
        self._open.clear()

    def _others(self, skip) -> Iterator[tuple[str, torch.Tensor]]:
        if self.device is not None:
            it = iter_tensors_to_device([m for m, _ in self.order], self.device)
            try:
                for n, t in it:
                    if n not in skip:
                        yield n, t
            finally:
                it.close()
            return
        for m, names in self.order:
            for n in names:
                if n not in skip:
                    yield n, m.tensor(n)

    def whole(self, file: str, dtype: torch.dtype) -> torch.Tensor:
        return self.maps[file].whole(dtype)

    def file_of(self, name: str) -> str:
        return self._file[name]


def file_digest(kind: str, buf) -> str:
    """Digest of a whole staged file of the kind the area records (``xxh3_128``, its pieces form,
    or ``sha256``)."""
    from qconvert.formats import staging as fmt

    if kind == fmt.DIGEST_XXH3:
        from qconvert.convert.safetensors_io import xxh3_128_hex

        return xxh3_128_hex(buf)
    if kind == fmt.DIGEST_XXH3_PIECES:
        from qconvert.convert.safetensors_io import xxh3_128_of_pieces, xxh3_128_piece

        return xxh3_128_of_pieces([xxh3_128_piece(buf, a, b) for a, b in fmt.digest_pieces(len(buf))])
    if kind == fmt.DIGEST_SHA256:
        import hashlib

        return hashlib.sha256(buf).hexdigest()
    raise StagedLoadError(f"digest kind {kind!r} unknown; restage the area with this qconvert")


def verify_files(view, maps: list[MappedFile], threads: int = 8) -> None:
    """Check every mapped file against the committed digests (threads: both hashes release the GIL)."""

    def one(m: MappedFile) -> str | None:
        buf = memoryview(m.mm)
        try:
            got = file_digest(view.digest, buf)
        finally:
            buf.release()
        return None if got == view.digests.get(m.name) else m.name

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(maps)))) as ex:
        bad = [n for n in ex.map(one, maps) if n]
    if bad:
        raise StagedLoadError(
            f"staging area {view.root}: {bad[0]} does not match its {view.digest} digest "
            f"(modified or corrupt); nothing was loaded, restage the area"
        )


# ------------------------------------------------------------------------------- ranks


def moe_parallel(model: torch.nn.Module) -> tuple[int, int, int, int] | None:
    """(tp_size, tp_rank, ep_size, ep_rank) of the model's MoE layers (the sizes a pre-shuffled
    layout is written for), or None for a model without MoE layers."""
    for m in model.modules():
        pc = getattr(getattr(m, "moe_config", None), "moe_parallel_config", None)
        if pc is not None:
            return int(pc.tp_size), int(pc.tp_rank), int(pc.ep_size), int(pc.ep_rank)
    return None


def server_rank(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(tp_size, tp_rank, ep_size, ep_rank) of this worker for file selection."""
    got = moe_parallel(model)
    if got is not None:
        return got
    try:
        from vllm.distributed import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), 1, 0
    except (ImportError, AssertionError, AttributeError):
        return 1, 0, 1, 0


def select_files(view, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int) -> list:
    """The files of ``view`` this rank reads (docs/reload.md#per-rank-files). An area without
    per-rank files is read whole by every rank; one with them must match the server's MoE sizes."""
    from qconvert.formats import staging as fmt

    if all(f.rank is None for f in view.files):
        return list(view.files)
    if (view.tp, view.ep) != (tp_size, ep_size):
        raise StagedLoadError(
            f"staging area {view.root} holds per-rank files for tp={view.tp} ep={view.ep}, "
            f"this server's MoE layers run tp={tp_size} ep={ep_size}; stage it for this "
            "server's parallel sizes"
        )
    return fmt.files_for_rank(view, tp_rank, ep_rank)


# ------------------------------------------------------------------------------- load


def _layout_of(view) -> dict | None:
    """The ``layout`` of a pre-shuffled area (``qconvert.json`` beside its files), or None."""
    from qconvert.engine.vllm_layout_loader import read_layout

    if MANIFEST_NAME not in view.extra_files:
        return None
    return read_layout(view.root)


def _profiled(fn, top: int):
    """Run ``fn()`` under cProfile; return the ``top`` functions by cumulative time as short lines."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:top]
    return [f"{v[3]:.3f}s cum {v[2]:.3f}s own {v[1]} calls {Path(k[0]).name}:{k[1]}({k[2]})" for k, v in rows]


def load_staged(
    model: torch.nn.Module,
    area: str | os.PathLike,
    reload_weights,
    *,
    verify: bool = False,
    lock_wait_s: float = 60.0,
    ranks: tuple[int, int, int, int] | None = None,
    profile: int = 0,
    direct_load=None,
    device_chunks: bool | None = None,
    keep_maps: bool | None = None,
    direct_forms: frozenset | None = None,
    marlin_gather: bool | None = None,
) -> dict:
    """Load the committed content of the staging area at ``area`` into ``model``.

    ``reload_weights(iterator)`` hands (name, tensor) pairs to vLLM's layerwise reload (checkpoint
    format). ``direct_load(StagedTensors, forms)``, when given, is the direct in-place load
    (qconvert/engine/vllm_direct.py), taken when :func:`vllm_direct.choose` finds modules it
    applies to (only the forms ``direct_forms`` names, when given); ``path`` in the result says which ran (``why``: the reason code of a layerwise
    load, ``modules``: the direct load's module counts per form). Returns JSON-serialisable
    statistics (with ``profile`` > 0, also the load's ``profile`` most expensive functions by
    cumulative time: scripts/bench_reload.py). ``device_chunks`` (default: on unless
    DEVICE_CHUNKS_ENV is ``0``) copies a GPU server's files to the device in chunks first
    (:func:`iter_tensors_to_device`); ``device_chunks`` in the result says whether it did.
    ``keep_maps`` (default: on for a refit area loaded by a GPU server unless KEEP_ENV is ``0``)
    takes the files from :data:`KEPT` (mapped once, registered with CUDA on a GPU server) instead
    of mapping them afresh; ``kept_maps`` and ``pinned_files`` in the result say what ran.
    ``marlin_gather`` (default: on for a GPU server unless ``vllm_marlin.ENV`` is ``0``) runs vLLM's
    MXFP8 MoE Marlin preparation as one byte gather per tensor (qconvert/engine/vllm_marlin.py);
    ``marlin`` in the result counts its calls."""
    from qconvert.formats import staging as fmt

    t0 = time.perf_counter()
    root = Path(area)
    tp_size, tp_rank, ep_size, ep_rank = ranks if ranks is not None else server_rank(model)
    device = _model_device(model)
    if device_chunks is None:
        device_chunks = os.environ.get(DEVICE_CHUNKS_ENV, "1") != "0"
    maps: list[MappedFile] = []
    released = True
    try:
        with fmt.committed(root, wait_s=lock_wait_s) as view:
            files = select_files(view, tp_size, tp_rank, ep_size, ep_rank)
            keep = view.slot is not None and (
                keep_maps if keep_maps is not None else device.type == "cuda" and keep_maps_enabled()
            )
            if keep:
                maps = _kept_files(view, files, device)
            else:
                for f in files:
                    maps.append(map_file(view.directory, f))
            t_map = time.perf_counter()
            if verify:
                verify_files(view, maps)
            t_verify = time.perf_counter()
            layout = _layout_of(view)
            n_tensors = sum(len(m.spec.tensors) for m in maps)
            chunked = layout is None and device.type == "cuda" and bool(device_chunks)
            extra: dict = {"device_chunks": chunked, "kept_maps": keep, "pinned_files": sum(m.pinned for m in maps)}
            if keep and KEPT.pin_error and device.type == "cuda":
                extra["pin_error"] = KEPT.pin_error  # the last refusal (a fallback may have followed)

            forms, why = None, None
            if layout is None:
                from qconvert.engine import vllm_direct

                forms, why = vllm_direct.choose(
                    model, enabled=direct_load is not None, layout=layout, forms=direct_forms
                )
                extra["path"] = vllm_direct.PATH_DIRECT if forms is not None else vllm_direct.PATH_LAYERWISE
                if why is not None:
                    extra["why"] = why.value

            def run() -> None:
                with torch.no_grad():
                    if forms is not None:
                        staged = StagedTensors(maps, device if chunked else None)
                        try:
                            extra["modules"] = direct_load(staged, forms)
                        finally:
                            staged.close()  # before the files are unmapped
                        extra["replay"] = extra["modules"].pop("replay", None)
                        extra["plan"] = extra["modules"].pop("plan", None)
                        if "copies_recorded" in extra["modules"]:
                            extra["copies_recorded"] = extra["modules"].pop("copies_recorded")
                    elif chunked:
                        it = iter_tensors_to_device(maps, device)
                        try:
                            reload_weights(it)
                        finally:
                            it.close()  # waits for the copies in flight before the files are unmapped
                    elif layout is None:
                        reload_weights(iter_tensors(maps))
                    else:
                        from qconvert.engine.vllm_layout_loader import load_preshuffled_entries

                        extra.update(load_preshuffled_entries(model, str(root), layout, maps, reload_weights))

            gathered = device.type == "cuda" and (marlin_gather if marlin_gather is not None else vllm_marlin.enabled())
            with vllm_marlin.patched() if gathered else contextlib.nullcontext() as g:
                since = g.counts.copy() if g is not None else None
                if profile:
                    extra["profile"] = _profiled(run, int(profile))
                else:
                    run()
                if g is not None:
                    extra["marlin"] = g.summary(since)
            t_load = time.perf_counter()
            stats = {
                "format": view.format,
                "version": view.version,
                "slot": view.slot,
                "files": len(maps),
                "files_in_area": len(view.files),
                "bytes": sum(m.spec.size for m in maps),
                "bytes_in_area": view.nbytes,
                "tensors": n_tensors,
                "tp_rank": tp_rank,
                "ep_rank": ep_rank,
                "verified": bool(verify),
                "map_seconds": t_map - t0,
                "verify_seconds": t_verify - t_map,
                "load_seconds": t_load - t_verify,
                **extra,
            }
    finally:
        for m in maps:
            released = m.close() and released
    stats["mappings_released"] = released
    stats["seconds"] = time.perf_counter() - t0
    return stats


def copy_floor(
    model: torch.nn.Module,
    area: str | os.PathLike,
    *,
    repeat: int = 3,
    ranks: tuple[int, int, int, int] | None = None,
    keep_maps: bool | None = None,
) -> dict:
    """The floor a load of ``area`` is measured against (scripts/bench_reload.py,
    scripts/gpu_vllm_check.py), in the same process, on the model's device, into destinations
    allocated and touched beforehand; the best of ``repeat`` timings. Where a load keeps the
    mappings (:class:`KeptMaps`: a refit area on a GPU server, ``keep_maps`` as :func:`load_staged`
    takes it), the floor is the bare copy of every file this rank loads, whole, from its kept
    (registered) mapping to the device (``kind`` ``kept-files``); else the files mapped afresh, as a
    load maps them, and one plain copy of every tensor (``fresh-tensors``; on a GPU server the
    host-to-device copy from pageable memory)."""
    from qconvert.formats import staging as fmt

    tp_size, tp_rank, ep_size, ep_rank = ranks if ranks is not None else server_rank(model)
    device = _model_device(model)
    best, nbytes, n = float("inf"), 0, 0
    with fmt.committed(Path(area)) as view:
        files = select_files(view, tp_size, tp_rank, ep_size, ep_rank)
        keep = view.slot is not None and (
            keep_maps if keep_maps is not None else device.type == "cuda" and keep_maps_enabled()
        )
        if keep:
            return _kept_floor(view, files, device, repeat)
        dst: list[torch.Tensor] | None = None
        for _ in range(max(1, repeat) + 1):  # the first round allocates and touches the destinations
            maps: list[MappedFile] = []
            try:
                t0 = time.perf_counter()
                for f in files:
                    maps.append(map_file(view.directory, f))
                src = [t for _, t in iter_tensors(maps)]
                if dst is None:  # on the model's device: a GPU server's floor is the host-to-device copy
                    dst = [torch.zeros_like(t, device=device) for t in src]
                else:
                    for s, d in zip(src, dst):
                        d.copy_(s)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    best = min(best, time.perf_counter() - t0)
                nbytes, n = sum(s.nbytes for s in src), len(src)
                del src
            finally:
                for m in maps:
                    m.close()
    return {"bytes": nbytes, "tensors": n, "seconds": best, "threads": torch.get_num_threads(), "kind": "fresh-tensors"}


def _kept_floor(view, files: list, device: torch.device, repeat: int) -> dict:
    """:func:`copy_floor` over the kept mappings: each whole file copied to a device buffer of its
    size (asynchronously where registered), one wait at the end."""
    maps = _kept_files(view, files, device)
    dst = [torch.zeros(m.base.numel(), dtype=torch.uint8, device=device) for m in maps]
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        for m, d in zip(maps, dst):
            d.copy_(m.base, non_blocking=m.pinned)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return {
        "bytes": sum(m.spec.size for m in maps),
        "files": len(maps),
        "seconds": best,
        "pinned_files": sum(m.pinned for m in maps),
        "kind": "kept-files",
    }


def load_staged_into_worker(
    worker,
    area: str,
    verify: bool = False,
    profile: int = 0,
    direct: bool | list | None = None,
    device_chunks: bool | None = None,
    keep_maps: bool | None = None,
    marlin_gather: bool | None = None,
    loader_copies: bool | None = None,
) -> dict:
    """Body of ``WorkerExtension.qconvert_load_staged``: ``worker`` is the vLLM worker. ``direct``
    (default: the server's ``QCONVERT_DIRECT_RELOAD``, on when unset) allows the direct in-place
    load where it is exact (qconvert/engine/vllm_direct.py): True for every form, False for none,
    or a list of form names (``vllm_direct.Form`` values), the others then reloading layerwise;
    ``device_chunks``, ``keep_maps``, ``marlin_gather``: see :func:`load_staged`; ``loader_copies``
    (default: on unless the server's ``QCONVERT_LOADER_COPIES`` is ``0``) makes replayed modules'
    loader calls as their recorded copies (vllm_replay)."""
    from qconvert.engine import vllm_direct

    runner = worker.model_runner

    def reload_weights(weights):
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    def direct_load(staged, forms):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(worker.vllm_config):
            got = vllm_direct.load_direct(
                runner.get_model(), worker.vllm_config.model_config, staged, forms, copies=loader_copies
            )
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            fn = getattr(runner, reset, None)
            if fn is not None:
                fn()
        return got

    forms = None
    if direct is None:
        direct, forms = vllm_direct.direct_enabled(), vllm_direct.enabled_forms()
    elif isinstance(direct, (list, tuple)):
        direct, forms = True, vllm_direct.parse_forms(direct, "qconvert_load_staged direct")
    lora = getattr(worker.vllm_config, "lora_config", None) is not None
    return load_staged(
        runner.get_model(),
        area,
        reload_weights,
        verify=verify,
        profile=profile,
        direct_load=direct_load if direct and not lora else None,
        device_chunks=device_chunks,
        keep_maps=keep_maps,
        direct_forms=forms,
        marlin_gather=marlin_gather,
    )
