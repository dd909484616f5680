"""`qconvert demo DST --seed N`: a second demo checkpoint for the README's hot-reload walkthrough,
with the same architecture, options, tensor names, dtypes and shapes as the first and other
weights (read back with the safetensors library), which the reload clients accept."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from qconvert.cli import main
from qconvert.client.compat import check_reload_compatible


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_demo_seed_gives_a_reloadable_second_checkpoint(tmp_path, arch):
    a, b = tmp_path / "demo", tmp_path / "demo-step1"
    r = CliRunner().invoke(main, ["demo", str(a), "--arch", arch])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["demo", str(b), "--arch", arch, "--seed", "1"])
    assert r.exit_code == 0, r.output
    assert "seed 1" in r.output
    qa, qb = a / "mxfp8-last1-bf16", b / "mxfp8-last1-bf16"
    check_reload_compatible(qa, qb)  # what `qconvert reload` checks before pausing a server
    assert json.loads((qa / "config.json").read_text()) == json.loads((qb / "config.json").read_text())
    ta, tb = _tensors(qa), _tensors(qb)
    assert {k: (v.dtype, v.shape) for k, v in ta.items()} == {k: (v.dtype, v.shape) for k, v in tb.items()}
    weights = [k for k in ta if k.endswith(".weight")]
    same = [k for k in weights if ta[k].view(-1).view(torch.uint8).equal(tb[k].view(-1).view(torch.uint8))]
    # every weight differs (norms are random too), quantized or kept in BF16
    assert weights and same == [], same[:5]
    # the default seed is the checkpoint the demo always made
    assert (a / "bf16" / "README.md").read_text().startswith("---\nlicense: apache-2.0")
    assert f"# qconvert demo model ({arch})\n" in (a / "bf16" / "README.md").read_text()
    assert f"# qconvert demo model ({arch}, seed 1)\n" in (b / "bf16" / "README.md").read_text()
