"""Hostile file systems: a DST that is (inside, around) SRC, symlinks planted at the paths qconvert
writes (partial dir, old DST, pickle copy, staging names), symlinks in SRC that leave it, FIFOs in
place of checkpoint files.

One table, one row per case: how the tree is set up, the command, and the one-line error expected.
Every row also asserts that nothing under the test's directory changed, byte for byte: the source,
unrelated siblings and the targets of every planted link (a link's target is read through the link
only where the case says it is allowed). New commands that read a SRC or write a DST add rows here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qconvert.cli import main
from qconvert.convert import destination, pipeline

TIMEOUT_S = 60  # a case that blocks (a FIFO opened for reading) fails instead of hanging the run


@pytest.fixture(autouse=True)
def _alarm():
    def boom(*_):
        raise TimeoutError(f"blocked for {TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def shm_root(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(root))
    return root


def snapshot(d: Path) -> dict[str, object]:
    """Every entry under ``d`` without following links: file bytes, link targets, folders, FIFOs."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(d, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(d))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_fifo():
                out[rel] = "fifo"
            else:
                out[rel] = p.read_bytes()
    return out


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    out = r.output + (r.stderr if hasattr(r, "stderr") and r.stderr not in r.output else "")
    return r, out


# ---- setups: each gets P (a directory holding the source "model", a sibling and a victim) and
# returns the command's arguments -------------------------------------------------------------


def _victim(P: Path) -> Path:
    v = P / "victim"
    v.mkdir(exist_ok=True)
    (v / "precious.txt").write_text("not yours")
    return v


def _outside(P: Path, name: str, data: bytes) -> Path:
    f = _victim(P) / name
    f.write_bytes(data)
    return f


def _first_shard(m: Path) -> Path:
    return sorted(m.glob("*.safetensors"))[0]


def s_dst_is_src(P):
    return ["mxfp8", P / "model", P / "model", "--force"]


def s_dst_contains_src(P):
    return ["mxfp8", P / "model", P, "--force"]


def s_dst_inside_src(P):
    return ["mxfp8", P / "model", P / "model" / "out"]


def s_dst_link_to_src(P):
    (P / "link").symlink_to(P / "model")
    return ["mxfp8", P / "model", P / "link", "--force"]


def s_src_through_link_is_dst(P):
    (P / "srclink").symlink_to(P / "model")
    return ["nvfp4", P / "srclink", P / "model", "--force"]


def s_bf16_dst_contains_src(P):
    return ["bf16", P / "model", P, "--force", "--layout", "flashinfer-trtllm"]


def s_unshuffle_dst_is_src(P):
    return ["unshuffle", P / "model", P / "model", "--force"]


def s_unshuffle_dst_contains_src(P):
    return ["unshuffle", P / "model", P, "--force"]


def s_dst_is_link_elsewhere(P):
    (P / "out").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out", "--force"]


def s_partial_is_link_resume(P):
    (P / ".out.qconvert-partial").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out", "--resume"]


def s_partial_is_link(P):
    (P / ".out.qconvert-partial").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out"]


def s_old_dst_is_link(P):
    (P / "out").mkdir()
    (P / "out" / "old.txt").write_text("old output")
    (P / f".out.qconvert-old-{os.getpid()}").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out", "--force"]


def s_pickle_copy_is_link(P):
    _to_pickle(P / "model")
    (P / ".out.qconvert-pickle-src").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out", "--allow-pickle"]


def s_pickle_bin_leaves_src(P):
    _to_pickle(P / "model")
    b = P / "model" / "pytorch_model.bin"
    shutil.move(b, _victim(P) / "pytorch_model.bin")
    b.symlink_to(P / "victim" / "pytorch_model.bin")
    return ["mxfp8", P / "model", P / "out", "--allow-pickle"]


def s_pickle_bin_fifo(P):
    _to_pickle(P / "model")
    b = P / "model" / "pytorch_model.bin"
    b.unlink()
    os.mkfifo(b)
    return ["mxfp8", P / "model", P / "out", "--allow-pickle"]


def _link_out(P, name):
    m = P / "model" / name
    f = _outside(P, name.replace("/", "_"), m.read_bytes())
    m.unlink()
    m.symlink_to(f)


def s_config_leaves_src(P):
    _link_out(P, "config.json")
    return ["mxfp8", P / "model", P / "out"]


def s_index_leaves_src(P):
    _link_out(P, "model.safetensors.index.json")
    return ["mxfp8", P / "model", P / "out"]


def s_shard_leaves_src(P):
    _link_out(P, _first_shard(P / "model").name)
    return ["mxfp8", P / "model", P / "out"]


def s_extra_leaves_src(P):
    _link_out(P, "tokenizer.json")
    return ["mxfp8", P / "model", P / "out"]


def s_subfolder_file_leaves_src(P):
    (P / "model" / "1_Pooling").mkdir()
    (P / "model" / "1_Pooling" / "config.json").symlink_to(_outside(P, "pool.json", b"{}"))
    return ["mxfp8", P / "model", P / "out"]


def s_subfolder_leaves_src(P):
    (P / "model" / "1_Pooling").symlink_to(_victim(P))
    return ["mxfp8", P / "model", P / "out"]


def s_shard_fifo(P):
    s = _first_shard(P / "model")
    s.unlink()
    os.mkfifo(s)
    return ["mxfp8", P / "model", P / "out"]


def s_config_fifo(P):
    (P / "model" / "config.json").unlink()
    os.mkfifo(P / "model" / "config.json")
    return ["mxfp8", P / "model", P / "out"]


def s_stage_shard_leaves_src(P):
    _link_out(P, _first_shard(P / "model").name)
    return ["stage", P / "model", "area"]


def s_stage_config_leaves_src(P):
    _link_out(P, "config.json")
    return ["stage", P / "model", "area"]


def s_stage_json_leaves_src(P):
    _link_out(P, "tokenizer.json")
    return ["stage", P / "model", "area"]


def s_stage_shard_fifo(P):
    s = _first_shard(P / "model")
    s.unlink()
    os.mkfifo(s)
    return ["stage", P / "model", "area"]


def s_stage_drop_link(P):
    root = Path(os.environ["QCONVERT_SHM_ROOT"])
    root.mkdir(mode=0o700)
    (root / "area").symlink_to(_victim(P))
    return ["stage", "--drop", "area"]


def s_stage_over_link(P):
    root = Path(os.environ["QCONVERT_SHM_ROOT"])
    root.mkdir(mode=0o700)
    (root / "area").symlink_to(_victim(P))
    return ["stage", P / "model", "area"]


def s_inspect_config_leaves_src(P):
    _link_out(P, "config.json")
    return ["inspect", P / "model"]


def s_inspect_index_leaves_src(P):
    _link_out(P, "model.safetensors.index.json")
    return ["inspect", P / "model"]


def s_stage_root_is_link(P):
    Path(os.environ["QCONVERT_SHM_ROOT"]).symlink_to(_victim(P))
    return ["stage", P / "model", "area"]


def s_demo_bf16_is_link(P):
    (P / "demo").mkdir()
    (P / "demo" / "bf16").symlink_to(_victim(P))
    return ["demo", P / "demo", "--force"]


def s_unshuffle_tmp_is_link(P):
    (P / f".out.qconvert-tmp-{os.getpid()}").symlink_to(_victim(P))
    (P / "model" / "qconvert.json").write_text(
        json.dumps({"dialect": "auto", "layout": {"engine": "sglang", "tp": 1, "ep": 1, "layers": {}, "contracts": {}}})
    )
    return ["unshuffle", P / "model", P / "out"]


def s_input_scales_shard_leaves_ckpt(P):
    other = P / "scales"
    other.mkdir()
    (other / "model.safetensors").symlink_to(_outside(P, "x.safetensors", _first_shard(P / "model").read_bytes()))
    return ["nvfp4", P / "model", P / "out", "--input-scales-from", other]


def s_verify_src_shard_leaves_src(P):
    pipeline.convert(str(P / "model"), P / "out", "mxfp8", pipeline.ConvertOptions(progress=False))
    _link_out(P, _first_shard(P / "model").name)
    return ["verify", P / "model", P / "out"]


def _layout_manifest() -> bytes:
    return json.dumps(
        {"dialect": "auto", "layout": {"engine": "sglang", "tp": 1, "ep": 1, "layers": {}, "contracts": {}}}
    ).encode()


def s_unshuffle_manifest_leaves_src(P):
    (P / "model" / "qconvert.json").symlink_to(_outside(P, "qconvert.json", _layout_manifest()))
    return ["unshuffle", P / "model", P / "out"]


def s_stage_manifest_leaves_src(P):
    (P / "model" / "qconvert.json").symlink_to(_outside(P, "qconvert.json", _layout_manifest()))
    return ["stage", P / "model", "area"]


def s_unshuffle_shard_fifo(P):
    (P / "model" / "qconvert.json").write_bytes(_layout_manifest())
    s = _first_shard(P / "model")
    s.unlink()
    os.mkfifo(s)
    return ["unshuffle", P / "model", P / "out"]


def s_inspect_manifest_fifo(P):
    os.mkfifo(P / "model" / "qconvert.json")
    return ["inspect", P / "model"]


def s_verify_dst_manifest_leaves_dst(P):
    pipeline.convert(str(P / "model"), P / "out", "mxfp8", pipeline.ConvertOptions(progress=False))
    m = P / "out" / "qconvert.json"
    f = _outside(P, "out-qconvert.json", m.read_bytes())
    m.unlink()
    m.symlink_to(f)
    return ["verify", P / "model", P / "out"]


def _to_pickle(m: Path):
    sd = {}
    for f in sorted(m.glob("*.safetensors")):
        sd.update(load_file(f))
        f.unlink()
    (m / "model.safetensors.index.json").unlink()
    torch.save(sd, m / "pytorch_model.bin")


CASES = [
    # (setup, expected substring of the one-line error)
    (s_dst_is_src, "DST is SRC"),
    (s_dst_contains_src, "DST contains SRC"),
    (s_dst_inside_src, "DST lies inside SRC"),
    (s_dst_link_to_src, "DST is SRC"),
    (s_src_through_link_is_dst, "DST is SRC"),
    (s_bf16_dst_contains_src, "DST contains SRC"),
    (s_unshuffle_dst_is_src, "DST is SRC"),
    (s_unshuffle_dst_contains_src, "DST contains SRC"),
    (s_dst_is_link_elsewhere, "is a symbolic link"),
    (s_partial_is_link_resume, "does not follow links"),
    (s_partial_is_link, "does not follow links"),
    (s_old_dst_is_link, "interrupted --force run"),
    (s_pickle_copy_is_link, "a symbolic link?"),
    (s_pickle_bin_leaves_src, "resolves outside"),
    (s_pickle_bin_fifo, "is a FIFO"),
    (s_config_leaves_src, "resolves outside"),
    (s_index_leaves_src, "resolves outside"),
    (s_shard_leaves_src, "resolves outside"),
    (s_extra_leaves_src, "resolves outside"),
    (s_subfolder_file_leaves_src, "resolves outside"),
    (s_subfolder_leaves_src, "resolves outside"),
    (s_shard_fifo, "is a FIFO"),
    (s_config_fifo, "is a FIFO"),
    (s_stage_shard_leaves_src, "resolves outside"),
    (s_stage_config_leaves_src, "resolves outside"),
    (s_stage_json_leaves_src, "resolves outside"),
    (s_stage_shard_fifo, "is a FIFO"),
    (s_stage_drop_link, "is a symbolic link"),
    (s_stage_over_link, "is a symbolic link"),
    (s_stage_root_is_link, "staging root is not a plain directory"),
    (s_demo_bf16_is_link, "is a symbolic link"),
    (s_unshuffle_tmp_is_link, "is a symbolic link"),
    (s_input_scales_shard_leaves_ckpt, "resolves outside"),
    (s_verify_src_shard_leaves_src, "resolves outside"),
    (s_inspect_config_leaves_src, "resolves outside"),
    (s_inspect_index_leaves_src, "resolves outside"),
    (s_unshuffle_manifest_leaves_src, "resolves outside"),
    (s_unshuffle_shard_fifo, "is a FIFO"),
    (s_stage_manifest_leaves_src, "resolves outside"),
    (s_inspect_manifest_fifo, "is a FIFO"),
    (s_verify_dst_manifest_leaves_dst, "resolves outside"),
]


@pytest.mark.parametrize("setup,expected", CASES, ids=[c[0].__name__[2:] for c in CASES])
def test_hostile_fs(setup, expected, demo_dense, tmp_path):
    P = tmp_path / "P"
    P.mkdir()
    shutil.copytree(demo_dense, P / "model")
    (P / "sibling").mkdir()
    (P / "sibling" / "data.bin").write_bytes(os.urandom(4096))
    args = setup(P)
    before = snapshot(P)
    r, out = cli(*args)
    assert r.exit_code == 1, out
    assert isinstance(r.exception, SystemExit), f"traceback instead of a one-line error: {r.exception!r}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out
    assert snapshot(P) == before, "the source, a sibling or a link's target changed"
    if setup in (s_partial_is_link, s_partial_is_link_resume):
        # the error must not recommend --resume or deleting the path (that would hit the link's target)
        assert "--resume" not in lines[0] and "delete" not in lines[0], lines[0]


# ---- C: the writer lock and the install -------------------------------------------------------


def test_failed_install_restores_the_old_dst_and_keeps_a_resumable_partial(demo_dense, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("the previous conversion")
    real_rename = os.rename

    def failing_rename(a, b):
        if Path(a).name == ".out.qconvert-partial" and Path(b) == dst:
            raise OSError(28, "No space left on device")
        return real_rename(a, b)

    monkeypatch.setattr(destination.os, "rename", failing_rename)
    r, out = cli("mxfp8", demo_dense, dst, "--force", "--no-progress")
    assert r.exit_code == 1 and "cannot move the finished output into place" in out, out
    assert sorted(p.name for p in dst.iterdir()) == ["old.txt"]
    assert (dst / "old.txt").read_text() == "the previous conversion"
    assert not any(".qconvert-old-" in p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(destination.os, "rename", real_rename)
    r, out = cli("mxfp8", demo_dense, dst, "--force", "--no-progress", "--resume")
    assert r.exit_code == 0, out
    n = len(list(demo_dense.glob("*.safetensors")))
    assert f"{n} of {n} output shards verified and kept" in out, out
    assert not (dst / "old.txt").exists() and (dst / "qconvert.json").is_file()


def test_writer_lock_is_held_until_dst_is_in_place(demo_dense, tmp_path, monkeypatch):
    """A second --resume run started while the first one installs DST is refused and deletes nothing."""
    from qconvert.convert import resume

    dst = tmp_path / "out"
    seen = {}
    real_install = destination.install

    def install_with_a_rival(tmp, d, force=True):
        r, out = cli("mxfp8", demo_dense, d, "--no-progress", "--resume")
        seen["rival"] = (r.exit_code, out, sorted(p.name for p in tmp.iterdir()))
        return real_install(tmp, d, force)

    monkeypatch.setattr(destination, "install", install_with_a_rival)
    r, out = cli("mxfp8", demo_dense, dst, "--no-progress")
    assert r.exit_code == 0, out
    code, rival_out, files_then = seen["rival"]
    assert code == 1 and "another qconvert process is writing" in rival_out, rival_out
    assert sorted(p.name for p in dst.iterdir()) == files_then  # nothing was deleted by the rival
    assert not resume.partial_dir(dst).exists()


# ---- 4: every non-weight file and folder of the source is copied ------------------------------


def test_sentence_transformers_folders_are_copied(demo_dense, tmp_path):
    src = tmp_path / "st"
    shutil.copytree(demo_dense, src)
    (src / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "2_Normalize").mkdir()  # empty in sentence-transformers models
    (src / "2_Dense").mkdir()
    (src / "2_Dense" / "model.safetensors").write_bytes(_first_shard(src).read_bytes())
    (src / "2_Dense" / "nested").mkdir()
    (src / "2_Dense" / "nested" / "x.txt").write_text("deep")
    (src / "1_Pooling" / "alias.json").symlink_to("config.json")  # a link inside SRC: fine
    (src / "onnx").mkdir()
    (src / "onnx" / "model.onnx").write_bytes(b"onnx export")  # other formats: not copied
    (src / ".cache").mkdir()
    (src / ".cache" / "junk").write_text("hidden")
    dst = tmp_path / "out"
    r, out = cli("mxfp8", src, dst, "--no-progress")
    assert r.exit_code == 0, out
    for rel in ["modules.json", "1_Pooling/config.json", "2_Dense/model.safetensors", "2_Dense/nested/x.txt"]:
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert (dst / "1_Pooling" / "alias.json").read_bytes() == (src / "1_Pooling" / "config.json").read_bytes()
    assert not (dst / "1_Pooling" / "alias.json").is_symlink()
    assert (dst / "2_Normalize").is_dir()
    assert not (dst / "onnx").exists() and not (dst / ".cache").exists()
    # the copied files feed the resume fingerprint by their path inside SRC
    from qconvert.convert.checkpoint import load_checkpoint
    from qconvert.convert.resume import fingerprint

    fp = fingerprint(load_checkpoint(str(src)), "mxfp8", "auto", pipeline.ConvertOptions())
    assert "1_Pooling/config.json" in fp["files"] and "2_Dense/nested/x.txt" in fp["files"]


# ---- 6: a killed stage leaves nothing --list does not show -------------------------------------


def test_a_killed_stage_is_listed_and_dropped(demo_dense, shm_root):
    from qconvert.client import staging

    w = staging.StagingWriter("area", config={"architectures": []})
    leftover = w.tmp
    os.close(w._lock_fd)  # as if the process had been killed: the lock goes with it
    w._lock_fd = None
    r, out = cli("stage", "--list")
    assert r.exit_code == 0 and "area\tBROKEN\tincomplete:" in out and "interrupted" in out, out
    r, out = cli("stage", "--drop", "area")
    assert r.exit_code == 0 and "dropped area" in out, out
    assert not leftover.exists()


def test_a_running_stage_is_listed_as_being_written_and_not_dropped(shm_root):
    from qconvert.client import staging

    w = staging.StagingWriter("area", config={"architectures": []})
    try:
        r, out = cli("stage", "--list")
        assert "area\tBROKEN\tincomplete: being written" in out, out
        cli("stage", "--drop", "area")
        assert w.tmp.is_dir()
    finally:
        w.abort()


# ---- A for a Hub source: its whole repo cache (snapshot and blobs) is the source ---------------


@pytest.mark.parametrize(
    "dst_rel,expected",
    [
        ("hub", "DST contains SRC"),
        ("hub/models--acme--tiny/blobs", "DST lies inside SRC"),
        ("hub/models--acme--tiny/snapshots", "DST lies inside SRC"),
    ],
)
def test_hub_source_cache_is_never_dst(dst_rel, expected, demo_dense, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny"
    snap, blobs = repo / "snapshots" / rev, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(demo_dense.iterdir())):
        b = blobs / f"blob{i}"
        shutil.copyfile(p, b)
        os.symlink(os.path.relpath(b, snap), snap / p.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    before = snapshot(tmp_path)
    r, out = cli("mxfp8", "acme/tiny", tmp_path / dst_rel, "--force", "--no-progress")
    assert r.exit_code == 1 and expected in out, out
    assert isinstance(r.exception, SystemExit), r.exception
    assert snapshot(tmp_path) == before


def test_ctrl_c_between_the_install_renames_restores_the_old_dst(demo_dense, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("the previous conversion")
    real_rename = os.rename

    def interrupted_rename(a, b):
        if Path(a).name == ".out.qconvert-partial" and Path(b) == dst:  # the old DST was just moved aside
            raise KeyboardInterrupt
        return real_rename(a, b)

    monkeypatch.setattr(destination.os, "rename", interrupted_rename)
    r, out = cli("mxfp8", demo_dense, dst, "--force", "--no-progress")
    assert r.exit_code == 130, out
    assert sorted(p.name for p in dst.iterdir()) == ["old.txt"]
    assert not any(".qconvert-old-" in p.name for p in tmp_path.iterdir())
