"""Trainer-side refit: staged bytes equal the converter's output for the same weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import shm_dir
from safetensors.torch import load_file

from qconvert.client import staging
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import QConvertError
from qconvert.formats import staging as fs
from qconvert.trainer.refit import Refitter, stage_refit


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _trainer_stream(src: Path, seed: int = 0):
    """Layer order (as a trainer walks its modules), shuffled inside each layer."""
    t = _tensors(src)
    groups: dict = {}
    for n in t:
        groups.setdefault(staging.group_key(n), []).append(n)
    rng = random.Random(seed)
    for k in sorted(groups):
        names = groups[k]
        rng.shuffle(names)
        for n in names:
            yield n, t[n]


CASES = [
    ("mxfp8", {}, PlanOptions(last_n_bf16=1)),
    ("mxfp8", {"dialect": "modelopt"}, PlanOptions(first_n_bf16=1)),
    ("nvfp4", {}, PlanOptions(last_n_bf16=1)),
]


@pytest.mark.parametrize("scheme,extra,plan", CASES, ids=["mxfp8-last1", "mxfp8-modelopt-first1", "nvfp4-last1"])
@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_refit_bytes_equal_converter(arch, scheme, extra, plan, demo_moe, demo_dense, tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(shm_dir(tmp_path)))
    src = demo_moe if arch == "moe" else demo_dense
    opts = ConvertOptions(scheme=scheme, plan=plan, fsync=False, progress=False, **extra)
    dst = tmp_path / "converted"
    try:
        convert(str(src), dst, scheme, opts)
    except QConvertError as e:  # a scheme/dialect the converter does not offer in this tree
        pytest.skip(f"converter: {e}")
    res = stage_refit(
        _trainer_stream(src),
        reference=src,
        stage_name="r",
        options=ConvertOptions(scheme=scheme, plan=plan, progress=False, **extra),
    )
    want, got = _tensors(dst), _tensors(res.area.path)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape, k
        assert torch.equal(want[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)), k
    cw = json.loads((dst / "config.json").read_text())
    cg = json.loads((res.area.root / "config.json").read_text())
    assert cw == cg
    for extra_file in dst.glob("*.json"):
        if extra_file.name not in ("qconvert.json", "model.safetensors.index.json"):
            assert (res.area.root / extra_file.name).is_file(), extra_file.name
    # and the staging area's contract is the converted checkpoint's
    assert fs.read_area(res.area.root).contract == staging.checkpoint_contract(dst)


def test_refit_layer_complete_before_staging(demo_dense, tmp_path, monkeypatch):
    """Each layer group is quantized and written once, only when all of a layer's tensors arrived."""
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(shm_dir(tmp_path)))
    seen = []
    orig = Refitter._write_group

    def spy(self, key):
        seen.append(({staging.layer_of(n) for n in self._buffers[key]}, set(self._buffers[key]) == self._need[key]))
        return orig(self, key)

    monkeypatch.setattr(Refitter, "_write_group", spy)
    res = stage_refit(_trainer_stream(demo_dense), reference=demo_dense, stage_name="r")
    assert all(complete for _, complete in seen)
    layers = [s.pop() for s, _ in seen if s != {None}]
    assert (
        layers == sorted(set(layers))
        and len(layers) == json.loads((demo_dense / "config.json").read_text())["num_hidden_layers"]
    )
    assert res.tensors_in == len(_tensors(demo_dense))


def test_refit_refuses_missing_and_foreign_tensors(demo_dense, tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(shm_dir(tmp_path)))
    items = list(_trainer_stream(demo_dense))
    with pytest.raises(QConvertError, match="never arrived"):
        stage_refit(items[:-1], reference=demo_dense, stage_name="r")
    with pytest.raises(QConvertError, match="not in the reference"):
        stage_refit(items + [("model.extra.weight", torch.zeros(2))], reference=demo_dense, stage_name="r")
    bad = [(n, t.float()) if i == 0 else (n, t) for i, (n, t) in enumerate(items)]
    with pytest.raises(QConvertError, match="the reference has"):
        stage_refit(bad, reference=demo_dense, stage_name="r")
    with pytest.raises(QConvertError, match="nothing committed yet"):  # the area exists, no version in it
        fs.read_area(shm_dir(tmp_path) / "r")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refit_cuda_equals_cpu(demo_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(shm_dir(tmp_path)))
    a = stage_refit(_trainer_stream(demo_moe), reference=demo_moe, stage_name="cpu")
    cuda_stream = ((n, t.cuda()) for n, t in _trainer_stream(demo_moe))
    b = stage_refit(
        cuda_stream, reference=demo_moe, stage_name="cuda", options=ConvertOptions(device="cuda", progress=False)
    )
    ta, tb = _tensors(a.area.path), _tensors(b.area.path)
    assert all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)
