"""The one-pass C kernels (numerics/cpu_kernels.py) give the bytes of the torch op chains, which
the oracle tests hold to vLLM, torchao, ModelOpt and CUDA's own conversions (those tests call
mxfp8_quantize / nvfp4_quantize, which run the C kernels on CPU wherever they could be built).

Expected values here are the chains themselves, run directly (mxfp8.quantize_cpu_chain,
nvfp4.quantize_cpu_chain), on every BF16 bit pattern and the adversarial cases of kernel_cases.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import kernel_cases as kc
import numpy as np
import pytest
import torch

from qconvert.convert.numerics import cpu_kernels, mxfp8, nvfp4

HAVE_CC = cpu_kernels._compiler() is not None
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
C_CASES = [c for c in kc.CASES if c[1].dtype in (torch.bfloat16, torch.float32)]
C_IDS = [c[0] for c in C_CASES]


def test_kernels_are_built_where_a_compiler_exists():
    assert cpu_kernels.library() is not None, cpu_kernels.status()
    assert cpu_kernels.status() == "compiled C"


def test_avx2_loops_are_built_on_avx2_cpus():
    with open("/proc/cpuinfo") as f:
        has = " avx2 " in f.read().replace("\n", " ")
    assert cpu_kernels.avx2() == has


@pytest.fixture(params=["vector", "portable"])
def c_path(request, monkeypatch):
    """Both C code paths: the AVX2 loops (where built) and the portable ones (QCONVERT_NO_AVX2)."""
    if request.param == "portable":
        monkeypatch.setenv("QCONVERT_NO_AVX2", "1")
    elif not cpu_kernels.avx2():
        pytest.skip("no AVX2 loops on this CPU")
    return request.param


def _chain_mxfp8(x):
    xb = x.reshape(-1, 32)
    q = torch.empty(xb.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(xb.shape[0], dtype=torch.uint8)
    mxfp8.quantize_cpu_chain(xb, q, s, 1)
    return q.view(torch.uint8), s


def _chain_nvfp4(x, g, recipe):
    xb = x.reshape(-1, 16)
    p = torch.empty(xb.shape[0], 8, dtype=torch.uint8)
    sc = torch.empty(xb.shape[0], dtype=torch.float8_e4m3fn)
    nvfp4.quantize_cpu_chain(xb, g, nvfp4.recipe_scale_2(g, recipe), recipe, p, sc, 1)
    return p, sc.view(torch.uint8)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("case", C_CASES, ids=C_IDS)
def test_mxfp8_c_equals_chain(case, workers, c_path):
    _, x = case
    assert cpu_kernels.usable(x.reshape(-1, 32))
    q, s = mxfp8.mxfp8_quantize(x, workers=workers)
    q_ref, s_ref = _chain_mxfp8(x)
    keep = kc.finite_rows(x, 32)
    assert torch.equal(s.reshape(-1), s_ref)
    assert int((q.reshape(-1, 32).view(torch.uint8)[keep] != q_ref[keep]).sum()) == 0


@pytest.mark.parametrize("recipe", ["te", "modelopt", "4over6"])
@pytest.mark.parametrize("case", C_CASES, ids=C_IDS)
def test_nvfp4_c_equals_chain(case, recipe, c_path):
    name, x = case
    keep = kc.finite_rows(x, 16)
    for gs in kc.global_amaxes(name, x):
        g = nvfp4._global_amax(x, None if gs is None else torch.tensor(gs))
        p, sc, s2 = nvfp4.nvfp4_quantize(x, global_amax=g, recipe=recipe, workers=2)
        p_ref, sc_ref = _chain_nvfp4(x, g, recipe)
        p, sc = p.reshape(-1, 8), sc.reshape(-1).view(torch.uint8)
        assert int((sc[keep] != sc_ref[keep]).sum()) == 0, (name, gs)
        assert int((p[keep] != p_ref[keep]).sum()) == 0, (name, gs)
        assert torch.equal(p & 0x77, p_ref & 0x77), (name, gs)  # magnitudes everywhere: NaN -> 7
        assert torch.equal(s2.view(torch.int32), nvfp4.recipe_scale_2(g, recipe).view(torch.int32)), (name, gs)


def _f32_bits(v) -> int:
    return int(np.asarray(v, dtype=np.float32).view(np.uint32))


@pytest.mark.parametrize("recipe", ["te", "modelopt", "4over6"])
def test_numpy_tensor_scalars_equal_the_tensor_ops(recipe):
    """The C kernel path takes its per-tensor factors from numpy fp32 scalars (cpu_tensor_scalars);
    they must be the bits of the tensor ops the CUDA and chain paths use, over the whole fp32 range
    and its edges: 0, subnormals, either side of TE's S_enc clamp (2688 / FLT_MAX, 1536 / FLT_MAX for
    4over6), FLT_MAX, inf, NaN."""
    clamp = np.float32(nvfp4.global_div(recipe)) / np.float32(np.finfo(np.float32).max)
    gs = [
        0.0,
        1.4e-45,
        7.2e-43,
        1e-38,
        1e-36,
        float(clamp),
        3e38,
        float(np.finfo(np.float32).max),
        float("inf"),
        float("nan"),
        1.0,
        2688.0,
        1536.0,
        0.1,
        448.0,
        6.0,
    ]
    gs += [float(np.nextafter(clamp, np.float32(d))) for d in (0, 1)]
    gs += [float(v) for v in np.random.default_rng(0).random(200).astype(np.float32) * 10.0 ** np.arange(-20, 20, 0.2)]
    for gv in gs:
        g = torch.tensor(gv, dtype=torch.float32)
        s2, k0, k1 = nvfp4.cpu_tensor_scalars(np.float32(gv), recipe)
        ref_s2 = nvfp4.recipe_scale_2(g, recipe)
        if recipe == "te":
            ref_k0, ref_k1 = nvfp4.te_tensor_scalars(g)
        elif recipe == "4over6":
            ref_k0, ref_k1 = nvfp4.four_over_six_tensor_scalars(g)
        else:
            ref_k0, ref_k1 = nvfp4.modelopt_tensor_divisor(ref_s2), ref_s2
        got = [_f32_bits(v) for v in (s2, k0, k1)]
        want = [int(t.view(torch.int32)) & 0xFFFFFFFF for t in (ref_s2, ref_k0, ref_k1)]
        assert got == want, (gv, got, want)


@pytest.mark.parametrize("blocks", [1, 4095, 8192, 8193, 70001])
def test_chunk_boundaries_and_threads(blocks):
    g = torch.Generator().manual_seed(blocks)
    x = (torch.randn(blocks, 32, generator=g) * torch.logspace(-3, 3, blocks).unsqueeze(1)).bfloat16()
    q_ref, s_ref = _chain_mxfp8(x)
    for workers in (1, 2, 5):
        q, s = mxfp8.mxfp8_quantize(x, workers=workers)
        assert torch.equal(q.view(torch.uint8), q_ref) and torch.equal(s.reshape(-1), s_ref)
    ga = nvfp4._global_amax(x, None)
    for recipe in ("te", "4over6"):
        p_ref, sc_ref = _chain_nvfp4(x, ga, recipe)
        for workers in (1, 4):
            p, sc, _ = nvfp4.nvfp4_quantize(x, recipe=recipe, workers=workers)
            assert torch.equal(p.reshape(-1, 8), p_ref) and torch.equal(sc.reshape(-1).view(torch.uint8), sc_ref)


def test_non_contiguous_and_fp16_inputs_use_the_chain_with_the_same_bytes():
    x = (torch.randn(64, 128) * 0.1).bfloat16()
    xt = x.t()  # not contiguous: reshape copies, the kernel sees a contiguous copy
    q1, s1 = mxfp8.mxfp8_quantize(xt)
    q2, s2 = mxfp8.mxfp8_quantize(xt.contiguous())
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    h = x.half()
    assert not cpu_kernels.usable(h.reshape(-1, 32))
    q3, s3 = mxfp8.mxfp8_quantize(h)
    q4, s4 = _chain_mxfp8(h)
    assert torch.equal(q3.reshape(-1, 32).view(torch.uint8), q4) and torch.equal(s3.reshape(-1), s4)


def test_disabled_or_no_compiler_falls_back_to_the_chain(tmp_path):
    """QCONVERT_CPU_KERNELS=0, and a CC that does not exist: the chains run, the bytes are equal."""
    code = (
        "import torch; from qconvert.convert.numerics import cpu_kernels as c, mxfp8_quantize as q;"
        "x = (torch.randn(4096, 32, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16();"
        "a, s = q(x); print(c.status()); print(int(a.view(torch.uint8).int().sum()), int(s.int().sum()))"
    )
    outs = []
    for env in (
        {"QCONVERT_CPU_KERNELS": "0"},
        {"CC": str(tmp_path / "no-such-cc"), "QCONVERT_CACHE_DIR": str(tmp_path)},
        {"QCONVERT_CACHE_DIR": str(tmp_path / "fresh")},
    ):
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.splitlines())
    assert "disabled by QCONVERT_CPU_KERNELS=0" in outs[0][0]
    assert outs[1][0].startswith("torch op chains (") and "no-such-cc" in outs[1][0]
    assert outs[2][0] == "compiled C"  # built afresh into an empty cache directory
    assert outs[0][1] == outs[1][1] == outs[2][1]
    assert any(p.suffix == ".so" for p in (tmp_path / "fresh").iterdir())


def test_cuda_quantizer_choice(monkeypatch):
    """QCONVERT_CUDA_QUANTIZER picks the CUDA core; Triton falls back to eager where it cannot run,
    and a misspelt value is a one-line error, not a traceback."""
    from qconvert.convert.numerics import cuda_kernels
    from qconvert.convert.pipeline import cuda_quantizer
    from qconvert.errors import QConvertError

    monkeypatch.delenv("QCONVERT_COMPILE", raising=False)
    monkeypatch.delenv("QCONVERT_CUDA_QUANTIZER", raising=False)
    assert cuda_quantizer("cuda") == ("triton" if cuda_kernels.available("cuda") else "eager")
    monkeypatch.setenv("QCONVERT_COMPILE", "1")
    assert cuda_quantizer("cuda") == "compile"
    monkeypatch.setenv("QCONVERT_CUDA_QUANTIZER", "eager")
    assert cuda_quantizer("cuda") == "eager"
    monkeypatch.setenv("QCONVERT_CUDA_QUANTIZER", "tritn")
    with pytest.raises(QConvertError, match="QCONVERT_CUDA_QUANTIZER='tritn'"):
        cuda_quantizer("cuda")


def test_whole_conversion_without_the_kernels_has_the_same_bytes_and_says_so(demo_moe, tmp_path, monkeypatch):
    import json

    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    digests, notes = [], []
    for name, state in (("c", None), ("chain", {"lib": None, "why": "disabled for this test"})):
        if state is not None:
            monkeypatch.setattr(cpu_kernels, "_state", state)
        for scheme, recipe in (("mxfp8", "te"), ("nvfp4", "te"), ("nvfp4", "4over6")):
            dst = tmp_path / f"{name}-{scheme}-{recipe}"
            res = convert(
                str(demo_moe),
                str(dst),
                scheme,
                ConvertOptions(scheme=scheme, recipe=recipe, plan=PlanOptions(scheme=scheme), progress=False),
            )
            digests.append(json.loads((dst / "qconvert.json").read_text())["outputs"]["sha256"])
            notes.append(" ".join(res.notes))
    assert digests[:3] == digests[3:] and digests[1] != digests[2]
    assert "torch op chains" not in notes[0]
    assert "not the C kernels (disabled for this test)" in notes[3] and "not the C kernels" in notes[4]


@pytest.mark.parametrize("workers", [1, 3])
def test_abs_max_equals_torch(workers):
    """The global amax of NVFP4 and the finiteness check: max |x| exactly, NaN if any NaN."""
    allbf = kc._all_bf16(nan=False)
    big = torch.cat(
        [allbf[torch.randperm(allbf.numel(), generator=torch.Generator().manual_seed(s))] for s in range(40)]
    )  # > 2M elements: several chunks
    cases = [
        allbf,
        big,
        torch.zeros(5, dtype=torch.bfloat16),
        (torch.randn(3_000_001) * 1e30).float(),
        torch.tensor([-0.0, -1e-45, 3.0]),
        allbf.float(),
    ]
    for x in cases:
        ref = x.float().abs().max()
        got = cpu_kernels.abs_max(x, workers)
        assert got.dtype == torch.float32 and got.view(torch.int32) == ref.view(torch.int32)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = big.clone()
        x[1_234_567] = bad
        got = cpu_kernels.abs_max(x, workers)
        assert torch.isnan(got) if bad != bad else got == float("inf")


_SELF_CHECK_RUN = """
import sys, torch
from pathlib import Path
from qconvert.convert.numerics import cpu_kernels as c, nvfp4
c._SRC = Path(sys.argv[1])
print(c.status())
x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
g = x.float().abs().max()
p, sc, _ = nvfp4.nvfp4_quantize(x, global_amax=g, recipe="te", workers=1)
xb = x.reshape(-1, 16)
p_ref = torch.empty(xb.shape[0], 8, dtype=torch.uint8)
sc_ref = torch.empty(xb.shape[0], dtype=torch.float8_e4m3fn)
nvfp4.quantize_cpu_chain(xb, g, nvfp4.recipe_scale_2(g, "te"), "te", p_ref, sc_ref, 1)
print("same" if torch.equal(p.reshape(-1, 8), p_ref) else "differ")
"""


def _run_mutated(tmp_path, old: str, new: str) -> list[str]:
    src = cpu_kernels._SRC.read_text()
    assert src.count(old) == 1, old
    mutated = tmp_path / "cpu_kernels.c"
    mutated.write_text(src.replace(old, new))
    r = subprocess.run(
        [sys.executable, "-c", _SELF_CHECK_RUN, str(mutated)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "QCONVERT_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_a_build_that_fails_the_self_check_is_not_used(tmp_path):
    """A miscompiled (here: mutated) portable E2M1 rounding, in every build: no build passes the
    self-check, the torch chains run, the bytes are right and status says why."""
    status, verdict = _run_mutated(tmp_path, "t1 = c + 8388610.0f", "t1 = c + 8388611.0f")
    assert status.startswith("torch op chains (") and "failed the self-check" in status, status
    assert "NVFP4" in status
    assert verdict == "same"
    assert not list((tmp_path / "cache").glob("*.so"))
    assert len(list((tmp_path / "cache").glob("*.rejected"))) == 2


def test_a_native_build_that_fails_the_self_check_falls_back_to_the_baseline_build(tmp_path):
    """A mutation in the AVX2 loop alone (as GCC 12's AVX-512 miscompile was in one select of it):
    the -march=native build is rejected, the baseline build (no AVX2 loops) runs, same bytes."""
    if not cpu_kernels.avx2():
        pytest.skip("no AVX2 loops on this CPU")
    status, verdict = _run_mutated(tmp_path, "_mm256_set1_ps(8388610.0f)", "_mm256_set1_ps(8388611.0f)")
    assert status.startswith("compiled C, baseline ISA (") and "-march=native" in status, status
    assert "vector loops" in status
    assert verdict == "same"
    assert [p.name.endswith("-baseline.so") for p in (tmp_path / "cache").glob("*.so")] == [True]


#: (source text, its mutation, what the self-check names): mutations of one AVX2 loop each, which
#: the self-check must catch, rejecting the -march=native build for the baseline one
AVX2_LOOP_MUTATIONS = {
    # the 4over6 error table decoded with 1535 instead of 1536 picks the other candidate on some blocks
    "nvfp4-4over6": ("_mm256_set1_ps(1536.0f)", "_mm256_set1_ps(1535.0f)", "NVFP4 4over6"),
    # NVFP4 -> BF16 tables kept from one row's per-tensor scale into a next row with another
    "nvfp4-dequant-table": ("if (b == b0 || f2u(gr) != made_for)", "if (b == b0)", "NVFP4 to BF16"),
    # MXFP8 -> BF16: a subnormal code's offset taken from the wrong table entry
    "mxfp8-dequant-table": (
        "mx8_bf16_exact((uint16_t)(m & 7), 0)",
        "mx8_bf16_exact((uint16_t)((m + 1) & 7), 0)",
        "MXFP8 to BF16",
    ),
}


@pytest.mark.parametrize("case", list(AVX2_LOOP_MUTATIONS))
def test_a_native_build_with_a_wrong_avx2_loop_falls_back_to_the_baseline_build(tmp_path, case):
    """The self-check covers each AVX2 loop: a build with one mutated is rejected, the baseline
    build runs, same bytes."""
    if not cpu_kernels.avx2():
        pytest.skip("no AVX2 loops on this CPU")
    old, new, named = AVX2_LOOP_MUTATIONS[case]
    status, verdict = _run_mutated(tmp_path, old, new)
    assert status.startswith("compiled C, baseline ISA (") and named in status, status
    assert verdict == "same"
