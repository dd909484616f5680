"""The staging-area contract (qconvert/formats/staging.py): build, parse, validate, rank selection, locks.

docs/reload.md#staging-area-format, docs/reload.md#per-rank-files.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from qconvert.formats import staging as fs


def _spec(tp=1, ep=1, ranked=False) -> fs.AreaSpec:
    files = [
        fs.FileSpec(
            "g00000-00.safetensors",
            1024,
            None,
            {
                "model.embed_tokens.weight": fs.TensorSpec("BF16", (4, 64), 256),
                "model.norm.weight": fs.TensorSpec("BF16", (64,), 768),
            },
        )
    ]
    if ranked:
        for r in range(tp):
            for q in range(ep):
                files.append(
                    fs.FileSpec(
                        fs.file_name(1, 0, (r, q)),
                        512,
                        (r, q),
                        {"model.layers.0.mlp.experts.w13_weight": fs.TensorSpec("U8", (2, 128), 256)},
                    )
                )
    return fs.AreaSpec(
        {"architectures": ["X"], "num_tensors": 3}, fs.DIGEST_XXH3, tp, ep, tuple(files), ("config.json",)
    )


def _write_area(root, spec: fs.AreaSpec, slot=0, version=1):
    root.mkdir(parents=True, exist_ok=True)
    fs.write_json_atomic(root / fs.AREA_JSON, spec.to_json())
    for k in fs.SLOTS:
        fs.slot_dir(root, k).mkdir(exist_ok=True)
    c = fs.Commit(slot, version, {f.name: f"{i:032x}" for i, f in enumerate(spec.files)}, 123.0)
    fs.write_json_atomic(root / fs.COMMIT_JSON, c.to_json())
    return c


def test_file_names():
    assert fs.file_name(3, 1) == "g00003-01.safetensors"
    assert fs.file_name(12, 0, (1, 3)) == "g00012-tp1-ep3-00.safetensors"
    m = fs.FILE_RE.match("g00012-tp1-ep3-00.safetensors")
    assert (m.group("group"), m.group("tp"), m.group("ep"), m.group("part")) == ("00012", "1", "3", "00")
    assert fs.FILE_RE.match("../g00000-00.safetensors") is None


def test_area_json_round_trip():
    spec = _spec(2, 2, ranked=True)
    doc = json.loads(json.dumps(spec.to_json()))
    assert doc["format"] == "qconvert-staging/2" and doc["digest"] == "xxh3_128"
    assert doc["files"][1]["rank"] == [0, 0] and doc["files"][0]["rank"] is None
    assert doc["files"][0]["tensors"]["model.norm.weight"] == {"dtype": "BF16", "shape": [64], "offset": 768}
    back = fs.parse_area(doc)
    assert back == spec and back.mismatch(spec) is None
    assert back.files[0].tensors["model.embed_tokens.weight"].nbytes == 512
    doc["files"][0]["tensors"]["model.norm.weight"].update(dtype="F32", shape=[2], offset=772)  # small: own alignment
    assert fs.parse_area(doc).files[0].tensors["model.norm.weight"].offset == 772


def _mutate(path, fn):
    doc = _spec(2, 1, ranked=True).to_json()
    fn(doc)
    return doc


@pytest.mark.parametrize(
    "fn,words",
    [
        (lambda d: d.update(format="qconvert-staging/3"), "unknown format"),
        (lambda d: d.update(digest="md5"), "digest kind"),
        (lambda d: d.update(tp=0), "tp is 0"),
        (lambda d: d["files"][0]["tensors"]["model.embed_tokens.weight"].update(offset=300), "not a multiple of 256"),
        (lambda d: d["files"][0]["tensors"]["model.norm.weight"].update(shape=[1000]), "past its file"),
        (
            lambda d: d["files"][0]["tensors"]["model.norm.weight"].update(shape=[3], offset=769),
            "not a multiple of 256",
        ),
        (lambda d: d["files"][0]["tensors"]["model.norm.weight"].update(dtype="F4"), "unknown"),
        (lambda d: d["files"][1].update(rank=[5, 0]), "outside tp=2"),
        (lambda d: d["files"][1].update(rank=[1, 0]), "disagree"),
        (lambda d: d["files"][1].update(rank=None), "disagree"),
        (lambda d: d["files"][1].update(name="../x.safetensors"), "not a staging file name"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
        (
            lambda d: d["files"][1]["tensors"].update(
                {"model.norm.weight": {"dtype": "BF16", "shape": [1], "offset": 0}}
            ),
            "both replicated and per-rank",
        ),
        (lambda d: d.update(extra_files=["../config.json"]), "extra_files"),
        (lambda d: d.update(extra_files=["commit.json"]), "staging file"),
    ],
)
def test_area_json_refused(fn, words):
    doc = _mutate(None, fn)
    with pytest.raises(fs.StagingError, match=words) as e:
        fs.parse_area(doc, "/x/area.json")
    assert "\n" not in str(e.value) and "/x/area.json" in str(e.value)


def test_mismatch_names_the_tensor():
    a = _spec()
    files = list(a.files)
    t = dict(files[0].tensors)
    t["model.norm.weight"] = fs.TensorSpec("F32", (64,), 768)
    files[0] = fs.FileSpec(files[0].name, files[0].size, None, t)
    b = fs.AreaSpec(a.contract, a.digest, 1, 1, tuple(files), a.extra_files)
    assert a.mismatch(b) == "tensor model.norm.weight is F32 [64], the area has BF16 [64]"
    del t["model.norm.weight"]
    c = fs.AreaSpec(a.contract, a.digest, 1, 1, (fs.FileSpec(files[0].name, 1024, None, t),), a.extra_files)
    assert a.mismatch(c) == "tensor model.norm.weight is missing"
    assert c.mismatch(a) == "tensor model.norm.weight is not in the area"
    assert a.mismatch(fs.AreaSpec(a.contract, a.digest, 2, 1, a.files)).startswith("tp/ep 2/1")
    d = fs.AreaSpec(dict(a.contract, num_tensors=4), a.digest, 1, 1, a.files, a.extra_files)
    assert a.mismatch(d) == "the layout contract differs in num_tensors"


def test_commit_validation():
    spec = _spec()
    good = {"slot": 1, "version": 7, "digests": {"g00000-00.safetensors": "0" * 32}, "time": 5}
    c = fs.parse_commit(good, spec)
    assert (c.slot, c.version, c.time) == (1, 7, 5.0) and fs.next_slot(c) == 0 and fs.next_slot(None) == 0
    for bad, words in [
        (dict(good, slot=2), "slot"),
        (dict(good, slot=True), "slot"),
        (dict(good, version=0), "version"),
        (dict(good, digests={}), "exactly"),
        (dict(good, digests={"g00000-00.safetensors": "0" * 64}), "hex"),
        (dict(good, digests={"g00000-00.safetensors": "A" * 32}), "hex"),
        (dict(good, time="x"), "time"),
    ]:
        with pytest.raises(fs.StagingError, match=words):
            fs.parse_commit(bad, spec)


def test_read_area_v2_and_ranks(tmp_path):
    root = tmp_path / "a"
    spec = _spec(2, 2, ranked=True)
    with pytest.raises(fs.StagingError, match="not a staging area"):
        fs.read_area(root)
    root.mkdir()
    fs.write_json_atomic(root / fs.AREA_JSON, spec.to_json())
    assert fs.is_area(root)
    with pytest.raises(fs.StagingError, match="nothing committed yet"):
        fs.read_area(root)
    c = _write_area(root, spec, slot=1, version=3)
    assert oct(os.stat(root / fs.COMMIT_JSON).st_mode & 0o777) == "0o600"
    v = fs.read_area(root)
    assert (v.format, v.directory, v.slot, v.version, v.digest, v.tp, v.ep) == (
        fs.FORMAT_V2,
        root / "slot-1",
        1,
        3,
        "xxh3_128",
        2,
        2,
    )
    assert v.digests == c.digests and v.extra_files == ("config.json",) and v.contract == spec.contract
    assert [f.name for f in fs.files_for_rank(v, 1, 0)] == ["g00000-00.safetensors", "g00001-tp1-ep0-00.safetensors"]
    assert [f.name for f in fs.files_for_rank(v, 0, 1)] == ["g00000-00.safetensors", "g00001-tp0-ep1-00.safetensors"]
    with pytest.raises(fs.StagingError, match="outside the staging area's tp=2 ep=2"):
        fs.files_for_rank(v, 2, 0)
    assert v.lock_path == root / "slot-1" / ".lock"


def test_read_area_refuses_links_and_others(tmp_path):
    root = tmp_path / "a"
    _write_area(root, _spec())
    (tmp_path / "c.json").write_text((root / fs.COMMIT_JSON).read_text())
    os.unlink(root / fs.COMMIT_JSON)
    os.symlink(tmp_path / "c.json", root / fs.COMMIT_JSON)
    with pytest.raises(fs.StagingError, match="symbolic link"):
        fs.read_area(root)
    os.unlink(root / fs.COMMIT_JSON)
    (root / fs.COMMIT_JSON).write_text("{not json")
    with pytest.raises(fs.StagingError, match="not valid JSON"):
        fs.read_area(root)


def _v1_manifest(ranks=False):
    files = {
        "g00000-00.safetensors": {"size": 1024, "sha256": "a" * 64},
        "config.json": {"size": 10, "sha256": "b" * 64},
    }
    tensors = {
        "w": {
            "file": "g00000-00.safetensors",
            "offset": 256,
            "nbytes": 512,
            "dtype": "BF16",
            "shape": [4, 64],
            "group": 0,
        }
    }
    if ranks:
        files["g00000-00.safetensors"]["rank"] = [1, 0]
    body = {
        "format": "qconvert-staging/1",
        "name": "n",
        "source": "",
        "created": 0,
        "alignment": 256,
        "contract": {"num_tensors": 1},
        "files": files,
        "tensors": tensors,
    }
    if ranks:
        body["tp"] = 2
    return dict(body, manifest_sha256=fs.manifest_digest_v1(body))


def test_read_area_v1(tmp_path):
    root = tmp_path / "v1"
    root.mkdir()
    (root / fs.MANIFEST_V1).write_text(json.dumps(_v1_manifest()))
    v = fs.read_area(root)
    assert (v.format, v.directory, v.digest, v.slot, v.tp, v.ep) == (fs.FORMAT_V1, root, "sha256", None, 1, 1)
    assert [f.name for f in v.files] == ["g00000-00.safetensors"] and v.extra_files == ("config.json",)
    assert v.files[0].tensors["w"] == fs.TensorSpec("BF16", (4, 64), 256) and v.files[0].rank is None
    assert v.digests["g00000-00.safetensors"] == "a" * 64
    with fs.committed(root) as w:  # no locks for v1
        assert w == v
    (root / fs.MANIFEST_V1).write_text(json.dumps(_v1_manifest(ranks=True)))
    v = fs.read_area(root)
    assert v.tp == 2 and fs.files_for_rank(v, 0, 0) == [] and len(fs.files_for_rank(v, 1, 0)) == 1
    m = _v1_manifest()
    m["contract"]["num_tensors"] = 2  # edited after the checksum
    (root / fs.MANIFEST_V1).write_text(json.dumps(m))
    with pytest.raises(fs.StagingError, match="manifest checksum mismatch"):
        fs.read_area(root)


def _hold(root, slot, shared, ready, release):
    lock = fs.SlotLock(root, slot, shared=shared, wait_s=5)
    ready.set()
    release.wait(10)
    lock.release()


def test_slot_locks_between_processes(tmp_path):
    root = tmp_path / "a"
    _write_area(root, _spec(), slot=0)
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(root, 0, True, ready, release))  # a server reading slot 0
    p.start()
    try:
        assert ready.wait(10)
        with fs.SlotLock(root, 1, shared=False, wait_s=1):  # the other slot is free for the writer
            pass
        with fs.SlotLock(root, 0, shared=True, wait_s=1):  # readers share
            pass
        with pytest.raises(fs.StagingError, match="slot 0 is held by a server reading it") as e:
            fs.SlotLock(root, 0, shared=False, wait_s=0.2)
        assert str(root) in str(e.value)
    finally:
        release.set()
        p.join(10)
    with fs.SlotLock(root, 0, shared=False, wait_s=1):
        pass


def test_committed_rereads_after_a_concurrent_commit(tmp_path, monkeypatch):
    """A writer commits slot 1 between the reader's first read and its lock: the reader follows it."""
    root = tmp_path / "a"
    spec = _spec()
    _write_area(root, spec, slot=0, version=1)
    real = fs.SlotLock.__init__
    calls = []

    def racing(self, r, slot, **kw):
        if not calls:
            fs.write_json_atomic(root / fs.COMMIT_JSON, fs.Commit(1, 2, {spec.files[0].name: "1" * 32}, 1.0).to_json())
        calls.append(slot)
        real(self, r, slot, **kw)

    monkeypatch.setattr(fs.SlotLock, "__init__", racing)
    with fs.committed(root) as v:
        assert (v.slot, v.version) == (1, 2)
    assert calls == [0, 1]


def test_write_json_atomic_leaves_old_on_failure(tmp_path):
    p = tmp_path / "commit.json"
    fs.write_json_atomic(p, {"v": 1})
    with pytest.raises(TypeError):
        fs.write_json_atomic(p, {"v": object()})
    assert json.loads(p.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["commit.json"]


def test_area_spec_is_parsed_again_only_when_area_json_changes(tmp_path):
    """read_area_spec keeps the last parse of an unchanged area.json (a refit after the first parses
    no tensor list) and reads it again when it was replaced, rewritten in place, or made a link."""
    root = tmp_path / "a"
    _write_area(root, _spec())
    first = fs.read_area_spec(root)
    assert fs.read_area_spec(root) is first and fs.read_area(root).files is first.files
    # replaced whole (write_json_atomic: a new inode): the new tensors are seen
    other = fs.AreaSpec(first.contract, first.digest, 1, 1, (fs.FileSpec(first.files[0].name, 2048, None, {}),))
    fs.write_json_atomic(root / fs.AREA_JSON, other.to_json())
    got = fs.read_area_spec(root)
    assert got is not first and got.files[0].size == 2048 and got.files[0].tensors == {}
    # rewritten in place with the same size: another modification time, so parsed again
    p = root / fs.AREA_JSON
    raw = p.read_text()
    assert '"size": 2048' in raw
    p.write_text(raw.replace('"size": 2048', '"size": 4096'))
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fs.read_area_spec(root).files[0].size == 4096
    # a link in its place is refused, not answered from the last parse
    (tmp_path / "x.json").write_text(p.read_text())
    os.unlink(p)
    os.symlink(tmp_path / "x.json", p)
    with pytest.raises(fs.StagingError, match="symbolic link"):
        fs.read_area_spec(root)
