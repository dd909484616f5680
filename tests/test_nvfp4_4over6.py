"""NVFP4 "4over6" recipe (docs/formats.md#nvfp4-4over6) against an independent NumPy
implementation of the published definition (TransformerEngine 2.17's reference quantizer with
``nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MAE"``, no fast math).

No installed package runs 4over6 on a CPU (FlashInfer 0.7.4 has it only in its CUDA and CuTe-DSL
kernels; TransformerEngine is not installed), so the oracle is written here from the definition,
with a different structure from qconvert's: E4M3 and E2M1 by nearest-value search in value tables
(not bit manipulation), NumPy float32 scalar algebra, and the two candidates kept side by side.

Each check runs every CPU path of ``nvfp4_quantize``: the C kernel's AVX2 loops (where built), its
portable loops (``QCONVERT_NO_AVX2``) and the torch op chain (C kernels switched off).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qconvert.convert.numerics import cpu_kernels
from qconvert.convert.numerics.nvfp4 import NVFP4_BLOCK, SMALL_BLOCKS, nvfp4_dequantize, nvfp4_quantize
from tests.test_bad_inputs import make_model, run_cli
from tests.test_numerics_nvfp4 import adversarial_bf16, random_bf16

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)
E4M3_MAX_4OVER6 = 256
LEVELS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
SIGNED = np.concatenate([LEVELS, -LEVELS]).astype(np.float32)
SIGNED[8] = -0.0


def _e4m3_values() -> np.ndarray:
    out = []
    for b in range(127):
        e, m = b >> 3, b & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


E4M3 = _e4m3_values()


def e4m3_byte(s: np.ndarray) -> np.ndarray:
    """Byte of the E4M3 value nearest to s >= 0 (ties: even mantissa), values above 448 -> 448."""
    s = np.minimum(s.astype(np.float64), 448.0)
    d = np.abs(s[:, None] - E4M3[None, :])
    best = d.min(axis=1, keepdims=True)
    tied = d == best
    even = tied & (np.arange(127) % 2 == 0)[None, :]
    return np.where(even.any(1), even.argmax(1), tied.argmax(1)).astype(np.uint8)


def e2m1_code(v: np.ndarray) -> np.ndarray:
    """Signed E2M1 code of v: nearest level to |v| (ties: even code), saturating at 6; the sign is
    v's sign bit, as the CUDA conversion sets it."""
    a = np.minimum(np.abs(v.astype(np.float64)), 6.0)
    d = np.abs(a[..., None] - LEVELS)
    best = d.min(axis=-1, keepdims=True)
    tied = d == best
    even = tied & (np.arange(8) % 2 == 0)
    mag = np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))
    return (mag | (np.signbit(v).astype(np.int64) << 3)).astype(np.uint8)


def reference_4over6(x: torch.Tensor, global_amax=None):
    """(packed bytes, scale bytes, scale_2, picked map-to-4) of the published definition."""
    xf = x.float().numpy().reshape(-1, NVFP4_BLOCK)
    g = F(np.abs(xf).max()) if global_amax is None else F(global_amax)
    denom = F(6 * E4M3_MAX_4OVER6)
    with np.errstate(all="ignore"):
        s_enc = np.minimum(denom / g, FLT_MAX)
        if g == 0 or s_enc == 0:
            s_enc = F(1.0)
        s_dec = F(1.0) / s_enc
        scale_2 = F(1.0) / FLT_MAX if (g > 0 and denom / g > FLT_MAX) else g / denom
        base = (np.abs(xf).max(axis=1) / F(6.0)) * s_enc
        cand = {}
        for name, factor in (("map6", F(1.0)), ("map4", F(1.5))):
            sb = e4m3_byte(base * factor)
            sf = E4M3[sb].astype(np.float32)
            inv = np.minimum(F(1.0) / (sf * s_dec), FLT_MAX)
            codes = e2m1_code(xf * inv[:, None])
            vals = SIGNED[codes]
            err = np.zeros(xf.shape[0], dtype=np.float32)
            for i in range(NVFP4_BLOCK):
                dq = ((vals[:, i] * sf) * g) / denom
                err = err + np.abs(dq - xf[:, i])
            cand[name] = (sb, codes, err)
    pick4 = cand["map4"][2] < cand["map6"][2]
    sb = np.where(pick4, cand["map4"][0], cand["map6"][0])
    codes = np.where(pick4[:, None], cand["map4"][1], cand["map6"][1]).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(-1), sb, F(scale_2), pick4


def adversarial_1536(k: int, seed: int = 0) -> torch.Tensor:
    """Blocks built for global amax 1536 * 2^k, where S_enc is a power of two: a block with
    amax 6 * 2^(j+k) gets map-to-6 scale 2^j and map-to-4 scale 1.5 * 2^j, so its elements land on
    E2M1 ties and on exact levels of one candidate or the other; and blocks whose two candidates
    have equal error (a lone maximum: 6 under map-to-6 and 4 under map-to-4, both exact)."""
    g = torch.Generator().manual_seed(seed)
    unit0 = 2.0**k
    rows = []
    top = torch.zeros(NVFP4_BLOCK, dtype=torch.float64)
    top[0] = 1536 * unit0
    rows.append(top)
    for j in range(-12, 8):
        u = 2.0 ** (j + k)
        pool = [t * u for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0, 6.0, 2.0 / 3.0, 8.0 / 3.0, 4.5)] + [
            0.0,
            -0.0,
        ]
        for rep in range(3):
            idx = torch.randint(0, len(pool), (NVFP4_BLOCK,), generator=g)
            b = torch.tensor([pool[i] for i in idx], dtype=torch.float64)
            b *= torch.where(torch.rand(NVFP4_BLOCK, generator=g) < 0.5, -1.0, 1.0)
            b[rep] = 6 * u
            rows.append(b)
        lone = torch.zeros(NVFP4_BLOCK, dtype=torch.float64)
        lone[7] = -6 * u
        rows.append(lone)
        rows.append(torch.full((NVFP4_BLOCK,), 6 * u, dtype=torch.float64))
    rows.append(torch.full((NVFP4_BLOCK,), -0.0, dtype=torch.float64))
    rows.append(torch.zeros(NVFP4_BLOCK, dtype=torch.float64))
    for rel in (1e-6, 3e-7, 1e-9):  # block scales in and below E4M3's subnormal range
        rows.append(torch.linspace(-1, 1, NVFP4_BLOCK, dtype=torch.float64) * 1536 * unit0 * rel)
    while len(rows) % 4:
        rows.append(torch.zeros(NVFP4_BLOCK, dtype=torch.float64))
    x = torch.stack(rows).to(torch.bfloat16).reshape(-1, 4 * NVFP4_BLOCK)
    assert float(x.float().abs().max()) == 1536 * unit0
    return x


def _check(x: torch.Tensor, global_amax=None):
    packed, scale, scale_2 = nvfp4_quantize(x, global_amax=global_amax, recipe="4over6")
    want_p, want_s, want_s2, pick4 = reference_4over6(x, global_amax)
    got_p = packed.view(torch.uint8).reshape(-1).numpy()
    got_s = scale.view(torch.uint8).reshape(-1).numpy()
    bad_s = np.flatnonzero(got_s != want_s)
    assert bad_s.size == 0, (
        f"{bad_s.size} block scales differ, first block {bad_s[0]}: {got_s[bad_s[0]]} != {want_s[bad_s[0]]}"
    )
    bad_p = np.flatnonzero(got_p != want_p)
    assert bad_p.size == 0, f"{bad_p.size} code bytes differ, first at {bad_p[0]}"
    assert np.float32(scale_2.item()).tobytes() == want_s2.tobytes()
    return pick4


@pytest.fixture(params=["c-vector", "c-portable", "chain"])
def cpu_path(request, monkeypatch):
    """Which CPU quantizer ``nvfp4_quantize`` runs: the C kernel's AVX2 loops, its portable loops,
    or the torch op chain."""
    if request.param == "chain":
        monkeypatch.setattr(cpu_kernels, "_state", {"lib": None, "why": "switched off by the test"})
    elif cpu_kernels.library() is None:
        pytest.skip(f"no C kernels here: {cpu_kernels.status()}")
    elif request.param == "c-portable":
        monkeypatch.setenv("QCONVERT_NO_AVX2", "1")
    elif not cpu_kernels.avx2():
        pytest.skip("no AVX2 loops on this CPU")
    return request.param


CASES = (
    [("random", s) for s in (1, 2, 3)]
    + [("adv1536", k) for k in (-30, -4, 0, 9)]
    + [("adv2688", k) for k in (-3, 0, 5)]
)


def _input(kind, arg):
    if kind == "random":
        return random_bf16(seed=arg, shape=(48, 256))
    if kind == "adv1536":
        return adversarial_1536(arg, seed=arg + 40)
    return adversarial_bf16(global_exp=arg, seed=arg + 7)


@pytest.mark.parametrize("kind,arg", CASES)
@pytest.mark.parametrize("shared", [False, True])
def test_4over6_matches_published_definition(kind, arg, shared, cpu_path):
    x = _input(kind, arg)
    g = None
    if shared:  # a fused group whose other member has the larger amax
        g = float(np.float32(float(x.float().abs().max()) * 1.37))
    pick4 = _check(x, g)
    if kind == "random":  # both candidates are exercised
        assert 0.05 < pick4.mean() < 0.95, pick4.mean()


def test_4over6_ties_keep_map_to_6(cpu_path):
    x = adversarial_1536(0)
    _, scale, _ = nvfp4_quantize(x, recipe="4over6")
    s = scale.float().reshape(-1)
    xb = x.float().reshape(-1, NVFP4_BLOCK)
    lone = ((xb != 0).sum(1) == 1) & (xb.abs().amax(1) < 1536) & (xb.abs().amax(1) / 6 >= 2.0**-6)
    assert lone.sum() >= 10
    # a lone maximum is exact under both candidates: the tie keeps map-to-6 (scale amax/6 * S_enc)
    assert torch.equal(s[lone], xb.abs().amax(1)[lone] / 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_4over6_other_source_dtypes(dtype, cpu_path):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(32, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (32, 1), generator=g).float())).to(dtype)
    _check(x)


def test_4over6_tiny_global_amax_and_zero_tensor(cpu_path):
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 1e-37).float()
    _check(x)  # S_enc clamps at FLT_MAX, scale_2 = 1/FLT_MAX
    z = torch.zeros(4, 32, dtype=torch.bfloat16)
    p, s, s2 = nvfp4_quantize(z, recipe="4over6")
    assert not p.any() and not s.view(torch.uint8).any() and float(s2) == 0.0


def test_4over6_chunked_cpu_path_equals_one_pass(cpu_path):
    x = random_bf16(seed=9, shape=(SMALL_BLOCKS // 8 + 40, 256))
    assert x.numel() // NVFP4_BLOCK > SMALL_BLOCKS
    _check(x)
    one = nvfp4_quantize(x, recipe="4over6", workers=1)
    many = nvfp4_quantize(x, recipe="4over6", workers=3)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1].view(torch.uint8), many[1].view(torch.uint8))


@pytest.mark.parametrize("rows,k", [(1, 16), (3, 48), (5, 16), (17, 32), (9, 144), (33, 80)])
def test_4over6_row_counts_off_the_kernel_groups(rows, k, cpu_path):
    """Block counts that are not multiples of the C kernel's groups (8 blocks for AVX2, 16 for the
    portable loops): the tails run the portable loops, with the same bytes."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = (torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())).to(
        torch.bfloat16
    )
    _check(x)
    _check(x.float(), float(np.float32(float(x.float().abs().max()) * 3)))


def test_4over6_subnormal_blocks_and_huge_global_amax(cpu_path):
    """Blocks in the BF16/fp32 subnormal range, under their own global amax (their block scales are
    normal) and under a huge one (their scales round to E4M3 zero, and to its subnormals)."""
    g = torch.Generator().manual_seed(11)
    tiny = torch.randn(16, 64, generator=g) * torch.logspace(-45, -36, 16).unsqueeze(1)
    for x in (tiny.bfloat16(), tiny):
        _check(x)
        for big in (1e6, 3e38, float(np.finfo(np.float32).max)):
            _check(x, big)
    _check(random_bf16(seed=12, shape=(8, 128)), float(np.finfo(np.float32).max))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_4over6_non_finite_weight_refused(tmp_path, value, cpu_path):
    """A weight holding NaN or +-Inf: the same one-line refusal as the other recipes, no output."""
    name = "model.layers.1.self_attn.k_proj.weight"

    def poison(t):
        t[name].view(-1)[7] = value

    src = make_model(tmp_path / "src", mutate=poison)
    for recipe in ("te", "4over6"):
        dst = tmp_path / f"out-{recipe}"
        code, out, _ = run_cli("nvfp4", src, dst, "--no-progress", "--recipe", recipe)
        errs = [ln for ln in out.splitlines() if ln.startswith("error: ")]
        assert code == 1 and len(errs) == 1 and name in errs[0] and "NaN or Inf" in errs[0], out
        assert not dst.exists()


def test_4over6_error_below_te_on_random_weights():
    x = random_bf16(seed=4, shape=(64, 512))
    errs = {}
    for recipe in ("te", "4over6"):
        d = nvfp4_dequantize(*nvfp4_quantize(x, recipe=recipe))
        errs[recipe] = float((d - x.float()).abs().sum())
    assert errs["4over6"] < errs["te"] * 0.97, errs


def test_4over6_convert_manifest_and_verify(demo_dense, tmp_path):
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions
    from qconvert.verify import verify

    for dialect in ("modelopt", "compressed-tensors"):
        dst = tmp_path / dialect
        convert(
            str(demo_dense),
            dst,
            "nvfp4",
            ConvertOptions(
                scheme="nvfp4", recipe="4over6", dialect=dialect, plan=PlanOptions(scheme="nvfp4"), progress=False
            ),
        )
        man = json.loads((dst / "qconvert.json").read_text())
        assert man["recipe"] == "4over6" and "1536" in man["global_scale"] and "4over6" in man["scale_rule"]
        r = verify(str(demo_dense), str(dst))
        assert r.ok, r.failures
        assert r.tensors and all(t.exact for t in r.tensors)
