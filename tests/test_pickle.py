"""--allow-pickle: .bin/.pt checkpoints are read with torch.load(weights_only=True) and convert to
exactly what their safetensors twin converts to; a pickle that would run code is still refused."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import torch
from click.testing import CliRunner
from test_convert_e2e import load_dir

from qconvert.cli import main
from qconvert.convert.demo import build_demo_model


def test_allow_pickle_equals_safetensors_conversion(tmp_path):
    st = build_demo_model(tmp_path / "st", arch="qwen3", n_shards=1)
    pk = tmp_path / "pk"
    shutil.copytree(st, pk)
    tensors, _ = load_dir(st)
    (pk / "model.safetensors").unlink()
    torch.save(tensors, pk / "pytorch_model.bin")
    r = CliRunner()
    res = r.invoke(main, ["mxfp8", str(pk), str(tmp_path / "refused"), "--no-progress"])
    assert res.exit_code == 1 and "--allow-pickle" in res.output and not (tmp_path / "refused").exists()
    assert r.invoke(main, ["mxfp8", str(st), str(tmp_path / "a"), "--no-progress"]).exit_code == 0
    res = r.invoke(main, ["mxfp8", str(pk), str(tmp_path / "b"), "--no-progress", "--allow-pickle"])
    assert res.exit_code == 0, res.output
    a, _ = load_dir(tmp_path / "a")
    b, _ = load_dir(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert json.loads((tmp_path / "b" / "qconvert.json").read_text())["source"]["id"] == str(pk)
    assert not any(p.name.startswith(".b.qconvert") for p in tmp_path.iterdir())  # temporary copy removed


def test_allow_pickle_still_refuses_code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Evil()}))
    res = CliRunner().invoke(main, ["mxfp8", str(src), str(tmp_path / "out"), "--no-progress", "--allow-pickle"])
    assert res.exit_code == 1 and "weights_only=True" in res.output
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.qconvert") for p in tmp_path.iterdir())
