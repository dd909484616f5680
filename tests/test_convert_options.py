"""The conversion's options and decisions: the scheme is stated once, build_jobs returns what it
decided, and layout jobs check and quantize as the plain jobs do."""

from __future__ import annotations

import json

import pytest

from qconvert.convert.checkpoint import load_checkpoint
from qconvert.convert.demo import demo_config, demo_tensors, write_sharded
from qconvert.convert.jobs import BuiltJobs, build_jobs
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions, build_plan
from qconvert.errors import CheckpointError, QConvertError
from qconvert.formats import dialects

EXPERT = "model.layers.1.mlp.experts.5.up_proj.weight"


def test_a_scheme_argument_that_disagrees_with_the_options_is_an_error(demo_dense, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(QConvertError, match="'nvfp4' disagrees with ConvertOptions.scheme 'mxfp8'"):
        convert(str(demo_dense), dst, "nvfp4", ConvertOptions(scheme="mxfp8", progress=False))
    assert not dst.exists() and list(tmp_path.iterdir()) == []


def test_the_plan_takes_its_scheme_from_the_options(demo_dense, tmp_path):
    opts = ConvertOptions(scheme="nvfp4", plan=PlanOptions(last_n_bf16=1), progress=False, fsync=False)
    assert opts.plan.scheme == "nvfp4" and opts.plan.last_n_bf16 == 1
    res = convert(str(demo_dense), tmp_path / "out", opts=opts)  # the scheme stated once, in the options
    assert res.scheme == "nvfp4"
    man = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    assert man["scheme"] == "nvfp4" and man["options"]["scheme"] == "nvfp4" and man["options"]["last_n_bf16"] == 1
    # changed after the options were made: the plan follows at convert()
    opts = ConvertOptions(progress=False, fsync=False, dry_run=True)
    opts.scheme = "nvfp4"
    assert convert(str(demo_dense), None, opts=opts).plan.options.scheme == "nvfp4"


def test_build_jobs_returns_the_layout_layers_and_leaves_the_options_alone(demo_moe):
    cfg = json.loads((demo_moe / "config.json").read_text())
    inv = {n: (e.dtype, e.shape) for n, e in load_checkpoint(str(demo_moe)).tensors.items()}
    opts = ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=1), layout="flashinfer-trtllm")
    before = dict(vars(opts))
    plan = build_plan(inv, cfg, opts.plan)
    built = build_jobs(plan, "mxfp8", dialects.resolve_dialect("mxfp8", None), opts)
    assert isinstance(built, BuiltJobs)
    n = cfg["num_hidden_layers"]
    assert built.layout_layers == {
        f"model.layers.{i}.mlp.experts": ("bf16" if i == n - 1 else "mxfp8") for i in range(n)
    }
    assert vars(opts) == before
    assert sum(j.fmt.endswith("+trtllm") for j in built.jobs) == n


def _poisoned(d, name, value=float("nan")):
    config = demo_config("qwen3-moe")
    t = demo_tensors(config)
    t[name] = t[name].clone()
    t[name].view(-1)[7] = value
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    write_sharded(d, t, 3)
    return d


@pytest.mark.parametrize("scheme,extra", [("bf16", {}), ("mxfp8", {}), ("nvfp4", {"input_mode": "unit"})])
def test_layout_jobs_name_the_non_finite_tensor_as_plain_jobs_do(tmp_path, scheme, extra):
    src = _poisoned(tmp_path / "src", EXPERT, float("inf") if scheme == "bf16" else float("nan"))
    dst = tmp_path / "out"
    opts = ConvertOptions(scheme=scheme, layout="flashinfer-trtllm", progress=False, fsync=False, **extra)
    with pytest.raises(CheckpointError) as e:
        convert(str(src), dst, opts=opts)
    assert str(e.value) == (f"tensor {EXPERT!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite")
    assert not dst.exists()
    opts.allow_non_finite = True
    convert(str(src), dst, opts=opts)
    assert (dst / "qconvert.json").is_file()


def test_layout_jobs_quantize_on_all_cores_as_plain_jobs_do(demo_moe, tmp_path, monkeypatch):
    """The layout job quantizes every expert matrix through the plain jobs' helper, one matrix per
    thread on several threads at once, each single-threaded (as job threads run plain experts);
    not on torch's thread count, which is 1 inside a conversion."""
    import threading

    from qconvert.convert import kernels
    from qconvert.convert.numerics import mxfp8

    monkeypatch.setattr(kernels, "CPU_WORKERS", 3)
    monkeypatch.setattr(kernels, "SMALL_JOB_BYTES", 0)  # every job on the calling thread
    seen = []
    real = mxfp8.mxfp8_quantize

    def spy(x, workers=None, blocks_fn=None):
        seen.append((threading.current_thread().name, workers, tuple(x.shape)))
        return real(x, workers=workers, blocks_fn=blocks_fn)

    monkeypatch.setattr("qconvert.convert.jobs.mxfp8_quantize", spy)
    res = convert(
        str(demo_moe),
        tmp_path / "out",
        opts=ConvertOptions(scheme="mxfp8", layout="flashinfer-trtllm", progress=False, fsync=False),
    )
    experts = [t for t in res.plan.quantized if ".experts." in t.name]
    assert experts and len(seen) == res.n_quantized, (len(seen), res.n_quantized)
    on_layout = [(name, w) for name, w, _ in seen if name.startswith("qconvert-layout")]
    assert len(on_layout) == len(experts) and {w for _, w in on_layout} == {1}, on_layout[:3]
    assert len({name for name, _ in on_layout}) >= 2  # side by side, up to one thread per core (CPU_WORKERS)
