"""The shared-memory staging area, on disk: what the refit writer and the engine-side reader agree on.

The format is described in docs/reload.md#staging-area-format (per-rank files:
docs/reload.md#per-rank-files). This module holds every constant and JSON shape of it, builds,
parses and validates ``area.json``/``commit.json`` (version 2) and ``qconvert-staging.json``
(version 1), picks a rank's files and takes the slot locks. It imports no torch and reads or writes
no tensor data: only the small JSON and lock files it is given paths for.

Reader side, for either version::

    with committed(area_root) as view:          # holds the committed slot's shared lock (v2)
        for f in files_for_rank(view, tp_rank, ep_rank):
            path = view.directory / f.name      # f.tensors[name].offset/.dtype/.shape
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from qconvert.errors import QConvertError
from qconvert.formats.safetensors import DTYPE_SIZES  # noqa: F401  (the one table; re-exported)

# ----------------------------------------------------------------------------- constants

ROOT_ENV = "QCONVERT_SHM_ROOT"
DEFAULT_ROOT = "/dev/shm/qconvert"
ALIGN = 256  # tensor data starts at a file offset that is a multiple of this (tensors under ALIGN bytes:
#              of their element size, packed at the end of a file; docs/reload.md#staging-area-format)


def offset_ok(offset: int, nbytes: int, tag: str) -> bool:
    """Whether a tensor of ``nbytes`` bytes of safetensors dtype ``tag`` may start at file offset
    ``offset`` in a staging file: a multiple of :data:`ALIGN`, or, under ALIGN bytes, of its
    element size (both formats; docs/reload.md#staging-area-format)."""
    return offset % ALIGN == 0 or (nbytes < ALIGN and offset % DTYPE_SIZES[tag] == 0)


def pack(sizes: dict[str, int], tags: dict[str, str], part_bytes: int | None = None) -> list[list[str]]:
    """The files of one group's tensors (``sizes``: name -> bytes, in the order to keep; ``tags``:
    their dtype tags), each a list of names written back to back after a header padded to ALIGN:
    the tensors whose size is a multiple of ALIGN (each then ALIGN-aligned), in files of at most
    ``part_bytes`` (one when None) unless one tensor is larger, the last file then taking those
    under ALIGN bytes by falling element size (each at a multiple of its element size: sizes that
    are multiples of larger powers of two come first); any other tensor in a file of its own."""
    even = [n for n in sizes if sizes[n] % ALIGN == 0]
    tiny = sorted((n for n in sizes if sizes[n] < ALIGN and sizes[n] % ALIGN), key=lambda n: -DTYPE_SIZES[tags[n]])
    odd = [n for n in sizes if sizes[n] % ALIGN and sizes[n] >= ALIGN]
    parts: list[list[str]] = [[]]
    filled = 0
    for n in even:
        if part_bytes is not None and parts[-1] and filled + sizes[n] > part_bytes:
            parts.append([])
            filled = 0
        parts[-1].append(n)
        filled += sizes[n]
    parts[-1] += tiny
    return [p for p in parts if p] + [[n] for n in odd]


FORMAT_V1 = "qconvert-staging/1"
MANIFEST_V1 = "qconvert-staging.json"  # v1: whole area written once, renamed into place
FORMAT_V2 = "qconvert-staging/2"
AREA_JSON = "area.json"  # v2: written once when the area is created, read-only afterwards
COMMIT_JSON = "commit.json"  # v2: replaced atomically at every commit
SLOTS = (0, 1)
LOCK_FILE = ".lock"  # in each slot directory

DIGEST_XXH3 = "xxh3_128"  # over the whole file
# xxh3_128 over the concatenated 16-byte xxh3_128 digests of the file's consecutive pieces of
# DIGEST_PIECE_BYTES (the last one shorter; an empty file is one empty piece): the pieces of one
# large file hash on several threads (docs/reload.md#staging-area-format). Written by refit.
DIGEST_XXH3_PIECES = "xxh3_128-pieces-64MiB"
DIGEST_PIECE_BYTES = 64 << 20
DIGEST_SHA256 = "sha256"
DIGEST_HEX_LEN = {DIGEST_XXH3: 32, DIGEST_XXH3_PIECES: 32, DIGEST_SHA256: 64}


def digest_pieces(size: int, piece: int = DIGEST_PIECE_BYTES) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte ranges a DIGEST_XXH3_PIECES digest hashes, in order."""
    return [(a, min(size, a + piece)) for a in range(0, size, piece)] or [(0, 0)]


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FILE_RE = re.compile(r"^g(?P<group>\d{5})(?:-tp(?P<tp>\d+)-ep(?P<ep>\d+))?-(?P<part>\d{2})\.safetensors$")
EXTRA_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")
_HEX_RE = re.compile(r"^[0-9a-f]+$")


class StagingError(QConvertError):
    """A staging area is missing, corrupt, unsafe, busy or does not match the expected layout."""


def staging_root() -> Path:
    """``$QCONVERT_SHM_ROOT`` or ``/dev/shm/qconvert``."""
    return Path(os.environ.get(ROOT_ENV, DEFAULT_ROOT))


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise StagingError(
            f"staging name {name!r} is invalid; use letters, digits, '.', '_' or '-' (max 128, not starting with a dot)"
        )


def file_name(group: int, part: int, rank: tuple[int, int] | None = None) -> str:
    """``gNNNNN-KK.safetensors`` (read by every rank) or ``gNNNNN-tp{r}-ep{q}-KK.safetensors``."""
    if rank is None:
        return f"g{group:05d}-{part:02d}.safetensors"
    return f"g{group:05d}-tp{rank[0]}-ep{rank[1]}-{part:02d}.safetensors"


def tensor_nbytes(dtype: str, shape) -> int:
    return DTYPE_SIZES[dtype] * math.prod(int(s) for s in shape)


def slot_dir(root: Path, slot: int) -> Path:
    return Path(root) / f"slot-{slot}"


def next_slot(commit: Commit | None) -> int:
    """The slot a writer fills next: the one that is not committed."""
    return 0 if commit is None else 1 - commit.slot


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    offset: int  # of the data, from the start of the file (a multiple of ALIGN)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}


@dataclass(frozen=True)
class FileSpec:
    name: str
    size: int
    rank: tuple[int, int] | None  # None: read by every server rank; (tp_rank, ep_rank): by that rank only
    tensors: dict[str, TensorSpec] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "size": self.size,
            "rank": None if self.rank is None else list(self.rank),
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
        }


@dataclass(frozen=True)
class AreaSpec:
    """``area.json``: fixed when the area is created."""

    contract: dict
    digest: str
    tp: int
    ep: int
    files: tuple[FileSpec, ...]
    extra_files: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "format": FORMAT_V2,
            "contract": self.contract,
            "digest": self.digest,
            "tp": self.tp,
            "ep": self.ep,
            "files": [f.to_json() for f in self.files],
            "extra_files": list(self.extra_files),
        }

    def mismatch(self, other: AreaSpec) -> str | None:
        """First difference that makes ``other`` not fit an area made as ``self`` (one phrase), else None."""
        if (self.tp, self.ep) != (other.tp, other.ep):
            return f"tp/ep {other.tp}/{other.ep} against the area's {self.tp}/{self.ep}"
        mine = {(f.rank, n): t for f in self.files for n, t in f.tensors.items()}
        theirs = {(f.rank, n): t for f in other.files for n, t in f.tensors.items()}
        for key in sorted(set(mine) | set(theirs), key=str):
            a, b = mine.get(key), theirs.get(key)
            where = key[1] if key[0] is None else f"{key[1]} (rank {list(key[0])})"
            if a is None:
                return f"tensor {where} is not in the area"
            if b is None:
                return f"tensor {where} is missing"
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                return f"tensor {where} is {b.dtype} {list(b.shape)}, the area has {a.dtype} {list(a.shape)}"
        if [(f.name, f.size, f.rank) for f in self.files] != [(f.name, f.size, f.rank) for f in other.files]:
            return "the file layout differs"
        if self.contract != other.contract:
            diff = sorted(
                k for k in set(self.contract) | set(other.contract) if self.contract.get(k) != other.contract.get(k)
            )
            return f"the layout contract differs in {', '.join(diff)}"
        if self.digest != other.digest or tuple(self.extra_files) != tuple(other.extra_files):
            return "the digest kind or extra files differ"
        return None


@dataclass(frozen=True)
class Commit:
    """``commit.json``: which slot holds the current version."""

    slot: int
    version: int
    digests: dict[str, str]
    time: float

    def to_json(self) -> dict:
        return {
            "slot": self.slot,
            "version": self.version,
            "digests": dict(sorted(self.digests.items())),
            "time": self.time,
        }


@dataclass(frozen=True)
class AreaView:
    """What a reader needs of a committed area, version 1 or 2."""

    root: Path
    format: str  # FORMAT_V1 or FORMAT_V2
    directory: Path  # where the committed files are (v1: root; v2: root/slot-K)
    files: tuple[FileSpec, ...]
    contract: dict
    digest: str  # DIGEST_SHA256 (v1) or DIGEST_XXH3 (v2)
    digests: dict[str, str]  # expected digest of each file of ``files`` (and, v1, of the extra files)
    tp: int = 1
    ep: int = 1
    version: int | None = None  # v2 commit version
    slot: int | None = None  # v2 committed slot
    extra_files: tuple[str, ...] = ()  # config.json, tokenizer files: in ``root``

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def lock_path(self) -> Path | None:
        return None if self.slot is None else slot_dir(self.root, self.slot) / LOCK_FILE


def files_for_rank(view: AreaView | AreaSpec, tp_rank: int, ep_rank: int) -> list[FileSpec]:
    """The files server rank (``tp_rank``, ``ep_rank``) reads: every ``rank: null`` file and its own.

    A TP-only or EP-only server passes 0 for the other rank.
    """
    if not (0 <= tp_rank < view.tp and 0 <= ep_rank < view.ep):
        raise StagingError(
            f"rank tp={tp_rank} ep={ep_rank} is outside the staging area's tp={view.tp} ep={view.ep}; "
            "serve it with the tensor/expert parallel sizes it was staged for"
        )
    return [f for f in view.files if f.rank is None or f.rank == (tp_rank, ep_rank)]


# ----------------------------------------------------------------------------- build / parse


def _bad(where: str, what: str) -> StagingError:
    return StagingError(f"{where}: {what}; drop the staging area and stage it again")


def _int(v, where: str, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(where, f"{what} is {v!r}, expected an integer >= {lo}")
    return v


def _rank(v, tp: int, ep: int, where: str, fname: str) -> tuple[int, int] | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 2):
        raise _bad(where, f"file {fname}: rank {v!r} is not null or [tp_rank, ep_rank]")
    r, q = (_int(x, where, f"file {fname} rank") for x in v)
    if r >= tp or q >= ep:
        raise _bad(where, f"file {fname}: rank {[r, q]} is outside tp={tp} ep={ep}")
    return (r, q)


def _parse_files(raw, tp: int, ep: int, where: str, v2: bool) -> tuple[FileSpec, ...]:
    if not isinstance(raw, list):
        raise _bad(where, "'files' is not a list")
    out, names, seen = [], set(), set()
    for f in raw:
        if not isinstance(f, dict):
            raise _bad(where, "a 'files' entry is not an object")
        name = f.get("name")
        m = FILE_RE.match(name) if isinstance(name, str) else None
        if m is None and (
            v2 or not (isinstance(name, str) and EXTRA_FILE_RE.match(name) and name.endswith(".safetensors"))
        ):
            raise _bad(where, f"file name {name!r} is not a staging file name")
        if name in names:
            raise _bad(where, f"file {name} is listed twice")
        names.add(name)
        size = _int(f.get("size"), where, f"file {name} size")
        rank = _rank(f.get("rank"), tp, ep, where, name)
        if v2 and m is not None and (m.group("tp") is None) != (rank is None):
            raise _bad(where, f"file {name}: its name and its rank {f.get('rank')!r} disagree")
        if v2 and rank is not None and (int(m.group("tp")), int(m.group("ep"))) != rank:
            raise _bad(where, f"file {name}: its name and its rank {list(rank)} disagree")
        traw = f.get("tensors")
        if not isinstance(traw, dict):
            raise _bad(where, f"file {name}: 'tensors' is not an object")
        tensors = {}
        for tname, t in traw.items():
            if not isinstance(t, dict) or t.get("dtype") not in DTYPE_SIZES:
                raise _bad(where, f"tensor {tname}: dtype {t.get('dtype') if isinstance(t, dict) else t!r} unknown")
            shape = t.get("shape")
            if not isinstance(shape, list):
                raise _bad(where, f"tensor {tname}: shape {shape!r} is not a list")
            shape = tuple(_int(s, where, f"tensor {tname} shape") for s in shape)
            off = _int(t.get("offset"), where, f"tensor {tname} offset")
            spec = TensorSpec(t["dtype"], shape, off)
            if not offset_ok(off, spec.nbytes, spec.dtype):
                raise _bad(where, f"tensor {tname} starts at {off}, not a multiple of {ALIGN}")
            if off + spec.nbytes > size:
                raise _bad(where, f"tensor {tname} ends at {off + spec.nbytes}, past its file's {size} bytes")
            key = (rank, tname)
            if key in seen:
                raise _bad(where, f"tensor {tname} is listed twice")
            seen.add(key)
            tensors[tname] = spec
        out.append(FileSpec(name, size, rank, tensors))
    both = {n for r, n in seen if r is None} & {n for r, n in seen if r is not None}
    if both:  # a replicated tensor may not also be per-rank
        raise _bad(where, f"tensor {sorted(both)[0]} is both replicated and per-rank")
    return tuple(out)


def _parse_extra(raw, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(n, str) and EXTRA_FILE_RE.match(n) for n in raw):
        raise _bad(where, f"'extra_files' {raw!r} is not a list of plain file names")
    if len(set(raw)) != len(raw) or {AREA_JSON, COMMIT_JSON} & set(raw):
        raise _bad(where, "'extra_files' repeats a name or names a staging file")
    return tuple(raw)


def parse_area(obj, where: str = AREA_JSON) -> AreaSpec:
    """Validate an ``area.json`` document."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_V2:
        fmt = obj.get("format") if isinstance(obj, dict) else None
        raise StagingError(f"{where}: unknown format {fmt!r}; drop it and let this qconvert create it again")
    if obj.get("digest") not in DIGEST_HEX_LEN:
        raise _bad(where, f"digest kind {obj.get('digest')!r} unknown")
    if not isinstance(obj.get("contract"), dict):
        raise _bad(where, "'contract' is not an object")
    tp = _int(obj.get("tp"), where, "tp", 1)
    ep = _int(obj.get("ep"), where, "ep", 1)
    return AreaSpec(
        obj["contract"],
        obj["digest"],
        tp,
        ep,
        _parse_files(obj.get("files"), tp, ep, where, True),
        _parse_extra(obj.get("extra_files", []), where),
    )


def parse_commit(obj, spec: AreaSpec, where: str = COMMIT_JSON) -> Commit:
    """Validate a ``commit.json`` document against its area."""
    if not isinstance(obj, dict):
        raise _bad(where, "not a JSON object")
    slot = obj.get("slot")
    if slot not in SLOTS or isinstance(slot, bool):
        raise _bad(where, f"slot {slot!r} is not 0 or 1")
    version = _int(obj.get("version"), where, "version", 1)
    t = obj.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise _bad(where, f"time {t!r} is not a number")
    digests = obj.get("digests")
    want = {f.name for f in spec.files}
    if not isinstance(digests, dict) or set(digests) != want:
        raise _bad(where, "'digests' does not name exactly the area's files")
    n = DIGEST_HEX_LEN[spec.digest]
    for k, v in digests.items():
        if not (isinstance(v, str) and len(v) == n and _HEX_RE.match(v)):
            raise _bad(where, f"digest of {k} is {v!r}, not {n} lower-case hex digits")
    return Commit(slot, version, dict(digests), float(t))


def manifest_digest_v1(body: dict) -> str:
    """``manifest_sha256`` of a version 1 manifest (over every other key)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def parse_manifest_v1(obj, root: Path, where: str = MANIFEST_V1) -> AreaView:
    """Validate a ``qconvert-staging.json`` (version 1) and describe it as an :class:`AreaView`."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_V1:
        fmt = obj.get("format") if isinstance(obj, dict) else None
        raise StagingError(f"{where}: unknown format {fmt!r}; restage it with this qconvert")
    body = {k: v for k, v in obj.items() if k != "manifest_sha256"}
    if obj.get("manifest_sha256") != manifest_digest_v1(body):
        raise _bad(where, "manifest checksum mismatch (edited or corrupt)")
    files, tensors = obj.get("files"), obj.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise _bad(where, "'files' or 'tensors' is not an object")
    tp = _int(obj.get("tp", 1), where, "tp", 1)
    ep = _int(obj.get("ep", 1), where, "ep", 1)
    by_file: dict[str, dict] = {}
    for tname, t in tensors.items():
        if not isinstance(t, dict) or t.get("file") not in files:
            raise _bad(where, f"tensor {tname} names no listed file")
        by_file.setdefault(t["file"], {})[tname] = t
    raw, extra = [], []
    for fname, f in files.items():
        if not isinstance(f, dict):
            raise _bad(where, f"file {fname}: entry is not an object")
        if fname.endswith(".safetensors"):
            raw.append({"name": fname, "size": f.get("size"), "rank": f.get("rank"), "tensors": by_file.get(fname, {})})
        else:
            extra.append(fname)
    digests = {}
    for fname, f in files.items():
        d = f.get("sha256")
        if not (isinstance(d, str) and len(d) == 64 and _HEX_RE.match(d)):
            raise _bad(where, f"file {fname}: sha256 {d!r} is not 64 lower-case hex digits")
        digests[fname] = d
    contract = obj.get("contract")
    if not isinstance(contract, dict):
        raise _bad(where, "'contract' is not an object")
    return AreaView(
        Path(root),
        FORMAT_V1,
        Path(root),
        _parse_files(raw, tp, ep, where, False),
        contract,
        DIGEST_SHA256,
        digests,
        tp,
        ep,
        extra_files=tuple(_parse_extra(extra, where)),
    )


# ----------------------------------------------------------------------------- small files


def read_json(path: Path):
    """A small JSON file of the area: a regular file of ours, never through a link."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StagingError(f"{path}: not found; is this a staging area (`qconvert stage list`)?") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StagingError(f"{path}: is a symbolic link; staging areas hold plain files only") from None
        raise StagingError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StagingError(f"{path}: not a regular file; drop the staging area and stage it again")
        if st.st_uid != os.getuid():
            raise StagingError(f"{path}: owned by uid {st.st_uid}, not you; refusing it")
        if st.st_size > 64 << 20:
            raise StagingError(f"{path}: {st.st_size} bytes is too large for a staging manifest; drop it")
        data = f.read()
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise _bad(str(path), "not valid JSON") from None


def write_json_atomic(path: Path, obj) -> None:
    """Replace ``path`` with ``obj`` as JSON: write a temporary file, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(obj, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


#: ``area.json`` path -> (its identity when read, the parsed spec): the last few areas read in this
#: process. The spec is fixed when an area is created and the file is only ever replaced whole
#: (:func:`write_json_atomic`: a new inode), so an unchanged identity means an unchanged spec; a
#: refit after the first then costs no parse of its (tens of thousands of) tensor entries in the
#: client, in the worker and in the trainer (docs/reload.md#staging-area-format)
_SPECS: dict[str, tuple[tuple, AreaSpec]] = {}
_SPECS_KEPT = 8


def _identity(path: Path) -> tuple | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid)


def read_area_spec(root: Path) -> AreaSpec:
    """The validated ``area.json`` of the area at ``root``; parsed again only when the file's
    identity (device, inode, size, times, mode, owner) differs from the last read of it."""
    path = Path(root) / AREA_JSON
    key, ident = str(path), _identity(path)
    got = _SPECS.get(key)
    if got is not None and ident is not None and got[0] == ident:
        return got[1]
    spec = parse_area(read_json(path), key)
    if ident is not None and _identity(path) == ident:  # unchanged while it was read
        _SPECS.pop(key, None)
        _SPECS[key] = (ident, spec)
        while len(_SPECS) > _SPECS_KEPT:
            del _SPECS[next(iter(_SPECS))]
    return spec


def read_commit(root: Path, spec: AreaSpec) -> Commit | None:
    """The committed version of a v2 area, or None before the first commit."""
    p = Path(root) / COMMIT_JSON
    if not os.path.lexists(p):
        return None
    return parse_commit(read_json(p), spec, str(p))


def is_area(root: Path) -> bool:
    """Whether ``root`` looks like a staging area (either version); nothing is validated."""
    root = Path(root)
    return os.path.lexists(root / AREA_JSON) or os.path.lexists(root / MANIFEST_V1)


def read_area(root: Path) -> AreaView:
    """The committed content of the staging area at ``root`` (version 1 or 2), validated (no data read).

    A v2 reader should hold the slot's shared lock while it reads the files: use :func:`committed`.
    """
    root = Path(root)
    if os.path.lexists(root / AREA_JSON):
        spec = read_area_spec(root)
        commit = read_commit(root, spec)
        if commit is None:
            raise StagingError(f"staging area {root}: nothing committed yet; run a refit into it first")
        return AreaView(
            root,
            FORMAT_V2,
            slot_dir(root, commit.slot),
            spec.files,
            spec.contract,
            spec.digest,
            commit.digests,
            spec.tp,
            spec.ep,
            commit.version,
            commit.slot,
            spec.extra_files,
        )
    if os.path.lexists(root / MANIFEST_V1):
        return parse_manifest_v1(read_json(root / MANIFEST_V1), root, str(root / MANIFEST_V1))
    raise StagingError(
        f"{root}: neither {AREA_JSON} nor {MANIFEST_V1}; not a staging area (`qconvert stage list` shows them)"
    )


# ----------------------------------------------------------------------------- slot locks


class SlotLock:
    """``flock`` on ``slot-K/.lock``: exclusive for the writer of slot K, shared for its readers."""

    def __init__(self, root: Path, slot: int, *, shared: bool, wait_s: float = 60.0):
        self.path = slot_dir(root, slot) / LOCK_FILE
        self.root, self.slot, self.shared = Path(root), slot, shared
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, op)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    who = "a writer" if shared else "a server reading it"
                    raise StagingError(
                        f"staging area {self.root}: slot {slot} is held by {who} for more than {wait_s:g} s; "
                        "wait for that reload/refit to finish (or raise lock_wait_s)"
                    ) from None
                time.sleep(0.01)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> SlotLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def committed(root: Path, *, wait_s: float = 60.0) -> Iterator[AreaView]:
    """:func:`read_area`, holding (v2) the committed slot's shared lock until the block ends.

    The commit is read again once the lock is held: a writer that committed and started on the
    other slot meanwhile makes it retry, so the view never names a slot being written.
    """
    deadline = time.monotonic() + wait_s
    while True:
        view = read_area(root)
        if view.slot is None:
            yield view
            return
        lock = SlotLock(root, view.slot, shared=True, wait_s=max(0.0, deadline - time.monotonic()))
        try:
            again = read_area(root)
            if (again.slot, again.version) == (view.slot, view.version):
                yield again
                return
        finally:
            lock.release()
        if time.monotonic() >= deadline:
            raise StagingError(f"staging area {root}: commits keep changing for {wait_s:g} s; retry the reload")
