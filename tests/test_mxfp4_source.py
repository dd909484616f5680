"""MXFP4 (gpt-oss) sources (docs/formats.md#mxfp4-sources) on the built-in tiny gpt-oss-shaped
MXFP4 checkpoint: the decode against transformers' own gpt-oss dequantizer, the per-expert NVFP4
cast against ModelOpt's ``quantize_mxfp4_to_nvfp4_lossless``, the lossless MXFP8 cast, and the
one-line refusals (bad tensors named; the conversion itself refused because no engine loads gpt-oss
experts as NVFP4 or MXFP8, docs/formats.md#gpt-oss-quantized-forms)."""

from __future__ import annotations

import pytest
import torch
from conftest import have
from safetensors.torch import load_file
from test_hostile_convert import assert_one_line, cli

from qconvert.convert.demo import build_gpt_oss_mxfp4
from qconvert.convert.mxfp4_source import to_mxfp8, to_nvfp4
from qconvert.convert.numerics.mxfp4 import k_max_of, mxfp4_decode
from qconvert.errors import CheckpointError

DOC = "docs/formats.md#gpt-oss-quantized-forms"
GU = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"
# E2M1 code -> value (OCP MX table), for decoding NVFP4 outputs here
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(dir, tensors): exponents spread over 35 values, so some blocks fall outside NVFP4's 18-exponent window."""
    d = build_gpt_oss_mxfp4(tmp_path_factory.mktemp("gptoss") / "src", exponents=(-30, 4))
    return d, _tensors(d)


@pytest.fixture(scope="module")
def transformers_decode():
    if not have("transformers"):
        pytest.skip("transformers not installed")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return lambda b, s: convert_moe_packed_tensors(b, s, dtype=torch.float32)


@pytest.mark.parametrize("name", [GU, DOWN])
def test_decode_equals_transformers(gptoss, transformers_decode, name):
    _, t = gptoss
    b, s = t[name + "_blocks"], t[name + "_scales"]
    ours = mxfp4_decode(b.reshape(*b.shape[:2], -1), s)
    ref = transformers_decode(b, s)  # [E, K, N]: gpt-oss's BF16 orientation
    assert torch.equal(ours.transpose(1, 2), ref)


@pytest.mark.parametrize("name", [GU, DOWN])
def test_mxfp8_is_lossless(gptoss, transformers_decode, name):
    _, t = gptoss
    b, s = t[name + "_blocks"], t[name + "_scales"]
    q, e8 = to_mxfp8(name, b, s)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(e8, s)
    dec = q.float().view(*s.shape, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)
    assert torch.equal(dec.reshape(q.shape).transpose(1, 2), transformers_decode(b, s))


@pytest.mark.parametrize("name", [GU, DOWN])
def test_nvfp4_equals_modelopt_per_expert(gptoss, transformers_decode, name):
    if not have("modelopt"):
        pytest.skip("nvidia-modelopt not installed")
    from modelopt.torch.export.shard_cast_utils import quantize_mxfp4_to_nvfp4_lossless as cast

    _, t = gptoss
    b, s = t[name + "_blocks"], t[name + "_scales"]
    p, sc, s2, lossless = to_nvfp4(name, b, s)
    packed = b.reshape(*b.shape[:2], -1)
    for e in range(b.shape[0]):  # one k_max per expert: its gate and up rows share it
        rp, rs, rs2, n_blocks, n_lossless = cast(packed[e], s[e], k_max_of(s[e]), "cpu")
        assert torch.equal(p[e], rp.view(torch.uint8))
        assert torch.equal(sc[e].view(torch.uint8), rs.view(torch.uint8))
        assert s2[e].item() == rs2.item()
        assert int(lossless[e].sum()) == n_lossless and lossless[e].numel() == n_blocks
    assert lossless.any() and (~lossless).any()  # the fixture has both kinds
    # where lossless, the NVFP4 output decodes to exactly the source (transformers' decode)
    codes = torch.stack(((p & 0xF).long(), (p >> 4).long()), -1).reshape(*p.shape[:2], -1)
    vals = E2M1[codes].view(*sc.shape, 16) * (sc.to(torch.float64) * s2.double().view(-1, 1, 1)).unsqueeze(-1)
    dec = vals.reshape(codes.shape).view(*lossless.shape, 32)
    src = transformers_decode(b, s).transpose(1, 2).double().reshape(dec.shape)
    assert torch.equal(dec[lossless], src[lossless])


@pytest.mark.parametrize("cast", [to_mxfp8, to_nvfp4])
def test_nan_scale_byte_refused(gptoss, cast):
    _, t = gptoss
    s = t[GU + "_scales"].clone()
    s[2, 5, 1] = 0xFF
    with pytest.raises(CheckpointError) as ei:
        cast(GU, t[GU + "_blocks"], s)
    msg = str(ei.value)
    assert "\n" not in msg and GU + "_scales" in msg and "[2, 5, 1]" in msg and "0xFF" in msg


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8"])
def test_conversion_refused_naming_why(gptoss, tmp_path, scheme):
    src, _ = gptoss
    dst = tmp_path / "out"
    assert_one_line(
        cli(scheme, src, dst),
        1,
        "MXFP4",
        scheme.upper() if scheme == "nvfp4" else "MXFP8",
        DOC,
        "qconvert bf16 SRC DST",
    )
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    assert_one_line(cli(scheme, src, "--dry-run"), 1, DOC)


def _cut_scales(config, t):
    t[GU + "_scales"] = t[GU + "_scales"][..., :-1].contiguous()


def _odd_rows(config, t):
    t[GU + "_blocks"] = t[GU + "_blocks"][:, :-1].contiguous()
    t[GU + "_scales"] = t[GU + "_scales"][:, :-1].contiguous()


def _no_scales(config, t):
    del t[DOWN + "_scales"]


def _i32_scales(config, t):
    t[DOWN + "_scales"] = t[DOWN + "_scales"].to(torch.int32)


BAD = [  # (mutation, what the line names)
    (_cut_scales, (GU + "_scales", "[4, 128, 4]")),
    (_odd_rows, (GU + "_blocks", "127 rows", "intermediate_size")),
    (_no_scales, (DOWN + "_blocks", DOWN + "_scales")),
    (_i32_scales, (DOWN + "_scales", "I32")),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_mxfp4_source(tmp_path, case):
    mutate, needles = BAD[case]
    src = build_gpt_oss_mxfp4(tmp_path / "src", mutate=mutate)
    dst = tmp_path / "out"
    line = assert_one_line(cli("nvfp4", src, dst), 1, *needles)
    assert DOC not in line  # the bad tensor is named before the refusal
    assert not dst.exists()


def test_inspect_names_the_mxfp4_source(gptoss):
    src, _ = gptoss
    r = cli("inspect", src)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in r.stdout.splitlines() if " : " in ln}
    assert lines["format"].startswith("mxfp4 (gpt-oss dialect")
    engines = [ln for ln in r.stdout.splitlines() if ln.startswith("engine")]
    assert len(engines) == 2 and all(" yes " in ln for ln in engines)
