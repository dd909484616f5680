"""ShardReader(mapped=True), the converter's reader: same tensors and digests as reading, the file
never written through a mapping, and each mapping gone with its tensor (the memory claim)."""

from __future__ import annotations

import gc
import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qconvert.convert.safetensors_io import ShardReader, read_header


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.bf16": torch.randn(37, 129, generator=g).to(torch.bfloat16),
        "b.f16": torch.randn(5, 3, generator=g).to(torch.float16),
        "c.u8": torch.randint(0, 256, (11,), generator=g, dtype=torch.uint8),
        "d.f32": torch.randn(64, 64, generator=g),
        "e.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "f.i64": torch.arange(9, dtype=torch.int64),
        "g.e4m3": torch.randn(3, 32, generator=g).to(torch.float8_e4m3fn),
        "h.big": torch.randn(300_000, generator=g).to(torch.bfloat16),  # spans several pages
    }


def _unpadded(path: Path, tensors: dict[str, torch.Tensor]):
    """A valid safetensors file whose header length is odd, so every tensor starts at an odd
    offset: a 2- or 4-byte dtype cannot be viewed in place there and the reader must copy."""
    meta, blobs, off = {}, [], 0
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}
    for k, t in tensors.items():
        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        meta[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    head = json.dumps(meta, separators=(",", ":")).encode()
    if len(head) % 2 == 0:
        head += b" "
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _maps_of(path: Path) -> int:
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path)))


@pytest.mark.parametrize("mapped", [True, False])
def test_tensors_and_digest_equal_safetensors_and_hashlib(tmp_path, mapped):
    p = tmp_path / "m.safetensors"
    save_file(_tensors(), p)
    want = load_file(p)
    with ShardReader(read_header(p), mapped=mapped) as r:
        got = {e.name: t.clone() for e, t in r.iter_tensors()}
        digest = r.sha256()
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    assert digest == hashlib.sha256(p.read_bytes()).hexdigest()


def test_odd_offsets_fall_back_to_reading(tmp_path):
    src = {k: v for k, v in _tensors().items() if v.dtype in (torch.bfloat16, torch.float32, torch.uint8)}
    p = tmp_path / "odd.safetensors"
    _unpadded(p, src)
    h = read_header(p)
    assert any(e.start % 2 for e in h.entries.values())
    with ShardReader(h, mapped=True) as r:
        for e, t in r.iter_tensors():
            assert torch.equal(t.contiguous().view(torch.uint8), src[e.name].contiguous().view(torch.uint8)), e.name
        assert r.sha256() == hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_writes_stay_private_and_mappings_go_with_their_tensors(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(_tensors(), p)
    before = p.read_bytes()
    gc.collect()
    assert _maps_of(p) == 0
    with ShardReader(read_header(p), hash_file=False, mapped=True) as r:
        t = r.read("h.big")
        u = r.read("a.bf16")
        assert _maps_of(p) == 2  # one mapping per tensor
        t.fill_(3.0)  # copy-on-write: the process's pages change, the file does not
        assert torch.all(t == 3.0)
        del t
        gc.collect()
        assert _maps_of(p) == 1
        again = r.read("h.big")
        assert torch.equal(again, load_file(p)["h.big"])
        del again, u
        gc.collect()
        assert _maps_of(p) == 0
    assert p.read_bytes() == before
