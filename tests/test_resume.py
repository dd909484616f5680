"""--resume: kill -9 a real conversion at random points, resume, and compare every byte.

The reference is an uninterrupted run of the same command. ``SOURCE_DATE_EPOCH`` pins the
manifest's ``created`` field, so *all* files, the manifest included, must be byte-identical.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from qconvert.cli import main
from qconvert.convert import runner
from qconvert.convert.demo import build_demo_model
from qconvert.convert.resume import JOURNAL_NAME, partial_dir
from qconvert.convert.safetensors_io import ShardReader

EPOCH = "1700000000"
N_SHARDS = 8


def tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def assert_same_tree(got: Path, want: Path):
    a, b = tree(got), tree(want)
    assert sorted(a) == sorted(b), f"file sets differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name] == b[name], f"{name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The demo MoE model in 8 shards: a shard completes every ~1/8 of the run."""
    return build_demo_model(tmp_path_factory.mktemp("resume") / "bf16", arch="qwen3-moe", n_shards=N_SHARDS)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ref") / "out"
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH)
    r = subprocess.run(_cmd(src, dst), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dst


def _cmd(src, dst, *extra):
    return [
        sys.executable,
        "-m",
        "qconvert.cli",
        "mxfp8",
        str(src),
        str(dst),
        "--last-n-bf16",
        "1",
        "--no-progress",
        *extra,
    ]


def cli(*args, env=None):
    r = CliRunner().invoke(main, [str(a) for a in args], env=env)
    return r.exit_code, r.output + (r.stderr if hasattr(r, "stderr") and r.stderr not in r.output else "")


def _journaled(part: Path) -> int:
    try:
        return len(json.loads((part / JOURNAL_NAME).read_text())["outputs"])
    except (OSError, ValueError, KeyError):
        return -1


def test_sigkill_at_random_points_then_resume_is_byte_identical(src, reference, tmp_path):
    """SIGKILL a run, then each resumed run, at random points spread over the whole conversion
    (random shard counts plus a random delay, so kills land before the first shard, mid-shard,
    between shards and after the last one); then --resume to the end and compare every byte."""
    rng = random.Random(int(os.environ.get("QCONVERT_KILL_SEED", "20240607")))
    dst = tmp_path / "out"
    part = partial_dir(dst)
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH)
    # On a loaded machine a run can finish before its kill lands; then start over (fresh targets),
    # so the test always exercises at least three real kills instead of failing on timing.
    for _round in range(4):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(part, ignore_errors=True)
        targets = sorted(rng.sample(range(0, N_SHARDS + 1), 4))
        seen = []
        kills = 0
        for attempt, target in enumerate(targets):
            p = subprocess.Popen(
                _cmd(src, dst, *(["--resume"] if attempt else [])),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            t0 = time.monotonic()
            # Wait until this run holds the lock and has journaled `target` shards.
            while p.poll() is None and time.monotonic() - t0 < 120:
                if part.exists() and _journaled(part) >= target:
                    break
                time.sleep(0.003)
            time.sleep(rng.uniform(0.0, 0.08))
            if p.poll() is not None:
                err = p.stderr.read().decode()
                p.stderr.close()
                assert p.returncode == 0, err
                break
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stderr.close()
            kills += 1
            if dst.exists():  # killed after the final rename: complete, and nothing is left behind
                assert not part.exists()
                break
            seen.append(_journaled(part))
        if kills >= 3:
            break
    assert kills >= 3, f"only {kills} kills landed in 4 rounds; targets {targets}"
    if not dst.exists():
        r = subprocess.run(_cmd(src, dst, "--resume"), env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "output shards verified and kept" in r.stdout
    assert not part.exists()
    assert_same_tree(dst, reference)
    # Shards really were kept across kills (else resume would be a plain rerun).
    assert max(seen) >= 1, seen


def _interrupt_after(monkeypatch, n_closed: int):
    """Raise KeyboardInterrupt (as Ctrl-C would) once ``n_closed`` output shards are complete."""
    closed = [0]
    real_close = runner.HashingWriter.close

    def close(self, fsync):
        if closed[0] >= n_closed:
            # A closed shard is journaled once its input shard's digest is known too, which the
            # source-hashing threads compute meanwhile: wait for the journal to list the shards
            # closed so far, so that the interruption always lands at the same point.
            journal = self.w.path.parent / JOURNAL_NAME
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if journal.exists() and len(json.loads(journal.read_text())["outputs"]) >= n_closed:
                    break
                time.sleep(0.02)
            raise KeyboardInterrupt
        closed[0] += 1
        return real_close(self, fsync)

    monkeypatch.setattr(runner.HashingWriter, "close", close)


def test_resume_keeps_verified_shards_skips_their_input_and_redoes_corrupt_ones(src, reference, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    env = {"SOURCE_DATE_EPOCH": EPOCH}
    _interrupt_after(monkeypatch, 4)
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", env=env)
    assert code == 130 and "--resume" in out
    monkeypatch.undo()
    part = partial_dir(dst)
    journal = json.loads((part / JOURNAL_NAME).read_text())
    kept = sorted(journal["outputs"])
    assert len(kept) == 4 and not dst.exists()
    # Corrupt one journaled shard: resume must notice by checksum and redo it.
    bad = part / kept[1]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))

    opened = []
    real_init = ShardReader.__init__

    def init(self, header, *a, **kw):
        opened.append(header.path.name)
        real_init(self, header, *a, **kw)

    monkeypatch.setattr(ShardReader, "__init__", init)
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", "--resume", env=env)
    assert code == 0, out
    assert f"{kept[1]} failed its checksum" in out
    assert "3 of 8 output shards verified and kept" in out
    # Verified shards' inputs are not read again; the corrupt one's and the unfinished ones' are.
    assert sorted(opened) == sorted(set(p.name for p in src.glob("*.safetensors")) - set(kept) | {kept[1]})
    assert_same_tree(dst, reference)
    assert not part.exists()


def test_stale_partial_without_resume_is_reported_with_a_hint(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    _interrupt_after(monkeypatch, 1)
    code, _ = cli("mxfp8", src, dst, "--no-progress")
    assert code == 130
    monkeypatch.undo()
    code, out = cli("mxfp8", src, dst, "--no-progress")
    assert code == 1
    assert "interrupted conversion" in out and "--resume" in out and str(partial_dir(dst)) in out
    assert not dst.exists() and (partial_dir(dst) / JOURNAL_NAME).exists()


def test_resume_with_different_options_or_source_is_refused(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    _interrupt_after(monkeypatch, 2)
    assert cli("mxfp8", src, dst, "--no-progress", "--last-n-bf16", "1")[0] == 130
    monkeypatch.undo()
    code, out = cli("mxfp8", src, dst, "--no-progress", "--last-n-bf16", "2", "--resume")
    assert code == 1 and "last_n_bf16: 1 before, 2 now" in out, out
    assert not dst.exists()
    # A source shard touched since the interruption: refused, names the file.
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    try:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        code, out = cli("mxfp8", src, dst, "--no-progress", "--last-n-bf16", "1", "--resume")
        assert code == 1 and shard.name in out and "differs from this command" in out, out
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Device, progress and the like change no byte: accepted.
    code, out = cli("mxfp8", src, dst, "--progress", "--last-n-bf16", "1", "--resume")
    assert code == 0 and "2 of 8 output shards verified" in out, out


def test_resume_with_nothing_to_resume_starts_fresh(src, reference, tmp_path):
    dst = tmp_path / "out"
    code, out = cli(
        "mxfp8", src, dst, "--no-progress", "--last-n-bf16", "1", "--resume", env={"SOURCE_DATE_EPOCH": EPOCH}
    )
    assert code == 0 and "no interrupted conversion found" in out
    assert_same_tree(dst, reference)


def test_a_second_process_on_the_same_dst_is_refused(src, tmp_path):
    dst = tmp_path / "out"
    part = partial_dir(dst)
    part.mkdir()
    fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live conversion holds it: the directory itself
    try:
        code, out = cli("mxfp8", src, dst, "--no-progress", "--resume")
    finally:
        os.close(fd)
    assert code == 1 and "another qconvert process" in out
    assert part.exists() and not dst.exists()


def test_resume_under_no_checksums_keeps_shards_by_size_and_matches_a_hashed_run(src, reference, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    env = {"SOURCE_DATE_EPOCH": EPOCH}
    _interrupt_after(monkeypatch, 3)
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", "--no-checksums", env=env)
    assert code == 130
    monkeypatch.undo()
    journal = json.loads((partial_dir(dst) / JOURNAL_NAME).read_text())
    assert len(journal["outputs"]) == 3 and all(r["sha256"] == "" for r in journal["outputs"].values())
    # the setting is part of the fingerprint: resuming with checksums on is refused
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", "--resume", env=env)
    assert code == 1 and "output_checksums: false before, true now" in out, out
    # a journaled shard cut short is redone (size check), the others kept
    short = partial_dir(dst) / sorted(journal["outputs"])[0]
    short.write_bytes(short.read_bytes()[:-1])
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", "--no-checksums", "--resume", env=env)
    assert code == 0, out
    assert f"{short.name} failed its size check" in out
    assert "2 of 8 output shards verified and kept (2 by size only: --no-checksums)" in out
    ref = tree(reference)
    got = tree(dst)
    assert sorted(got) == sorted(ref)
    for name in got:  # shards identical to the hashed reference; only the manifest's digests differ
        if name != "qconvert.json":
            assert got[name] == ref[name], name
    m = json.loads(got["qconvert.json"])
    assert m["outputs"]["sha256"] == {} and "sha256_note" in m["outputs"]


def test_a_journaled_shard_without_a_digest_is_rehashed_when_checksums_are_on(src, reference, tmp_path, monkeypatch):
    """Only the fingerprint's --no-checksums makes resume trust sizes: a hashed run's journal entry
    whose digest went missing is checked against the shard's bytes, and a changed shard is redone."""
    dst = tmp_path / "out"
    env = {"SOURCE_DATE_EPOCH": EPOCH}
    _interrupt_after(monkeypatch, 2)
    assert cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", env=env)[0] == 130
    monkeypatch.undo()
    jpath = partial_dir(dst) / JOURNAL_NAME
    journal = json.loads(jpath.read_text())
    name = sorted(journal["outputs"])[0]
    journal["outputs"][name]["sha256"] = ""
    jpath.write_text(json.dumps(journal))
    shard = partial_dir(dst) / name
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    code, out = cli("mxfp8", src, dst, "--last-n-bf16", "1", "--no-progress", "--resume", env=env)
    assert code == 0, out
    assert f"{name} failed its checksum" in out and "1 of 8 output shards verified and kept" in out, out
    assert_same_tree(dst, reference)
