"""BackgroundSha256 and sha256_file (the digests in manifests and journals, computed off the
I/O threads)."""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time

import pytest

from qconvert.convert.safetensors_io import BackgroundSha256, sha256_file


def _hash_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "qconvert-sha256"}


def _left_running(before: set) -> set:
    """Hash threads started since ``before`` that are still alive after a short wait (threads of
    earlier tests may end meanwhile, so counts would not do)."""
    for _ in range(100):
        new = _hash_threads() - before
        if not new:
            break
        time.sleep(0.01)
    return _hash_threads() - before


def test_digest_equals_hashlib_for_mixed_buffers():
    parts = [b"header", os.urandom(1 << 20), memoryview(os.urandom(3000)), b"", bytearray(os.urandom(77))]
    h = BackgroundSha256(b"head:", max_pending=1 << 16)  # smaller than one part: update must wait
    for p in parts:
        h.update(p)
    ref = hashlib.sha256(b"head:")
    for p in parts:
        ref.update(p)
    assert h.hexdigest() == ref.hexdigest()
    assert h.hexdigest() == ref.hexdigest()  # idempotent


def test_threads_end_on_close_on_drop_and_after_a_conversion(demo_moe, tmp_path):
    gc.collect()
    before = _hash_threads()
    h = BackgroundSha256()
    h.update(b"x" * 100)
    h.close()
    h = BackgroundSha256()
    h.update(b"y")
    del h  # dropped without a digest (an error elsewhere): its thread still ends
    gc.collect()
    assert not _left_running(before)

    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    convert(
        str(demo_moe),
        str(tmp_path / "q"),
        "mxfp8",
        ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False),
    )
    assert not _left_running(before)
    # nor do the source-digest and shard-closing threads outlive the conversion
    assert not [t for t in threading.enumerate() if t.name.startswith(("qconvert-input-sha", "qconvert-output-close"))]


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (3 << 20) + 4097])
def test_sha256_file_equals_hashlib_across_its_steps(tmp_path, size):
    p = tmp_path / "f"
    data = os.urandom(size)
    p.write_bytes(data)
    assert sha256_file(p) == hashlib.sha256(data).hexdigest()


def test_sha256_file_stops_when_cancelled(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(os.urandom((1 << 20) + 5))
    stop = threading.Event()
    stop.set()
    assert sha256_file(p, cancel=stop) is None


def test_hashing_writer_digest_for_any_arrival_order(tmp_path):
    """Output shards are hashed while written; tensors that arrive before their predecessors
    (jobs finishing out of file order) are hashed from the file once the gap is filled. The digest
    must be the file's in every arrival order, and nothing may be left unhashed."""
    import random

    import torch

    from qconvert.convert.runner import HashingWriter as _HashingWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randint(0, 255, (int(n),), dtype=torch.uint8, generator=g)
        for i, n in enumerate([1, 5000, 3, 70000, 0, 17, 40000, 8, 123457, 2])
    }
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    rng = random.Random(1)
    orders = [list(tensors), list(reversed(tensors))] + [rng.sample(list(tensors), len(tensors)) for _ in range(20)]
    for k, order in enumerate(orders):
        path = tmp_path / f"o{k}.safetensors"
        w = _HashingWriter(path, specs)
        for n in order:
            w.write(n, tensors[n])
        assert w.complete
        assert w.close(fsync=False) == hashlib.sha256(path.read_bytes()).hexdigest(), order
