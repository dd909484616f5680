"""Shared-memory staging area: layout, alignment, permissions, checksums, refusals, CLI."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from qconvert.client import staging
from qconvert.client.staging import StagingError, open_area, stage_checkpoint


@pytest.fixture(autouse=True)
def shm_root(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(root))
    return root


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _check_offsets(d: Path) -> tuple[int, int]:
    """(tensors, those under 256 bytes) of the area ``d``'s files, each offset checked from the raw
    headers: a multiple of 256, or under 256 bytes at a multiple of its element size after every
    aligned tensor of its file."""
    sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1, "F8_E8M0": 1, "I32": 4}
    n_all = n_tiny = 0
    for f in d.glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        hdr = json.loads(raw[8 : 8 + n])
        last_aligned = 0
        tiny = []
        for name, spec in hdr.items():
            if name == "__metadata__":
                continue
            a, b = spec["data_offsets"]
            n_all += 1
            if b - a < 256 and (b - a) % 256:
                assert (8 + n + a) % sizes[spec["dtype"]] == 0, (f.name, name)
                tiny.append(a)
                n_tiny += 1
            else:
                assert (8 + n + a) % 256 == 0, (f.name, name)
                last_aligned = max(last_aligned, a)
        assert all(a > last_aligned for a in tiny) or not last_aligned, f.name
    return n_all, n_tiny


def test_stage_roundtrip_alignment_modes(demo_moe, shm_root):
    area = stage_checkpoint(demo_moe, "moe")
    # same tensors, same bytes, read by the safetensors library (what vLLM/SGLang use)
    src, got = _all_tensors(demo_moe), _all_tensors(area.path)
    assert src.keys() == got.keys()
    for k in src:
        assert src[k].dtype == got[k].dtype and torch.equal(src[k].view(torch.uint8), got[k].view(torch.uint8)), k
    # every tensor starts at a 256-byte file offset, or one under 256 bytes (q/k norms) at a
    # multiple of its element size after the aligned ones (checked from the raw headers)
    assert _check_offsets(area.path) == (len(src), 8)  # q_norm and k_norm of 4 layers
    # every tensor of a layer in one group, groups in layer order
    idx = json.loads((area.path / "model.safetensors.index.json").read_text())["weight_map"]
    layer_groups: dict[int, set[str]] = {}
    for name, fname in idx.items():
        if (layer := staging.layer_of(name)) is not None:
            layer_groups.setdefault(layer, set()).add(fname.split("-")[0])
    assert all(len(g) == 1 for g in layer_groups.values()), layer_groups
    order = [layer_groups[k].pop() for k in sorted(layer_groups)]
    assert order == sorted(order)
    # permissions
    assert stat.S_IMODE(os.stat(area.path).st_mode) == 0o700
    for p in area.path.iterdir():
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    assert (area.path / "config.json").read_text() == (demo_moe / "config.json").read_text()
    assert (area.path / "tokenizer.json").is_file()
    again = open_area("moe")
    assert again.manifest["manifest_sha256"] == area.manifest["manifest_sha256"]


def test_refuses_modified_data(demo_dense):
    area = stage_checkpoint(demo_dense, "d")
    f = sorted(area.path.glob("g*.safetensors"))[1]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(StagingError, match="checksum mismatch"):
        open_area("d")


def test_refuses_truncated_file(demo_dense):
    area = stage_checkpoint(demo_dense, "d")
    f = sorted(area.path.glob("g*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(StagingError, match="truncated"):
        open_area("d")


def test_refuses_edited_manifest(demo_dense):
    area = stage_checkpoint(demo_dense, "d")
    m = area.path / staging.MANIFEST
    man = json.loads(m.read_text())
    man["contract"]["quantization_config"] = {"quant_method": "mxfp8"}
    m.write_text(json.dumps(man))
    os.chmod(m, 0o600)
    with pytest.raises(StagingError, match="manifest checksum mismatch"):
        open_area("d")


def test_refuses_loose_permissions_and_extra_files(demo_dense):
    area = stage_checkpoint(demo_dense, "d")
    f = sorted(area.path.glob("g*.safetensors"))[0]
    os.chmod(f, 0o644)
    with pytest.raises(StagingError, match="mode 0o644"):
        open_area("d")
    os.chmod(f, 0o600)
    (area.path / "evil.safetensors").write_bytes(b"x")
    os.chmod(area.path / "evil.safetensors", 0o600)
    with pytest.raises(StagingError, match="extra"):
        open_area("d")


def test_refuses_other_layout_contract(demo_dense, demo_moe, tmp_path):
    area = stage_checkpoint(demo_dense, "d")
    with pytest.raises(StagingError, match="layout contract differs"):
        open_area("d", expected_contract=staging.checkpoint_contract(demo_moe))
    # a converted (MXFP8) checkpoint differs in quantization_config and tensors
    from qconvert.convert.pipeline import ConvertOptions, convert

    q = tmp_path / "q"
    convert(str(demo_dense), q, "mxfp8", ConvertOptions(scheme="mxfp8", fsync=False, progress=False))
    with pytest.raises(StagingError) as ei:
        open_area("d", expected_contract=staging.checkpoint_contract(q))
    assert "quantization_config" in str(ei.value) and "tensors_sha256" in str(ei.value)
    assert open_area("d", expected_contract=staging.checkpoint_contract(demo_dense)).name == "d"
    assert area.contract == staging.checkpoint_contract(demo_dense)


def test_partial_area_never_visible(demo_dense, shm_root, monkeypatch):
    calls = {"n": 0}
    orig = staging.StagingWriter.add_group

    def boom(self, tensors, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed mid-staging")
        return orig(self, tensors, **kw)

    monkeypatch.setattr(staging.StagingWriter, "add_group", boom)
    with pytest.raises(RuntimeError):
        stage_checkpoint(demo_dense, "p")
    assert not (shm_root / "p").exists()
    assert [p.name for p in shm_root.iterdir()] == []


def test_bad_names_refused():
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(StagingError):
            staging.drop_area(bad)


def test_cli_stage_list_drop(demo_dense, shm_root):
    from qconvert.cli.reload import stage

    r = CliRunner().invoke(stage, [str(demo_dense), "dense"])
    assert r.exit_code == 0, r.output
    assert "256-byte aligned" in r.output
    r = CliRunner().invoke(stage, ["--list"])
    assert r.exit_code == 0 and r.output.startswith("dense\t")
    r = CliRunner().invoke(stage, ["--drop", "dense"])
    assert r.exit_code == 0 and not (shm_root / "dense").exists()
    r = CliRunner().invoke(stage, ["--drop", "dense"])
    assert r.exit_code == 1 and "no staging area 'dense'" in r.output


def test_staged_files_open_with_safetensors_mmap(demo_dense):
    area = stage_checkpoint(demo_dense, "d")
    f = sorted(area.path.glob("g*.safetensors"))[0]
    with safe_open(f, framework="pt") as h:
        assert list(h.keys())


def test_cli_stage_subcommands(demo_dense, shm_root):
    """``stage create|list|drop``, subcommands as ``reload`` has (the flag forms above still work)."""
    from qconvert.cli import main

    r = CliRunner().invoke(main, ["stage", "create", str(demo_dense), "dense"])
    assert r.exit_code == 0, r.output
    assert "256-byte aligned" in r.output
    r = CliRunner().invoke(main, ["stage", "list"])
    assert r.exit_code == 0 and r.output.startswith("dense\t")
    r = CliRunner().invoke(main, ["stage", "drop", "dense"])
    assert r.exit_code == 0 and r.output == "dropped dense\n" and not (shm_root / "dense").exists()
    r = CliRunner().invoke(main, ["stage", "drop", "dense"])
    assert r.exit_code == 1 and "no staging area 'dense'" in r.output and "`qconvert stage list`" in r.output


@pytest.mark.parametrize("align", [8, 256])
def test_one_header_writer_any_alignment(tmp_path, align):
    """``safetensors_io.header_bytes`` (the converter's shards: 8; staging areas: 256): data starts
    at a multiple of ``align``, and safetensors' own reader gives back every tensor, metadata
    included, whatever the header length before padding."""
    from qconvert.convert.safetensors_io import DTYPES, TORCH_TO_TAG, header_bytes

    g = torch.Generator().manual_seed(align)
    for extra in range(align + 1):  # every padding length
        ts = {
            "a" * (1 + extra): torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "b": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
            "c": torch.randn((), generator=g),
        }
        specs = [
            (n, TORCH_TO_TAG[t.dtype], tuple(t.shape), t.numel() * DTYPES[TORCH_TO_TAG[t.dtype]][1])
            for n, t in ts.items()
        ]
        head, offs = header_bytes(specs, {"format": "pt", "k": "v"}, align)
        assert len(head) % align == 0
        assert offs == [0, 30, 37]
        p = tmp_path / f"x{extra}.safetensors"
        p.write_bytes(head + b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in ts.values()))
        with safe_open(p, "pt") as f:
            assert f.metadata() == {"format": "pt", "k": "v"}
            for n, t in ts.items():
                got = f.get_tensor(n)
                assert got.dtype == t.dtype and torch.equal(
                    got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                )


def test_scalars_share_their_layers_file(demo_moe, tmp_path, shm_root):
    """An NVFP4 MoE checkpoint's per-expert scalar scales (4 bytes each) sit after the aligned
    tensors of their layer's file, not each in a file of its own (docs/reload.md#staging-area-format):
    one file per layer, bytes unchanged, the area readable."""
    from qconvert.convert.pipeline import ConvertOptions, convert

    q = tmp_path / "q"
    convert(str(demo_moe), q, "nvfp4", ConvertOptions(scheme="nvfp4", fsync=False, progress=False))
    area = stage_checkpoint(q, "nv")
    want, got = _all_tensors(q), _all_tensors(area.path)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k].reshape(-1).view(torch.uint8), got[k].reshape(-1).view(torch.uint8)) for k in want)
    n, tiny = _check_offsets(area.path)
    assert n == len(want) and tiny >= 3 * 8 * 4, tiny  # gate/up/down scale_2 of 8 experts, 4 layers
    files = {json.loads((area.path / "model.safetensors.index.json").read_text())["weight_map"][k] for k in want}
    layers = {staging.layer_of(k) for k in want} - {None}
    assert len(files) <= len(layers) + 2, sorted(files)  # a file per layer, the embeddings and the rest
    assert open_area("nv").manifest["tensors"].keys() == want.keys()
