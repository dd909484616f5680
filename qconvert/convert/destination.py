"""DST: the checks before a conversion writes anything, and the install of the finished
directory (rename into place, an existing DST moved aside and restored on failure).

Every command that writes a DST from a SRC passes :func:`check_dst` (convert, and so mxfp8,
nvfp4, bf16, demo; unshuffle) and installs with :func:`install`.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from ..errors import OutputError


def lstat(p: Path):
    """``os.lstat(p)``, or None when nothing is there (a link is not followed)."""
    try:
        return os.lstat(p)
    except FileNotFoundError:
        return None


def check_not_overlapping(src_root: Path, dst: Path):
    """Refuse a DST that is SRC, lies inside it or contains it, compared on real paths (symlinks
    resolved, on DST and on its parent), with or without --force: replacing DST would delete the
    source, or the conversion would be written into the checkpoint it reads."""
    s = Path(os.path.realpath(src_root))
    for d in {Path(os.path.realpath(dst)), Path(os.path.realpath(dst.parent)) / dst.name}:
        if d == s or s in d.parents or d in s.parents:
            what = "is SRC" if d == s else ("lies inside SRC" if s in d.parents else "contains SRC")
            raise OutputError(
                f"{dst}: DST {what} ({src_root}); choose a DST outside the source checkpoint "
                "(--force never replaces or writes into the source)"
            )


def check_dst(dst: Path, force: bool, src: str | None = None):
    """Every command that writes a DST from a SRC passes here (convert, and so mxfp8, nvfp4, bf16,
    demo; unshuffle). ``src``: the source, checked against DST when it is a local directory (a Hub
    source is checked once resolved, in :func:`qconvert.convert.conversion.convert`)."""
    if src is not None and Path(src).expanduser().is_dir():
        check_not_overlapping(Path(src).expanduser(), dst)
    st = lstat(dst)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputError(
            f"{dst}: is a symbolic link; qconvert does not write through or replace links: choose another DST"
        )
    if st is not None and not force:
        raise OutputError(f"{dst}: already exists; choose another DST or pass --force to replace it")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{dst}: exists and is not a directory; remove it or choose another DST")
    if st is not None:
        check_old_free(dst)
    parent = dst.parent
    if not parent.exists():
        raise OutputError(f"{parent}: parent directory of DST does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{parent}: not writable; choose a DST in a writable directory")


def check_old_free(dst: Path) -> Path:
    """The path an existing DST is moved to while --force installs the new one; nothing may be there."""
    old = dst.parent / f".{dst.name}.qconvert-old-{os.getpid()}"
    if lstat(old) is not None:
        raise OutputError(
            f"{old}: already exists (left by an interrupted --force run: the DST it replaced); move it away, then rerun"
        )
    return old


def tmp_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.qconvert-tmp-{os.getpid()}"


def install(tmp: Path, dst: Path, force: bool = True):
    """Rename the finished directory ``tmp`` into place. Call it holding the writer lock (the rename
    is the last thing done under it). An existing DST (--force) is moved aside first and deleted
    last; if the second rename fails, it is moved back, so a failure never leaves no DST. Nothing
    here follows a symlink: DST and the old-DST path are checked with lstat."""
    st = lstat(dst)
    old = None
    if st is not None:
        if not force:
            raise OutputError(
                f"{dst}: appeared while converting (another process?); pass --force to replace it or choose another DST"
            )
        if not stat.S_ISDIR(st.st_mode):  # a link or a file put there since check_dst
            raise OutputError(f"{dst}: is not a directory (a symbolic link?); choose another DST")
        old = check_old_free(dst)
    try:
        if old is not None:
            os.rename(dst, old)
        os.rename(tmp, dst)
    except BaseException:  # OSError, or Ctrl-C between the renames
        if old is not None and lstat(dst) is None and lstat(old) is not None:
            try:
                os.rename(old, dst)
            except OSError as e:
                raise OutputError(
                    f"{dst}: cannot move the finished output into place nor restore the "
                    f"previous DST ({e.strerror}); the previous DST is in {old}"
                ) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # a directory we renamed; rmtree never follows links in it
