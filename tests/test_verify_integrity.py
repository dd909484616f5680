"""verify must not pass garbage, and must pass qconvert's own good output (issue 24, items 2, 3, 16, 17).

* Linear biases (Qwen2 q/k/v, BERT encoders) are kept byte for byte next to a quantized weight.
* Any non-finite figure fails (a NaN compares false with every bound).
* NVFP4 bytes, global scale included, must equal a fresh quantization of SRC: a global scale off
  in its lowest bit, or DST made from slightly different weights, fails even without checksums.
* With source digests, a different SRC fails with one diagnosis line first; without them the
  report says what cannot be told.
* Pre-shuffled NVFP4 for vLLM (and compressed-tensors) is verified against SRC laid out again.
* The vLLM worker's real error reaches the one-line report.

Tiny Qwen2 / BERT checkpoints are built here and converted by qconvert; tensors are read back with
the safetensors library, not qconvert's reader.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_verify import patch_bytes, tensor_location

from qconvert.cli import main
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.inspect import inspect_checkpoint
from qconvert.verify import format_report, verify

H, INTER, VOCAB = 64, 128, 32
DIALECTS = [
    ("mxfp8", "auto"),
    ("mxfp8", "sglang"),
    ("mxfp8", "modelopt"),
    ("nvfp4", "modelopt"),
    ("nvfp4", "compressed-tensors"),
]


def _r(g, *shape, sc=0.05):
    return (torch.randn(*shape, generator=g) * sc).bfloat16()


def tiny_qwen2(root: Path) -> Path:
    """Qwen2: q/k/v projections with biases, o_proj and the MLP without."""
    g = torch.Generator().manual_seed(0)
    t = {
        "model.embed_tokens.weight": _r(g, VOCAB, H, sc=1),
        "model.norm.weight": torch.ones(H).bfloat16(),
        "lm_head.weight": _r(g, VOCAB, H, sc=1),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(H).bfloat16()
        t[p + "post_attention_layernorm.weight"] = torch.ones(H).bfloat16()
        for n in ("q_proj", "k_proj", "v_proj"):
            t[p + f"self_attn.{n}.weight"], t[p + f"self_attn.{n}.bias"] = _r(g, H, H), _r(g, H, sc=0.5)
        t[p + "self_attn.o_proj.weight"] = _r(g, H, H)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = _r(g, INTER, H), _r(g, INTER, H)
        t[p + "mlp.down_proj.weight"] = _r(g, H, INTER)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": H,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "intermediate_size": INTER,
        "torch_dtype": "bfloat16",
    }
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def tiny_bert(root: Path) -> Path:
    """A BERT encoder: every Linear has a bias (attention, intermediate, output), LayerNorms too."""
    g = torch.Generator().manual_seed(1)
    t = {
        "embeddings.word_embeddings.weight": _r(g, VOCAB, H, sc=1),
        "embeddings.LayerNorm.weight": torch.ones(H).bfloat16(),
        "embeddings.LayerNorm.bias": torch.zeros(H).bfloat16(),
    }
    for i in range(2):
        p = f"encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            t[p + n + ".weight"], t[p + n + ".bias"] = _r(g, H, H), _r(g, H, sc=0.5)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = _r(g, INTER, H), _r(g, INTER, sc=0.5)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = _r(g, H, INTER), _r(g, H, sc=0.5)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = torch.ones(H).bfloat16(), torch.zeros(H).bfloat16()
    cfg = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": H,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": INTER,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def run_convert(src: Path, dst: Path, scheme: str, dialect: str, **kw) -> Path:
    opts = ConvertOptions(
        scheme=scheme, dialect=dialect, plan=PlanOptions(scheme=scheme), progress=False, fsync=False, **kw
    )
    convert(str(src), dst, scheme, opts)
    return dst


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    root = tmp_path_factory.mktemp("biased")
    return {"qwen2": tiny_qwen2(root / "qwen2"), "bert": tiny_bert(root / "bert")}


# ---- item 3: biases -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "bert"])
@pytest.mark.parametrize("scheme,dialect", DIALECTS)
def test_verify_and_inspect_accept_linear_biases(biased, tmp_path, arch, scheme, dialect):
    src = biased[arch]
    dst = run_convert(src, tmp_path / "q", scheme, dialect)
    want = load_file(str(src / "model.safetensors"))
    got = {}
    for f in dst.glob("*.safetensors"):
        got.update(load_file(str(f)))
    biases = [
        n for n in want if n.endswith(".bias") and f"{n[:-5]}.weight" in want and want[f"{n[:-5]}.weight"].dim() == 2
    ]
    assert len(biases) == (6 if arch == "qwen2" else 12)
    scale = "weight_scale_inv" if dialect == "sglang" else "weight_scale"
    quantized_biases = [n for n in biases if f"{n[:-5]}.{scale}" in got]
    assert quantized_biases == biases  # every biased Linear was quantized, its bias kept
    for n in biases:
        assert got[n].dtype == torch.bfloat16 and torch.equal(got[n].view(torch.int16), want[n].view(torch.int16))

    r = verify(str(src), str(dst))
    assert r.ok, r.failures
    n_quant = len(r.tensors)
    assert n_quant == (14 if arch == "qwen2" else 12)
    assert r.kept_identical == len(want) - n_quant  # biases are byte-compared kept tensors
    # inspect: the bias bytes are counted as BF16, not as the quantized format
    rep = inspect_checkpoint(dst)
    assert rep.problems == [] and rep.notes == []
    bias_bytes = sum(want[n].numel() * 2 for n in biases)
    kept_other = sum(
        t.numel() * 2 for n, t in want.items() if n not in biases and f"{n[: -len('.weight')]}.{scale}" not in got
    )
    assert rep.totals["bytes_by_format"]["bf16"] == bias_bytes + kept_other

    # a changed bias byte fails, naming the bias
    name = biases[1]
    f, off, _ = tensor_location(dst, name)
    patch_bytes(f, off, bytes([f.read_bytes()[off] ^ 0x40]))
    r = verify(str(src), str(dst))
    assert not r.ok and any(name in m and "bytes differ" in m for m in r.failures), r.failures


def test_bias_missing_or_extra_in_dst_fails(biased, tmp_path):
    src = biased["qwen2"]
    dst = run_convert(src, tmp_path / "q", "nvfp4", "modelopt", output_checksums=False)
    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.bias"
    del t[name]
    t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(H, dtype=torch.bfloat16)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    r = verify(str(src), str(dst))
    text = "\n".join(r.failures)
    assert f"tensor {name!r}: in the source but not in DST" in text
    assert "'model.layers.0.self_attn.o_proj.bias'" in text and "not derived from any source tensor" in text


# ---- item 2: non-finite figures --------------------------------------------------------------------


def test_engine_nan_kl_fails(demo_dense, tmp_path, monkeypatch):
    """The outside report: `mean KL nan` and PASSED. A figure that is not a number fails."""
    import qconvert.verify as V
    from qconvert.engine.vllm_compare import compare_logprobs

    dst = run_convert(demo_dense, tmp_path / "q", "mxfp8", "auto")
    nan = float("nan")
    ref = [[{"1": -0.1, "2": -2.5}, {"3": -0.2, "4": -1.8}]]
    garbage = [[{"1": nan, "2": nan}, {"3": -0.3, "4": -1.5}]]
    res = compare_logprobs(ref, garbage)
    assert res["nonfinite_positions"] == 1 and math.isnan(res["mean_kl"]) and math.isnan(res["max_kl"])
    assert res["top1_agreement"] == 0.5  # the NaN position does not agree
    # a legitimate -inf logprob on both sides is a finite KL, not NaN
    ok = compare_logprobs([[{"1": 0.0, "2": -math.inf}]], [[{"1": 0.0, "2": -math.inf}]])
    assert ok["mean_kl"] == 0.0 and ok["nonfinite_positions"] == 0 and ok["max_abs_logprob_diff"] == 0.0

    def fake(src, dst, engine, log):
        keep = ("top1_agreement", "mean_kl", "max_kl", "positions", "nonfinite_positions")
        return {"available": True, **{k: res[k] for k in keep}}

    monkeypatch.setattr(V, "engine_compare", fake)
    r = verify(str(demo_dense), str(dst), engine="vllm")
    assert not r.ok and r.checks["engine"] == "FAILED"
    assert any(f.startswith("vLLM: mean_kl nan") and "1 of 2 positions" in f for f in r.failures), r.failures
    # also with --max-kl (the bound would compare false) and for a scheme without a default bound
    assert not verify(str(demo_dense), str(dst), engine="vllm", max_kl=10.0).ok


def test_tensor_nan_figure_fails(demo_dense, tmp_path, monkeypatch):
    """A NaN SQNR or block ratio with a finite relative error fails the tensor (it used to be
    compared only through the relative error)."""
    import qconvert.verify as V

    dst = run_convert(demo_dense, tmp_path / "q", "nvfp4", "modelopt")
    real = V.encoded_compare
    target = "model.layers.1.mlp.down_proj"

    def poisoned(x, ts, fmt, m, workers):
        rel, sqnr, worst, first = real(x, ts, fmt, m, workers)
        return (rel, math.nan, worst, first) if m.name == target else (rel, sqnr, worst, first)

    monkeypatch.setattr(V, "encoded_compare", poisoned)
    r = verify(str(demo_dense), str(dst))
    assert not r.ok
    assert [t.module for t in r.tensors if not t.ok] == [target]
    assert any(f"tensor {target}.weight: non-finite error figures" in f for f in r.failures), r.failures
    assert "SQNR min nan dB" in format_report(r)


@pytest.mark.parametrize("xn,en", [(math.nan, 0.0), (math.inf, 1.0), (1.0, math.nan), (math.nan, math.nan)])
def test_figures_of_non_finite_sums_are_not_a_pass(xn, en):
    """sum x^2 NaN with sum err^2 0 used to give rel err 0 and SQNR +inf: a perfect decode."""
    from qconvert.verify import _figures

    rel, sqnr = _figures(xn, en)
    assert not (rel <= 0.06) and not (math.isfinite(sqnr) or sqnr == math.inf)


# ---- item 2: NVFP4 bytes are exact -----------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["te", "modelopt"])
@pytest.mark.parametrize(
    "dialect,suffix", [("modelopt", "weight_scale_2"), ("compressed-tensors", "weight_global_scale")]
)
def test_nvfp4_global_scale_lowest_bit_fails(demo_dense, tmp_path, dialect, suffix, recipe):
    """Without output checksums nothing but the values can catch it; the error figures barely move
    (1 ulp of the global scale), so the check has to be exact."""
    dst = run_convert(demo_dense, tmp_path / "q", "nvfp4", dialect, recipe=recipe, output_checksums=False)
    r = verify(str(demo_dense), str(dst))
    assert r.ok, r.failures
    assert all(t.exact for t in r.tensors) and len(r.tensors) == 28
    name = f"model.layers.1.self_attn.k_proj.{suffix}"
    f, off, n = tensor_location(dst, name)
    with safe_open(str(f), "pt") as fh:
        before = float(fh.get_tensor(name).reshape(-1)[0])
    raw = f.read_bytes()
    patch_bytes(f, off, bytes([raw[off] ^ 1]))  # lowest mantissa bit (little-endian fp32)
    with safe_open(str(f), "pt") as fh:
        after = float(fh.get_tensor(name).reshape(-1)[0])
    assert after != before and abs(after - before) / before < 2e-7
    r = verify(str(demo_dense), str(dst))
    assert not r.ok
    assert [t.module for t in r.tensors if not t.ok] == ["model.layers.1.self_attn.k_proj"]
    msg = next(m for m in r.failures if name in m)
    assert repr(after) in msg and repr(before) in msg and "model.layers.1.self_attn.q_proj" in msg  # the q/k/v group


def _finetune(src: Path, dst: Path, scale: float = 0.002) -> Path:
    """The same model after a few steps of training: every 2-D projection moved a little, the
    embeddings, norms and lm_head untouched."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    for f in dst.glob("*.safetensors"):
        t = load_file(str(f))
        for k, v in t.items():
            if v.dim() == 2 and "_proj" in k:
                t[k] = (v.float() * (1 + scale * torch.randn(v.shape, generator=g))).to(v.dtype)
        save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_different_source_without_digests_fails_and_says_what_it_cannot_tell(demo_dense, tmp_path):
    dst = run_convert(demo_dense, tmp_path / "q", "nvfp4", "modelopt", source_checksums=False)
    ft = _finetune(demo_dense, tmp_path / "ft")
    r = verify(str(ft), str(dst))
    worst = max(t.rel_err for t in r.tensors)
    assert worst < 0.12  # the error figures alone cannot tell the fine-tune from the source
    assert not r.ok
    assert (
        r.diagnosis
        == r.failures[0]
        == (
            "28 of 47 tensors do not match SRC: DST was probably converted from "
            "different weights than SRC (no source digests to confirm it); pass the "
            "SRC DST was converted from"
        )
    )
    assert all("the group" in f or "recipe gives" in f or "quantization" in f for f in r.failures[1:]), r.failures
    assert any("no source digests" in w and "cannot tell whether DST was converted from SRC" in w for w in r.warnings)
    assert r.checks["source"] == "not checked: no source digests"
    ok = verify(str(demo_dense), str(dst))
    assert ok.ok and any("no source digests" in w for w in ok.warnings)
    assert "warning: no source digests" in format_report(ok)


def test_different_source_with_digests_leads_with_the_diagnosis(demo_dense, tmp_path):
    dst = run_convert(demo_dense, tmp_path / "q", "mxfp8", "auto")
    ft = _finetune(demo_dense, tmp_path / "ft", scale=0.05)
    r = verify(str(ft), str(dst))
    assert not r.ok and r.checks["source"] == "FAILED"
    man = json.loads((dst / "qconvert.json").read_text())["source"]["sha256"]
    shard = sorted(p.name for p in ft.glob("*.safetensors"))[0]
    import hashlib

    got = hashlib.sha256((ft / shard).read_bytes()).hexdigest()
    assert r.failures[0] == r.diagnosis
    assert r.diagnosis.startswith(
        f"DST was converted from different weights than SRC: shard {shard} sha256 {got} vs {man[shard]}"
    )
    assert len(r.failures) > 10  # every re-quantized tensor differs too
    res = CliRunner().invoke(main, ["verify", str(ft), str(dst)])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    head = max(i for i, ln in enumerate(lines) if ln.startswith("verify: "))  # the report's first line
    assert lines[head + 1] == f"  diagnosis  : {r.diagnosis}"
    failed = next(i for i, ln in enumerate(lines) if ln.startswith("FAILED"))
    assert lines[failed] == f"FAILED: {r.diagnosis}"
    assert f"{len(r.failures) - 1} further problems, expected from that cause" in lines[failed + 1]
    assert len(lines) - failed <= 7  # not 50 "re-run the conversion" lines


# ---- item 16: pre-shuffled NVFP4 for vLLM / compressed-tensors ---------------------------------------


@pytest.mark.parametrize(
    "dialect,engine", [("modelopt", "vllm"), ("compressed-tensors", "vllm"), ("compressed-tensors", "sglang")]
)
def test_preshuffled_nvfp4_verifies(demo_moe, tmp_path, dialect, engine):
    """Layouts whose plain scalars cannot be inverted (vLLM folds the activation scales into the
    global scales; compressed-tensors stores 2688/amax) used to fail with 5 problems."""
    plain = run_convert(demo_moe, tmp_path / "plain", "nvfp4", dialect, input_mode="unit")
    lay = run_convert(
        demo_moe,
        tmp_path / "lay",
        "nvfp4",
        dialect,
        input_mode="unit",
        layout="flashinfer-trtllm",
        engine=engine,
        tp=2,
        output_checksums=False,
    )
    r = verify(str(demo_moe), str(lay))
    assert r.ok, r.failures
    assert r.checks["layout"].startswith("ok") and "byte for byte" in r.checks["layout"]
    assert all(t.exact for t in r.tensors) and len(r.tensors) == 4 * (4 + 8 * 3)
    # the experts decode exactly as the plain conversion's (whose decode test_verify checks independently)
    rp = verify(str(demo_moe), str(plain))
    assert rp.ok, rp.failures
    want = {t.module: t.rel_err for t in rp.tensors}
    got = {t.module: t.rel_err for t in r.tensors}
    if dialect == "modelopt":
        assert got == want
    else:  # the plain checkpoint decodes with 1 / (2688 / amax), the layout with amax / 2688
        assert got == pytest.approx(want, rel=1e-6) and got != want
    res = CliRunner().invoke(main, ["verify", str(demo_moe), str(lay)])
    assert res.exit_code == 0 and res.output.rstrip().endswith("PASSED"), res.output

    # one bit of a folded scalar, of a packed weight byte: named
    for param, off in (("g1_scale_c" if engine == "vllm" else "g1_alphas", 0), ("w13_weight", 4097)):
        bad = tmp_path / f"bad-{param}"
        shutil.copytree(lay, bad)
        name = f"model.layers.2.mlp.experts.trtllm_tp1_ep0.{param}"
        f, o, _ = tensor_location(bad, name)
        patch_bytes(f, o + off, bytes([f.read_bytes()[o + off] ^ 1]))
        r = verify(str(demo_moe), str(bad))
        assert not r.ok and r.checks["layout"] == "FAILED"
        assert any(f"tensor {name!r}: 1 of" in m and "bytes differ" in m for m in r.failures), r.failures


# ---- item 17: the vLLM worker's error --------------------------------------------------------------


def test_vllm_worker_error_reaches_the_report(demo_dense, tmp_path, monkeypatch):
    """`vLLM worker failed (exit 1):` and nothing else was all a user saw; here vLLM is made
    unimportable in the worker (a package that raises as a missing one does)."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    tree = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", f"{fake.parent}:{tree}")
    dst = run_convert(demo_dense, tmp_path / "q", "mxfp8", "auto")
    r = verify(str(demo_dense), str(dst), engine="vllm")
    assert not r.ok and r.checks["engine"] == "FAILED"
    msg = next(f for f in r.failures if f.startswith("vLLM comparison failed"))
    assert "ModuleNotFoundError: No module named 'vllm'" in msg and "vLLM is not installed for" in msg
    assert "\n" not in msg


def test_worker_error_line_from_a_vllm_traceback():
    from qconvert.engine.vllm_compare import worker_error

    err = (
        "INFO 12-04 loading\n[vllm_compare] loading /m/dst\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in <module>\n    LLM(**kw)\n'
        "ValueError: NVFP4 weight_scale for layer 'parallel_lm_head' was never loaded\n"
    )
    assert worker_error(err, ["[vllm_compare] loading /m/dst"]) == (
        "ValueError: NVFP4 weight_scale for layer 'parallel_lm_head' was never loaded [while: loading /m/dst]"
    )
    assert worker_error("Killed\n") == "Killed"
    assert worker_error("") == "no error output"
    assert "\x1b" not in worker_error("RuntimeError: \x1b[2Kfake PASSED\n")


# ---- decisions travel as values ----------------------------------------------------------------------


def test_conflicts_are_values_not_words(demo_dense, tmp_path, monkeypatch):
    import qconvert.verify as V
    from qconvert.formats.detect import Code, detect, finding

    dst = run_convert(demo_dense, tmp_path / "q", "mxfp8", "auto")

    def wordy(*a, **kw):
        d = detect(*a, **kw)  # an informational finding whose text has the words a conflict's text has
        d.findings.append(
            finding(Code.UNKNOWN_QUANT_METHOD, method="the README says this is a test; config.json declares nothing")
        )
        return d

    monkeypatch.setattr(V, "detect", wordy)
    r = verify(str(demo_dense), str(dst))
    assert r.ok, r.failures
    assert any("README says" in w for w in r.warnings)
    monkeypatch.undo()
    man = json.loads((dst / "qconvert.json").read_text())
    man["scheme"] = "nvfp4"
    (dst / "qconvert.json").write_text(json.dumps(man))
    r = verify(str(demo_dense), str(dst))
    assert not r.ok and r.checks["format"] == "FAILED"
    assert any("qconvert.json says nvfp4/auto but config and tensors say mxfp8/auto" in f for f in r.failures)
    rep = inspect_checkpoint(dst)
    assert any("says nvfp4/auto" in n for n in rep.notes)


def test_preshuffled_layout_tensor_of_wrong_shape_is_one_line(demo_moe, tmp_path):
    lay = run_convert(
        demo_moe,
        tmp_path / "lay",
        "nvfp4",
        "modelopt",
        input_mode="unit",
        layout="flashinfer-trtllm",
        engine="vllm",
        output_checksums=False,
    )
    name = "model.layers.1.mlp.experts.trtllm.w13_weight"
    for f in lay.glob("*.safetensors"):
        t = load_file(str(f))
        if name in t:
            t[name] = t[name][:, :128].contiguous()
            save_file(t, str(f), metadata={"format": "pt"})
    res = CliRunner().invoke(main, ["verify", str(demo_moe), str(lay)])
    assert (
        res.exit_code == 1
        and "Traceback" not in res.output
        and res.exception is None
        or isinstance(res.exception, SystemExit)
    ), res.output
    assert f"tensor {name!r}: torch.uint8 [8, 128, 128], the layout gives torch.uint8 [8, 256, 128]" in res.output
    assert "tensor model.layers.1.mlp.experts.*: the layout tensors cannot be decoded" in res.output


def test_missing_exclusion_key_fails(demo_dense, tmp_path):
    """The auto dialect keeps its list under both keys: verify fails when one is gone (the check looks
    the key up by formats.exclusions.config_where, not by the end of a label)."""
    dst = run_convert(demo_dense, tmp_path / "q", "mxfp8", "auto")
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["ignored_layers"]  # a list to lose
    del cfg["quantization_config"]["modules_to_not_convert"]
    (dst / "config.json").write_text(json.dumps(cfg))
    r = verify(str(demo_dense), str(dst))
    assert not r.ok and r.checks["exclusions"] == "FAILED"
    assert any("quantization_config.modules_to_not_convert is missing" in f for f in r.failures), r.failures
