"""Shared-memory staging area: ``/dev/shm/qconvert/NAME`` (RAM-backed), read by servers as a checkpoint.

Layout of a staging area (directory mode 0700, every file mode 0600, owned by the caller):

* ``gNNNNN-KK.safetensors``: standard safetensors shards, one *group* (a decoder layer, or the
  tensors outside layers) per ``gNNNNN``; every tensor of a layer is in the same group and the
  groups are in layer order, so engines that load layer by layer (vLLM layerwise reload) hold one
  layer at a time. Every tensor's data starts at a file offset that is a multiple of 256: the
  header is padded with spaces (allowed by the format) and, because safetensors forbids gaps
  between tensors, a shard holds all tensors whose size is a multiple of 256 followed by at most
  one tensor that is not (further ones get their own shard ``KK``).
* ``model.safetensors.index.json``: the usual index; ``config.json`` and tokenizer files copied.
* ``qconvert-staging.json``: the manifest: per-file size and SHA-256, per-tensor file/offset/dtype/
  shape, the *layout contract* (architecture, ``quantization_config``, digest of the tensor names,
  dtypes and shapes) and ``manifest_sha256`` over all of that.

An area is built in a hidden temporary directory (``.NAME.tmp-XXXXXXXX``, flocked while being
written) and renamed into place when complete, so a half-written area never looks complete; one
left by a killed ``stage`` is listed by :func:`list_areas` as incomplete and removed by
:func:`drop_area`. Every file of the source checkpoint is read through the checkpoint's guard
(:func:`qconvert.convert.checkpoint.guard`): nothing outside CKPT is read, even through a symlink,
and a FIFO or device in place of a file is an error. Nothing under the staging root follows links. :func:`open_area` refuses an area whose manifest checksum,
file checksums, permissions, alignment or (when given) layout contract do not match.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from qconvert import host_memory
from qconvert.convert.checkpoint import INDEX_NAME as INDEX
from qconvert.convert.safetensors_io import DTYPES, TORCH_TO_TAG, header_bytes, sha256_file
from qconvert.errors import QConvertError
from qconvert.formats import staging as fs
from qconvert.formats.staging import (  # noqa: F401  (the on-disk facts live there, once)
    ALIGN,
    NAME_RE,
    StagingError,
    staging_root,
)
from qconvert.formats.staging import (
    FORMAT_V1 as FORMAT,
)
from qconvert.formats.staging import (
    MANIFEST_V1 as MANIFEST,
)
from qconvert.formats.staging import (
    check_name as _check_name,
)
from qconvert.formats.staging import (
    manifest_digest_v1 as _manifest_digest,
)
from qconvert.interrupts import ctrl_c_safe

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Files copied from a checkpoint next to the shards (small, non-weight).
_COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
_SKIP_FILES = {INDEX, MANIFEST}


# ----------------------------------------------------------------------------- dtypes, contract

# the dtype tags are safetensors_io's (one table): TORCH_TO_TAG re-exported for the trainer side


def dtype_tag(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TAG[dtype]
    except KeyError:
        raise StagingError(f"dtype {dtype} cannot be staged as safetensors") from None


def layout_contract(
    config: dict, tensors: Iterable[tuple[str, str, Iterable[int]]], layout: dict | None = None
) -> dict:
    """What must be identical between the serving checkpoint and every reloaded one.

    ``tensors``: (name, safetensors dtype tag, shape). Weights may differ; names, dtypes, shapes,
    architecture and quantization config may not.
    """
    lines = sorted(f"{n}|{d}|{','.join(str(int(s)) for s in shape)}" for n, d, shape in tensors)
    return {
        "architectures": list(config.get("architectures") or []),
        "model_type": config.get("model_type"),
        "quantization_config": config.get("quantization_config"),
        "num_tensors": len(lines),
        "tensors_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
        "layout": layout,
    }


def read_layout(root: Path) -> dict | None:
    """The kernel-layout contract of a pre-shuffled qconvert checkpoint (the manifest's ``layout``),
    None without one; read guarded (a corrupt manifest, a link out or a FIFO is an error)."""
    from qconvert.convert.checkpoint import manifest_layout, read_manifest

    return manifest_layout(read_manifest(root))


def contract_mismatch(have: dict, want: dict) -> list[str]:
    """Keys on which two layout contracts differ (empty when they match)."""
    return sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))


def checkpoint_contract(ckpt: str | os.PathLike) -> dict:
    """Layout contract of a checkpoint directory (reads only config.json, shard headers, manifest),
    or of a refit area (version 2: the contract its ``area.json`` records, which every refit into
    it matched), so that a server now serving a refit area is still checked against what is
    reloaded next."""
    from qconvert.convert.checkpoint import open_checkpoint

    if os.path.lexists(Path(ckpt) / fs.AREA_JSON):
        return fs.read_area_spec(Path(ckpt)).contract
    ck = open_checkpoint(ckpt, strict=False)
    tensors = [(e.name, e.dtype, e.shape) for h in ck.shards for e in h.entries.values()]
    return layout_contract(ck.config, tensors, ck.layout)


def served_contract(previous: str | os.PathLike | None) -> dict | None:
    """Layout contract of what a server serves now, from the path it reports or qconvert recorded:
    a checkpoint directory, a refit area, or a refit area's slot directory (what SGLang reports
    after a refit, docs/reload.md#sglang-disk-update); None when that path is none of these here
    (a Hub id, another machine's path), so that nothing is compared."""
    if not previous:
        return None
    p = Path(previous)
    if any(p == fs.slot_dir(p.parent, k) for k in fs.SLOTS) and os.path.lexists(p.parent / fs.AREA_JSON):
        p = p.parent  # a slot directory: its area's contract
    if not (os.path.lexists(p / fs.AREA_JSON) or (p / "config.json").is_file()):
        return None
    try:
        return checkpoint_contract(p)
    except (QConvertError, OSError):
        return None


def read_config(root: Path) -> dict:
    """config.json of a checkpoint directory (:func:`qconvert.convert.checkpoint.read_config`)."""
    from qconvert.convert.checkpoint import read_config as _read_config

    return _read_config(root)


def shard_files(root: Path) -> list[Path]:
    """The shard files of a checkpoint directory, as the checkpoint reader lists them (lenient)."""
    from qconvert.convert.checkpoint import open_checkpoint

    return [h.path for h in open_checkpoint(root, strict=False).shards]


# ----------------------------------------------------------------------------- writer


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def group_key(name: str) -> tuple[int, int]:
    """Sort key of a tensor's group: embeddings, then layers in order, then the rest."""
    layer = layer_of(name)
    if layer is not None:
        return (1, layer)
    return (0, 0) if "embed" in name else (2, 0)


def _open_private(path: Path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class StagingWriter:
    """Builds a staging area group by group; :meth:`commit` makes it visible atomically.

    Use as a context manager: an exception removes the partial area.
    """

    def __init__(
        self,
        name: str,
        *,
        root: Path | None = None,
        source: str = "",
        config: dict | None = None,
        replace: bool = True,
        layout: dict | None = None,
    ):
        _check_name(name)
        self.name = name
        self.root = Path(root) if root is not None else staging_root()
        self.final = self.root / name
        _refuse_link(self.final)
        if self.final.exists() and not replace:
            raise StagingError(f"staging area {self.final} exists; drop it with `qconvert stage drop {name}`")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        _check_root(self.root)
        self.tmp = self.root / f"{_TMP_PREFIX.format(name=name)}{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp, 0o700)
        os.chmod(self.tmp, 0o700)
        # held while the area is written: --list tells a running stage from one that was killed
        self._lock_fd = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.source = source
        self.config = config
        self.layout = layout
        self.files: dict[str, dict] = {}
        self.tensors: dict[str, dict] = {}
        self.weight_map: dict[str, str] = {}
        self._groups: dict[tuple[int, int], int] = {}
        self._ranked: set = set()
        self._committed = False

    # context manager: drop partial area on error
    def __enter__(self) -> StagingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def add_file(self, rel: str, data: bytes) -> None:
        """A small non-weight file (config.json, tokenizer...)."""
        p = self.tmp / rel
        with _open_private(p) as f:
            f.write(data)
        self.files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def add_group(
        self, tensors: list[tuple[str, str, tuple[int, ...], object]], rank: tuple[int, int] | None = None
    ) -> None:
        """Write one group: (name, dtype tag, shape, data) where data is a torch.Tensor or bytes-like.

        All tensors of a decoder layer must be passed in one call, or, for a pre-shuffled layer,
        one call for its replicated tensors (``rank=None``) and one per server rank (``rank=(tp_rank,
        ep_rank)``: files ``gNNNNN-tp{r}-ep{q}-KK``, read by that rank only, docs/reload.md#per-rank-files).
        """
        if not tensors:
            return
        keys = {group_key(n) for n, *_ in tensors}
        if len(keys) != 1:
            raise StagingError(f"one group must hold one layer, got tensors of {sorted(keys)}")
        key = keys.pop()
        if (key, rank) in self._ranked:
            raise StagingError(f"group {key} staged twice; pass every tensor of a layer together")
        self._ranked.add((key, rank))
        gidx = self._groups.setdefault(key, len(self._groups))
        by_name = {}
        for name, tag, shape, data in tensors:
            if name in self.tensors or name in by_name:
                raise StagingError(f"tensor {name!r} staged twice")
            buf = _tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
            want = math.prod(shape) * DTYPES[tag][1]
            if buf.nbytes != want:
                raise StagingError(f"tensor {name!r}: {buf.nbytes} bytes do not match {tag} {list(shape)}")
            by_name[name] = (tag, tuple(int(s) for s in shape), buf)
        sizes = {n: by_name[n][2].nbytes for n in by_name}
        for k, names in enumerate(fs.pack(sizes, {n: by_name[n][0] for n in by_name})):
            fname = (
                f"g{gidx:05d}-{k:02d}.safetensors"
                if rank is None
                else f"g{gidx:05d}-tp{rank[0]}-ep{rank[1]}-{k:02d}.safetensors"
            )
            specs = [(n, by_name[n][0], by_name[n][1], by_name[n][2].nbytes) for n in names]
            head, offs = header_bytes(specs, {"format": "pt", "qconvert": FORMAT}, ALIGN)
            h = hashlib.sha256(head)
            with _open_private(self.tmp / fname) as f:
                f.write(head)
                for n, off in zip(names, offs):
                    buf = by_name[n][2]
                    f.write(buf)
                    h.update(buf)
                    tag, shape, _ = by_name[n]
                    self.tensors[n] = {
                        "file": fname,
                        "offset": len(head) + off,
                        "nbytes": buf.nbytes,
                        "dtype": tag,
                        "shape": list(shape),
                        "group": gidx,
                    }
                    self.weight_map[n] = fname
                size = f.tell()
            self.files[fname] = {
                "size": size,
                "sha256": h.hexdigest(),
                "rank": None if rank is None else [int(rank[0]), int(rank[1])],
            }

    def commit(self) -> StagingArea:
        if self.config is None:
            raise StagingError("staging needs the checkpoint's config.json")
        contract = layout_contract(
            self.config, ((n, t["dtype"], t["shape"]) for n, t in self.tensors.items()), self.layout
        )
        if "config.json" not in self.files:
            self.add_file("config.json", json.dumps(self.config, indent=2).encode())
        total = sum(t["nbytes"] for t in self.tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))}
        self.add_file(INDEX, json.dumps(index, indent=2).encode())
        body = {
            "format": FORMAT,
            "name": self.name,
            "source": self.source,
            "created": time.time(),
            "alignment": ALIGN,
            "contract": contract,
            # the server's MoE tensor/expert parallel sizes the per-rank files are for
            "tp": int((self.layout or {}).get("tp", 1)),
            "ep": int((self.layout or {}).get("ep", 1)),
            "files": dict(sorted(self.files.items())),
            "tensors": dict(sorted(self.tensors.items())),
        }
        manifest = dict(body, manifest_sha256=_manifest_digest(body))
        with _open_private(self.tmp / MANIFEST) as f:
            f.write(json.dumps(manifest, indent=1).encode())
        old = None
        _refuse_link(self.final)
        if self.final.exists():
            old = self.root / f"{_OLD_PREFIX.format(name=self.name)}{uuid.uuid4().hex[:8]}"
            os.rename(self.final, old)
        os.rename(self.tmp, self.final)
        self._committed = True
        self._unlock()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return StagingArea(self.final, manifest)


_RANK_TAG_RE = re.compile(r"\.(trtllm_tp\d+_ep\d+)\.")


def rank_of(name: str, layout: dict | None) -> tuple[int, int] | None:
    """The server rank (tp_rank, ep_rank) that alone reads tensor ``name`` of a pre-shuffled
    checkpoint with TP or EP > 1 (its ``trtllm_tp{r}_ep{q}`` expert tensors), else None (every rank)."""
    from qconvert.convert.layout_jobs import parse_rank_tag

    if not layout or int(layout.get("tp", 1)) == int(layout.get("ep", 1)) == 1:
        return None
    m = _RANK_TAG_RE.search(name)
    return parse_rank_tag(m.group(1)) if m else None


@ctrl_c_safe
def stage_checkpoint(ckpt: str | os.PathLike, name: str, *, root: Path | None = None) -> StagingArea:
    """Copy a safetensors checkpoint directory into the staging area ``name`` (replacing it)."""

    src = Path(ckpt)
    if not src.is_dir():
        raise StagingError(f"{src}: not a directory; pass a Hugging Face checkpoint directory")
    _check_name(name)
    from qconvert.convert.checkpoint import open_checkpoint, read_member

    ck = open_checkpoint(src, strict=False)  # guarded, headers validated
    config, headers = ck.config, ck.shards
    where: dict[str, tuple] = {}
    for h in headers:
        for e in h.entries.values():
            if e.name in where:
                raise StagingError(f"{src}: tensor {e.name!r} is in two shards; fix the checkpoint")
            where[e.name] = (h.path, e)
    layout = ck.layout
    groups: dict[tuple, list[str]] = {}
    for n in where:
        r = rank_of(n, layout)
        groups.setdefault((group_key(n), (0, 0, 0) if r is None else (1, *r)), []).append(n)
    with StagingWriter(name, root=root, source=str(src.resolve()), config=config, layout=layout) as w:
        fds: dict[Path, int] = {}
        try:
            for key in sorted(groups):
                batch = []
                for n in sorted(groups[key]):
                    path, e = where[n]
                    fd = fds.get(path)
                    if fd is None:  # shard_files guarded the path; open_member refuses a FIFO swapped in since
                        from qconvert.convert.checkpoint import open_member

                        f = open_member(src, path)
                        fd = fds[path] = os.dup(f.fileno())
                        f.close()
                    data = os.pread(fd, e.nbytes, e.start)
                    if len(data) != e.nbytes:
                        raise StagingError(f"{path}: tensor {n!r} is truncated; re-export the checkpoint")
                    batch.append((n, e.dtype, e.shape, data))
                w.add_group(batch, rank=None if key[1][0] == 0 else key[1][1:])
        finally:
            for fd in fds.values():
                os.close(fd)
        for p in sorted(src.iterdir()):
            if (
                p.name not in _SKIP_FILES
                and p.suffix in _COPY_SUFFIXES
                and not p.name.startswith(".")
                and not p.is_dir()
            ):
                w.add_file(p.name, read_member(src, p))
        return w.commit()


# ----------------------------------------------------------------------------- reader / checks


@dataclass
class StagingArea:
    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def contract(self) -> dict:
        return self.manifest["contract"]

    @property
    def nbytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values())

    def check_contract(self, expected: dict | None, what: str = "the serving checkpoint") -> None:
        if expected is None:
            return
        diff = contract_mismatch(self.contract, expected)
        if diff:
            raise StagingError(
                f"staging area {self.path}: layout contract differs from {what} in {', '.join(diff)}; "
                "restage from a checkpoint converted with the same options as the one the server runs"
            )


def open_area(
    name: str, *, root: Path | None = None, expected_contract: dict | None = None, verify_data: bool = True
) -> StagingArea:
    """Open and check a staging area; refuse it on any mismatch (see module docstring)."""
    _check_name(name)
    path = (Path(root) if root is not None else staging_root()) / name
    mpath = path / MANIFEST
    if os.path.lexists(path):
        _check_private(path, is_dir=True)  # before reading anything in it: a link is refused unread
    if not mpath.is_file():
        raise StagingError(f"staging area {path}: no {MANIFEST}; stage it with `qconvert stage create CKPT {name}`")
    _check_private(mpath)
    try:
        manifest = json.loads(mpath.read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise StagingError(f"{mpath}: not valid JSON; drop and restage {name}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StagingError(
            f"{mpath}: unknown format {manifest.get('format') if isinstance(manifest, dict) else None!r}; "
            f"restage {name} with this qconvert"
        )
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _manifest_digest(body):
        raise StagingError(f"{mpath}: manifest checksum mismatch (edited or corrupt); drop and restage {name}")
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST}
    listed = set(manifest["files"])
    if on_disk != listed:
        extra, missing = sorted(on_disk - listed), sorted(listed - on_disk)
        raise StagingError(
            f"staging area {path}: files differ from the manifest (extra {extra}, missing {missing}); "
            f"drop and restage {name}"
        )
    for t, spec in manifest["tensors"].items():
        if manifest.get("alignment", ALIGN) != ALIGN or not fs.offset_ok(spec["offset"], spec["nbytes"], spec["dtype"]):
            raise StagingError(f"staging area {path}: tensor {t!r} is not {ALIGN}-byte aligned; restage {name}")
    for fname, spec in manifest["files"].items():
        fp = path / fname
        _check_private(fp)
        if fp.stat().st_size != spec["size"]:
            raise StagingError(
                f"{fp}: size {fp.stat().st_size} != manifest {spec['size']} (truncated?); restage {name}"
            )
        if verify_data and sha256_file(fp) != spec["sha256"]:
            raise StagingError(f"{fp}: checksum mismatch with the manifest (modified or corrupt); restage {name}")
    area = StagingArea(path, manifest)
    area.check_contract(expected_contract)
    return area


def _check_private(p: Path, is_dir: bool = False) -> None:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise StagingError(f"{p}: is a symlink; staging areas hold plain files only; drop and restage")
    if st.st_uid != os.getuid():
        raise StagingError(f"{p}: owned by uid {st.st_uid}, not you; refusing it")
    want = 0o700 if is_dir else 0o600
    if stat.S_IMODE(st.st_mode) != want:
        raise StagingError(
            f"{p}: mode {oct(stat.S_IMODE(st.st_mode))}, expected {oct(want)}; "
            "another user may have changed it; drop and restage"
        )


def list_areas(root: Path | None = None) -> list[dict]:
    """Staging areas under the root: name, size, source, created, ok (manifest checksum only)."""
    r = Path(root) if root is not None else staging_root()
    out = []
    if not r.is_dir():
        return out
    for p in sorted(r.iterdir()):
        left = _leftover_of(p.name)
        if left is not None:
            out.append(
                {
                    "name": left,
                    "bytes": None,
                    "source": "",
                    "created": None,
                    "ok": False,
                    "problem": _leftover_problem(p, left),
                }
            )
            continue
        if p.name.startswith(".") or not (p.is_dir() or p.is_symlink()):
            continue
        if not p.is_symlink() and os.path.lexists(p / fs.AREA_JSON):  # a refit area (version 2)
            try:
                v = fs.read_area(p)
                out.append(
                    {
                        "name": p.name,
                        "bytes": 2 * v.nbytes,
                        "source": f"refit, version {v.version}",
                        "created": None,
                        "ok": True,
                        "problem": "",
                    }
                )
            except QConvertError as e:
                out.append(
                    {"name": p.name, "bytes": None, "source": "refit", "created": None, "ok": False, "problem": str(e)}
                )
            continue
        try:
            a = open_area(p.name, root=r, verify_data=False)
            out.append(
                {
                    "name": p.name,
                    "bytes": a.nbytes,
                    "source": a.manifest.get("source", ""),
                    "created": a.manifest.get("created"),
                    "ok": True,
                    "problem": "",
                }
            )
        except QConvertError as e:
            out.append({"name": p.name, "bytes": None, "source": "", "created": None, "ok": False, "problem": str(e)})
    return out


def drop_area(name: str, root: Path | None = None) -> bool:
    """Remove a staging area and the temporaries a killed ``stage`` of it left (not those of a
    running one). Returns whether anything was removed. A symlink in place of the area is refused."""
    _check_name(name)
    r = Path(root) if root is not None else staging_root()
    if os.path.lexists(r):
        _check_root(r)
    p = r / name
    _refuse_link(p)
    existed = p.exists()
    if existed:
        shutil.rmtree(p)
    if r.is_dir() and not r.is_symlink():
        for q in r.iterdir():
            if _leftover_of(q.name) == name and not q.is_symlink() and not _being_written(q):
                shutil.rmtree(q, ignore_errors=True)
                existed = True
    return existed


_TMP_PREFIX = ".{name}.tmp-"
_OLD_PREFIX = ".{name}.old-"
_LEFTOVER_RE = re.compile(r"^\.(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,127})\.(?:tmp|old)-[0-9a-f]{8}$")


def _leftover_of(fname: str) -> str | None:
    """The area name of a temporary directory of a stage (``.NAME.tmp-X`` / ``.NAME.old-X``), else None."""
    m = _LEFTOVER_RE.match(fname)
    return m.group("name") if m else None


def _being_written(p: Path) -> bool:
    """Whether a running ``stage`` holds the lock of the temporary directory ``p``."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _leftover_problem(p: Path, name: str) -> str:
    if p.name.startswith(_TMP_PREFIX.format(name=name)) and _being_written(p):
        return f"incomplete: being written by a running `qconvert stage` ({p})"
    return f"incomplete: {p} was left by an interrupted `qconvert stage`; `qconvert stage drop {name}` removes it"


def _check_root(r: Path) -> None:
    """The staging root must be a directory of the caller's, not a link (``/dev/shm`` is shared)."""
    st = os.lstat(r)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StagingError(
            f"{r}: the staging root is not a plain directory (a symbolic link?); "
            "qconvert does not follow it: move it away or set QCONVERT_SHM_ROOT"
        )
    if st.st_uid != os.getuid():
        raise StagingError(
            f"{r}: the staging root is owned by uid {st.st_uid}, not you; set QCONVERT_SHM_ROOT to a directory of yours"
        )


def _refuse_link(p: Path) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise StagingError(
            f"{p}: is a symbolic link, not a staging area; qconvert does not follow links "
            "in the staging root (move the link away)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise StagingError(f"{p}: is not a directory, so not a staging area; move it away")


# ----------------------------------------------------------------------------- version 2 (refit)
# The persistent two-slot area of docs/reload.md#staging-area-format: its files are laid out once
# from the output inventory, created once, mapped once and overwritten in place at every refit.


#: A version 2 file holds at most this many bytes (unless one tensor is larger): a layer's digests
#: are computed on several threads, and the last layer's adds little to the commit.
PART_BYTES = 128 << 20


def pack_v2(
    group: int, rank: tuple[int, int] | None, tensors: list[tuple[str, str, tuple[int, ...]]]
) -> list[tuple[fs.FileSpec, bytes]]:
    """The files of one (group, rank): (FileSpec, header bytes), by the staging files' one packing
    rule (:func:`formats.staging.pack`, in name order, files of at most :data:`PART_BYTES`)."""
    size = {n: fs.tensor_nbytes(tag, shape) for n, tag, shape in sorted(tensors)}
    meta = {n: (tag, tuple(int(x) for x in shape)) for n, tag, shape in tensors}
    parts = fs.pack(size, {n: m[0] for n, m in meta.items()}, PART_BYTES)
    out = []
    for part, names in enumerate(parts):
        head, offs = header_bytes(
            [(n, *meta[n], size[n]) for n in names], {"format": "pt", "qconvert": fs.FORMAT_V2}, ALIGN
        )
        specs = {n: fs.TensorSpec(meta[n][0], meta[n][1], len(head) + off) for n, off in zip(names, offs)}
        out.append(
            (fs.FileSpec(fs.file_name(group, part, rank), len(head) + sum(size[n] for n in names), rank, specs), head)
        )
    return out


def create_area_v2(
    name: str, spec: fs.AreaSpec, headers: dict[str, bytes], extra: dict[str, bytes], *, root: Path | None = None
) -> Path:
    """Create the area ``name`` (both slots' files at full size with their headers, area.json, the
    extra files) in a hidden directory, renamed into place when complete. Nothing is committed."""
    _check_name(name)
    r = Path(root) if root is not None else staging_root()
    r.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_root(r)
    final = r / name
    _refuse_link(final)
    tmp = r / f"{_TMP_PREFIX.format(name=name)}{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp, 0o700)
    lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # list_areas: being written
        for k in fs.SLOTS:
            d = fs.slot_dir(tmp, k)
            os.mkdir(d, 0o700)
            os.close(os.open(d / fs.LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            for f in spec.files:
                with _open_private(d / f.name) as fh:
                    fh.write(headers[f.name])
                    fh.truncate(f.size)  # tmpfs: pages are populated by the first refit's writes
        for fname in spec.extra_files:
            with _open_private(tmp / fname) as fh:
                fh.write(extra[fname])
        fs.write_json_atomic(tmp / fs.AREA_JSON, spec.to_json())
        try:
            os.rename(tmp, final)  # an existing non-empty area makes this fail: never replaced
        except OSError:
            raise StagingError(
                f"staging area {final} appeared while it was being created; another trainer "
                "creates it: pass rank/world_size to every trainer rank"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return final


class SlotMaps:
    """The files of both slots of an area, each mapped (MAP_SHARED) once, on first use, and with
    ``cuda`` registered with ``cudaHostRegister`` (page-locked, so device-to-host copies go straight
    in at full speed). Kept until :meth:`close`."""

    def __init__(self, area: Path, spec: fs.AreaSpec, cuda: bool = False, device: int | None = None):
        self.area, self.cuda = Path(area), cuda
        # the CUDA device whose context registers the files (default: the current one)
        self.device = (torch.cuda.current_device() if device is None else device) if cuda else -1
        self.sizes = {f.name: f.size for f in spec.files}
        self._maps: dict[tuple[int, str], tuple] = {}  # (slot, file) -> (mmap, uint8 tensor, registered)

    def tensor(self, slot: int, fname: str) -> torch.Tensor:
        """The whole file as a writable uint8 tensor over the mapping. The first use of a file maps
        (and registers) it in both slots, so that the first refit pays for both."""
        if (slot, fname) not in self._maps:
            for k in fs.SLOTS:
                self._map(k, fname)
        return self._maps[(slot, fname)][1]

    def _map(self, slot: int, fname: str) -> None:
        m = self._maps.get((slot, fname))
        if m is None:
            import mmap

            p = fs.slot_dir(self.area, slot) / fname
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != self.sizes[fname] or st.st_uid != os.getuid():
                    raise StagingError(
                        f"{p}: not the file area.json describes (size {st.st_size}, want "
                        f"{self.sizes[fname]}); drop the staging area and refit again"
                    )
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            registered = False
            if self.cuda:
                rc = host_memory.register(t.data_ptr(), t.numel(), 0, self.device)
                if rc != 0:
                    del t
                    mm.close()
                    raise StagingError(
                        f"{p}: cudaHostRegister failed (error {rc}); the staging "
                        "root must be on tmpfs (the default /dev/shm/qconvert; QCONVERT_SHM_ROOT) with a "
                        "locked-memory limit (ulimit -l) that covers the area, or stage with device='cpu'"
                    )
                registered = True
            self._maps[(slot, fname)] = (mm, t, registered)

    def buffer(self, slot: int, fname: str):
        """The mapping of a file (for digests), mapping it if needed."""
        self.tensor(slot, fname)
        return self._maps[(slot, fname)][0]

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        mms = []
        for mm, t, registered in maps.values():
            if registered:
                host_memory.unregister(t.data_ptr(), self.device)
            mms.append(mm)
        maps.clear()
        t = None  # noqa: F841 - the last tensor view of a mapping goes before the mapping closes
        for mm in mms:
            try:
                mm.close()
            except BufferError:  # a view of it still lives somewhere: the mapping goes with it
                pass
