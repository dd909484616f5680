"""Fused-expert MoE tensors (docs/formats.md#fused-expert-tensors): one 3-D tensor per layer,
``…experts.gate_up_proj`` [E, 2I, H] and ``…experts.down_proj`` [E, H, I] as transformers 5 holds
them (or transposed, [E, H, 2I] / [E, I, H]), with or without ``.weight``.

The oracle for the bytes is transformers 5's own modeling code: the fused tensors are built from
the split demo checkpoint the way transformers 5 does (gate first, ``chunk(2, dim=-1)`` of
``linear(x, gate_up_proj[e])``), checked against transformers' Qwen3MoeExperts forward, and the
conversion of the fused checkpoint must equal the conversion of the split one, tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qconvert.convert.demo import write_sharded
from qconvert.convert.fused import Refusal
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.errors import PlanError, QConvertError


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def fuse(
    tensors: dict[str, torch.Tensor], num_layers: int, num_experts: int, orientation: str = "out_in", suffix: str = ""
) -> dict[str, torch.Tensor]:
    """The split checkpoint's experts as transformers 5 stores them: gate_up_proj [E, 2I, H] (gate
    first), down_proj [E, H, I]; ``in_out`` transposes each expert's matrix."""
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts."
        gu = torch.stack(
            [
                torch.cat([tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]])
                for e in range(num_experts)
            ]
        )
        dn = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(num_experts)])
        if orientation == "in_out":
            gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        out[p + "gate_up_proj" + suffix] = gu
        out[p + "down_proj" + suffix] = dn
    return out


def write_like(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None, n_shards: int = 2
) -> Path:
    """A checkpoint with ``src``'s other files and ``tensors``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, dst / f.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    write_sharded(dst, tensors, n_shards)
    return dst


@pytest.fixture(scope="module")
def split_tensors(demo_moe):
    return _load_dir(demo_moe)


@pytest.fixture(scope="module")
def config(demo_moe):
    return json.loads((demo_moe / "config.json").read_text())


@pytest.fixture(scope="module")
def fused_dirs(demo_moe, split_tensors, config, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    n, e = config["num_hidden_layers"], config["num_experts"]
    return {
        "out_in": write_like(demo_moe, root / "out_in", fuse(split_tensors, n, e)),
        "in_out_w": write_like(demo_moe, root / "in_out_w", fuse(split_tensors, n, e, "in_out", ".weight")),
    }


def test_fused_matches_transformers_experts(split_tensors, config):
    """The fused layout built here is what transformers 5's Qwen3MoeExperts computes with."""
    tf = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    cfg = tf.Qwen3MoeConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    experts = m.Qwen3MoeExperts(cfg)
    fused = fuse(split_tensors, 1, config["num_experts"])
    with torch.no_grad():
        experts.gate_up_proj.copy_(fused["model.layers.0.mlp.experts.gate_up_proj"])
        experts.down_proj.copy_(fused["model.layers.0.mlp.experts.down_proj"])
    x = torch.randn(5, config["hidden_size"])
    top_k_index = torch.tensor([[3, 1]] * 5)
    top_k_weights = torch.ones(5, 2)
    with torch.no_grad():
        got = experts(x, top_k_index, top_k_weights).float()
    want = torch.zeros(5, config["hidden_size"])
    p = "model.layers.0.mlp.experts."
    for e in (3, 1):
        g = x.float() @ split_tensors[f"{p}{e}.gate_proj.weight"].float().T
        u = x.float() @ split_tensors[f"{p}{e}.up_proj.weight"].float().T
        want += (torch.nn.functional.silu(g) * u) @ split_tensors[f"{p}{e}.down_proj.weight"].float().T
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


CASES = {
    "mxfp8": dict(scheme="mxfp8"),
    "mxfp8_last1": dict(scheme="mxfp8", last_n_bf16=1),
    "nvfp4": dict(scheme="nvfp4"),
    "nvfp4_last1": dict(scheme="nvfp4", last_n_bf16=1),
    "mxfp8_layout": dict(scheme="mxfp8", layout="flashinfer-trtllm"),
    "nvfp4_layout": dict(scheme="nvfp4", layout="flashinfer-trtllm", input_mode="unit"),
}


def _opts(scheme, last_n_bf16=0, layout=None, input_mode="weight-only"):
    return ConvertOptions(
        scheme=scheme,
        plan=PlanOptions(scheme=scheme, last_n_bf16=last_n_bf16),
        layout=layout,
        input_mode=input_mode,
        fsync=False,
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", ["out_in", "in_out_w"])
def test_bytes_equal_split_first(case, form, demo_moe, fused_dirs, tmp_path, monkeypatch):
    """Converting the fused checkpoint gives every output tensor, and the quantization config,
    byte for byte as converting the split checkpoint."""
    kw = CASES[case]
    if form == "in_out_w":  # every job on the dispatch thread: a merged job's parts run side by side
        from qconvert.convert import kernels

        monkeypatch.setattr(kernels, "SMALL_JOB_BYTES", 0)
    a = convert(str(demo_moe), tmp_path / "split", opts=_opts(**kw))
    b = convert(str(fused_dirs[form]), tmp_path / "fused", opts=_opts(**kw))
    ta, tb = _load_dir(tmp_path / "split"), _load_dir(tmp_path / "fused")
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and ta[n].shape == tb[n].shape, n
        assert torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)), n
    ca = json.loads((tmp_path / "split" / "config.json").read_text())
    cb = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert ca.get("quantization_config") == cb.get("quantization_config")
    assert a.plan.exclusions == b.plan.exclusions
    assert sorted((r.module, r.action, r.fmt, r.bytes_in, r.bytes_out) for r in a.rows) == sorted(
        (r.module, r.action, r.fmt, r.bytes_in, r.bytes_out) for r in b.rows
    )


def _refused(tmp_path, demo_moe, tensors, config, match, code):
    d = write_like(demo_moe, tmp_path / "src", tensors, config)
    with pytest.raises(QConvertError, match=match) as ei:
        convert(str(d), tmp_path / "out", opts=_opts("mxfp8"))
    assert "\n" not in str(ei.value)
    assert ei.value.code == code
    assert not (tmp_path / "out").exists()
    return str(ei.value)


def test_wrong_orientation_in_one_layer_caught(demo_moe, split_tensors, config, tmp_path):
    """One layer's down_proj handed over transposed while the rest is [E, out, in]: refused (it
    would quantize along the wrong axis), naming both forms."""
    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    n = "model.layers.2.mlp.experts.down_proj"
    t[n] = t[n].transpose(1, 2).contiguous()
    # (gate_up_proj is square here, 2I == H: its sibling decides, so layer 2 reads as [E, in, out])
    msg = _refused(tmp_path, demo_moe, t, config, "different orientations", Refusal.MIXED_ORIENTATIONS)
    assert "model.layers.2.mlp.experts." in msg and "model.layers.0.mlp.experts." in msg


def test_siblings_disagreeing_refused(config):
    """gate_up_proj [E, 2I, H] beside down_proj [E, I, H] (2I != H): the layer contradicts itself."""
    from qconvert.convert import fused

    e, h, i = config["num_experts"], config["hidden_size"], 64
    inv = {
        "model.layers.0.mlp.experts.gate_up_proj": ("BF16", (e, 2 * i, h)),
        "model.layers.0.mlp.experts.down_proj": ("BF16", (e, i, h)),
    }
    with pytest.raises(PlanError, match="different orientations") as ei:
        fused.expand(inv, dict(config, moe_intermediate_size=i))
    assert ei.value.code == Refusal.SIBLINGS_DISAGREE
    assert "experts.down_proj" in str(ei.value) and "experts.gate_up_proj" in str(ei.value)


def test_mixed_orientations_across_layers_refused(demo_moe, split_tensors, config, tmp_path):
    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    for proj in ("gate_up_proj", "down_proj"):
        n = f"model.layers.1.mlp.experts.{proj}"
        t[n] = t[n].transpose(1, 2).contiguous()
    _refused(tmp_path, demo_moe, t, config, "in one checkpoint", Refusal.MIXED_ORIENTATIONS)


def test_square_without_sibling_refused(demo_moe, split_tensors, config, tmp_path):
    """hidden_size == moe_intermediate_size: down_proj [E, H, H] fits both orientations; without
    its gate_up_proj sibling nothing decides."""
    cfg = dict(config, moe_intermediate_size=config["hidden_size"])
    e, h = config["num_experts"], config["hidden_size"]
    t = {n: v for n, v in split_tensors.items() if ".experts." not in n}
    for i in range(config["num_hidden_layers"]):
        t[f"model.layers.{i}.mlp.experts.down_proj"] = torch.zeros(e, h, h, dtype=torch.bfloat16)
    _refused(tmp_path, demo_moe, t, cfg, "square shape", Refusal.SQUARE)


def test_square_with_sibling_decides(demo_moe, config, tmp_path):
    from qconvert.convert import fused

    e, h = config["num_experts"], config["hidden_size"]
    cfg = dict(config, moe_intermediate_size=h)
    inv = {
        "model.layers.0.mlp.experts.gate_up_proj": ("BF16", (e, h, 2 * h)),
        "model.layers.0.mlp.experts.down_proj": ("BF16", (e, h, h)),
    }
    _, views = fused.expand(inv, cfg)
    assert {v.orientation for v in views.values()} == {fused.IN_OUT}


def test_fused_and_per_expert_duplicates_refused(demo_moe, split_tensors, config, tmp_path):
    t = dict(split_tensors)
    t.update({k: v for k, v in fuse(split_tensors, 1, config["num_experts"]).items() if ".experts." in k})
    _refused(tmp_path, demo_moe, t, config, "holds the layer twice", Refusal.BOTH_FORMS)


def test_unknown_expert_tensor_refused(demo_moe, split_tensors, config, tmp_path):
    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    t["model.layers.0.mlp.experts.gate_up_proj_bias"] = torch.zeros(config["num_experts"], 256, dtype=torch.bfloat16)
    _refused(tmp_path, demo_moe, t, config, "does not know", Refusal.UNKNOWN_TENSOR)


def test_wrong_shape_refused(demo_moe, split_tensors, config, tmp_path):
    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    t["model.layers.0.mlp.experts.down_proj"] = t["model.layers.0.mlp.experts.down_proj"][:4].contiguous()
    _refused(tmp_path, demo_moe, t, config, "do not belong to this config.json", Refusal.SHAPE)


@pytest.mark.parametrize(
    "arch,match,code",
    [
        ("GptOssForCausalLM", "gpt-oss", Refusal.REFUSED_ARCH),
        ("MixtralForCausalLM", "Mixtral", Refusal.REFUSED_ARCH),
        ("Llama4ForConditionalGeneration", "Llama 4", Refusal.REFUSED_ARCH),
        ("SomethingMoeForCausalLM", "does not know what engines load", Refusal.UNKNOWN_ARCH),
    ],
)
def test_unsupported_architectures_refused(arch, match, code, demo_moe, split_tensors, config, tmp_path):
    from qconvert.convert import fused

    inv = {
        n: ("BF16", tuple(v.shape))
        for n, v in fuse(split_tensors, config["num_hidden_layers"], config["num_experts"]).items()
    }
    with pytest.raises(PlanError, match=match) as ei:
        fused.expand(inv, dict(config, architectures=[arch]))
    assert ei.value.code == code


def test_dry_run_lists_per_expert_rows(fused_dirs, demo_moe):
    a = convert(str(demo_moe), None, opts=ConvertOptions(scheme="mxfp8", dry_run=True))
    b = convert(str(fused_dirs["out_in"]), None, opts=ConvertOptions(scheme="mxfp8", dry_run=True))
    assert sorted(r.module for r in a.rows) == sorted(r.module for r in b.rows)
    assert any(r.sources == ("model.layers.0.mlp.experts.0.gate_proj.weight",) for r in b.rows)
    assert f"{2 * len(b.plan.moe_layers)} fused expert tensors ([E, out, in]) read per expert" in "\n".join(b.notes)
    assert not any("fused expert" in n for n in a.notes)


@pytest.fixture(scope="module")
def tf_model(demo_moe):
    """A transformers 5 Qwen3-MoE model loaded from the split demo checkpoint: transformers itself
    merges the per-expert weights into its fused parameters."""
    tf = pytest.importorskip("transformers")
    model = tf.AutoModelForCausalLM.from_pretrained(str(demo_moe), dtype=torch.bfloat16)
    return model


@pytest.mark.parametrize("scheme,plan", [("mxfp8", PlanOptions(last_n_bf16=1)), ("nvfp4", PlanOptions())])
@pytest.mark.parametrize("reference", ["split", "fused"])
def test_refit_from_transformers_named_parameters(
    scheme, plan, reference, tf_model, demo_moe, fused_dirs, tmp_path, monkeypatch
):
    """refit takes ``named_parameters()`` of a transformers 5 MoE (fused expert names and shapes)
    and stages the bytes the converter writes for the reference checkpoint."""
    from qconvert.trainer.refit import stage_refit

    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    names = dict(tf_model.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the names transformers 5 yields
    assert not any(".experts.0." in n for n in names)
    ref = demo_moe if reference == "split" else fused_dirs["out_in"]
    opts = ConvertOptions(
        scheme=scheme, plan=PlanOptions(scheme=scheme, last_n_bf16=plan.last_n_bf16), fsync=False, progress=False
    )
    convert(str(demo_moe), tmp_path / "converted", opts=opts)
    res = stage_refit(
        ((n, p.detach()) for n, p in tf_model.named_parameters()), reference=ref, stage_name="r", options=opts
    )
    want, got = _load_dir(tmp_path / "converted"), _load_dir(res.area.path)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k].reshape(-1).view(torch.uint8), got[k].reshape(-1).view(torch.uint8)), k


def test_refit_refuses_wrong_fused_shape(tf_model, demo_moe, tmp_path, monkeypatch):
    from qconvert.trainer.refit import stage_refit

    monkeypatch.setenv("QCONVERT_SHM_ROOT", str(tmp_path / "shm"))
    items = [(n, p.detach()) for n, p in tf_model.named_parameters()]
    items = [(n, p.transpose(1, 2) if n.endswith("layers.0.mlp.experts.down_proj") else p) for n, p in items]
    with pytest.raises(PlanError, match="experts.down_proj") as ei:
        stage_refit(items, reference=demo_moe, stage_name="r")
    assert ei.value.code == Refusal.SHAPE


def test_unshuffle_of_fused_layout_equals_plain(demo_moe, fused_dirs, tmp_path):
    """``unshuffle`` of a fused source's pre-shuffled conversion gives the split source's plain
    conversion (the layout job reads the fused tensors; unshuffle sees per-expert layouts)."""
    from qconvert.convert.unshuffle import unshuffle_checkpoint

    convert(str(fused_dirs["in_out_w"]), tmp_path / "lay", opts=_opts("mxfp8", layout="flashinfer-trtllm"))
    convert(str(demo_moe), tmp_path / "plain", opts=_opts("mxfp8"))
    unshuffle_checkpoint(tmp_path / "lay", tmp_path / "back")
    ta, tb = _load_dir(tmp_path / "plain"), _load_dir(tmp_path / "back")
    assert ta.keys() == tb.keys()
    for n in ta:
        assert torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)), n


@pytest.mark.vllm
def test_vllm_loads_fused_source_conversion(fused_dirs, demo_moe, tmp_path):
    """A fused Qwen3-MoE checkpoint (transformers 5's layout) converted by qconvert loads in vLLM
    CPU with qconvert's plugin, and its logprobs equal a BF16 checkpoint of its dequantized
    weights (tests/test_vllm_cpu_plugin.py's comparison); the experts run quantized. The fused BF16
    source itself also loads in vLLM 0.32 (its Qwen3-MoE loader reads fused names) with the split
    source's logprobs, which ``verify --check-in-engine vllm`` relies on for a fused SRC."""
    pytest.importorskip("vllm")
    from test_vllm_cpu_plugin import (
        MAX_TOKENS,
        MOE_METHOD,
        MOE_VS_DEQUANT_MEAN_KL,
        PROMPTS,
        _all_finite,
        convert_with_qconvert,
        make_dequantized,
    )

    from qconvert.engine.vllm_compare import compare_logprobs, run_in_vllm

    keys = ["auto", "nv_a16"]
    ck = {k: convert_with_qconvert(fused_dirs["out_in"], tmp_path / k, k) for k in keys}
    dq = {k: make_dequantized(ck[k], tmp_path / ("dq_" + k)) for k in keys}
    jobs = [{"model": dq[k]} for k in keys] + [{"model": ck[k], "inspect": True} for k in keys]
    jobs += [{"model": demo_moe}, {"model": fused_dirs["out_in"]}]
    res = run_in_vllm(jobs, PROMPTS, MAX_TOKENS, top_k=20, score_with_first=True)["jobs"]
    split, fz = res[-2]["stages"][0], res[-1]["stages"][0]
    assert _all_finite(fz)
    assert compare_logprobs(split["score"], fz["score"])["max_abs_logprob_diff"] == 0.0
    assert split["tokens"] == fz["tokens"]
    for i, k in enumerate(keys):
        ref, q = res[i], res[len(keys) + i]
        st, st_ref = q["stages"][0], ref["stages"][0]
        assert _all_finite(st_ref) and _all_finite(st), k
        m = compare_logprobs(st_ref["score"], st["score"])
        # vLLM's quantized CPU MoE (plain-torch experts) against its BF16 MoE kernel: the bound and
        # reason of tests/test_vllm_cpu_plugin.py::test_equals_bf16_of_qconverts_dequantized_weights
        assert m["top1_agreement"] >= 0.9 and m["mean_kl"] < MOE_VS_DEQUANT_MEAN_KL, (k, m)
        assert q["layers"]["model.layers.0.mlp.experts.routed_experts"] == MOE_METHOD[k], (k, q["layers"])
        assert q["layers"]["model.layers.0.mlp.gate"] == "UnquantizedLinearMethod", k


@pytest.mark.parametrize("case", ["mxfp8_last1", "nvfp4", "mxfp8_layout"])
def test_verify_against_fused_source(case, fused_dirs, tmp_path):
    """``verify`` takes a fused SRC: every per-expert output is checked against its slice of the
    fused tensor (values, kept bytes, layouts)."""
    from qconvert.verify import verify

    src = fused_dirs["in_out_w"]
    convert(str(src), tmp_path / "q", opts=_opts(**CASES[case]))
    r = verify(str(src), str(tmp_path / "q"))
    assert r.ok, r.failures
    if "layout" not in case:
        assert any(t.module.endswith(".experts.3.up_proj") for t in r.tensors)


def test_verify_catches_wrong_expert_against_fused_source(fused_dirs, tmp_path):
    """Swapping two experts' quantized gate weights in DST fails verify against the fused SRC."""
    from safetensors.torch import save_file

    from qconvert.verify import verify

    src = fused_dirs["out_in"]
    q = tmp_path / "q"
    convert(str(src), q, opts=_opts("mxfp8"))
    a, b = "model.layers.1.mlp.experts.2.gate_proj.", "model.layers.1.mlp.experts.5.gate_proj."
    for f in q.glob("*.safetensors"):
        t = load_file(f)
        if a + "weight" in t:
            assert b + "weight" in t  # one layer's experts sit in one shard
            for s in ("weight", "weight_scale"):
                t[a + s], t[b + s] = t[b + s], t[a + s]
            save_file(t, f, metadata={"format": "pt"})
    r = verify(str(src), str(q))
    assert not r.ok
    assert any("experts.2.gate_proj" in x or "experts.5.gate_proj" in x for x in r.failures), r.failures


def test_inspect_fused_source(fused_dirs, demo_moe, split_tensors, config, tmp_path):
    from qconvert.inspect import inspect_checkpoint

    r = inspect_checkpoint(fused_dirs["in_out_w"])
    assert r.moe and r.scheme == "bf16"
    note = [n for n in r.notes if n.startswith("fused expert tensors")]
    assert note == [
        f"fused expert tensors: {2 * config['num_hidden_layers']} (…experts.gate_up_proj / down_proj, "
        "[E, in, out] (transposed)); qconvert writes them as per-expert experts.{e}.gate_proj/up_proj/"
        "down_proj"
    ]
    assert not any(n.startswith("fused expert tensors") for n in inspect_checkpoint(demo_moe).notes)
    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    d = write_like(demo_moe, tmp_path / "gptoss", t, dict(config, architectures=["GptOssForCausalLM"]))
    assert any(
        n.startswith("fused expert tensors: qconvert refuses them (refused-architecture):") and "gpt-oss" in n
        for n in inspect_checkpoint(d).notes
    )


def test_cli_refusal_is_one_line_exit_1(demo_moe, split_tensors, config, tmp_path):
    """The silent pass-through of issue 21 (fused experts kept BF16 but declared quantized) is now
    a one-line refusal at the command line, with nothing written."""
    from click.testing import CliRunner

    from qconvert.cli import main

    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    d = write_like(demo_moe, tmp_path / "src", t, dict(config, architectures=["GptOssForCausalLM"]))
    r = CliRunner().invoke(main, ["mxfp8", str(d), str(tmp_path / "out")])
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "model.layers.0.mlp.experts.gate_up_proj" in lines[0] and "gpt-oss" in lines[0], r.output
    assert not (tmp_path / "out").exists()


def test_nan_in_fused_tensor_names_it_in_one_line(demo_moe, split_tensors, config, tmp_path):
    """A NaN inside a fused tensor: a fresh ``qconvert`` process exits 1 with one line naming the
    fused tensor the user has and the expert, not a per-expert name that is not in the files."""
    from test_hostile_convert import assert_one_line, cli

    t = fuse(split_tensors, config["num_hidden_layers"], config["num_experts"])
    n = "model.layers.1.mlp.experts.gate_up_proj"
    t[n] = t[n].clone()
    t[n][5, config["moe_intermediate_size"] + 3, 7] = float("nan")  # expert 5, up half
    d = write_like(demo_moe, tmp_path / "src", t)
    r = cli("mxfp8", str(d), str(tmp_path / "out"))
    line = assert_one_line(r, 1, "NaN")
    assert f"'{n}' (expert 5, up_proj)" in line, line
    assert not (tmp_path / "out").exists()


def test_config_without_sizes_refused(split_tensors, config):
    """Orientation is decided from config.json's sizes: without them, a one-line refusal."""
    from qconvert.convert import fused

    inv = {n: ("BF16", tuple(v.shape)) for n, v in fuse(split_tensors, 1, config["num_experts"]).items()}
    cfg = {k: v for k, v in config.items() if k not in ("moe_intermediate_size", "intermediate_size")}
    with pytest.raises(PlanError, match="moe_intermediate_size") as ei:
        fused.expand(inv, cfg, "/x/config.json")
    assert ei.value.code == Refusal.CONFIG_KEYS and "/x/config.json" in str(ei.value)


@pytest.mark.parametrize(
    "pattern", ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj*"]
)
def test_keep_bf16_naming_a_fused_tensor_keeps_its_layer(pattern, demo_moe, fused_dirs, tmp_path):
    """``--keep-bf16`` with the fused name the user sees keeps that layer's experts BF16, as the
    split checkpoint's ``--keep-bf16 'model.layers.1.mlp.experts.*'`` does, byte for byte."""
    src = fused_dirs["out_in"] if "*" not in pattern else fused_dirs["in_out_w"]
    a = convert(
        str(demo_moe),
        tmp_path / "split",
        opts=ConvertOptions(scheme="mxfp8", plan=PlanOptions(keep_bf16=("model.layers.1.mlp.experts.*",)), fsync=False),
    )
    b = convert(
        str(src),
        tmp_path / "fused",
        opts=ConvertOptions(scheme="mxfp8", plan=PlanOptions(keep_bf16=(pattern,)), fsync=False),
    )
    assert "model.layers.1.mlp.experts" in b.plan.exclusions
    assert a.plan.exclusions == b.plan.exclusions
    assert not any("matched no tensor" in n for n in b.notes)
    ta, tb = _load_dir(tmp_path / "split"), _load_dir(tmp_path / "fused")
    assert ta.keys() == tb.keys()
    assert tb["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    for n in ta:
        assert torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)), n
