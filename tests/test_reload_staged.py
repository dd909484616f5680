"""Loading a staging area in a vLLM worker (qconvert/engine/vllm_staged.py, docs/reload.md#vllm-staged-load).

Unit checks (no server): every tensor the worker hands to vLLM is a view of the one mapping of its
file (zero copy) and equals what the safetensors library reads from the source checkpoint; a
version 2 area is read from its committed slot under that slot's shared lock (a writer cannot take
it meanwhile), with digests checked only when asked; a pre-shuffled checkpoint staged with TP 2
gives each server rank only its own expert files (docs/reload.md#per-rank-files).
A real vLLM CPU server (marked vllm): ``qconvert_load_staged`` changes the outputs and reloading
back restores them exactly, with the load statistics in the reload result.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qconvert.client import staging
from qconvert.engine import vllm_staged
from qconvert.formats import staging as fmt


@pytest.fixture()
def shm_root(tmp_path, monkeypatch):
    from conftest import shm_dir  # on /dev/shm with CUDA: registration needs tmpfs

    root = shm_dir(tmp_path)
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(root))
    return root


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _source_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The oracle: the safetensors library's own reader over the source checkpoint."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                out[k] = g.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def mxfp8_moe(tmp_path_factory):
    """The demo Qwen3-MoE converted to MXFP8 (F8_E4M3, F8_E8M0/U8 scales and BF16 tensors)."""
    from qconvert.convert.demo import build_demo_model
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    root = tmp_path_factory.mktemp("staged")
    src = build_demo_model(root / "bf16", arch="qwen3-moe", seed=0)
    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8", last_n_bf16=1), fsync=False, progress=False)
    return convert(str(src), root / "mxfp8", "mxfp8", opts) and root / "mxfp8"


def _load(area: Path, **kw) -> tuple[dict, dict[str, torch.Tensor], list]:
    """load_staged with a reload_weights that records what vLLM would get (copies, as vLLM's loaders do)."""
    got, ptrs = {}, []

    def reload_weights(weights):
        for name, t in weights:
            ptrs.append((name, t.data_ptr(), t.nbytes))
            got[name] = t.clone()

    stats = vllm_staged.load_staged(torch.nn.Module(), area, reload_weights, **kw)
    return stats, got, ptrs


def test_v1_views_are_the_mapping_and_equal_safetensors(mxfp8_moe, shm_root, monkeypatch):
    area = staging.stage_checkpoint(mxfp8_moe, "v1")
    want = _source_tensors(mxfp8_moe)
    # every tensor handed over lies inside its file's single mapping: no per-tensor copy
    spans = {}
    real_map = vllm_staged.map_file

    def spy(directory, spec):
        m = real_map(directory, spec)
        spans[spec.name] = (m.base.data_ptr(), m.base.data_ptr() + spec.size)
        return m

    monkeypatch.setattr(vllm_staged, "map_file", spy)
    stats, got, ptrs = _load(area.path)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(t)), name
    view = fmt.read_area(area.path)
    file_of = {n: f.name for f in view.files for n in f.tensors}
    for name, ptr, nbytes in ptrs:
        lo, hi = spans[file_of[name]]
        assert nbytes == 0 or lo <= ptr and ptr + nbytes <= hi, name
    assert stats["files"] == len(view.files) and stats["bytes"] == view.nbytes
    assert stats["tensors"] == len(want) and stats["format"] == fmt.FORMAT_V1
    assert stats["mappings_released"] is True


def _pieces_digest(data: bytes) -> str:
    """The xxh3_128-pieces-64MiB digest, from its definition (docs/reload.md#staging-area-format)."""
    import xxhash

    step = 64 << 20
    pieces = [data[a : a + step] for a in range(0, len(data), step)] or [b""]
    return xxhash.xxh3_128(b"".join(xxhash.xxh3_128(p).digest() for p in pieces)).hexdigest()


def test_pieces_digest_of_a_large_buffer():
    """Three pieces (64 MiB, 64 MiB, 1 byte), an exact multiple and an empty buffer: the reader's
    digest equals the definition computed with xxhash directly."""
    import numpy as np

    big = np.random.default_rng(5).integers(0, 256, (128 << 20) + 1, dtype=np.uint8).tobytes()
    for data in (big, big[: 128 << 20], big[:1000], b""):
        assert vllm_staged.file_digest(fmt.DIGEST_XXH3_PIECES, memoryview(data)) == _pieces_digest(data)
    assert _pieces_digest(big) != _pieces_digest(big[:-1] + bytes([big[-1] ^ 1]))


def _v2_from_v1(v1: Path, root: Path, kind: str = "xxh3_128") -> Path:
    """A committed version 2 area (slot 1) with v1's files, built with the contract module."""
    import xxhash

    view = fmt.read_area(v1)
    root.mkdir(mode=0o700)
    files, digests = [], {}
    for i, f in enumerate(view.files):
        new = fmt.FileSpec(fmt.file_name(i, 0), f.size, None, f.tensors)
        files.append(new)
        data = (v1 / f.name).read_bytes()
        digests[new.name] = xxhash.xxh3_128(data).hexdigest() if kind == "xxh3_128" else _pieces_digest(data)
        for k in fmt.SLOTS:
            fmt.slot_dir(root, k).mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(v1 / f.name, fmt.slot_dir(root, k) / new.name)
    shutil.copyfile(v1 / "config.json", root / "config.json")
    spec = fmt.AreaSpec(view.contract, kind, 1, 1, tuple(files), ("config.json",))
    fmt.write_json_atomic(root / fmt.AREA_JSON, spec.to_json())
    fmt.write_json_atomic(root / fmt.COMMIT_JSON, fmt.Commit(1, 7, digests, time.time()).to_json())
    return root


@pytest.mark.parametrize("kind", ["xxh3_128", "xxh3_128-pieces-64MiB"])
def test_v2_committed_slot_locked_and_verified_on_request(mxfp8_moe, shm_root, tmp_path, kind):
    v1 = staging.stage_checkpoint(mxfp8_moe, "v1").path
    v2 = _v2_from_v1(v1, tmp_path / "v2", kind)
    want = _source_tensors(mxfp8_moe)
    seen_lock = {}

    def reload_weights(weights):
        got = {n: t.clone() for n, t in weights}
        # while the worker reads slot 1 a writer cannot take it; the other slot is free
        with pytest.raises(fmt.StagingError, match="slot 1"):
            fmt.SlotLock(v2, 1, shared=False, wait_s=0.05)
        fmt.SlotLock(v2, 0, shared=False, wait_s=0.05).release()
        seen_lock["ok"] = True
        assert all(torch.equal(_bytes(got[n]), _bytes(t)) for n, t in want.items())

    stats = vllm_staged.load_staged(torch.nn.Module(), v2, reload_weights, verify=True, device_chunks=True)
    assert seen_lock["ok"] and stats["version"] == 7 and stats["slot"] == 1 and stats["verified"]
    assert stats["device_chunks"] is False  # a CPU model: host views, whatever is asked
    fmt.SlotLock(v2, 1, shared=False, wait_s=0.05).release()  # released after the load
    # a flipped byte in the committed slot: found with verify=True, nothing handed to vLLM
    victim = fmt.slot_dir(v2, 1) / fmt.file_name(1, 0)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    called = []
    with pytest.raises(vllm_staged.StagedLoadError, match=f"{victim.name} does not match its {kind} digest"):
        vllm_staged.load_staged(torch.nn.Module(), v2, lambda w: called.append(1), verify=True)
    assert not called
    # by default the digests are not recomputed (the writer made them from the same bytes)
    stats = vllm_staged.load_staged(torch.nn.Module(), v2, lambda w: [None for _ in w])
    assert stats["verified"] is False


def test_truncated_file_refused_before_loading(mxfp8_moe, shm_root):
    area = staging.stage_checkpoint(mxfp8_moe, "t").path
    f = sorted(area.glob("g*.safetensors"))[1]
    os.truncate(f, f.stat().st_size - 256)
    with pytest.raises(vllm_staged.StagedLoadError, match=f"{f.name}: .* bytes, the staging area says"):
        vllm_staged.load_staged(torch.nn.Module(), area, lambda w: pytest.fail("loaded"))


@pytest.fixture(scope="module")
def preshuffled_tp2(tmp_path_factory):
    """The demo Qwen3-MoE pre-shuffled for vLLM with TP 2 (BF16 experts, per-rank tensors)."""
    from click.testing import CliRunner

    from qconvert.cli import main
    from qconvert.convert.demo import build_demo_model

    root = tmp_path_factory.mktemp("tp2")
    src = build_demo_model(root / "bf16", arch="qwen3-moe", seed=0)
    res = CliRunner().invoke(
        main,
        [
            "bf16",
            str(src),
            str(root / "lay"),
            "--no-progress",
            "--layout",
            "flashinfer-trtllm",
            "--engine",
            "vllm",
            "--tp",
            "2",
            "--ep",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    return root / "lay"


def test_each_rank_reads_only_its_files(preshuffled_tp2, shm_root):
    area = staging.stage_checkpoint(preshuffled_tp2, "tp2").path
    view = fmt.read_area(area)
    assert (view.tp, view.ep) == (2, 1)
    every = _source_tensors(preshuffled_tp2)
    seen: dict[str, int] = {}
    for r in range(2):
        files = vllm_staged.select_files(view, 2, r, 1, 0)
        names = {n for f in files for n in f.tensors}
        for n in names:
            seen[n] = seen.get(n, 0) + 1
        own = {n for n in names if ".trtllm_" in n}
        assert own and all(f".trtllm_tp{r}_ep0." in n for n in own)
        assert {f.rank for f in files} == {None, (r, 0)}
        # the rank's files hold exactly the tensors a reader of the whole checkpoint would give it
        want = {n for n in every if ".trtllm_" not in n or f".trtllm_tp{r}_ep0." in n}
        assert names == want
        maps = [vllm_staged.map_file(view.directory, f) for f in files]
        for m in maps:
            for n in m.spec.tensors:
                assert torch.equal(_bytes(m.tensor(n)), _bytes(every[n])), n
        for m in maps:
            assert m.close()
    assert set(seen) == set(every)
    assert {n for n, k in seen.items() if k == 2} == {n for n in every if ".trtllm_" not in n}
    # a server whose MoE sizes differ from the staged ranks is refused, naming both
    with pytest.raises(vllm_staged.StagedLoadError, match="tp=2 ep=1.*tp=1 ep=2"):
        vllm_staged.select_files(view, 1, 0, 2, 1)
    # a plain area is read whole by every rank, whatever the server's sizes
    plain = fmt.read_area(staging.stage_checkpoint(preshuffled_tp2.parent / "bf16", "plain").path)
    assert vllm_staged.select_files(plain, 4, 3, 1, 0) == list(plain.files)
    # the manifest records the rank of each file
    man = json.loads((area / fmt.MANIFEST_V1).read_text())
    assert {
        tuple(f["rank"]) if f.get("rank") else None for n, f in man["files"].items() if n.endswith(".safetensors")
    } == {None, (0, 0), (1, 0)}


def _fake_vllm(extension: bool, calls: list):
    """tests/test_reload_clients.py's fake vLLM server; qconvert_* methods answer as vLLM 0.32 does
    with (a stats dict per worker) or without the worker extension ("is not implemented")."""
    from test_reload_clients import FakeServer, vllm_routes

    routes = vllm_routes({})
    orig = routes[("POST", "/collective_rpc")]

    def rpc(body, q, h):
        calls.append(body["method"])
        if body["method"].startswith("qconvert_"):
            if not extension:
                return 500, {
                    "error": {
                        "message": "Call to collective_rpc method failed: Worker failed with error "
                        f"'Method {body['method']!r} is not implemented.'"
                    }
                }
            if body["method"] == "qconvert_ping":
                return 200, {"results": ["qconvert-test"]}
            return 200, {
                "results": [{"files": 3, "area": body["kwargs"].get("area"), "verify": body["kwargs"].get("verify")}]
            }
        return orig(body, q, h)

    routes[("POST", "/collective_rpc")] = rpc
    return FakeServer(routes)


@pytest.mark.parametrize("extension", [True, False], ids=["extension", "stock"])
def test_client_picks_staged_rpc_or_stock_reload(demo_dense, shm_root, extension):
    """With the extension: one qconvert_load_staged with the area, its statistics in the result, no
    stock reload. Without: one ping answered "not implemented" (never asked again), then stock
    reload_weights of the committed directory."""
    from qconvert.client.vllm_client import reload_vllm

    area = staging.stage_checkpoint(demo_dense, "d").path
    calls: list = []
    srv = _fake_vllm(extension, calls)
    try:
        res = reload_vllm([srv.url], "shm:d", retries=0, weight_version="v")
    finally:
        srv.close()
    assert calls.count("qconvert_ping") <= 1
    if extension:
        assert calls == ["qconvert_ping", "qconvert_load_staged"]
        assert res[0].load == [{"files": 3, "area": str(area), "verify": False}]
    else:
        assert calls == ["qconvert_ping", "reload_weights"]
        assert res[0].load == []


def test_client_hashes_the_area_only_with_verify(demo_dense, shm_root):
    """A reload of ``shm:NAME`` does not sha256 the whole area; ``--verify`` does, and refuses a
    changed byte before pausing the server."""
    from qconvert.client.vllm_client import reload_vllm

    area = staging.stage_checkpoint(demo_dense, "d").path
    f = sorted(area.glob("g*.safetensors"))[-1]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    calls: list = []
    srv = _fake_vllm(True, calls)
    try:
        assert reload_vllm([srv.url], "shm:d", retries=0)[0].ok  # not hashed: the worker may verify on request
        with pytest.raises(staging.StagingError, match=f"{f.name}: checksum mismatch"):
            reload_vllm([srv.url], "shm:d", retries=0, verify=True)
        assert calls.count("qconvert_load_staged") == 1
    finally:
        srv.close()


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["avx2", "portable", "torch"])
def test_cpu_plugin_mxfp8_dequant_equals_vllms(path, monkeypatch):
    """The CPU plugin's MXFP8 expert dequantization (run at every reload: the bulk of an MXFP8
    reload on CPU before, scripts/bench_reload.py) equals vLLM's own ``dequant_mxfp8_to_bf16`` bit
    for bit: every E4M3 code (NaN codes included) under every kind of scale (0, subnormal results,
    1, large, 254 and the E8M0 NaN 255); through the C kernel's AVX2 loop, its portable loops, and
    the torch fallback (no C compiler)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

    from qconvert.convert.numerics import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    else:
        assert cpu_kernels.library() is not None, cpu_kernels.status()
        if path == "portable":
            monkeypatch.setenv("QCONVERT_NO_AVX2", "1")

    from qconvert.engine.vllm_cpu_plugin import mxfp8_experts_to_bf16

    scales = torch.tensor([0, 1, 2, 20, 100, 126, 127, 128, 140, 200, 253, 254, 255], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8).repeat(2, len(scales), 1)  # [E=2, N, 256]: every code per row
    codes[1] = codes[1].flip(-1)
    w = codes.view(torch.float8_e4m3fn)
    s = scales.view(1, -1, 1).expand(2, -1, 8).contiguous()
    s[1, :, 3] = 127
    got, want = mxfp8_experts_to_bf16(w, s), dequant_mxfp8_to_bf16(w, s)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (3, 64, 128), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s = torch.randint(90, 160, (3, 64, 4), dtype=torch.uint8, generator=g)
    assert torch.equal(mxfp8_experts_to_bf16(w, s).view(torch.int16), dequant_mxfp8_to_bf16(w, s).view(torch.int16))
    # every pair of codes at the positions the plugin looks up together (2k, 2k+1)
    first, second = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    pairs = torch.stack([first.reshape(-1), second.reshape(-1)], dim=1).reshape(2, -1, 256).to(torch.uint8)
    w = pairs.view(torch.float8_e4m3fn)
    s = torch.tensor([127, 119], dtype=torch.uint8).view(2, 1, 1).expand(2, pairs.shape[1], 8).contiguous()
    got, want = mxfp8_experts_to_bf16(w, s), dequant_mxfp8_to_bf16(w, s)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    out = torch.full(w.shape, 7.0, dtype=torch.bfloat16)
    mxfp8_experts_to_bf16(w, s, out=out)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["avx2", "portable", "torch"])
def test_cpu_plugin_nvfp4_dequant_equals_vllms(path, monkeypatch):
    """The CPU plugin's NVFP4 dequantization (run at every load and reload of NVFP4 experts and
    weight-only linear layers on CPU) equals vLLM's own ``dequantize_to_dtype`` bit for bit: every
    pair of E2M1 codes under every E4M3 scale byte (NaN scales included), per-tensor scales 0,
    subnormal, ordinary, huge and infinite, one per expert, a fused gate-and-up weight whose
    halves have their own scale, a 2-D weight with one scale, and ``out`` written in place;
    through the C kernel's AVX2 lanes, its portable loops, and the fallback to vLLM's function."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    from qconvert.convert.numerics import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    else:
        assert cpu_kernels.library() is not None, cpu_kernels.status()
        if path == "portable":
            monkeypatch.setenv("QCONVERT_NO_AVX2", "1")

    from qconvert.engine.vllm_cpu_plugin import nvfp4_to_dtype

    def bits(t):
        return t.view(torch.int16)

    # [E=5, N=256, K=512]: row n holds every byte (every code pair) under scale byte n
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(5, 256, 1)
    codes[1] = codes[1].flip(-1)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256, 1).repeat(5, 1, 32)
    per_expert = torch.tensor([1.0, 0.37, 2.0**-140, 3.0e38, float("inf")], dtype=torch.float32)
    want = dequantize_to_dtype(codes, scales.view(torch.float8_e4m3fn), per_expert, torch.bfloat16, 16, swizzle=False)
    rows = per_expert.view(5, 1).expand(5, 256)
    got = nvfp4_to_dtype(codes, scales.view(torch.float8_e4m3fn), rows, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (5, 256, 512)
    assert torch.isnan(want).any() and torch.equal(bits(got), bits(want))
    # a fused gate-and-up weight [E, 2I, K]: each half with its own per-tensor scale, as vLLM's
    # function gives each half separately
    g = torch.Generator().manual_seed(5)
    e, i, k = 3, 48, 128
    w13 = torch.randint(0, 256, (e, 2 * i, k // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(0, 127, (e, 2 * i, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    g13 = torch.rand(e, 2, generator=g) * 1e-3
    halves = [
        dequantize_to_dtype(
            w13[:, j * i : (j + 1) * i].contiguous(),
            s13[:, j * i : (j + 1) * i].contiguous(),
            g13[:, j].contiguous(),
            torch.bfloat16,
            16,
            swizzle=False,
        )
        for j in range(2)
    ]
    out = torch.full((e, 2 * i, k), 7.0, dtype=torch.bfloat16)
    res = nvfp4_to_dtype(w13, s13, g13.repeat_interleave(i, dim=1), torch.bfloat16, out=out)
    assert res is out and torch.equal(bits(out), bits(torch.cat(halves, dim=1)))
    # a 2-D linear weight with one per-tensor scale
    w = torch.randint(0, 256, (64, 96), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (64, 12), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.tensor([0.0123])
    want2 = dequantize_to_dtype(w, s, gs, torch.bfloat16, 16, swizzle=False)
    assert torch.equal(bits(nvfp4_to_dtype(w, s, gs, torch.bfloat16)), bits(want2))
    with pytest.raises(ValueError, match="per-tensor scales"):
        nvfp4_to_dtype(w, s, torch.ones(3), torch.bfloat16)


@pytest.mark.vllm
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_moe_prepack_per_expert_equals_vllms(isa):
    """The worker extension's CPU MoE prepack after a reload, one expert at a time into the served
    storage, gives the bytes of vLLM's own ``cpu_prepack_moe_weight`` of the whole tensor."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    from qconvert.engine.vllm_worker import prepack_experts_in_place

    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 64, 96, generator=g).to(torch.bfloat16)
    want = ops.cpu_prepack_moe_weight(w, isa)
    assert not torch.equal(want.view(torch.int16), w.view(torch.int16))  # the op does change the layout
    storage = w.untyped_storage().data_ptr()
    prepack_experts_in_place(w, isa)
    assert w.untyped_storage().data_ptr() == storage
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


@pytest.mark.vllm
@pytest.mark.slow
def test_server_loads_staged_area_and_back(tmp_path, monkeypatch):
    """A real vLLM CPU server (Qwen3-MoE MXFP8, qconvert's worker extension): B from a version 1
    area computes what vLLM's own disk loader gives for B; A from a version 2 area restores the
    original outputs exactly; each reload reports what the worker mapped."""
    pytest.importorskip("vllm")
    from test_reload_vllm import Server, _make_pair

    from qconvert.client.vllm_client import reload_vllm

    monkeypatch.setenv("QCONVERT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    a, b, _ = _make_pair(tmp_path, "qwen3-moe:mxfp8")
    area_b = staging.stage_checkpoint(b, "b")
    area_a = _v2_from_v1(staging.stage_checkpoint(a, "a1").path, tmp_path / "shm" / "a2")
    srv = Server(a, tmp_path / "server.log")
    try:
        original = srv.greedy()
        res = reload_vllm([srv.url], "shm:b", weight_version="B-staged")
        (stats,) = res[0].load  # one worker
        assert stats["format"] == fmt.FORMAT_V1 and stats["bytes"] == area_b.nbytes - sum(
            f["size"] for n, f in area_b.manifest["files"].items() if not n.endswith(".safetensors")
        )
        assert stats["files"] == stats["files_in_area"] and stats["mappings_released"] is True
        staged_b = srv.greedy()
        assert staged_b != original
        reload_vllm([srv.url], b, weight_version="B-disk")  # vLLM's own loader: the oracle
        assert srv.greedy() == staged_b
        res = reload_vllm([srv.url], str(area_a), weight_version="A-staged", verify=True)
        assert res[0].load[0]["format"] == fmt.FORMAT_V2 and res[0].load[0]["verified"] is True
        assert srv.greedy() == original
    finally:
        srv.stop()


def test_refit_area_reloads_through_the_extension(demo_moe, shm_root, monkeypatch):
    """A version 2 area written by qconvert's Refitter: ``Refitter.reload`` (``shm:NAME``) reaches
    the worker extension with the area's root, and what the worker hands vLLM equals what the
    safetensors library reads from the committed slot's files."""
    from qconvert.client.vllm_client import reload_vllm
    from qconvert.convert.options import ConvertOptions
    from qconvert.convert.plan import PlanOptions
    from qconvert.trainer.refit import Refitter

    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), progress=False, fsync=False)
    src = _source_tensors(demo_moe)
    with Refitter(demo_moe, opts, "policy") as r:
        r.stage(sorted(src.items(), key=lambda kv: (staging.group_key(kv[0]), kv[0])))
        staged = r.commit()
    area = shm_root / "policy"
    view = fmt.read_area(area)
    assert view.format == fmt.FORMAT_V2 and view.directory == staged.path
    stats, got, _ = _load(area, verify=True)
    want = _source_tensors(view.directory)
    assert got.keys() == want.keys()
    assert all(torch.equal(_bytes(got[n]), _bytes(t)) for n, t in want.items())
    assert stats["verified"] and stats["version"] == view.version and stats["mappings_released"]
    calls: list = []
    srv = _fake_vllm(True, calls)
    try:
        res = reload_vllm([srv.url], "shm:policy", retries=0)
    finally:
        srv.close()
    assert calls == ["qconvert_ping", "qconvert_load_staged", "qconvert_repack_cpu_moe"]  # MoE on a CPU server
    assert res[0].load[0]["area"] == str(area)


def _refits(demo_moe, name: str, n: int):
    """A Refitter over the demo's BF16 tensors; yields after each of ``n`` refits (each with other
    weights), the committed slot's directory."""
    from qconvert.convert.options import ConvertOptions
    from qconvert.convert.plan import PlanOptions
    from qconvert.trainer.refit import Refitter

    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), progress=False, fsync=False)
    src = sorted(_source_tensors(demo_moe).items(), key=lambda kv: (staging.group_key(kv[0]), kv[0]))
    with Refitter(demo_moe, opts, name) as r:
        for i in range(n):
            r.stage([(k, t * (1.0 + 0.25 * i)) for k, t in src])
            yield r.commit().path


def test_kept_maps_see_every_refit_in_place(demo_moe, shm_root, monkeypatch):
    """A GPU server keeps a refit area's mappings between loads (docs/reload.md#kept-mappings; here
    forced on a CPU model, where nothing is registered): each file is mapped once per slot, a later
    refit's in-place writes are what the next load hands vLLM (equal to the safetensors library's
    reading of the committed slot), a file made again is mapped again, and a dropped area's
    mappings are let go at the next load."""
    kept = vllm_staged.KeptMaps()
    monkeypatch.setattr(vllm_staged, "KEPT", kept)
    area = shm_root / "kept"
    mms, seen, tables = {}, [], {}
    for slot_dir in _refits(demo_moe, "kept", 3):
        stats, got, _ = _load(area, keep_maps=True)
        want = _source_tensors(slot_dir)
        assert got.keys() == want.keys() and all(torch.equal(_bytes(got[n]), _bytes(t)) for n, t in want.items())
        assert stats["kept_maps"] is True and stats["pinned_files"] == 0 and stats["mappings_released"]
        seen.append({n: _bytes(t).sum().item() for n, t in got.items()})
        assert len(kept) == 2 * stats["files"]  # the first load maps both slots' files
        for key, k in kept._maps.items():
            assert mms.setdefault(key, k.mm) is k.mm, key  # mapped once, reused by later loads
            if k.views is not None:  # read by a load: its view table is made once per area spec
                assert tables.setdefault(key, k.views) is k.views, key
    assert len(tables) == 2 * stats["files"]
    assert seen[0] != seen[2]  # slot 0 twice: the third refit's bytes, through the first load's mappings
    files = len(fmt.read_area(area).files)
    # the default on a CPU server: mapped afresh, nothing kept (a GPU server keeps them unless
    # QCONVERT_STAGED_KEEP_MAPS=0)
    before = len(kept)
    assert _load(area)[0]["kept_maps"] is False and len(kept) == before
    monkeypatch.delenv(vllm_staged.KEEP_ENV, raising=False)
    assert vllm_staged.keep_maps_enabled() is True
    for value, on in (("1", True), ("0", False), ("yes", True)):
        monkeypatch.setenv(vllm_staged.KEEP_ENV, value)
        assert vllm_staged.keep_maps_enabled() is on, value
    # a file made again at the same path (new inode) is mapped again
    view = fmt.read_area(area)
    victim = view.directory / view.files[0].name
    tmp = victim.with_name("tmp")
    shutil.copyfile(victim, tmp)
    os.replace(tmp, victim)
    _, got, _ = _load(area, keep_maps=True)
    assert kept._maps[str(victim)].mm is not mms[str(victim)]
    assert all(torch.equal(_bytes(got[n]), _bytes(t)) for n, t in _source_tensors(view.directory).items())
    # the copy floor over the kept mappings: every file of the rank, whole
    fl = vllm_staged.copy_floor(torch.nn.Module(), area, repeat=1, keep_maps=True)
    assert fl["kind"] == "kept-files" and fl["bytes"] == view.nbytes and fl["files"] == files
    assert kept.release(area) == 2 * files and len(kept) == 0
    _load(area, keep_maps=True)
    shutil.rmtree(area)
    assert kept.prune() == 2 * files and len(kept) == 0


def test_kept_maps_skip_missing_files_of_the_other_slot(mxfp8_moe, shm_root, tmp_path, monkeypatch):
    """The first kept load maps the other slot's files too; one missing there (an area from
    another writer) is left to the load that reads that slot, and this load goes on."""
    kept = vllm_staged.KeptMaps()
    monkeypatch.setattr(vllm_staged, "KEPT", kept)
    v2 = _v2_from_v1(staging.stage_checkpoint(mxfp8_moe, "v1").path, tmp_path / "v2")  # slot 1 committed
    n = len(fmt.read_area(v2).files)
    (fmt.slot_dir(v2, 0) / fmt.file_name(0, 0)).unlink()
    stats, got, _ = _load(v2, keep_maps=True)
    want = _source_tensors(mxfp8_moe)
    assert stats["slot"] == 1 and all(torch.equal(_bytes(got[k]), _bytes(t)) for k, t in want.items())
    assert len(kept) == 2 * n - 1


def test_kept_maps_fall_back_when_read_only_registration_is_refused(demo_moe, shm_root, monkeypatch):
    """Where CUDA refuses read-only registration (a device without cudaHostRegisterReadOnly), the
    kept file is mapped again writable and shared and registered with flags 0, for the device the
    load names; a mapping whose registration is refused both ways stays unregistered and usable, and
    is not retried at every load; letting go unregisters what was registered. (CUDA itself is
    replaced by a recorder here: on a CPU machine nothing can be registered.)"""
    from qconvert import host_memory

    calls: list[tuple] = []
    refuse = {host_memory.READ_ONLY}

    def register(ptr, nbytes, flags, device):
        calls.append(("register", ptr, nbytes, flags, device))
        return 801 if flags in refuse else 0  # 801: cudaErrorNotSupported

    monkeypatch.setattr(host_memory, "register", register)
    monkeypatch.setattr(host_memory, "unregister", lambda ptr, device: calls.append(("unregister", ptr, device)))
    for _ in _refits(demo_moe, "fallback", 1):
        pass
    area = shm_root / "fallback"
    view = fmt.read_area(area)
    spec = view.files[0]
    want = (view.directory / spec.name).read_bytes()
    kept = vllm_staged.KeptMaps()
    m = kept.get(view.directory, spec, pin=3)
    (_, ro_ptr, n, f0, d0), (_, rw_ptr, n1, f1, d1) = calls
    assert (n, f0, d0, n1, f1, d1) == (spec.size, host_memory.READ_ONLY, 3, spec.size, 0, 3)
    assert m.pinned and m.base.data_ptr() == rw_ptr and bytes(m.base.numpy()) == want
    assert "flags=8" in kept.pin_error and "801" in kept.pin_error
    k = kept._maps[str(view.directory / spec.name)]
    assert k.writable and k.pinned and k.device == 3
    kept.get(view.directory, spec, pin=3)
    assert len(calls) == 2  # registered once per mapping
    assert kept.release() == 1 and calls[-1] == ("unregister", rw_ptr, 3)
    # refused both ways: unregistered, still the file's bytes, one attempt
    calls.clear()
    refuse.add(0)
    m = kept.get(view.directory, spec, pin=0)
    assert not m.pinned and bytes(m.base.numpy()) == want and len(calls) == 2
    kept.get(view.directory, spec, pin=0)
    assert len(calls) == 2
    assert kept.release() == 1 and len(calls) == 2  # nothing to unregister


def test_host_registration_runs_on_a_thread_of_its_own(monkeypatch):
    """A refused cudaHostRegister leaves CUDA's last error on the thread that called it, where torch
    would raise it at its next kernel launch: qconvert.host_memory calls CUDA on a short thread of
    its own, current on the caller's device, and hands back the error code (or the exception)."""
    import threading

    from qconvert import host_memory

    seen: list = []

    class Code:  # torch's cudart returns an enum value
        def __init__(self, v):
            self.value = v

    class Runtime:
        def cudaHostRegister(self, ptr, n, flags):
            seen.append(("register", threading.current_thread() is main, device[0], ptr, n, flags))
            if flags == 99:
                raise RuntimeError("boom")
            return Code(801 if flags else 0)

        def cudaHostUnregister(self, ptr):
            seen.append(("unregister", threading.current_thread() is main, device[0], ptr))
            return 0

    main, device = threading.current_thread(), [None]
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: device.__setitem__(0, d))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    assert host_memory.register(4096, 8192, 0, 2) == 0
    assert host_memory.register(4096, 8192, host_memory.READ_ONLY, 5) == 801
    assert host_memory.unregister(4096, 2) == 0
    with pytest.raises(RuntimeError, match="boom"):
        host_memory.register(1, 1, 99, 0)
    assert seen[:3] == [
        ("register", False, 2, 4096, 8192, 0),
        ("register", False, 5, 4096, 8192, host_memory.READ_ONLY),
        ("unregister", False, 2, 4096),
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_server_keeps_refit_areas_registered(demo_moe, shm_root, monkeypatch):
    """On a CUDA model, by default (QCONVERT_STAGED_KEEP_MAPS unset), a refit area's files are kept
    mapped and registered with CUDA (read-only, else writable): every load after a refit hands
    device tensors equal to the committed slot's files; the copy floor is the kept files' copy;
    release lets every registration go; ``0`` maps afresh."""
    kept = vllm_staged.KeptMaps()
    monkeypatch.setattr(vllm_staged, "KEPT", kept)
    monkeypatch.delenv(vllm_staged.KEEP_ENV, raising=False)
    model = torch.nn.Linear(1, 1, device="cuda")
    area = shm_root / "pinned"
    got: dict = {}

    def reload_weights(weights):
        for name, t in weights:
            assert t.device.type == "cuda", name
            got[name] = t.clone()

    for slot_dir in _refits(demo_moe, "pinned", 3):
        got.clear()
        stats = vllm_staged.load_staged(model, area, reload_weights)
        want = _source_tensors(slot_dir)
        assert stats["kept_maps"] is True and stats["device_chunks"] is True, stats
        assert stats["pinned_files"] == stats["files"], stats.get("pin_error")
        assert got.keys() == want.keys()
        assert all(torch.equal(_bytes(got[n].cpu()), _bytes(t)) for n, t in want.items())
    files = len(fmt.read_area(area).files)
    fl = vllm_staged.copy_floor(model, area, repeat=2)
    assert fl["kind"] == "kept-files" and fl["pinned_files"] == files
    assert kept.release() == 2 * files and len(kept) == 0
    monkeypatch.setenv(vllm_staged.KEEP_ENV, "0")
    got.clear()
    stats = vllm_staged.load_staged(model, area, reload_weights)
    assert stats["kept_maps"] is False and stats["pinned_files"] == 0 and len(kept) == 0, stats
    assert all(torch.equal(_bytes(got[n].cpu()), _bytes(t)) for n, t in want.items())


def test_sglang_reads_a_refit_area_from_its_committed_slot(demo_dense, shm_root):
    """SGLang has no worker extension: ``reload sglang shm:NAME`` of a version 2 area sends the
    committed slot's directory (the area's root holds no weights), while the client holds that
    slot's shared lock, so a refit cannot overwrite it during SGLang's read."""
    from test_reload_clients import FakeServer
    from test_sglang_client import sglang_routes

    from qconvert.client.sglang_client import reload_sglang

    v2 = _v2_from_v1(staging.stage_checkpoint(demo_dense, "d").path, shm_root / "p")
    held = []

    def update(body):
        with pytest.raises(fmt.StagingError, match="slot 1"):
            fmt.SlotLock(v2, 1, shared=False, wait_s=0.05)
        held.append(body["model_path"])

    srv = FakeServer(sglang_routes({}, update))
    try:
        assert reload_sglang([srv.url], "shm:p", retries=0)[0].ok
    finally:
        srv.close()
    assert held == [str(fmt.slot_dir(v2, 1))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [4096, 256 << 20], ids=["small-chunks", "default-chunks"])
def test_cuda_server_gets_device_views_equal_to_safetensors(mxfp8_moe, shm_root, monkeypatch, chunk):
    """A model on a CUDA device gets every tensor as a device tensor (chunks copied ahead by a
    thread), in the mapped order, bytes equal to the safetensors library's reading of the source;
    a load that fails midway leaves no copy running and every mapping released."""
    monkeypatch.setattr(vllm_staged, "CHUNK_BYTES", chunk)
    area = staging.stage_checkpoint(mxfp8_moe, "gpu")
    want = _source_tensors(mxfp8_moe)
    model = torch.nn.Linear(1, 1, device="cuda")
    got, order = {}, []

    def reload_weights(weights):
        for name, t in weights:
            assert t.device.type == "cuda", name
            order.append(name)
            got[name] = t.clone()  # on the consumer's stream, as vLLM's loaders copy

    stats = vllm_staged.load_staged(model, area.path, reload_weights)
    assert set(got) == set(want) and stats["mappings_released"] is True and stats["device_chunks"] is True
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name].cpu()), _bytes(t)), name
    cpu_order = []
    st = vllm_staged.load_staged(torch.nn.Module(), area.path, lambda w: cpu_order.extend(n for n, _ in w))
    assert order == cpu_order and st["device_chunks"] is False
    # the caller turns the chunks off for one load (scripts/gpu_vllm_check.py's A/B): host views
    devices = set()
    st = vllm_staged.load_staged(
        model, area.path, lambda w: devices.update(t.device.type for _, t in w), device_chunks=False
    )
    assert devices == {"cpu"} and st["device_chunks"] is False

    def fails(weights):
        for i, (name, _t) in enumerate(weights):
            if i == 3:
                raise RuntimeError(f"stop at {name}")

    with pytest.raises(RuntimeError, match="stop at"):
        vllm_staged.load_staged(model, area.path, fails)
    assert vllm_staged.load_staged(model, area.path, lambda w: None)["mappings_released"] is True
