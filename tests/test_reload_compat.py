"""check_reload_compatible: refuse hot reloads whose layout differs from the served checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qconvert.client.compat import ReloadIncompatible, check_reload_compatible
from qconvert.convert.demo import build_demo_model
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import QConvertError


def _mx(src, dst, dialect="auto", last_n_bf16=0):
    convert(
        str(src),
        dst,
        "mxfp8",
        ConvertOptions(
            scheme="mxfp8",
            dialect=dialect,
            plan=PlanOptions(scheme="mxfp8", last_n_bf16=last_n_bf16),
            progress=False,
            fsync=False,
        ),
    )
    return dst


def _nv(src, dst, dialect="modelopt", input_mode="weight-only"):
    convert(
        str(src),
        dst,
        "nvfp4",
        ConvertOptions(
            scheme="nvfp4",
            dialect=dialect,
            input_mode=input_mode,
            plan=PlanOptions(scheme="nvfp4"),
            progress=False,
            fsync=False,
        ),
    )
    return dst


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    a = build_demo_model(root / "a", arch="qwen3", seed=0)
    b = build_demo_model(root / "b", arch="qwen3", seed=1)
    return {
        "bf16_a": a,
        "bf16_b": b,
        "mx_a": _mx(a, root / "mx_a"),
        "mx_b": _mx(b, root / "mx_b"),
        "mx_a_mo": _mx(a, root / "mx_a_mo", dialect="modelopt"),
        "mx_a_last1": _mx(a, root / "mx_a_last1", last_n_bf16=1),
        "nv_a16": _nv(a, root / "nv_a16"),
        "nv_a4": _nv(a, root / "nv_a4", input_mode="unit"),
        "root": root,
    }


def _raises(served, new, *needles):
    with pytest.raises(ReloadIncompatible) as ei:
        check_reload_compatible(served, new)
    msg = str(ei.value)
    assert isinstance(ei.value, QConvertError)
    assert "\n" not in msg, msg
    assert str(new) in msg and str(served) in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_same_layout_other_values_is_compatible(ck):
    check_reload_compatible(ck["mx_a"], ck["mx_b"])  # A -> B
    check_reload_compatible(ck["mx_b"], ck["mx_a"])  # and back
    check_reload_compatible(ck["bf16_a"], ck["bf16_b"])
    check_reload_compatible(ck["mx_a"], ck["mx_a"])


def test_quant_method_and_algo_differ(ck):
    _raises(ck["bf16_a"], ck["mx_a"], "unquantized")
    _raises(ck["mx_a"], ck["bf16_a"], "unquantized")
    _raises(ck["mx_a"], ck["mx_a_mo"], "quant_method")  # mxfp8 vs modelopt
    _raises(ck["mx_a_mo"], ck["nv_a16"], "quant_algo", "'MXFP8'", "'W4A16_NVFP4'")


def test_activation_scheme_differs(ck):
    # W4A16 vs W4A4: ModelOpt names them apart (docs/formats.md#nvfp4-weight-only-quant_algo), as
    # do config_groups and the input_scale tensors
    _raises(ck["nv_a16"], ck["nv_a4"], "quant_algo", "'W4A16_NVFP4'", "'NVFP4'")


def test_bf16_layers_differ(ck):
    # last-N-BF16 changes the exclusion list: the message names an entry
    _raises(ck["mx_a"], ck["mx_a_last1"], "exclusion list", "model.layers.3.", "new checkpoint")
    _raises(ck["mx_a_last1"], ck["mx_a"], "exclusion list", "served checkpoint")


def test_per_module_format_from_manifest(ck, tmp_path):
    # same config, but qconvert.json says one module has another format
    new = tmp_path / "fmt"
    shutil.copytree(ck["mx_b"], new)
    man = json.loads((new / "qconvert.json").read_text())
    mod = "model.layers.1.self_attn.o_proj"
    assert man["tensors"][mod]["format"] == "mxfp8"
    man["tensors"][mod]["format"] = "bf16"
    (new / "qconvert.json").write_text(json.dumps(man))
    _raises(ck["mx_a"], new, mod, "mxfp8", "bf16")


def _rewrite_tensors(d, fn):
    for f in sorted(d.glob("*.safetensors")):
        sd = load_file(str(f))
        sd2 = fn(sd)
        if sd2 is not None:
            save_file(sd2, str(f), metadata={"format": "pt"})


def test_tensor_set_shape_dtype_differ(ck, tmp_path):
    name = "model.layers.2.mlp.down_proj.weight_scale"

    def drop(sd):
        if name in sd:
            return {k: v for k, v in sd.items() if k != name}

    def extra(sd):
        if name in sd:
            return {**sd, "model.layers.2.mlp.down_proj.input_scale": torch.ones(())}

    def reshape(sd):
        if name in sd:
            return {**sd, name: sd[name][:, :-1].contiguous()}

    def retype(sd):
        if name in sd:
            return {**sd, name: sd[name].view(torch.int8)}

    cases = [(drop, "missing from the new"), (extra, "not in the served"), (reshape, "U8"), (retype, "I8")]
    for fn, needle in cases:
        new = tmp_path / fn.__name__
        shutil.copytree(ck["mx_b"], new)
        _rewrite_tensors(new, fn)
        msg = _raises(ck["mx_a"], new, needle)
        assert "model.layers.2.mlp.down_proj." in msg, msg


def test_not_a_checkpoint(ck, tmp_path):
    with pytest.raises(QConvertError, match="config.json"):
        check_reload_compatible(ck["mx_a"], tmp_path)
