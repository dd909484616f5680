"""Source checksums: hashed by default, read from the Hugging Face cache's blob names or from a
``hf download --local-dir`` directory's download records for free, skipped with --no-source-checksums (output checksums kept, same output bytes); --no-checksums
skips output checksums too (same shard bytes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from click.testing import CliRunner

from qconvert.cli import main
from qconvert.convert import runner
from qconvert.convert.safetensors_io import hub_cache_sha256, local_dir_sha256
from qconvert.verify import verify


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def run(*args) -> None:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output


def manifest(d: Path) -> dict:
    return json.loads((d / "qconvert.json").read_text())


def test_no_source_checksums_skips_only_the_source(demo_dense, tmp_path):
    run("mxfp8", demo_dense, tmp_path / "a")
    run("mxfp8", demo_dense, tmp_path / "b", "--no-source-checksums")
    a, b = manifest(tmp_path / "a"), manifest(tmp_path / "b")
    assert a["source"]["sha256"] == {p.name: sha(p) for p in demo_dense.glob("*.safetensors")}
    assert "sha256_note" not in a["source"]
    assert b["source"]["sha256"] == {} and "no-source-checksums" in b["source"]["sha256_note"]
    # outputs: hashed either way, and the same bytes
    assert b["outputs"]["sha256"] == a["outputs"]["sha256"]
    for name, digest in b["outputs"]["sha256"].items():
        assert sha(tmp_path / "b" / name) == digest
    r = verify(str(demo_dense), str(tmp_path / "b"))
    assert r.ok, r.failures
    assert "0 source shards" in r.checks["checksums"] and "not recorded" in r.checks["checksums"]


def test_no_checksums_hashes_nothing_and_writes_the_same_shards(demo_dense, tmp_path, monkeypatch):
    run("mxfp8", demo_dense, tmp_path / "a")
    hashed = []
    real_sha = runner.BackgroundSha256

    class Counting(real_sha):
        def update(self, buf):
            hashed.append(memoryview(buf).nbytes)
            super().update(buf)

    monkeypatch.setattr(runner, "BackgroundSha256", Counting)
    real_reader = runner.ShardReader
    reads = []

    def reader(h, hash_file=True, **kw):
        reads.append(hash_file)
        return real_reader(h, hash_file=hash_file, **kw)

    monkeypatch.setattr(runner, "ShardReader", reader)
    run("mxfp8", demo_dense, tmp_path / "b", "--no-checksums")
    assert hashed == [] and reads and not any(reads)  # not one byte hashed, in or out
    a, b = manifest(tmp_path / "a"), manifest(tmp_path / "b")
    assert b["outputs"]["sha256"] == {} and "--no-checksums" in b["outputs"]["sha256_note"]
    assert b["source"]["sha256"] == {} and "--no-checksums" in b["source"]["sha256_note"]
    shards = sorted(a["outputs"]["sha256"])
    assert shards == sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    for name in shards:  # the same bytes as a hashed run
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    monkeypatch.undo()
    r = verify(str(demo_dense), str(tmp_path / "b"))
    assert r.ok, r.failures
    assert "0 output, 0 source shards" in r.checks["checksums"], r.checks["checksums"]
    assert "output not recorded (--no-checksums)" in r.checks["checksums"]
    # a hashed manifest still fails a shard that lost its entry (the note is what makes it optional)
    m = manifest(tmp_path / "a")
    del m["outputs"]["sha256"][shards[0]]
    (tmp_path / "a" / "qconvert.json").write_text(json.dumps(m))
    r = verify(str(demo_dense), str(tmp_path / "a"))
    assert not r.ok and any("no sha256 for shard" in f for f in r.failures), r.failures


def test_a_source_shard_that_cannot_be_hashed_is_named_and_nothing_is_written(demo_moe, tmp_path, monkeypatch):
    bad = sorted(demo_moe.glob("*.safetensors"))[-1]
    real_sha256_file = runner.sha256_file

    def sha256_file(path, **kw):
        if Path(path).name == bad.name:
            raise OSError(5, "Input/output error")
        return real_sha256_file(path, **kw)

    monkeypatch.setattr(runner, "sha256_file", sha256_file)
    r = CliRunner().invoke(main, ["mxfp8", str(demo_moe), str(tmp_path / "out"), "--no-progress"])
    assert r.exit_code == 1, r.output
    assert str(bad) in r.output and "Input/output error" in r.output, r.output
    assert not (tmp_path / "out").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("qconvert-input-sha")]


def _hub_cache(src: Path, cache: Path) -> Path:
    """huggingface_hub's layout: files once under blobs/, snapshot names are relative links."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny"
    snap, blobs = repo / "snapshots" / rev, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            b = blobs / sha(p)
            shutil.copyfile(p, b)
            os.symlink(os.path.relpath(b, snap), snap / p.name)
        else:
            shutil.copyfile(p, snap / p.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def test_hub_cache_digest_comes_from_the_blob_name(demo_dense, tmp_path, monkeypatch):
    snap = _hub_cache(demo_dense, tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    hashed = []
    real_reader = runner.ShardReader

    def reader(h, hash_file=True, **kw):
        hashed.append((h.path.name, hash_file))
        return real_reader(h, hash_file=hash_file, **kw)

    monkeypatch.setattr(runner, "ShardReader", reader)
    files_hashed = []
    real_sha256_file = runner.sha256_file

    def sha256_file(path, **kw):
        files_hashed.append(path)
        return real_sha256_file(path, **kw)

    monkeypatch.setattr(runner, "sha256_file", sha256_file)
    run("mxfp8", "acme/tiny", tmp_path / "out")
    src = manifest(tmp_path / "out")["source"]
    assert src["sha256"] == {p.name: sha(p) for p in snap.glob("*.safetensors")}
    assert hashed and not any(h for _, h in hashed) and files_hashed == []  # no source byte was hashed


def test_hub_cache_sha256_only_trusts_links_into_blobs(tmp_path):
    (tmp_path / "src").mkdir()
    real = tmp_path / "src" / "x.safetensors"
    real.write_bytes(b"abc")
    digest = hashlib.sha256(b"abc").hexdigest()
    snap = _hub_cache(tmp_path / "src", tmp_path / "hub")
    assert hub_cache_sha256(snap / "x.safetensors") == digest
    assert hub_cache_sha256(real) is None  # a plain file
    assert hub_cache_sha256(next((tmp_path / "hub").rglob("blobs")) / digest) is None  # the blob itself: not a link
    other = tmp_path / "blobs"
    other.mkdir()
    (other / "not-a-digest").write_bytes(b"abc")
    os.symlink(other / "not-a-digest", tmp_path / "y.safetensors")
    assert hub_cache_sha256(tmp_path / "y.safetensors") is None
    assert hub_cache_sha256(tmp_path / "missing.safetensors") is None


def test_local_dir_sha256_trusts_what_huggingface_hub_trusts(tmp_path):
    """The records are written by huggingface_hub itself; its own reader is the oracle for when
    a record still holds (file unchanged since the download)."""
    from huggingface_hub._local_folder import read_download_metadata, write_download_metadata

    (tmp_path / "sub").mkdir()
    files = {"x.safetensors": b"abc", "sub/y.safetensors": b"defg"}
    for rel, data in files.items():
        (tmp_path / rel).write_bytes(data)
        os.utime(tmp_path / rel, (1e9, 1e9))  # written before its record, as a download is
        write_download_metadata(tmp_path, rel, "0" * 40, hashlib.sha256(data).hexdigest())
    for rel, data in files.items():
        assert read_download_metadata(tmp_path, rel) is not None
        assert local_dir_sha256(tmp_path / rel) == hashlib.sha256(data).hexdigest()
    # changed after the download: neither trusts the record
    (tmp_path / "x.safetensors").write_bytes(b"abX")
    os.utime(tmp_path / "x.safetensors", None)
    later = (tmp_path / "x.safetensors").stat().st_mtime + 5
    os.utime(tmp_path / "x.safetensors", (later, later))
    assert read_download_metadata(tmp_path, "x.safetensors") is None
    assert local_dir_sha256(tmp_path / "x.safetensors") is None
    # a non-LFS file's etag is a git blob id, not a sha256 of the content
    (tmp_path / "z.safetensors").write_bytes(b"z")
    os.utime(tmp_path / "z.safetensors", (1e9, 1e9))
    write_download_metadata(tmp_path, "z.safetensors", "0" * 40, "1" * 40)
    assert read_download_metadata(tmp_path, "z.safetensors") is not None
    assert local_dir_sha256(tmp_path / "z.safetensors") is None
    # no record, or a malformed one
    (tmp_path / "w.safetensors").write_bytes(b"w")
    assert local_dir_sha256(tmp_path / "w.safetensors") is None
    meta = tmp_path / ".cache" / "huggingface" / "download" / "w.safetensors.metadata"
    meta.write_text("only one line\n")
    assert local_dir_sha256(tmp_path / "w.safetensors") is None


def test_local_dir_download_records_save_the_source_digests(demo_dense, tmp_path, monkeypatch):
    """``hf download --local-dir`` sources: digests from the records, no source byte hashed; a shard
    changed after the download is hashed (and its new digest recorded)."""
    from huggingface_hub._local_folder import write_download_metadata

    local = tmp_path / "model"
    shutil.copytree(demo_dense, local)
    shards = sorted(local.glob("*.safetensors"))
    for p in shards:
        os.utime(p, (1e9, 1e9))
        write_download_metadata(local, p.name, "0" * 40, sha(p))
    files_hashed = []
    real_sha256_file = runner.sha256_file

    def sha256_file(path, **kw):
        files_hashed.append(Path(path).name)
        return real_sha256_file(path, **kw)

    monkeypatch.setattr(runner, "sha256_file", sha256_file)
    run("mxfp8", local, tmp_path / "a", "--no-progress")
    assert manifest(tmp_path / "a")["source"]["sha256"] == {p.name: sha(p) for p in shards}
    assert files_hashed == []
    later = time.time() + 10
    os.utime(shards[0], (later, later))  # touched after the download: its record no longer holds
    run("mxfp8", local, tmp_path / "b", "--no-progress")
    assert files_hashed == [shards[0].name]
    assert manifest(tmp_path / "b")["source"]["sha256"] == manifest(tmp_path / "a")["source"]["sha256"]
