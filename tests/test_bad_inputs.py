"""Hostile and broken inputs through the CLI: each gets one line naming the problem, exit 1, and
DST (and any partial output) does not exist afterwards."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qconvert.cli import main
from qconvert.convert.demo import demo_config, demo_tensors, write_sharded
from qconvert.convert.resume import partial_dir


def tiny_config(**over):
    c = demo_config("qwen3")
    c.update(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=64,
    )
    c.update(over)
    return c


def make_model(d: Path, n_shards=1, config=None, mutate=None) -> Path:
    d.mkdir(parents=True)
    config = config or tiny_config()
    tensors = demo_tensors(config)
    if mutate:
        mutate(tensors)
    (d / "config.json").write_text(json.dumps(config))
    write_sharded(d, tensors, n_shards)
    return d


def raw_safetensors(path: Path, header, data: bytes = b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def run_cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    out = r.output  # click >= 8.2: stdout and stderr interleaved
    return r.exit_code, out, r.exception


def expect_error(src, dst, *needles, extra=()):
    code, out, exc = run_cli("mxfp8", src, dst, "--no-progress", *extra)
    assert code == 1, (code, out, exc)
    errs = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, out
    assert "Traceback" not in out
    for n in needles:
        assert n in errs[0], (n, errs[0])
    assert not Path(dst).exists()
    assert not partial_dir(Path(dst)).exists(), "input errors leave no partial output"
    return errs[0]


@pytest.fixture
def single(tmp_path):
    return make_model(tmp_path / "src")


def _header_of(path: Path):
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8 : 8 + n]), b[8 + n :]


# ---- safetensors bytes ----------------------------------------------------------------------


def test_truncated_safetensors(single, tmp_path):
    f = single / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    expect_error(single, tmp_path / "out", "model.safetensors", "truncated")


def test_header_length_larger_than_file(single, tmp_path):
    f = single / "model.safetensors"
    b = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(b) * 2) + b[8:])
    expect_error(single, tmp_path / "out", "model.safetensors", f"header length {len(b) * 2} exceeds the file size")


def test_file_shorter_than_8_bytes(single, tmp_path):
    (single / "model.safetensors").write_bytes(b"\x01\x02")
    expect_error(single, tmp_path / "out", "too short")


@pytest.mark.parametrize(
    "header,needle",
    [
        (b"{not json at all", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[1, 2, 3]", "not a JSON object"),
        ({"w.weight": [1, 2]}, "header entry is not an object"),
        ({"w.weight": {"dtype": "BF16", "shape": "32x32", "data_offsets": [0, 2048]}}, "is not a list of non-negative"),
        (
            {"w.weight": {"dtype": "BF16", "shape": [32, -1], "data_offsets": [0, 2048]}},
            "is not a list of non-negative",
        ),
        (
            {"w.weight": {"dtype": "BF16", "shape": [32, True], "data_offsets": [0, 2048]}},
            "is not a list of non-negative",
        ),
        ({"w.weight": {"dtype": "BF16", "shape": [32, 32], "data_offsets": ["0", 2048]}}, "not a valid [begin, end]"),
        ({"w.weight": {"dtype": "BF16", "shape": [32, 32], "data_offsets": [2048, 0]}}, "not a valid [begin, end]"),
        ({"w.weight": {"dtype": "Q4_K", "shape": [32, 32], "data_offsets": [0, 2048]}}, "unsupported dtype 'Q4_K'"),
        (
            {
                "__metadata__": {"format": 1},
                "w.weight": {"dtype": "BF16", "shape": [32, 32], "data_offsets": [0, 2048]},
            },
            "__metadata__ must map strings",
        ),
    ],
)
def test_header_not_json_or_wrong_types(tmp_path, header, needle):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config()))
    raw_safetensors(src / "model.safetensors", header, bytes(2048))
    expect_error(src, tmp_path / "out", "model.safetensors", needle)


@pytest.mark.parametrize(
    "second_offsets,needle",
    [
        ([1024, 3072], "overlap in the data section"),
        ([2048, 4096 + 2], "data ends at byte 4098 but the file holds 4096 data bytes"),
        ([10**12, 10**12 + 2048], "data ends at byte"),
    ],
)
def test_offsets_overlapping_or_outside_the_data(tmp_path, second_offsets, needle):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config(architectures=["Foo"])))
    raw_safetensors(
        src / "model.safetensors",
        {
            "a.weight": {"dtype": "BF16", "shape": [32, 32], "data_offsets": [0, 2048]},
            "b.weight": {"dtype": "BF16", "shape": [32, 32], "data_offsets": second_offsets},
        },
        bytes(4096),
    )
    expect_error(src, tmp_path / "out", needle)


def test_dtype_and_shape_inconsistent_with_byte_length(single, tmp_path):
    f = single / "model.safetensors"
    header, data = _header_of(f)
    name = "model.layers.0.self_attn.q_proj.weight"
    header[name]["dtype"] = "F32"  # same bytes, twice the itemsize
    raw_safetensors(f, header, data)
    expect_error(single, tmp_path / "out", name, "do not match dtype F32")


# ---- index ----------------------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path):
    return make_model(tmp_path / "src", n_shards=3)


def _edit_index(src: Path, fn):
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))


def test_index_references_a_missing_shard(sharded, tmp_path):
    victim = sorted(sharded.glob("*.safetensors"))[1]
    victim.unlink()
    expect_error(sharded, tmp_path / "out", victim.name, "is missing")


@pytest.mark.parametrize(
    "rel", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS", "./x/../../outside.safetensors"]
)
def test_index_entries_outside_src_are_refused(sharded, tmp_path, rel):
    # A perfectly valid shard waits outside SRC: reading it would make the conversion succeed.
    outside = tmp_path / "outside.safetensors"
    shutil.copy(sorted(sharded.glob("*.safetensors"))[0], outside)
    rel = str(outside) if rel == "ABS" else rel
    first = sorted(sharded.glob("*.safetensors"))[0].name
    _edit_index(sharded, lambda wm: wm.update({k: rel for k, v in wm.items() if v == first}))
    expect_error(sharded, tmp_path / "out", "refusing to read outside SRC")


def test_symlinked_shard_pointing_outside_src_is_refused(sharded, tmp_path):
    first = sorted(sharded.glob("*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(first, outside)
    first.symlink_to(outside)
    expect_error(sharded, tmp_path / "out", first.name, "resolves outside")


def test_symlinked_extra_file_pointing_outside_src_is_refused(single, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not publish")
    (single / "tokenizer.json").symlink_to(secret)
    expect_error(single, tmp_path / "out", "tokenizer.json", "resolves outside")


def test_same_tensor_in_two_shards(sharded, tmp_path):
    a, b = sorted(sharded.glob("*.safetensors"))[:2]
    ha, da = _header_of(a)
    hb, db = _header_of(b)
    name, spec = next((k, v) for k, v in ha.items() if k != "__metadata__")
    # Append a copy of `name` to shard b.
    start = len(db)
    lo, hi = spec["data_offsets"]
    hb[name] = {**spec, "data_offsets": [start, start + hi - lo]}
    raw_safetensors(b, hb, db + da[lo:hi])
    expect_error(sharded, tmp_path / "out", name, "appears in both", a.name, b.name)


def test_index_lists_a_tensor_the_shard_lacks(sharded, tmp_path):
    _edit_index(sharded, lambda wm: wm.update({"model.layers.9.ghost.weight": next(iter(wm.values()))}))
    expect_error(sharded, tmp_path / "out", "model.layers.9.ghost.weight", "does not hold it")


def test_malformed_index(sharded, tmp_path):
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": 3}}')
    expect_error(sharded, tmp_path / "out", "malformed index")


# ---- values and model structure -------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value",
    [
        ("model.layers.0.mlp.down_proj.weight", float("nan")),  # quantized
        ("model.layers.1.self_attn.k_proj.weight", float("inf")),  # quantized
        ("model.layers.0.mlp.up_proj.weight", float("-inf")),  # quantized
        ("model.norm.weight", float("nan")),  # kept BF16
    ],
)
def test_non_finite_weight_refused_then_allowed_with_flag(tmp_path, name, value):
    def poison(t):
        t[name].view(-1)[7] = value

    src = make_model(tmp_path / "src", mutate=poison)
    expect_error(src, tmp_path / "out", name, "NaN or Inf", "--allow-non-finite")
    code, out, _ = run_cli("mxfp8", src, tmp_path / "ok", "--no-progress", "--allow-non-finite")
    assert code == 0, out
    manifest = json.loads((tmp_path / "ok" / "qconvert.json").read_text())
    assert manifest["non_finite_allowed"] is True


def test_finite_model_records_non_finite_not_allowed(single, tmp_path):
    code, out, _ = run_cli("mxfp8", single, tmp_path / "ok", "--no-progress")
    assert code == 0, out
    assert json.loads((tmp_path / "ok" / "qconvert.json").read_text())["non_finite_allowed"] is False


def test_weight_shape_contradicts_config(tmp_path):
    src = make_model(tmp_path / "src", config=tiny_config(intermediate_size=96))  # weights made for 96...
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 128  # ...but config.json says 128
    (src / "config.json").write_text(json.dumps(cfg))
    expect_error(
        src,
        tmp_path / "out",
        "mlp.",
        "has shape",
        "down_proj.weight",
        "has shape [64, 96] but config.json implies [64, 128]",
    )


def test_empty_model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config()))
    raw_safetensors(src / "model.safetensors", {"__metadata__": {"format": "pt"}})
    expect_error(src, tmp_path / "out", "holds no tensors")


def test_no_weights_at_all(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config()))
    expect_error(src, tmp_path / "out", "no .safetensors weights found")


def test_unknown_architecture_with_nothing_quantizable(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["MysteryNet"], "hidden_size": 48}))
    t = {
        "encoder.embed_tokens.weight": torch.zeros(64, 48, dtype=torch.bfloat16),
        "encoder.norm.weight": torch.ones(48, dtype=torch.bfloat16),
        "encoder.proj.weight": torch.zeros(16, 48, dtype=torch.bfloat16),
    }  # K=48: not a multiple of 32
    write_sharded(src, t, 1)
    expect_error(src, tmp_path / "out", "no tensor would be quantized")


def test_fused_3d_expert_tensor(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["SomeMoe"], "hidden_size": 64}))
    t = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 256, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.down_proj.weight": torch.zeros(4, 128, 64, dtype=torch.bfloat16),
    }
    write_sharded(src, t, 1)
    # an architecture qconvert does not know the engines' loader of (docs/formats.md#fused-expert-tensors)
    expect_error(src, tmp_path / "out", "fused expert tensor", "experts.gate_up_proj", "SomeMoe")


def test_already_quantized_config(single, tmp_path):
    cfg = json.loads((single / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (single / "config.json").write_text(json.dumps(cfg))
    expect_error(single, tmp_path / "out", "already quantized", "'fp8'")


def test_already_quantized_tensors(tmp_path):
    def to_fp8(t):
        n = "model.layers.0.mlp.up_proj.weight"
        t[n] = t[n].float().to(torch.float8_e4m3fn)

    src = make_model(tmp_path / "src", mutate=to_fp8)
    expect_error(src, tmp_path / "out", "model.layers.0.mlp.up_proj.weight", "already quantized (F8_E4M3)")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_checkpoints_are_refused(tmp_path, name):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config()))
    marker = tmp_path / "pwned"

    class Evil:  # unpickling this would create `marker`
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (src / name).write_bytes(pickle.dumps({"w": Evil()}))
    expect_error(src, tmp_path / "out", name, "pickle checkpoints can execute code")
    assert not marker.exists()


def test_bad_source_and_config(tmp_path):
    expect_error(tmp_path / "nope", tmp_path / "out", "no such directory")
    f = tmp_path / "file"
    f.write_text("x")
    expect_error(f, tmp_path / "out", "must be a checkpoint directory")
    src = tmp_path / "src"
    src.mkdir()
    expect_error(src, tmp_path / "out", "config.json: missing")
    (src / "config.json").write_text("{oops")
    expect_error(src, tmp_path / "out", "config.json: not valid JSON")


# ---- destination ----------------------------------------------------------------------------


def test_existing_dst_without_force(single, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, out, _ = run_cli("mxfp8", single, dst, "--no-progress")
    assert code == 1 and "already exists" in out and "--force" in out
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    code, out, _ = run_cli("mxfp8", single, dst, "--no-progress", "--force")
    assert code == 0 and (dst / "qconvert.json").exists() and not (dst / "keep.txt").exists()


def test_dst_parent_missing(single, tmp_path):
    expect_error(single, tmp_path / "no" / "out", "parent directory of DST does not exist")


def test_dry_run_writes_nothing(single, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, _ = run_cli("mxfp8", single, tmp_path / "out", "--dry-run")
    assert code == 0 and "model.layers.0.mlp.down_proj" in out and "plan:" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _mount_tmpfs(where: Path, opts: str) -> bool:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def _umount(where: Path):
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_dst_parent_read_only(single, tmp_path):
    mnt = tmp_path / "ro"
    if not _mount_tmpfs(mnt, "ro,size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        expect_error(single, mnt / "out", str(mnt), "not writable")
    finally:
        _umount(mnt)


def test_dst_on_a_full_filesystem(single, tmp_path):
    mnt = tmp_path / "full"
    if not _mount_tmpfs(mnt, "size=64k"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        code, out, exc = run_cli("mxfp8", single, mnt / "out", "--no-progress")
        assert code == 1, (out, exc)
        errs = [ln for ln in out.splitlines() if ln.startswith("error: ")]
        assert len(errs) == 1 and "No space left on device" in errs[0] and "--resume" in errs[0], out
        assert not (mnt / "out").exists()
        # The finished shards (none fit here) are kept for --resume; deleting them frees the space.
        assert partial_dir(mnt / "out").is_dir()
    finally:
        _umount(mnt)
