"""The one checkpoint-directory reader (``checkpoint.open_checkpoint``), strict and lenient, on
adversarial directories: what each mode accepts, which problem codes it reports, and that every
refusal is one line naming the file. Shards are written by the ``safetensors`` library itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qconvert.convert import checkpoint as C
from qconvert.errors import CheckpointError, QConvertError
from qconvert.inspect import read_checkpoint


def _shard(p: Path, names: list[str]):
    save_file({n: torch.full((2, 4), float(i), dtype=torch.bfloat16) for i, n in enumerate(names)}, str(p))


def _ckpt(root: Path, shards: dict[str, list[str]], index: dict | None | bool = True) -> Path:
    """``shards``: file name -> tensor names; ``index``: True = the consistent one, a dict = its
    weight_map as given, None/False = no index."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["Foo"], "hidden_size": 4}))
    for f, names in shards.items():
        _shard(root / f, names)
    if index is True:
        index = {n: f for f, names in shards.items() for n in names}
    if index:
        (root / C.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return root


def codes(ck) -> list[str]:
    return sorted(p.code for p in ck.problems)


def refused(root: Path, strict: bool, *needles: str) -> str:
    with pytest.raises(CheckpointError) as ei:
        C.open_checkpoint(root, strict=strict)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


SHARDS = {"a.safetensors": ["x.weight", "y.weight"], "b.safetensors": ["z.weight"]}


@pytest.mark.parametrize("strict", [True, False])
def test_consistent_sharded_checkpoint(tmp_path, strict):
    ck = C.open_checkpoint(_ckpt(tmp_path / "m", SHARDS), strict=strict)
    assert ck.problems == []
    assert [h.path.name for h in ck.shards] == ["a.safetensors", "b.safetensors"]
    assert ck.shard_of == {"x.weight": "a.safetensors", "y.weight": "a.safetensors", "z.weight": "b.safetensors"}
    assert ck.tensors["z.weight"].shape == (2, 4) and ck.tensors["z.weight"].dtype == "BF16"
    assert ck.total_bytes == 3 * 2 * 4 * 2
    assert ck.config == {"architectures": ["Foo"], "hidden_size": 4}
    assert ck.manifest is None and ck.hf_quant_config is None and ck.layout is None


@pytest.mark.parametrize(
    "case,code,needle",
    [
        # the index lists a tensor its shard does not hold
        ("ghost", "index-missing-tensor", "'ghost.weight' listed in a.safetensors but that shard does not hold it"),
        # the index names the wrong shard
        ("moved", "index-wrong-shard", "'x.weight' listed in b.safetensors but stored in a.safetensors"),
        # a shard holds a tensor the index does not list
        ("unlisted_tensor", "not-in-index", "'y.weight' in a.safetensors is not in the index"),
        # the same tensor in two shards
        ("duplicate", "duplicate", "'x.weight' appears in both a.safetensors and b.safetensors"),
    ],
)
def test_index_inconsistencies_strict_raises_lenient_collects(tmp_path, case, code, needle):
    shards = {k: list(v) for k, v in SHARDS.items()}
    wmap = {n: f for f, names in shards.items() for n in names}
    if case == "ghost":
        wmap["ghost.weight"] = "a.safetensors"
    elif case == "moved":
        wmap["x.weight"] = "b.safetensors"
    elif case == "unlisted_tensor":
        del wmap["y.weight"]
    elif case == "duplicate":
        shards["b.safetensors"].append("x.weight")
    root = _ckpt(tmp_path / "m", shards, wmap)
    ck = C.open_checkpoint(root, strict=False)
    assert codes(ck) == [code]
    assert needle in ck.problems[0]
    assert refused(root, True, needle) == ck.problems[0]


def test_extra_shard_not_in_index_is_a_problem_in_both_modes_and_fatal_in_neither(tmp_path):
    root = _ckpt(tmp_path / "m", SHARDS)
    _shard(root / "stray.safetensors", ["w.weight"])
    for strict in (True, False):
        ck = C.open_checkpoint(root, strict=strict)
        assert codes(ck) == ["unlisted-shard"] and "stray.safetensors" in ck.problems[0]
        assert "w.weight" not in ck.tensors and len(ck.shards) == 2  # engines do not load it either


def test_several_shards_without_index(tmp_path):
    root = _ckpt(tmp_path / "m", SHARDS, index=None)
    ck = C.open_checkpoint(root, strict=False)
    assert codes(ck) == ["no-index"] and set(ck.tensors) == {"x.weight", "y.weight", "z.weight"}
    refused(root, True, "2 .safetensors files but no model.safetensors.index.json")


def test_total_size_mismatch_is_reported_not_fatal(tmp_path):
    root = _ckpt(tmp_path / "m", SHARDS)
    idx = json.loads((root / C.INDEX_NAME).read_text())
    idx["metadata"]["total_size"] = 7
    (root / C.INDEX_NAME).write_text(json.dumps(idx))
    for strict in (True, False):
        ck = C.open_checkpoint(root, strict=strict)
        assert codes(ck) == ["total-size"] and "metadata.total_size 7 != 48" in ck.problems[0]


@pytest.mark.parametrize("strict", [True, False])
def test_shard_listed_but_missing(tmp_path, strict):
    root = _ckpt(tmp_path / "m", SHARDS)
    (root / "b.safetensors").unlink()
    refused(root, strict, "b.safetensors: shard listed in model.safetensors.index.json is missing")


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("what", ["config.json", C.INDEX_NAME])
@pytest.mark.parametrize(
    "raw,needle",
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"\xff\xfe", "not valid JSON")],
)
def test_bad_json(tmp_path, strict, what, raw, needle):
    root = _ckpt(tmp_path / "m", SHARDS)
    (root / what).write_bytes(raw)
    if what == C.INDEX_NAME:
        needle = "malformed index"
    refused(root, strict, str(root / what), needle)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("wmap", [{"x.weight": "../a.safetensors"}, {"x.weight": "/etc/passwd"}, {"x.weight": 3}])
def test_index_naming_a_file_outside_or_not_a_name(tmp_path, strict, wmap):
    root = _ckpt(tmp_path / "m", {"a.safetensors": ["x.weight"]}, wmap)
    msg = refused(root, strict, C.INDEX_NAME)
    assert "outside" in msg or "malformed index" in msg


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("victim", ["config.json", C.INDEX_NAME, "a.safetensors"])
def test_links_out_of_the_directory_are_refused(tmp_path, strict, victim):
    root = _ckpt(tmp_path / "m", SHARDS)
    outside = tmp_path / ("out-" + victim)
    os.replace(root / victim, outside)
    (root / victim).symlink_to(outside)
    refused(root, strict, str(root / victim), "resolves outside")


@pytest.mark.parametrize("strict", [True, False])
def test_link_inside_the_directory_is_read(tmp_path, strict):
    root = _ckpt(tmp_path / "m", SHARDS)
    (root / "real").mkdir()
    os.replace(root / "b.safetensors", root / "real" / "b.safetensors")
    (root / "b.safetensors").symlink_to(root / "real" / "b.safetensors")
    assert C.open_checkpoint(root, strict=strict).shard_of["z.weight"] == "b.safetensors"


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("victim", ["config.json", C.INDEX_NAME, "a.safetensors", C.MANIFEST_NAME])
def test_fifos_are_refused_without_blocking(tmp_path, strict, victim):
    root = _ckpt(tmp_path / "m", SHARDS)
    if os.path.exists(root / victim):
        (root / victim).unlink()
    os.mkfifo(root / victim)
    if victim == C.MANIFEST_NAME:  # read on first use only (convert never reads a source's manifest)
        ck = C.open_checkpoint(root, strict=strict)
        with pytest.raises(CheckpointError, match="is a FIFO"):
            ck.manifest
        return
    refused(root, strict, str(root / victim), "is a FIFO")


def test_manifest_missing_corrupt_and_layout(tmp_path):
    root = _ckpt(tmp_path / "m", SHARDS)
    assert C.read_manifest(root) is None and C.open_checkpoint(root, strict=False).manifest is None
    (root / C.MANIFEST_NAME).write_text("{oops")
    with pytest.raises(CheckpointError, match="qconvert.json: not valid JSON"):
        C.read_manifest(root)
    with pytest.raises(CheckpointError, match="qconvert.json: not valid JSON"):
        read_checkpoint(root)  # inspect / verify: a corrupt manifest is an error
    for strict in (True, False):  # read on first use: convert rewrites a source's manifest, never reads it
        ck = C.open_checkpoint(root, strict=strict)
        with pytest.raises(CheckpointError, match="qconvert.json: not valid JSON"):
            ck.manifest
    (root / C.MANIFEST_NAME).write_text(json.dumps(["not", "an", "object"]))
    with pytest.raises(CheckpointError, match="qconvert.json must be a JSON object"):
        C.read_manifest(root)
    lay = {"name": "flashinfer-trtllm", "engine": "vllm", "tp": 1, "ep": 1}
    (root / C.MANIFEST_NAME).write_text(json.dumps({"scheme": "mxfp8", "layout": lay}))
    assert C.manifest_layout(C.read_manifest(root)) == lay
    assert C.open_checkpoint(root, strict=False).layout == lay
    for no_layout in ({"scheme": "mxfp8"}, {"layout": {}}, {"layout": None}, {"layout": "x"}, None):
        assert C.manifest_layout(no_layout) is None


@pytest.mark.parametrize("strict", [True, False])
def test_no_weights(tmp_path, strict):
    root = _ckpt(tmp_path / "m", {}, index=None)
    refused(root, strict, "no .safetensors weights found")
    torch.save({"x": torch.zeros(1)}, root / "pytorch_model.bin")
    if strict:
        refused(root, True, "pytorch_model.bin", "pickle checkpoints can execute code")
    else:
        refused(root, False, "no .safetensors weights found")


def test_missing_config_and_not_a_directory(tmp_path):
    root = _ckpt(tmp_path / "m", SHARDS)
    (root / "config.json").unlink()
    for strict in (True, False):
        refused(root, strict, "config.json: missing")
        refused(root / "a.safetensors", strict, "not a checkpoint directory")


def test_empty_model_only_strict_refuses(tmp_path):
    root = _ckpt(tmp_path / "m", {"model.safetensors": []}, index=None)
    assert C.open_checkpoint(root, strict=False).tensors == {}
    refused(root, True, "holds no tensors")


def test_problem_is_its_text_and_pickles_with_its_code():
    import copy
    import pickle

    p = C.Problem("duplicate", "tensor 'x' appears in both a and b", "x")
    assert p == "tensor 'x' appears in both a and b" and json.dumps([p]) == "[\"tensor 'x' appears in both a and b\"]"
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert q == p and q.code == "duplicate" and q.subject == "x"


# ---- the entry points read through it -----------------------------------------------------------


def _layout_manifest(root: Path, lay=None):
    (root / C.MANIFEST_NAME).write_text(
        json.dumps({"scheme": "mxfp8", "layout": lay or {"name": "flashinfer-trtllm", "engine": "vllm"}})
    )


def test_staging_and_loader_read_the_manifest_guarded(tmp_path):
    from qconvert.client import staging
    from qconvert.engine import vllm_layout_loader as L

    root = _ckpt(tmp_path / "m", SHARDS)
    assert staging.read_layout(root) is None and L.read_layout(root) is None
    _layout_manifest(root)
    assert staging.read_layout(root) == L.read_layout(root) == {"name": "flashinfer-trtllm", "engine": "vllm"}
    outside = tmp_path / "elsewhere.json"
    os.replace(root / C.MANIFEST_NAME, outside)
    (root / C.MANIFEST_NAME).symlink_to(outside)  # read_layout used to follow it
    with pytest.raises(CheckpointError, match="resolves outside"):
        staging.read_layout(root)
    with pytest.raises(L.PreshuffledLoadError, match="unreadable qconvert manifest: .*resolves outside"):
        L.read_layout(root)
    (root / C.MANIFEST_NAME).unlink()
    os.mkfifo(root / C.MANIFEST_NAME)
    with pytest.raises(CheckpointError, match="is a FIFO"):
        staging.read_layout(root)


def test_loader_refuses_a_tensor_in_two_shards_by_its_code(tmp_path):
    from qconvert.engine import vllm_layout_loader as L

    root = _ckpt(
        tmp_path / "m",
        {"a.safetensors": ["x.weight"], "b.safetensors": ["x.weight", "z.weight"]},
        {"x.weight": "a.safetensors", "z.weight": "b.safetensors"},
    )
    with pytest.raises(L.PreshuffledLoadError, match="tensor x.weight appears in two shards"):
        L._checkpoint_entries(root)
    (root / "b.safetensors").unlink()
    _shard(root / "b.safetensors", ["z.weight"])
    assert sorted(L._checkpoint_entries(root)) == ["x.weight", "z.weight"]


@pytest.mark.parametrize("victim", ["config.json", "a.safetensors", C.MANIFEST_NAME, "hf_quant_config.json"])
def test_reload_compat_and_refit_read_guarded(tmp_path, victim):
    from qconvert.client.compat import check_reload_compatible
    from qconvert.client.staging import checkpoint_contract
    from qconvert.trainer.refit import reference_inventory

    a = _ckpt(tmp_path / "a", SHARDS)
    b = _ckpt(tmp_path / "b", SHARDS)
    check_reload_compatible(a, b)
    cfg, inv = reference_inventory(b)
    assert cfg["architectures"] == ["Foo"] and inv["z.weight"] == ("BF16", (2, 4))
    (b / victim).write_text("{}") if not (b / victim).exists() else None
    outside = tmp_path / ("out-" + victim)
    os.replace(b / victim, outside)
    (b / victim).symlink_to(outside)
    with pytest.raises(QConvertError, match="resolves outside"):
        check_reload_compatible(a, b)
    if victim in ("config.json", "a.safetensors"):
        with pytest.raises(QConvertError, match="resolves outside"):
            reference_inventory(b)
        with pytest.raises(QConvertError, match="resolves outside"):
            checkpoint_contract(b)
