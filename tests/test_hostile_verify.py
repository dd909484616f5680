"""The hostile-input table of `qconvert verify` (issue 24's matrix: one table per entry point).

Each row damages a copy of a good conversion (or its source) the way a disk, a user or another tool
could, runs `qconvert verify SRC DST` as a user does (in a fresh process: a FIFO or a crash must not
hang or abort it) and asserts: exit 1, the expected words, no traceback, and that verify read
nothing it should not (the source is unchanged byte for byte).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_verify import patch_bytes, tensor_location

from qconvert.convert.demo import build_demo_model
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions

ROOT = Path(__file__).resolve().parents[1]
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny dense source, its MXFP8 and NVFP4 conversions, and a source of other weights."""
    root = tmp_path_factory.mktemp("hv")
    src = build_demo_model(root / "bf16", arch="qwen3")
    other = build_demo_model(root / "bf16-seed1", arch="qwen3", seed=1)
    out = {"src": src, "other": other}
    for scheme in ("mxfp8", "nvfp4"):
        opts = ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme), progress=False, fsync=False)
        convert(str(src), root / scheme, scheme, opts)
        out[scheme] = root / scheme
    return out


def _shard_of(ckpt: Path, name: str) -> Path:
    return tensor_location(ckpt, name)[0]


def flip_weight_byte(dst: Path):
    f, off, _ = tensor_location(dst, f"{Q}.weight")
    patch_bytes(f, off, bytes([f.read_bytes()[off] ^ 0x01]))


def nan_scale(dst: Path):
    f, off, _ = tensor_location(dst, f"{Q}.weight_scale")
    patch_bytes(f, off, b"\xff")  # E8M0 255: NaN


def truncate_shard(dst: Path):
    f = _shard_of(dst, f"{Q}.weight")
    os.truncate(f, f.stat().st_size - 100)


def fifo_shard(dst: Path):
    f = _shard_of(dst, f"{Q}.weight")
    f.unlink()
    os.mkfifo(f)


def link_out(dst: Path):
    f = _shard_of(dst, f"{Q}.weight")
    outside = dst.parent / f"outside-{dst.name}.safetensors"
    shutil.move(f, outside)
    f.symlink_to(outside)


def drop_quant_config(dst: Path):
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))


def garbage_config(dst: Path):
    (dst / "config.json").write_text("{not json")


def empty_dst(dst: Path):
    shutil.rmtree(dst)
    dst.mkdir()


def manifest_of_another_scheme(dst: Path):
    man = json.loads((dst / "qconvert.json").read_text())
    man["scheme"] = "nvfp4" if man["scheme"] == "mxfp8" else "mxfp8"
    (dst / "qconvert.json").write_text(json.dumps(man))


def nvfp4_global_scale_bit(dst: Path):
    f, off, n = tensor_location(dst, f"{Q}.weight_scale_2")
    patch_bytes(f, off, bytes([f.read_bytes()[off] ^ 0x01]))


# (id, scheme, damage to DST, verify against the other source?, words expected in the output)
ROWS = [
    ("weight-byte", "mxfp8", flip_weight_byte, False, [Q]),
    ("nan-scale", "mxfp8", nan_scale, False, [Q]),
    ("truncated-shard", "mxfp8", truncate_shard, False, [".safetensors"]),
    ("fifo-shard", "mxfp8", fifo_shard, False, ["FIFO"]),
    ("shard-links-out-of-dst", "mxfp8", link_out, False, ["outside"]),
    ("no-quantization-config", "mxfp8", drop_quant_config, False, ["quantization_config"]),
    ("garbage-config", "mxfp8", garbage_config, False, ["config.json"]),
    ("empty-dst", "mxfp8", empty_dst, False, ["config.json: missing"]),
    ("manifest-says-other-scheme", "mxfp8", manifest_of_another_scheme, False, ["qconvert.json says"]),
    ("global-scale-lowest-bit", "nvfp4", nvfp4_global_scale_bit, False, [f"{Q}.weight_scale_2"]),
    ("other-source", "mxfp8", None, True, ["different weights than SRC"]),
    ("other-source-nvfp4", "nvfp4", None, True, ["different weights than SRC"]),
]


def _tree_digest(p: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(p).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_hostile_verify(row, good, tmp_path):
    _id, scheme, damage, other_source, words = row
    dst = shutil.copytree(good[scheme], tmp_path / scheme)
    if damage is not None:
        damage(dst)
    src = good["other"] if other_source else good["src"]
    before = _tree_digest(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "-c", "from qconvert.cli import main; main()", "verify", str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "internal error" not in out, out[-3000:]
    for w in words:
        assert w in out, (w, out[-3000:])
    assert _tree_digest(src) == before
