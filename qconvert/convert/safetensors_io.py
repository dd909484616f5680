"""Validating safetensors reader and an offset-addressed writer.

The reader never trusts a header: lengths, JSON types, dtypes, shapes and offsets are checked
against the file before any tensor byte is read, so a truncated or hostile file fails with a
one-line error that names the file and the tensor. Tensors are read with ``readinto`` into
fresh buffers, or (``ShardReader(mapped=True)``, the converter's reader) mapped one by one from
the page cache copy-on-write, which saves a copy of every input byte; either way a tensor's
memory goes with the tensor, so peak memory stays at the tensors in flight.

The writer computes the whole header up front from (name, dtype, shape) and then accepts tensors
in any order, writing each at its offset. A shard is complete when every tensor was written.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import queue
import re
import stat
import struct
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, OutputError
from ..formats.safetensors import DTYPE_SIZES

#: safetensors dtype tag -> (torch dtype, itemsize): the tags qconvert reads and writes, with their
#: sizes from the one table (qconvert/formats/safetensors.py)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    tag: (dt, DTYPE_SIZES[tag])
    for tag, dt in (
        ("BF16", torch.bfloat16),
        ("F16", torch.float16),
        ("F32", torch.float32),
        ("F64", torch.float64),
        ("F8_E4M3", torch.float8_e4m3fn),
        ("F8_E5M2", torch.float8_e5m2),
        ("I8", torch.int8),
        ("U8", torch.uint8),
        ("I16", torch.int16),
        ("I32", torch.int32),
        ("I64", torch.int64),
        ("BOOL", torch.bool),
    )
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = (torch.float8_e8m0fnu, DTYPE_SIZES["F8_E8M0"])
TORCH_TO_TAG = {v[0]: k for k, v in DTYPES.items()}

MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
ALIGN = 8


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


@dataclass
class Header:
    path: Path
    header_len: int
    entries: dict[str, TensorEntry]  # in file-offset order
    metadata: dict[str, str]
    file_size: int


def _fail(path: Path, what: str, fix: str = "re-download or re-export this shard") -> CheckpointError:
    return CheckpointError(f"{path}: {what}; {fix}")


def _unique_keys(pairs):
    """JSON object hook: readers disagree on duplicate keys (first or last wins), so refuse them."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """'a FIFO', 'a directory', ... for a non-regular file's st_mode."""
    return next((k for test, k in _KINDS if test(mode)), "a special file")


def open_regular(path: str | os.PathLike, buffering: int = -1):
    """Open ``path`` for binary reading, refusing anything but a regular file with a one-line
    CheckpointError. Opened non-blocking and checked with fstat before any read, so a FIFO (or a
    device) put in place of a shard is an error, not a hang; blocking again once it is known to be
    a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found; check the checkpoint path or re-download it") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied; make the file readable") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: is {file_kind(mode)}, not a regular file; put the real file there")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate a safetensors header. Raises CheckpointError naming the problem."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"file is {size} bytes, too short for a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _fail(path, f"header length {n} exceeds the file size {size} (truncated or not safetensors)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found; check the checkpoint path or re-download it") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a .safetensors file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied; make the file readable") from None
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise _fail(path, f"header is not valid JSON ({e.__class__.__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise _fail(path, "header is not a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    metadata = obj.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, "__metadata__ must map strings to strings")
    entries = []
    for name, spec in obj.items():
        if not isinstance(spec, dict):
            raise _fail(path, f"tensor {name!r}: header entry is not an object")
        dtype, shape, offs = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _fail(
                path,
                f"tensor {name!r}: unsupported dtype {dtype!r}",
                "convert it to BF16 first; qconvert reads " + ", ".join(DTYPES),
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise _fail(path, f"tensor {name!r}: data_offsets {offs!r} are not a valid [begin, end] pair")
        if offs[1] > data_len:
            raise _fail(
                path,
                f"tensor {name!r}: data ends at byte {offs[1]} but the file holds {data_len} data bytes (truncated)",
            )
        expect = math.prod(shape) * DTYPES[dtype][1]
        if offs[1] - offs[0] != expect:
            raise _fail(
                path,
                f"tensor {name!r}: {offs[1] - offs[0]} bytes do not match dtype {dtype} and shape {shape} ({expect} bytes)",
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1]))
    entries.sort(key=lambda e: (e.start, e.end))
    prev = None
    for e in entries:
        if prev is not None and e.start < prev.end and e.nbytes and prev.nbytes:
            raise _fail(path, f"tensors {prev.name!r} and {e.name!r} overlap in the data section")
        if e.nbytes:
            prev = e
    return Header(path, n, {e.name: e for e in entries}, metadata, size)


class ShardReader:
    """Reads the tensors of one validated shard, in file order, hashing every byte it reads.

    ``sha256`` covers the whole file once all tensors were read in order with
    :meth:`iter_tensors` (gaps and the header included), so input checksums cost no second pass.
    """

    def __init__(self, header: Header, hash_file: bool = True, mapped: bool = False, pinned=frozenset()):
        self.header = header
        self._f = open_regular(header.path, buffering=0)
        self._hash = BackgroundSha256() if hash_file else None
        self._hashed_to = 0
        #: map each tensor instead of copying it (one mapping per tensor, released with it: callers
        #: that keep every tensor of a large model alive would run into the kernel's map count)
        self._mapped = mapped
        #: names read into page-locked memory (CUDA builds of torch only): their host-to-device
        #: copies run asynchronously at the link's speed, where a copy from pageable memory, mapped
        #: or not, is staged by the driver and blocks the caller (H200 host: 55 against 6-7 GB/s)
        self._pinned = pinned

    def close(self):
        self._f.close()
        if self._hash is not None:
            self._hash.close(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read_into(self, buf: memoryview, start: int, name: str):
        self._f.seek(start)
        got = 0
        while got < len(buf):
            n = self._f.readinto(buf[got:])
            if not n:
                raise _fail(self.header.path, f"tensor {name!r}: unexpected end of file while reading (truncated?)")
            got += n

    def _hash_gap(self, upto: int):
        if self._hash is None or upto <= self._hashed_to:
            return
        self._f.seek(self._hashed_to)
        left = upto - self._hashed_to
        while left:
            chunk = self._f.read(min(left, 1 << 24))
            if not chunk:
                raise _fail(self.header.path, "unexpected end of file (truncated?)")
            self._hash.update(chunk)
            left -= len(chunk)
        self._hashed_to = upto

    def _map(self, e: TensorEntry, dtype: torch.dtype):
        """(tensor, its bytes) backed by a private (copy-on-write) mapping of the file, or None where
        a mapping cannot be made (the caller then reads). Pages fault in from the page cache on
        first touch; a write to the tensor copies the page, never reaching the file."""
        base = e.start - e.start % mmap.ALLOCATIONGRANULARITY
        if (e.start - base) % dtype.itemsize:
            return None
        try:
            mm = mmap.mmap(self._f.fileno(), e.end - base, access=mmap.ACCESS_COPY, offset=base)
        except (OSError, ValueError):
            return None
        buf = memoryview(mm)[e.start - base :]
        t = torch.frombuffer(buf, dtype=dtype).reshape(e.shape)
        return t, buf

    def read(self, name: str) -> torch.Tensor:
        e = self.header.entries[name]
        dtype, _ = DTYPES[e.dtype]
        pinned = name in self._pinned
        got = self._map(e, dtype) if self._mapped and e.nbytes and not pinned else None
        if got is not None:
            t, buf = got
        else:
            t = torch.empty(e.shape, dtype=dtype, pin_memory=pinned)
        if e.nbytes:
            if got is None:
                buf = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
                self._read_into(buf, e.start, name)
            if self._hash is not None and e.start == self._hashed_to:
                self._hash.update(buf)
                self._hashed_to = e.end
        return t

    def iter_tensors(self, only: set[str] | None = None):
        """Yield (entry, tensor) in file order, of the names in ``only`` if given; afterwards
        :meth:`sha256` is the whole file's digest (skipped tensors are hashed, not returned)."""
        for e in self.header.entries.values():
            if only is not None and e.name not in only:
                continue
            self._hash_gap(e.start)
            yield e, self.read(e.name)

    def sha256(self) -> str | None:
        """The whole file's digest (the rest of the file is hashed first), or None if unhashed."""
        if self._hash is None:
            return None
        self._hash_gap(self.header.file_size)
        return self._hash.hexdigest()


class _HashState:
    """What the hashing thread shares with its BackgroundSha256 (never the owner itself, so a
    dropped owner is collected and its finalizer ends the thread)."""

    def __init__(self, data: bytes):
        self.h = hashlib.sha256(data)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.pending = 0

    def run(self):
        while True:
            buf = self.q.get()
            if buf is None:
                return
            self.h.update(buf)  # releases the GIL for large buffers
            with self.cond:
                self.pending -= memoryview(buf).nbytes
                self.cond.notify_all()


class BackgroundSha256:
    """sha256 of a byte stream, computed on its own thread.

    ``update`` queues the buffer (it must not change afterwards; the queue holds a reference) and
    returns at once, so the thread reading or writing the bytes is not held up by hashing them
    (about 1.7 GB/s per core with SHA-NI, as slow as the copy itself): with a spare core the
    digest costs no wall time. At most ``max_pending`` bytes wait, which bounds the memory the
    queue keeps alive; ``update`` blocks beyond that. ``hexdigest`` waits for the queue.
    """

    def __init__(self, data: bytes = b"", max_pending: int = 256 << 20):
        self._s = _HashState(data)
        self._max = max_pending
        self._digest: str | None = None
        self._thread = threading.Thread(target=self._s.run, name="qconvert-sha256", daemon=True)
        self._thread.start()
        # the end marker, queued once: by hexdigest/close, or when this object is dropped
        self._finalizer = weakref.finalize(self, self._s.q.put, None)

    def update(self, buf) -> None:
        n = memoryview(buf).nbytes
        if not n:
            return
        s = self._s
        with s.cond:
            while s.pending and s.pending + n > self._max:
                s.cond.wait()
            s.pending += n
        s.q.put(buf)

    def hexdigest(self) -> str:
        if self._digest is None:
            self._finalizer()
            self._thread.join()
            self._digest = self._s.h.hexdigest()
        return self._digest

    def close(self, wait: bool = False) -> None:
        """Stop without a digest (bytes already queued are hashed, then the thread ends); with
        ``wait``, return once the thread has ended. A thread left running at interpreter exit can
        abort the process as it drops a buffer that holds a torch tensor (pipeline error paths)."""
        self._finalizer()
        if wait:
            self._thread.join()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def hub_cache_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of a file in the Hugging Face cache, from its name, or None.

    huggingface_hub keeps each LFS file once, as ``blobs/<sha256 of its content>`` (the LFS oid the
    Hub shows), and the snapshot's file names are links to it. Reading the digest from the name
    saves hashing every byte of a downloaded checkpoint (a core-second per 1.5-2 GB).
    """
    try:
        real = Path(path).resolve(strict=True)
    except OSError:
        return None
    if Path(path).is_symlink() and real.parent.name == "blobs" and _HEX64.fullmatch(real.name):
        return real.name
    return None


def local_dir_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of a file that ``hf download --local-dir`` fetched and nobody changed since, or None.

    huggingface_hub records each file it downloads into a local directory in
    ``<dir>/.cache/huggingface/download/<file>.metadata``: the commit, the etag (for an LFS file
    the sha256 of its content, 64 hex digits) and the time it wrote it. It trusts that etag for a
    file not modified after that time (mtime at most 1 s later), and so does this.
    """
    p = Path(path)
    for root in list(p.parents)[:4]:
        meta = root / ".cache" / "huggingface" / "download" / (str(p.relative_to(root)) + ".metadata")
        try:
            lines = meta.read_text().splitlines()
            mtime = p.stat().st_mtime
        except (OSError, UnicodeDecodeError):
            continue
        try:
            etag, stamp = lines[1].strip(), float(lines[2])
        except (IndexError, ValueError):
            return None
        return etag if _HEX64.fullmatch(etag) and mtime - 1 <= stamp else None
    return None


def sha256_file(path: str | os.PathLike, cancel: threading.Event | None = None) -> str | None:
    """sha256 of a whole file (the checksums in manifests and journals), or None once ``cancel``
    is set. Read into one reused 1 MiB buffer: as fast as hashing a mapping of the file here, and
    the process's resident memory does not grow by the file's size."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(1 << 20))
    with open_regular(path, buffering=0) as f:
        while n := f.readinto(buf):
            if cancel is not None and cancel.is_set():
                return None
            h.update(buf[:n])
    return h.hexdigest()


def xxh3_128_hex(buf) -> str:
    """xxh3_128 of a buffer (bytes, memoryview, mmap) as 32 lower-case hex digits; xxhash releases
    the GIL, so threads hash side by side (docs/reload.md#staging-area-format)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(buf)


def xxh3_128_piece(buf, start: int, end: int) -> bytes:
    """The 16-byte xxh3_128 digest of ``buf[start:end]`` (one piece of a pieces digest)."""
    import xxhash

    view = memoryview(buf)[start:end]
    try:
        return xxhash.xxh3_128_digest(view)
    finally:
        view.release()


def xxh3_128_of_pieces(piece_digests: list[bytes]) -> str:
    """A ``xxh3_128-pieces`` digest from its pieces' digests, in order (formats/staging.py)."""
    return xxh3_128_hex(b"".join(piece_digests))


def xxh3_128_file(path: str | os.PathLike) -> str:
    """xxh3_128 of a whole file, through a read-only mapping (no copy)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return xxh3_128_hex(b"")
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                return xxh3_128_hex(view)
            finally:
                view.release()


def digest_files(paths: list, kind: str, threads: int | None = None) -> dict[str, str]:
    """``{str(path): hex}`` of whole files, ``kind`` "xxh3_128" (files hashed in parallel threads)
    or "sha256"."""
    from concurrent.futures import ThreadPoolExecutor

    fn = {"xxh3_128": xxh3_128_file, "sha256": sha256_file}[kind]
    if not paths:
        return {}
    n = max(1, min(len(paths), threads or (os.cpu_count() or 1)))
    with ThreadPoolExecutor(n, thread_name_prefix="qconvert-digest") as pool:
        return dict(zip((str(p) for p in paths), pool.map(fn, paths)))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def header_bytes(
    specs: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str], align: int = ALIGN
) -> tuple[bytes, list[int]]:
    """The safetensors header (8-byte little-endian length, then the JSON) of a file holding
    (name, dtype tag, shape, nbytes) back to back in that order, with ``metadata`` as its
    ``__metadata__``; the JSON is padded with spaces so that the data starts at a multiple of
    ``align`` (8 for the converter's shards, 256 for staging areas). Returns it with each tensor's
    offset from the start of the data. The one header writer of qconvert."""
    hdr: dict = {"__metadata__": dict(metadata)}
    offsets, off = [], 0
    for name, tag, shape, nbytes in specs:
        hdr[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        offsets.append(off)
        off += nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw, offsets


class ShardWriter:
    """Writes one safetensors file whose header is fixed up front; tensors arrive in any order."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        planned: dict = {}  # name -> (torch dtype, tag, shape, nbytes)
        for name, dtype, shape in specs:
            if name in planned:
                raise AssertionError(f"internal: tensor {name!r} planned twice in {self.path}")
            if dtype not in TORCH_TO_TAG:
                raise OutputError(f"{self.path}: tensor {name!r} has dtype {dtype} that safetensors cannot store")
            tag = TORCH_TO_TAG[dtype]
            planned[name] = (dtype, tag, tuple(shape), math.prod(shape) * DTYPES[tag][1])
        head, offsets = header_bytes([(n, *p[1:]) for n, p in planned.items()], metadata or {"format": "pt"})
        self._specs = {n: (p[0], p[2], off, p[3]) for (n, p), off in zip(planned.items(), offsets)}
        self._data_start = len(head)
        self.size = self._data_start + sum(p[3] for p in planned.values())
        self._pending = set(self._specs)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)  # RDWR: read_back
            #: the file's first bytes (length prefix + JSON header), for callers that hash the file
            self.header_bytes = head
            os.pwrite(self._fd, self.header_bytes, 0)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write ({e.strerror}); check free space and permissions") from None

    @property
    def names(self):
        return list(self._specs)

    def write(self, name: str, t: torch.Tensor, before=None) -> None:
        """Write ``t`` at its offset. ``before(bytes)`` is called with its bytes first (a background
        hash then reads them while they are being written)."""
        dtype, shape, off, nbytes = self._specs[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise AssertionError(f"internal: {name} planned {dtype}{list(shape)} got {t.dtype}{list(t.shape)}")
        buf = tensor_bytes(t)
        if before is not None:
            before(buf)
        pos = self._data_start + off
        try:
            done = 0
            while done < nbytes:
                done += os.pwrite(self._fd, buf[done:], pos + done)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write tensor {name!r} ({e.strerror}); check free space") from None
        self._pending.discard(name)

    def read_back(self, name: str, chunk: int = 1 << 24):
        """The bytes of tensor ``name`` as written, read back from the file in chunks."""
        _, _, off, nbytes = self._specs[name]
        pos, end = self._data_start + off, self._data_start + off + nbytes
        while pos < end:
            b = os.pread(self._fd, min(chunk, end - pos), pos)
            if not b:
                raise OutputError(f"{self.path}: tensor {name!r} cannot be read back (file truncated?)")
            yield b
            pos += len(b)

    @property
    def complete(self) -> bool:
        return not self._pending

    def close(self, fsync: bool = True):
        if self._pending:
            missing = sorted(self._pending)[:3]
            raise AssertionError(f"internal: {self.path} closed with unwritten tensors {missing}")
        try:
            if fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write ({e.strerror}); check free space") from None
        finally:
            os.close(self._fd)

    def abort(self):
        try:
            os.close(self._fd)
        except OSError:
            pass
