"""Resumable output: a fixed partial directory beside DST and a journal of finished shards.

Every conversion writes into ``.DST.qconvert-partial`` (beside DST), which is renamed to DST only
when everything is written. The directory holds a journal, ``.qconvert-journal.json``, that records

* the fingerprint of the command: qconvert version, source id and revision, size and mtime of every
  source file that feeds the output, a digest of config.json, and every option that changes an
  output byte (scheme, dialect, plan options, --allow-non-finite, ...);
* ``created``: the manifest timestamp of the first attempt, so a resumed run writes the same
  manifest (with ``SOURCE_DATE_EPOCH`` set it is that time, so separate runs are byte-identical);
* ``inputs``: sha256 of each input shard once it was read completely;
* ``outputs``: sha256 ("" under ``--no-checksums``) and size of each output shard, added only
  after the shard was fsynced and its input's sha256 is known. The journal is replaced atomically (write, fsync, rename, fsync dir).

``--resume`` checks the fingerprint against the command, re-hashes every journaled output shard and
keeps those that match (under ``--no-checksums``, part of the fingerprint, those of the right size); all other files in the directory are deleted and redone. A journaled shard
whose jobs need nothing from other shards is not read again: its input checksum comes from the
journal. Without ``--resume`` a leftover partial directory is an error with a hint.

An flock on the partial directory itself (opened with O_NOFOLLOW) keeps two processes from writing
the same DST. It is held until the directory has been renamed to DST (the lock follows the inode),
so a second ``--resume`` can never take over a directory that is being installed; a process that
opened the directory just before that rename sees, once locked, that the path no longer names it.
Nothing here follows a symlink: a link in place of the partial directory, its journal or a shard is
refused or deleted, never read through.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..errors import OutputError
from .safetensors_io import sha256_file

JOURNAL_NAME = ".qconvert-journal.json"
LOCK_NAME = ".qconvert-lock"  # no longer written (the directory itself is locked); removed if found
JOURNAL_FORMAT = 1
#: ConvertOptions fields that change no output byte, so a resume may differ in them.
NOT_IN_FINGERPRINT = frozenset({"device", "force", "dry_run", "progress", "queue_bytes", "fsync", "resume"})


def partial_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.qconvert-partial"


def created_timestamp() -> str:
    """UTC now, or ``SOURCE_DATE_EPOCH`` when set (reproducible outputs)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is not None and epoch.strip().isdigit():
        t = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc)
    else:
        t = _dt.datetime.now(_dt.timezone.utc)
    return t.isoformat(timespec="seconds")


def _stat(p: Path) -> list[int]:
    st = os.stat(p)
    return [st.st_size, st.st_mtime_ns]


def fingerprint(ckpt, scheme: str, dialect: str, opts) -> dict:
    """What must be equal for a resumed run to produce the bytes of an uninterrupted one."""
    options = {k: v for k, v in asdict(opts).items() if k not in NOT_IN_FINGERPRINT}
    options["scheme"], options["dialect"] = scheme, dialect
    options = json.loads(json.dumps(options, sort_keys=True, default=str))
    files = {h.path.name: _stat(h.path) for h in ckpt.shards}
    # extra files by their path inside SRC (top-level ones: their name, as before)
    files.update({p.relative_to(ckpt.root).as_posix(): _stat(p) for p in ckpt.extra_files})
    config = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode()).hexdigest()
    return {
        "qconvert_version": __version__,
        "source_id": ckpt.source_id,
        "revision": ckpt.revision,
        "config_sha256": config,
        "options": options,
        "files": files,
    }


def _diff(old, new, path="") -> str | None:
    """First difference between two JSON values, as 'path: old -> new'."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            if k not in old or k not in new:
                return f"{path}{k}: {'absent' if k not in old else 'present'} before, {'absent' if k not in new else 'present'} now"
            d = _diff(old[k], new[k], f"{path}{k}.")
            if d:
                return d
        return None
    if old != new:
        return f"{path.rstrip('.')}: {json.dumps(old)[:60]} before, {json.dumps(new)[:60]} now"
    return None


class Partial:
    """The partial output directory of one run, locked, with its journal."""

    def __init__(
        self,
        path: Path,
        lock_fd: int,
        fp: dict,
        created: str,
        inputs: dict[str, str],
        outputs: dict[str, dict],
        notes: list[str],
    ):
        self.dir = path
        self._lock_fd = lock_fd
        self.fingerprint = fp
        self.created = created
        self.inputs = inputs  # input shard name -> sha256
        self.outputs = outputs  # output shard name -> {"sha256", "size"}, verified
        self.notes = notes
        self._pending: dict[str, dict] = {}
        self._mu = threading.Lock()

    @property
    def done(self) -> set[str]:
        return set(self.outputs)

    # -- journal --------------------------------------------------------------------------------
    def _save(self):
        obj = {
            "format": JOURNAL_FORMAT,
            "fingerprint": self.fingerprint,
            "created": self.created,
            "inputs": self.inputs,
            "outputs": self.outputs,
        }
        tmp = self.dir / (JOURNAL_NAME + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / JOURNAL_NAME)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise OutputError(
                f"{self.dir / JOURNAL_NAME}: cannot write the resume journal ({e.strerror}); "
                "check free space and permissions"
            ) from None

    def input_done(self, name: str, sha: str):
        with self._mu:
            self.inputs[name] = sha
            if name in self._pending:
                self.outputs[name] = self._pending.pop(name)
            self._save()

    def output_done(self, name: str, sha: str, size: int):
        """Call after the shard file was fsynced; journaled once its input checksum is known too."""
        with self._mu:
            rec = {"sha256": sha, "size": size}
            if name in self.inputs:
                self.outputs[name] = rec
                self._save()
            else:
                self._pending[name] = rec

    # -- end of life ----------------------------------------------------------------------------
    def finish(self):
        """Drop the journal so that the directory holds exactly the output (the lock stays held)."""
        try:
            os.unlink(self.dir / JOURNAL_NAME)
        except FileNotFoundError:
            pass

    def unfinish(self):
        """The journal back after a failed install, so that ``--resume`` keeps every shard."""
        try:
            self._save()
        except OutputError:
            pass

    def release(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def discard(self):
        self.release()
        shutil.rmtree(self.dir, ignore_errors=True)


def _lock(d: Path, dst: Path) -> int:
    """flock the partial directory ``d`` itself; it must still be the directory at ``d`` once locked."""
    busy = f"{d}: another qconvert process is writing {dst}; wait for it or choose another DST"
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # renamed to DST by the process that held it
        raise OutputError(busy) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutputError(_not_a_dir(d)) from None
        raise OutputError(f"{d}: cannot open the output directory ({e.strerror}); check permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise OutputError(busy) from None
        raise OutputError(f"{d}: cannot lock ({e.strerror})") from None
    st, now = os.fstat(fd), _lstat(d)
    if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise OutputError(busy)
    return fd


def _lstat(p: Path):
    try:
        return os.lstat(p)
    except FileNotFoundError:
        return None


def _not_a_dir(d: Path) -> str:
    # never suggest a command that could delete a link's target
    return (
        f"{d}: exists and is not a directory (a symbolic link or a file); qconvert keeps its partial output "
        "there and does not follow links: move it away or choose another DST"
    )


def _regular(p: Path) -> bool:
    st = _lstat(p)
    return st is not None and stat.S_ISREG(st.st_mode)


def open_partial(dst: Path, ckpt, scheme: str, dialect: str, opts) -> Partial:
    """Create (or, with ``opts.resume``, reopen and verify) the partial directory of ``dst``."""
    d = partial_dir(dst)
    resume = bool(getattr(opts, "resume", False))
    fp = fingerprint(ckpt, scheme, dialect, opts)
    notes: list[str] = []
    st = _lstat(d)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputError(_not_a_dir(d))
    existed = st is not None
    if not existed:
        try:
            os.mkdir(d)
        except FileExistsError:
            existed = True
        except OSError as e:
            raise OutputError(
                f"{d}: cannot create the output directory ({e.strerror}); check permissions and free space"
            ) from None
    fd = _lock(d, dst)
    try:
        journal = d / JOURNAL_NAME
        if existed and not resume:
            raise OutputError(
                f"{d}: left by an interrupted conversion to {dst}; rerun the same command with "
                "--resume to continue it, or delete that directory to start over"
            )
        created, inputs, outputs = None, {}, {}
        if existed and os.path.lexists(journal):
            try:
                if not _regular(journal):
                    raise ValueError("not a regular file")
                old = json.loads(journal.read_text())
                if not isinstance(old, dict) or old.get("format") != JOURNAL_FORMAT:
                    raise ValueError("unknown journal format")
                old_fp, created = old["fingerprint"], old["created"]
                inputs, recorded = dict(old["inputs"]), dict(old["outputs"])
                if not isinstance(created, str) or not all(isinstance(v, str) for v in inputs.values()):
                    raise ValueError("wrong types")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError) as e:
                raise OutputError(f"{journal}: unreadable resume journal ({e}); delete {d} to start over") from None
            diff = _diff(old_fp, fp)
            if diff:
                raise OutputError(
                    f"{d}: the interrupted conversion differs from this command ({diff}); rerun it "
                    f"with its original source and options and --resume, or delete {d} to start over"
                )
            # --no-checksums (part of the fingerprint, so the interrupted run had it too): no digests
            # were recorded, and shards are kept on their size alone
            by_size = not opts.output_checksums
            for name, rec in sorted(recorded.items()):
                p = d / name
                ok = (
                    isinstance(rec, dict)
                    and name in inputs
                    and "/" not in name
                    and _regular(p)
                    and p.stat().st_size == rec.get("size")
                )
                if ok and not by_size:
                    ok = sha256_file(p) == rec.get("sha256")
                if ok:
                    outputs[name] = {"sha256": rec["sha256"], "size": rec["size"]}
                else:
                    notes.append(f"resume: {name} failed its {'size check' if by_size else 'checksum'} and is redone")
            notes.append(
                f"resume: {len(outputs)} of {len(ckpt.shards)} output shards verified and kept"
                + (f" ({len(outputs)} by size only: --no-checksums)" if by_size and outputs else "")
            )
        elif resume:
            notes.append("resume: no interrupted conversion found; started from the beginning")
        # Whatever is not a verified shard is rewritten: remove it so DST holds only this run's files.
        for p in d.iterdir():
            if p.name in outputs or p.name == JOURNAL_NAME:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        part = Partial(d, fd, fp, created or created_timestamp(), inputs, outputs, notes)
        part._save()
        return part
    except BaseException:
        os.close(fd)
        if not existed:
            shutil.rmtree(d, ignore_errors=True)
        raise
