"""The Refitter's persistent two-slot staging area (docs/reload.md#staging-area-format): versions
alternate slots, the bytes equal the converter's (plain and pre-shuffled, TP 1 and 2), bad input
commits nothing, sharded trainers commit once, readers and writers exclude each other."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import shm_dir
from safetensors import safe_open
from safetensors.torch import load_file

from qconvert.client import staging
from qconvert.convert.demo import build_demo_model
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import QConvertError
from qconvert.formats import staging as fs
from qconvert.refit import RefitError, Refitter, stage_refit


def _tensors(d: Path, names=None) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        if names is None or f.name in names:
            out.update(load_file(f))
    return out


def _stream(src: Path, layers=None):
    t = _tensors(src)
    for n in sorted(t, key=lambda n: (staging.group_key(n), n)):
        if layers is None or staging.group_key(n) in layers:
            yield n, t[n]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_same(want: dict, got: dict):
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())[:4]
    bad = [k for k in want if not _equal(want[k], got[k])]
    assert not bad, bad[:4]


@pytest.fixture(scope="module")
def demo_moe_2(tmp_path_factory):
    """The demo MoE model again, other weights (seed 1): a second training step."""
    return build_demo_model(tmp_path_factory.mktemp("demo2") / "qwen3-moe", arch="qwen3-moe", seed=1)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(shm_dir(tmp_path)))
    return shm_dir(tmp_path)


def _convert(src, dst, opts):
    convert(str(src), dst, opts=opts)
    return _tensors(dst)


def _opts(**kw):
    return ConvertOptions(progress=False, fsync=False, **kw)


def test_versions_alternate_slots_and_keep_the_previous_whole(demo_moe, demo_moe_2, shm, tmp_path):
    opts = _opts(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1))
    want1 = _convert(demo_moe, tmp_path / "c1", opts)
    want2 = _convert(demo_moe_2, tmp_path / "c2", opts)
    with Refitter(demo_moe, opts, "policy") as r:
        a = r.refit(_stream(demo_moe)).area
        assert (a.version, a.slot, a.path) == (1, 0, shm / "policy" / "slot-0")
        _assert_same(want1, _tensors(a.path))
        mtimes = {p.name: p.stat().st_ino for p in a.path.glob("*.safetensors")}
        b = r.refit(_stream(demo_moe_2)).area
        assert (b.version, b.slot) == (2, 1)
        _assert_same(want2, _tensors(b.path))
        _assert_same(want1, _tensors(a.path))  # the previous version stays whole until overwritten
        c = r.refit(_stream(demo_moe)).area
        assert (c.version, c.slot) == (3, 0)
        _assert_same(want1, _tensors(c.path))
        # overwritten in place: the same files (inodes), not new ones
        assert {p.name: p.stat().st_ino for p in c.path.glob("*.safetensors")} == mtimes
    view = fs.read_area(shm / "policy")
    assert (view.version, view.slot, view.digest) == (3, 0, "xxh3_128-pieces-64MiB")
    for f in view.files:  # digests: xxhash's xxh3_128 over the 64 MiB pieces' xxh3_128 digests (one piece here)
        data = (view.directory / f.name).read_bytes()
        assert len(data) < 64 << 20
        assert view.digests[f.name] == xxhash.xxh3_128_hexdigest(xxhash.xxh3_128_digest(data))
        assert (view.directory / f.name).stat().st_size == f.size
        with safe_open(view.directory / f.name, "pt") as so:  # a standard safetensors file
            assert set(so.keys()) == set(f.tensors)
    assert json.loads((shm / "policy" / "config.json").read_text()) == json.loads(
        (tmp_path / "c1" / "config.json").read_text()
    )
    assert sorted(view.extra_files) == sorted(
        p.name for p in (shm / "policy").iterdir() if p.is_file() and p.name not in (fs.AREA_JSON, fs.COMMIT_JSON)
    )
    # a new Refitter (a restarted trainer) continues the area
    with Refitter(demo_moe, opts, "policy") as r:
        d = r.refit(_stream(demo_moe_2)).area
        assert (d.version, d.slot) == (4, 1)
        _assert_same(want2, _tensors(d.path))


def test_area_of_other_options_is_refused(demo_moe, shm):
    stage_refit(_stream(demo_moe), reference=demo_moe, stage_name="a", options=_opts(scheme="mxfp8"))
    with pytest.raises(RefitError) as e:
        Refitter(demo_moe, _opts(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1)), "a")
    msg = str(e.value)
    assert "\n" not in msg and "staging area" in msg and "model.layers.3." in msg and "qconvert stage drop a" in msg
    with pytest.raises(RefitError, match="tensor .* is missing|is not in the area|is U8|is F8"):
        Refitter(demo_moe, _opts(scheme="nvfp4"), "a")


def _snapshot(area: Path) -> dict:
    return {
        p.relative_to(area).as_posix(): p.read_bytes()
        for p in sorted(area.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.mark.parametrize("bad", ["missing", "foreign", "dtype", "shape", "duplicate", "job-error"])
def test_bad_input_commits_nothing(demo_moe, demo_moe_2, shm, bad, monkeypatch):
    opts = _opts(scheme="mxfp8")
    with Refitter(demo_moe, opts, "p") as r:
        r.refit(_stream(demo_moe))
        before = _snapshot(shm / "p" / "slot-0") | {"commit": (shm / "p" / fs.COMMIT_JSON).read_bytes()}
        items = list(_stream(demo_moe_2))
        name0, t0 = items[5]
        patch = pytest.MonkeyPatch()
        if bad == "missing":
            items.pop(5)
            words = "never arrived"
        elif bad == "foreign":
            items.insert(3, ("model.layers.0.mlp.extra.weight", torch.zeros(2)))
            words = "'model.layers.0.mlp.extra.weight' is not in the reference"
        elif bad == "dtype":
            items[5] = (name0, t0.float())
            words = f"{name0} is torch.float32 .* the reference has BF16"
        elif bad == "shape":
            items[5] = (name0, t0[:1])
            words = f"{name0} is torch.bfloat16 \\[1"
        elif bad == "duplicate":
            items.insert(6, items[5])
            words = "given twice"
        else:  # a crash in the middle of a group's quantization
            from qconvert.convert import jobs

            def boom(*a, **k):
                raise RuntimeError("killed mid-refit")

            patch.setattr(jobs, "mxfp8_quantize", boom)
            words = "killed mid-refit"
        with pytest.raises((QConvertError, RuntimeError), match=words) as e:
            r.refit(items)
        assert "\n" not in str(e.value)
        after = _snapshot(shm / "p" / "slot-0") | {"commit": (shm / "p" / fs.COMMIT_JSON).read_bytes()}
        assert after == before  # version 1 untouched
        assert fs.read_area(shm / "p").version == 1
        patch.undo()
        assert r.refit(_stream(demo_moe_2)).area.version == 2  # and the next refit works


LAYOUT_CASES = [("mxfp8", {}), ("nvfp4", {"input_mode": "unit"}), ("bf16", {})]


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "ep2"])
@pytest.mark.parametrize("scheme,extra", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_preshuffled_refit_equals_converter(demo_moe, shm, tmp_path, scheme, extra, tp, ep):
    opts = _opts(scheme=scheme, layout="flashinfer-trtllm", engine="vllm", tp=tp, ep=ep, **extra)
    want = _convert(demo_moe, tmp_path / "c", opts)
    res = stage_refit(_stream(demo_moe), reference=demo_moe, stage_name="lay", options=opts)
    view = fs.read_area(shm / "lay")
    _assert_same(want, _tensors(view.directory))
    assert (view.tp, view.ep) == (tp, ep)
    assert view.contract == staging.checkpoint_contract(tmp_path / "c")  # layout contract included
    assert (
        json.loads((shm / "lay" / "qconvert.json").read_text())["layout"]
        == json.loads((tmp_path / "c" / "qconvert.json").read_text())["layout"]
    )
    for f in view.files:
        tags = {n.split(".experts.")[1].split(".")[0] for n in f.tensors if ".experts.trtllm" in n}
        if f.rank is None:
            assert tags <= {"trtllm"} and (tags == set() or (tp, ep) == (1, 1))
        else:
            assert tags == {f"trtllm_tp{f.rank[0]}_ep{f.rank[1]}"}, (f.name, tags)
    for r in range(tp):
        for q in range(ep):
            mine = fs.files_for_rank(view, r, q)
            got = _tensors(view.directory, {f.name for f in mine})
            expert_keys = {k for k in want if ".experts.trtllm" in k}
            own = {k for k in expert_keys if (tp, ep) == (1, 1) or f".trtllm_tp{r}_ep{q}." in k}
            assert set(got) == (set(want) - expert_keys) | own
    assert res.area.version == 1


def _rank_main(demo, opts, rank, world, layers, out, barrier, **kw):
    try:
        with Refitter(demo, opts, "shard", rank=rank, world_size=world, **kw) as r:
            barrier.wait(60)  # every rank's Refitter is made at start-up, before any commit
            r.stage(_stream(demo, layers))
            out[rank] = r.commit()
    except BaseException as e:  # noqa: BLE001
        out[rank] = e


def _run_ranks(demo, opts, plan, **kw):
    out: dict = {}
    barrier = threading.Barrier(len(plan))
    threads = [
        threading.Thread(target=_rank_main, args=(demo, opts, r, len(plan), plan[r], out, barrier), kwargs=kw)
        for r in range(len(plan))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_sharded_trainer_commits_once(demo_moe, shm, tmp_path):
    opts = _opts(scheme="nvfp4", plan=PlanOptions(last_n_bf16=1))
    want = _convert(demo_moe, tmp_path / "c", opts)
    keys = sorted({staging.group_key(n) for n, _ in _stream(demo_moe)})
    plan = [set(keys[0::3]), set(keys[1::3]), set(keys[2::3])]  # layers dealt over 3 ranks
    out = _run_ranks(demo_moe, opts, plan)
    assert out[1] is None and out[2] is None, out
    assert out[0].version == 1
    _assert_same(want, _tensors(out[0].path))
    assert not list(out[0].path.glob(".rank-*"))  # reports removed after the commit
    # version 2 goes to the other slot, every rank agreeing on it
    out = _run_ranks(demo_moe, opts, plan)
    assert out[0].version == 2 and out[0].slot == 1
    _assert_same(want, _tensors(out[0].path))


@pytest.mark.parametrize("case", ["silent-rank", "two-ranks-one-layer", "no-rank"])
def test_sharded_trainer_refusals(demo_moe, shm, case):
    opts = _opts(scheme="mxfp8")
    keys = sorted({staging.group_key(n) for n, _ in _stream(demo_moe)})
    stage_refit(_stream(demo_moe), reference=demo_moe, stage_name="shard", options=opts)  # version 1
    before = (shm / "shard" / fs.COMMIT_JSON).read_bytes()
    if case == "silent-rank":
        with Refitter(demo_moe, opts, "shard", rank=0, world_size=2, rendezvous_timeout_s=0.5) as r:
            r.stage(_stream(demo_moe))
            with pytest.raises(
                RefitError, match="trainer rank 1 never reported version 2 within 0.5 s; nothing committed"
            ):
                r.commit()
    else:
        plan = [set(keys), {keys[2]}] if case == "two-ranks-one-layer" else [set(keys[1:]), set()]
        out = _run_ranks(demo_moe, opts, plan, rendezvous_timeout_s=20)
        err = out[0]
        assert isinstance(err, RefitError), out
        assert "nothing committed" in str(err) and "\n" not in str(err)
        if case == "two-ranks-one-layer":
            assert "staged by trainer ranks 0 and 1" in str(err)
        else:
            assert "staged by no trainer rank" in str(err) and "embed_tokens" in str(err)
    assert (shm / "shard" / fs.COMMIT_JSON).read_bytes() == before


def test_writer_waits_for_readers_of_its_slot(demo_moe, shm):
    opts = _opts(scheme="mxfp8")
    with Refitter(demo_moe, opts, "rw", lock_wait_s=0.3) as r:
        r.refit(_stream(demo_moe))  # version 1 in slot 0
        r.refit(_stream(demo_moe))  # version 2 in slot 1; the next refit writes slot 0
        reader = fs.SlotLock(shm / "rw", 0, shared=True)  # a slow server still reading version 1
        try:
            with pytest.raises(QConvertError, match="slot 0 is held by a server reading it") as e:
                r.refit(_stream(demo_moe))
            assert str(shm / "rw") in str(e.value)
        finally:
            reader.release()
        assert fs.read_area(shm / "rw").version == 2
        assert r.refit(_stream(demo_moe)).area.version == 3
        with fs.committed(shm / "rw") as view:  # a reader holds the committed slot...
            assert view.slot == 0
            assert r.refit(_stream(demo_moe)).area.slot == 1  # ...while the writer fills the other


def test_refitter_lifecycle_errors(demo_moe, shm):
    with pytest.raises(RefitError, match="rank 2 / world_size 2"):
        Refitter(demo_moe, _opts(), "x", rank=2, world_size=2)
    with pytest.raises(QConvertError, match="staging name"):
        Refitter(demo_moe, _opts(), "../x")
    # SGLang reads plain refit areas; pre-shuffled ones are refused by the value that says why
    Refitter(demo_moe, _opts(), "x", urls=["http://127.0.0.1:1"], engine="sglang").close()
    with pytest.raises(RefitError, match="refit area 'x' for SGLang servers: a pre-shuffled"):
        Refitter(demo_moe, _opts(layout="flashinfer-trtllm", engine="sglang"), "x", urls=["u"], engine="sglang")
    with pytest.raises(RefitError, match="refit area 'x' for SGLang servers: holds per-rank"):
        Refitter(demo_moe, _opts(layout="flashinfer-trtllm", engine="sglang", tp=2), "x", urls=["u"], engine="sglang")
    with pytest.raises(RefitError, match="options.engine 'sglang' .* differs from the servers' engine 'vllm'"):
        Refitter(demo_moe, _opts(layout="flashinfer-trtllm", engine="sglang"), "x")
    r = Refitter(demo_moe, _opts(), "x")
    with pytest.raises(RefitError, match="nothing staged"):
        r.commit()
    r.close()
    with pytest.raises(RefitError, match="closed"):
        r.stage([])


_TRT = {"layout": "flashinfer-trtllm"}
_W4A4 = {"input_mode": "unit"}
BATCHED_CASES = {
    "mxfp8": ("mxfp8", {}),
    "nvfp4-ct-w4a16": ("nvfp4", {}),
    "nvfp4-ct-w4a4": ("nvfp4", _W4A4),
    "nvfp4-modelopt-w4a4": ("nvfp4", {"dialect": "modelopt", **_W4A4}),
    "nvfp4-modelopt-recipe-w4a16": ("nvfp4", {"dialect": "modelopt", "recipe": "modelopt"}),
    "nvfp4-4over6": ("nvfp4", {"recipe": "4over6"}),
    "mxfp8-trtllm-tp2": ("mxfp8", {**_TRT, "tp": 2}),
    "nvfp4-trtllm-tp1": ("nvfp4", {**_TRT, **_W4A4}),
    "nvfp4-trtllm-tp2": ("nvfp4", {**_TRT, **_W4A4, "tp": 2}),
    "nvfp4-trtllm-ep2": ("nvfp4", {**_TRT, **_W4A4, "ep": 2}),
    "nvfp4-ct-copied": ("nvfp4", {"input_mode": "copied"}),
    "nvfp4-modelopt-copied": ("nvfp4", {"dialect": "modelopt", "input_mode": "copied"}),
    "nvfp4-trtllm-copied-ep2": ("nvfp4", {**_TRT, "input_mode": "copied", "ep": 2}),
}


@pytest.fixture(scope="module")
def input_scales_ckpt(demo_moe, tmp_path_factory):
    """An NVFP4 W4A4 checkpoint of the demo model whose input scales all differ (calibrated-like),
    for ``input_mode="copied"``: a stacked job that put one module's scale on another would show."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("scales") / "w4a4"
    convert(str(demo_moe), d, opts=_opts(scheme="nvfp4", dialect="modelopt", input_mode="unit"))
    g = torch.Generator().manual_seed(7)
    for f in sorted(d.glob("*.safetensors")):
        t = load_file(f)
        for n in t:
            if n.endswith(".input_scale"):
                t[n] = (torch.rand((), generator=g) * 4 + 0.01).float()
        save_file(t, f)
    return d


def _with_scales(extra: dict, request) -> dict:
    if extra.get("input_mode") == "copied":
        return {**extra, "input_scales_from": str(request.getfixturevalue("input_scales_ckpt"))}
    return extra


@pytest.mark.parametrize("scheme,extra", list(BATCHED_CASES.values()), ids=list(BATCHED_CASES))
def test_batched_path_equals_converter(demo_moe, shm, tmp_path, monkeypatch, request, scheme, extra):
    """The CUDA path's batched NaN/Inf check, stacked quantization (a layer's experts in one call
    per tensor kind: MXFP8, NVFP4 with its per-group global scales, W4A4 and W4A16, plain and
    pre-shuffled) and coalesced copies, run on CPU: the bytes of the converter's per-tensor jobs,
    and the same refusal (naming the tensor); huge finite values pass."""
    from qconvert.convert import jobs

    monkeypatch.setattr(Refitter, "_BATCHED", True)
    extra = _with_scales(extra, request)
    opts = _opts(scheme=scheme, **extra)
    want = _convert(demo_moe, tmp_path / "c", opts)  # the per-tensor jobs
    monkeypatch.setattr(jobs, "STACKED_DEVICES", {"cuda", "cpu"})  # stacked quantization
    with Refitter(demo_moe, opts, "b") as r:
        assert r._check_group
        if not extra.get("layout"):  # experts stacked: gate/up pairs, downs
            assert any(len(j.sources) > 8 for js in r._group_jobs.values() for j in js)
            if scheme == "nvfp4":  # every NVFP4 group went into a stacked job (all outputs on the device)
                assert not [j for js in r._group_jobs.values() for j in js if j.nvfp4 is not None]
            stacked = [j for js in r._group_jobs.values() for j in js if j.stacked is not None]
            assert stacked and all(len(j.sources) > 1 or scheme == "nvfp4" for j in stacked)
            j = max(stacked, key=lambda j: len(j.outputs))  # its dict interface: views of the same tiles
            got = j.fn({n: t for n, t in _stream(demo_moe) if n in j.sources})
            _assert_same({o.name: want[o.name] for o in j.outputs}, got)
        _assert_same(want, _tensors(r.refit(_stream(demo_moe)).area.path))
        items = list(_stream(demo_moe))
        name = next(n for n, _ in items if ".experts.3.up_proj" in n)
        huge = next(n for n, _ in items if ".experts.2.up_proj" in n)
        poisoned = []
        for n, t in items:
            if n in (name, huge):
                t = t.clone()
                t.view(-1)[5] = float("nan") if n == name else 3.0e38
                t.view(-1)[6] = 3.0e38
            poisoned.append((n, t))
        with pytest.raises(QConvertError) as e:
            r.refit(poisoned)
        assert str(e.value) == (
            f"tensor {name!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite"
        )
        assert fs.read_area(shm / "b").version == 1
        ok = [(n, t) for n, t in poisoned if n != name] + [(name, dict(items)[name])]
        assert r.refit(ok).area.version == 2  # finite values whose L1 norm overflows are not refused


@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_stack_of_another_shape_is_refused(demo_moe, demo_moe_2, shm, monkeypatch, scheme):
    """A refit copies a stacked job's outputs as tiles of its stacks without looking at each
    output: a stack of another shape or dtype (a quantizer bug) is refused naming an output it
    holds, before any byte of its layer is copied; nothing is committed."""
    from qconvert.convert import jobs

    monkeypatch.setattr(Refitter, "_BATCHED", True)
    monkeypatch.setattr(jobs, "STACKED_DEVICES", {"cuda", "cpu"})
    with Refitter(demo_moe, _opts(scheme=scheme), "t") as r:
        r.refit(_stream(demo_moe))
        before = {f.name: f.read_bytes() for f in sorted((shm / "t" / "slot-1").glob("*.safetensors"))}
        j = next(j for js in r._group_jobs.values() for j in js if j.stacked is not None and len(j.sources) > 1)
        st = j.stacked
        wrong = [st.fn, lambda src: [s.reshape(s.shape[0], -1) for s in st.fn(src)]]
        k = next(k for k, (dtype, _) in enumerate(st.stacks) if dtype != torch.uint8)
        wrong.append(lambda src: [x.view(torch.uint8) if i == k else x for i, x in enumerate(st.fn(src))])
        for bad in wrong[1:]:
            j.stacked = type(st)(bad, st.stacks, st.tiles)
            with pytest.raises(RefitError, match=r"refit: the stack holding .*\.experts\.0\..* came out"):
                r.refit(_stream(demo_moe_2))
            assert fs.read_area(shm / "t").version == 1
        after = {f.name: f.read_bytes() for f in sorted((shm / "t" / "slot-1").glob("*.safetensors"))}
        layer = staging.group_key(j.sources[0])
        assert all(before[n] == after[n] for n in before if r._gidx[layer] == int(n[1:6]))
        j.stacked = st
        assert r.refit(_stream(demo_moe_2)).area.version == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,extra", list(BATCHED_CASES.values()), ids=list(BATCHED_CASES))
def test_cuda_refit_equals_converter(demo_moe, demo_moe_2, shm, tmp_path, request, scheme, extra):
    extra = _with_scales(extra, request)
    opts = _opts(scheme=scheme, **extra)
    want = _convert(demo_moe_2, tmp_path / "c", opts)
    with Refitter(demo_moe, _opts(scheme=scheme, device="cuda", **extra), "gpu") as r:
        r.refit((n, t.cuda()) for n, t in _stream(demo_moe))
        got = r.refit((n, t.cuda()) for n, t in _stream(demo_moe_2)).area
        _assert_same(want, _tensors(got.path))


SYNC_CASES = ["mxfp8", "nvfp4-ct-w4a4", "nvfp4-modelopt-w4a4", "mxfp8-trtllm-tp2", "nvfp4-trtllm-ep2"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check", [False, True], ids=["allow-non-finite", "checked"])
@pytest.mark.parametrize("case", SYNC_CASES)
def test_cuda_refit_host_syncs_per_group(demo_moe, shm, case, check):
    """A refit after the first on CUDA: no host sync per tensor. PyTorch's sync debug mode reports
    every operation that waits for the device implicitly (.item(), .cpu(), a blocking copy): none,
    the batched NaN/Inf check included (its flags reach page-locked memory asynchronously and are
    read once the group's copies are done). The copier's wait for the previous group's copies (an
    event) is the pipeline's one intended wait and not counted, should this torch report it."""
    import linecache
    import warnings

    scheme, extra = BATCHED_CASES[case]
    opts = _opts(scheme=scheme, device="cuda", allow_non_finite=not check, **extra)
    items = [(n, t.cuda()) for n, t in _stream(demo_moe)]
    with Refitter(demo_moe, opts, "sync") as r:
        r.refit(items)  # the first: area made, mapped, registered
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r.stage(items)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        r.commit()
        syncs = [
            f"{w.filename}:{w.lineno}"
            for w in seen
            if "called a synchronizing" in str(w.message)  # not the once-per-process "prototype feature" notice
            and not (w.filename.endswith("refit.py") and ".synchronize()" in linecache.getline(w.filename, w.lineno))
        ]
        assert syncs == [], syncs[:10]


def test_area_of_an_older_qconvert_keeps_its_digest_kind(demo_moe, demo_moe_2, shm):
    """An area whose area.json says ``xxh3_128`` (made before the pieces digest) is refitted in
    place with that kind: whole-file xxh3_128 digests, as its readers expect."""
    with Refitter(demo_moe, _opts(scheme="mxfp8"), "old") as r:
        r.refit(_stream(demo_moe))
    doc = json.loads((shm / "old" / fs.AREA_JSON).read_text())
    doc["digest"] = "xxh3_128"
    os.chmod(shm / "old" / fs.AREA_JSON, 0o600)
    fs.write_json_atomic(shm / "old" / fs.AREA_JSON, doc)
    with Refitter(demo_moe, _opts(scheme="mxfp8"), "old") as r:
        r.refit(_stream(demo_moe_2))
    view = fs.read_area(shm / "old")
    assert (view.version, view.digest) == (2, "xxh3_128")
    for f in view.files:
        assert view.digests[f.name] == xxhash.xxh3_128_hexdigest((view.directory / f.name).read_bytes())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["first-layer", "last-layer"])
@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_cuda_refit_refuses_non_finite_without_committing(demo_moe, demo_moe_2, shm, scheme, where):
    """On CUDA the batched NaN/Inf check is read only once its group's copies are done: a NaN in
    any layer (the first, whose check is read while later layers are staged, or the last, read at
    the end of stage()) is still refused naming the tensor, nothing is committed, and the next
    clean refit goes through; finite values whose L1 norm overflows are not refused."""
    items = [(n, t.cuda()) for n, t in _stream(demo_moe)]
    layers = sorted({int(n.split(".")[2]) for n, _ in items if ".layers." in n})
    layer = layers[0] if where == "first-layer" else layers[-1]
    bad = next(n for n, _ in items if f".layers.{layer}.mlp.experts.1.up_proj" in n)
    huge = next(n for n, _ in items if f".layers.{layer}.mlp.experts.2.up_proj" in n)

    def poison(n, t, value):
        t = t.clone()
        t.view(-1)[5] = value
        t.view(-1)[6] = 3.0e38
        return t

    with Refitter(demo_moe, _opts(scheme=scheme, device="cuda"), "nf") as r:
        assert r._check_group
        r.refit(items)
        poisoned = [
            (n, poison(n, t, float("nan")) if n == bad else poison(n, t, 3.0e38) if n == huge else t) for n, t in items
        ]
        with pytest.raises(QConvertError) as e:
            r.refit(poisoned)
        assert str(e.value) == f"tensor {bad!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite"
        assert fs.read_area(shm / "nf").version == 1
        ok = [(n, poison(n, t, 3.0e38) if n == huge else t) for n, t in items]
        assert r.refit(ok).area.version == 2


def test_engine_side_loader_reads_what_the_refitter_wrote(demo_moe, demo_moe_2, shm, tmp_path):
    """The vLLM worker's staged loader (qconvert/engine/vllm_staged.py) hands vLLM exactly the
    converter's tensors from a refit area, holding the committed slot, and verifies digests."""
    from qconvert.engine import vllm_staged

    opts = _opts(scheme="nvfp4", plan=PlanOptions(last_n_bf16=1))
    want = _convert(demo_moe_2, tmp_path / "c", opts)
    with Refitter(demo_moe, opts, "eng") as r:
        r.refit(_stream(demo_moe))
        r.refit(_stream(demo_moe_2))
        got = {}

        def reload_weights(weights):
            for n, t in weights:
                got[n] = t.clone()
            with pytest.raises(fs.StagingError, match="slot 1"):  # the refitter cannot take it meanwhile
                fs.SlotLock(shm / "eng", 1, shared=False, wait_s=0.05)

        stats = vllm_staged.load_staged(torch.nn.Module(), shm / "eng", reload_weights, verify=True, ranks=(1, 0, 1, 0))
        assert stats["version"] == 2 and stats["slot"] == 1 and stats["verified"]
        _assert_same(want, got)


@pytest.mark.parametrize("recipe", ["te", "4over6"])
def test_device_encode_global_scale_is_numpy_fp32_division(recipe):
    """The GPU jobs' weight_global_scale (no host sync) against NumPy's fp32 division, clamp and
    zero rule on adversarial amaxes (zero, subnormal, tiny, huge, inf, NaN, random normals)."""
    import numpy as np

    from qconvert.convert.numerics.nvfp4 import encode_global_scale_tensor, global_div

    rng = np.random.default_rng(0)
    gs = np.concatenate(
        [
            np.array([0.0, 1e-45, 1e-40, 1.17e-38, 1e-30, 1e-6, 1.0, 3.0e38, np.inf, np.nan], dtype=np.float32),
            np.abs(rng.standard_normal(2000).astype(np.float32))
            * np.float32(10.0) ** rng.integers(-30, 30, 2000).astype(np.float32),
        ]
    )
    for g in gs:
        with np.errstate(all="ignore"):
            want = (
                min(np.float32(global_div(recipe)) / np.float32(g), np.finfo(np.float32).max)
                if g > 0
                else np.float32(1.0)
            )
        got = encode_global_scale_tensor(torch.tensor(g), recipe)
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert np.float32(want).tobytes() == got.numpy().tobytes(), (g, want, got)


@pytest.mark.parametrize("proj", ["down_proj", "up_proj"])
@pytest.mark.parametrize("layout", [None, "flashinfer-trtllm"])
@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_stacked_names_the_non_finite_tensor(demo_moe, shm, tmp_path, monkeypatch, scheme, layout, proj):
    """The stacked quantization (one launch per projection of a layer, the GPU path), run on CPU:
    a NaN in one expert is refused naming that tensor, by the converter's layout job and by the
    Refitter's stacked jobs with their own check."""
    from qconvert.convert import jobs

    monkeypatch.setattr(jobs, "STACKED_DEVICES", {"cuda", "cpu"})
    items = list(_stream(demo_moe))
    bad = next(n for n, _ in items if f".layers.1.mlp.experts.5.{proj}" in n)
    poisoned = [(n, t.clone().index_fill_(0, torch.tensor([0]), float("nan")) if n == bad else t) for n, t in items]
    want = f"tensor {bad!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite"
    opts = _opts(scheme=scheme, layout=layout, **(_W4A4 if scheme == "nvfp4" and layout else {}))
    with Refitter(demo_moe, opts, "s") as r:
        assert not r._check_group
        with pytest.raises(QConvertError) as e:
            r.refit(poisoned)
        assert str(e.value) == want
        r.refit(items)  # and clean weights go through


def test_pack_v2_parts_and_alignment(monkeypatch, tmp_path):
    """Files of at most PART_BYTES (or one tensor), tensors back to back, aligned per the contract,
    readable by safetensors' own parser and accepted by formats.staging.parse_area."""
    import struct

    monkeypatch.setattr(staging, "PART_BYTES", 4096)
    tensors = [(f"w{i}", "BF16", (8, 64)) for i in range(10)]  # 1024 bytes each
    tensors += [
        ("big", "U8", (9000,)),
        ("odd", "U8", (300,)),
        ("odd2", "BF16", (150,)),
        ("s1", "F32", ()),
        ("s2", "F32", (2,)),
        ("b1", "BF16", (3,)),
        ("u", "U8", (5,)),
    ]
    packed = staging.pack_v2(7, (1, 0), tensors)
    names = [n for f, _ in packed for n in f.tensors]
    assert sorted(names) == sorted(n for n, *_ in tensors)
    for f, head in packed:
        assert fs.FILE_RE.match(f.name) and f.rank == (1, 0) and f.name.startswith("g00007-tp1-ep0-")
        specs = sorted(f.tensors.values(), key=lambda t: t.offset)
        assert specs[0].offset == len(head) and len(head) % 256 == 0
        for a, b in zip(specs, specs[1:]):
            assert a.offset + a.nbytes == b.offset  # back to back: safetensors allows no gaps
        assert specs[-1].offset + specs[-1].nbytes == f.size
        if len(f.tensors) > 1:
            assert sum(t.nbytes for t in f.tensors.values() if t.nbytes >= 256) <= 4096
        n = struct.unpack("<Q", head[:8])[0]
        hdr = json.loads(head[8 : 8 + n])
        for name, t in f.tensors.items():
            assert hdr[name]["data_offsets"][0] + len(head) == t.offset and hdr[name]["dtype"] == t.dtype
        (tmp_path / f.name).write_bytes(head + bytes(f.size - len(head)))
        with safe_open(tmp_path / f.name, "pt") as so:
            assert {k: list(so.get_slice(k).get_shape()) for k in so.keys()} == {
                k: list(t.shape) for k, t in f.tensors.items()
            }
    by_name = {n: f for f, _ in packed for n in f.tensors}
    assert len(by_name["odd"].tensors) == 1 and len(by_name["odd2"].tensors) == 1
    assert by_name["s1"] is by_name["u"] is by_name["w9"]  # the small ones close the last aligned file
    spec = fs.AreaSpec({}, fs.DIGEST_XXH3, 2, 1, tuple(f for f, _ in packed))
    assert fs.parse_area(json.loads(json.dumps(spec.to_json()))) == spec


def test_refitter_reloads_sglang_from_its_committed_slot(demo_moe, demo_moe_2, shm):
    """``Refitter(..., engine="sglang").refit`` reloads SGLang as ``qconvert reload sglang`` of the
    area does (docs/reload.md#sglang-disk-update): ``update_weights_from_disk`` of the committed slot's
    directory (request bodies checked against SGLang's structs by the fake server), while the slot's
    shared lock is held, until SGLang answers. A refit meanwhile writes the other slot; one that
    needs the slot SGLang reads waits ``lock_wait_s`` and then refuses, committing nothing."""
    from test_reload_clients import FakeServer
    from test_sglang_client import sglang_routes

    opts = _opts(scheme="mxfp8")
    area = shm / "sg"
    seen = []

    def update(body):  # runs inside the fake server while the client waits for the answer
        slot = int(Path(body["model_path"]).name.split("-")[1])
        assert body["model_path"] == str(fs.slot_dir(area, slot))
        got = _tensors(Path(body["model_path"]))  # what SGLang's loader would read: the committed version
        with pytest.raises(fs.StagingError, match=f"slot {slot}"):
            fs.SlotLock(area, slot, shared=False, wait_s=0.05)
        if not seen:  # first version (slot 0) being read: another trainer step lands in slot 1,
            with Refitter(demo_moe, opts, "sg", lock_wait_s=0.3) as w:
                assert w.refit(_stream(demo_moe_2)).area.slot == 1
                with pytest.raises(QConvertError, match="slot 0 is held by a server reading it"):
                    w.refit(_stream(demo_moe_2))  # the next needs slot 0: refused after 0.3 s
            assert fs.read_area(area).version == 2
        seen.append((slot, body["weight_version"], body["flush_cache"], got))

    state: dict = {}
    srv = FakeServer(sglang_routes(state, update))
    try:
        with Refitter(demo_moe, opts, "sg", urls=[srv.url], engine="sglang", lock_wait_s=0.3) as r:
            res = r.refit(_stream(demo_moe))
            assert [x.ok for x in res.reload] == [True]
            fs.SlotLock(area, 0, shared=False, wait_s=0.05).release()  # SGLang answered: slot 0 free again
            res = r.refit(_stream(demo_moe), weight_version="step-4")  # version 3 (2 came from the other writer)
            assert res.area.version == 3 and res.area.slot == 0
    finally:
        srv.close()
    assert [(s, v, f) for s, v, f, _ in seen] == [(0, "v1", True), (0, "step-4", True)]
    assert state["mode"] == "retract" and not state["paused"]
    want = _convert(demo_moe, shm.parent / "conv", opts)
    for *_, got in seen:
        _assert_same(want, got)


@pytest.mark.parametrize("tp", [1, 2], ids=["preshuffled", "per-rank"])
def test_sglang_reload_refuses_a_preshuffled_area_before_any_request(demo_moe, shm, tp):
    """``qconvert reload sglang`` of a pre-shuffled refit area (made for vLLM) is refused up front,
    naming why by the value ``Unreadable`` (docs/reload.md#sglang-quantized-reload): the server sees
    no request, so it is never paused."""
    from test_reload_clients import FakeServer
    from test_sglang_client import sglang_routes

    from qconvert.client.sglang_client import Unreadable, area_unreadable, reload_sglang

    with Refitter(demo_moe, _opts(scheme="mxfp8", layout="flashinfer-trtllm", engine="vllm", tp=tp), "ps") as r:
        r.refit(_stream(demo_moe))
    assert area_unreadable(shm / "ps") is (Unreadable.PER_RANK if tp == 2 else Unreadable.PRESHUFFLED)
    srv = FakeServer(sglang_routes({}))
    try:
        with pytest.raises(QConvertError, match="holds per-rank" if tp == 2 else "pre-shuffled"):
            reload_sglang([srv.url], "shm:ps", retries=0)
        assert srv.calls == []
    finally:
        srv.close()
