"""FlashInfer TRT-LLM MoE layouts against FlashInfer's index helpers and vLLM's preparation code.

Oracles (never our own code): flashinfer 0.7.4 ``reorder_rows_for_gated_act_gemm``,
``get_shuffle_matrix_a_row_indices``, ``_maybe_get_cached_w3_w1_permute_indices``,
``get_w2_permute_indices_with_cache``, ``convert_to_block_layout``; vLLM's torch swizzles
``swizzle_mxfp8_scale`` / ``swizzle_blockscale`` and its FlashInfer TRT-LLM MoE preparation
functions (BF16, MXFP8, NVFP4 + the NVFP4 experts' scalar folding). FlashInfer's own
``block_scale_interleave`` needs CUDA; inside the vLLM pipelines it is replaced by vLLM's torch
swizzle (scripts/gpu_layout_check.py compares with the CUDA kernel on a GPU).
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qconvert.convert.layouts import trtllm as L
from qconvert.convert.layouts import trtllm_index as X

fi_core = pytest.importorskip("flashinfer.fused_moe.core")
fi_utils = pytest.importorskip("flashinfer.utils")

QWEN_I, QWEN_H = 768, 2048  # Qwen3-30B-A3B moe_intermediate_size, hidden_size


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _u8(x):
    return x.contiguous().view(torch.uint8)


def _eq(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.equal(_u8(a), _u8(b))


def _rank_slice(w13, w2, i, tp, r, per=1):
    """Plain per-rank slice as the engines' weight loaders cut it (each half, W2 columns)."""
    ir = i // tp
    a = torch.cat([w13[:, r * ir : (r + 1) * ir], w13[:, i + r * ir : i + (r + 1) * ir]], 1)
    b = w2[:, :, r * ir // per : (r + 1) * ir // per]
    return a.clone(), b.clone()  # the engines work in place


# ---------------------------------------------------------------------------------------------
# Index helpers vs FlashInfer
# ---------------------------------------------------------------------------------------------

ROWS = [32, 64, 96, 128, 256, 384, 1536, 4096]


@pytest.mark.parametrize("m", ROWS)
def test_shuffle_indices_equal_flashinfer(m):
    x = torch.empty(m, 8)
    assert torch.equal(X.shuffle_row_indices(m, 128), fi_utils.get_shuffle_matrix_a_row_indices(x, 128))
    if m % 16 == 0:
        assert torch.equal(X.shuffle_row_indices(m, 64), fi_utils.get_shuffle_matrix_a_row_indices(x, 64))


@pytest.mark.parametrize("m", ROWS)
def test_gated_reorder_equals_flashinfer(m):
    x = torch.arange(m * 3, dtype=torch.float32).view(m, 3)
    assert torch.equal(x[X.gated_interleave_indices(m)], fi_core.reorder_rows_for_gated_act_gemm(x))


@pytest.mark.parametrize("m", [256, 384, 1536])
@pytest.mark.parametrize("sf", [None, 16, 32])
def test_w13_w2_permutations_equal_flashinfer_cached(m, sf):
    w = torch.empty(m, 64, dtype=torch.uint8)
    ref13 = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w, 128, num_elts_per_sf=sf)
    ref2 = fi_core.get_w2_permute_indices_with_cache({}, w, 128, num_elts_per_sf=sf)
    assert torch.equal(X.w13_row_permutation(m), ref13)
    assert torch.equal(X.w2_row_permutation(m), ref2)
    # half swap folded in == vLLM's BF16 "(p + M/2) % M" == swap then R[S]
    x = torch.randint(0, 255, (m, 4), dtype=torch.uint8, generator=_gen())
    swapped = torch.cat([x[m // 2 :], x[: m // 2]])
    assert torch.equal(x[X.w13_row_permutation(m, swap_halves=True)], swapped[ref13])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_block_major_k_equals_flashinfer(dtype):
    x = torch.randint(0, 255, (3, 256, 512), dtype=torch.uint8, generator=_gen()).view(dtype)
    p = X.w13_row_permutation(256)
    got = X.to_block_major_k(x, 128, p)
    for e in range(3):
        ref = fi_core.convert_to_block_layout(_u8(x[e])[p], 128)
        assert torch.equal(_u8(got[e]).reshape(ref.shape), ref)
    assert torch.equal(_u8(X.from_block_major_k(got, p)), _u8(x))


# ---------------------------------------------------------------------------------------------
# 128x4 swizzle vs vLLM's torch swizzles
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_swizzles():
    mx = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
    nv = pytest.importorskip("vllm.model_executor.layers.quantization.utils.nvfp4_utils")
    return mx.swizzle_mxfp8_scale, nv.swizzle_blockscale


@pytest.mark.vllm
@pytest.mark.parametrize("rows,cols", [(256, 64), (1536, 48), (128, 4), (100, 5), (33, 1), (300, 7)])
def test_swizzle_equals_vllm(vllm_swizzles, monkeypatch, rows, cols):
    swz_mx, swz_nv = vllm_swizzles
    s = torch.randint(1, 255, (2, rows, cols), dtype=torch.uint8, generator=_gen(rows))
    got = X.swizzle_128x4(s)
    for e in range(2):
        assert torch.equal(got[e], swz_mx(s[e], rows, cols * 32))
    # vLLM's NVFP4 swizzle ends in .cuda(); on CPU that call is made a no-op
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    ref = swz_nv(s.view(torch.float8_e4m3fn))
    assert torch.equal(_u8(got.view(torch.float8_e4m3fn)).reshape(-1), _u8(ref).reshape(-1))
    assert torch.equal(X.unswizzle_128x4(got, rows, cols), s)
    if rows % 32 == 0:
        p = X.shuffle_row_indices(rows)
        got_p = X.swizzle_128x4(s, p)
        assert torch.equal(got_p[1], swz_mx(s[1][p], rows, cols * 32))
        assert torch.equal(X.unswizzle_128x4(got_p, rows, cols, p), s)


def test_swizzle_offset_formula():
    """Formula of docs/layouts.md#scale-swizzle-128x4 (transcribed from FlashInfer's computeSFIndex)."""
    rows, cols = 200, 6
    mp, kp = 256, 8
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=_gen(3))
    got = X.swizzle_128x4(s)
    assert got.numel() == mp * kp
    for r in (0, 31, 32, 127, 128, 199):
        for c in (0, 3, 4, 5):
            off = (r // 128) * 128 * kp + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert got[off] == s[r, c]
    assert int(got[(199 // 128) * 128 * kp + 0 + (200 % 32) * 16 + ((200 % 128) // 32) * 4]) == 0


# ---------------------------------------------------------------------------------------------
# Whole outputs vs vLLM's FlashInfer TRT-LLM MoE preparation (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_prep():
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (breaks an import cycle)
    from vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe import TrtLlmNvFp4ExpertsBase
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization.utils import flashinfer_fp4_moe as f4
    from vllm.model_executor.layers.quantization.utils import flashinfer_utils as fu
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import swizzle_mxfp8_scale

    return types.SimpleNamespace(
        fu=fu,
        f4=f4,
        backend=NvFp4MoeBackend.FLASHINFER_TRTLLM,
        experts=TrtLlmNvFp4ExpertsBase,
        swizzle=swizzle_mxfp8_scale,
    )


@pytest.fixture
def cpu_block_scale_interleave(vllm_prep, monkeypatch):
    """FlashInfer's block_scale_interleave (CUDA only) replaced by vLLM's torch swizzle."""

    def bsi(s):
        if s.dim() == 3:
            return torch.cat([bsi(x) for x in s])
        return vllm_prep.swizzle(_u8(s), s.shape[0], s.shape[1] * 32).view(s.dtype)

    import flashinfer
    import flashinfer.quantization.fp4_quantization as fq

    monkeypatch.setattr(fq, "block_scale_interleave", bsi)
    monkeypatch.setattr(flashinfer, "nvfp4_block_scale_interleave", bsi)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "e,i,h,tp",
    [(2, QWEN_I, QWEN_H, 1), (2, QWEN_I, QWEN_H, 2), (2, QWEN_I, QWEN_H, 4), (3, 96, 192, 1), (2, 320, 128, 2)],
)
def test_bf16_vllm_equals_vllm_preparation(vllm_prep, e, i, h, tp):
    g = _gen(i + tp)
    w13 = torch.randn(e, 2 * i, h, generator=g).bfloat16()
    w2 = torch.randn(e, h, i, generator=g).bfloat16()
    for r in range(tp):
        a, b = _rank_slice(w13, w2, i, tp, r)
        a, b, _ = vllm_prep.fu.align_moe_weights_for_fi(a, b, True, min_alignment=128)
        vllm_prep.fu.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, a, b)
        got = L.to_trtllm("bf16", "vllm", w13, w2, tp=tp, tp_rank=r)
        _eq(got["w13_weight"], a)
        _eq(got["w2_weight"], b)


def _sglang_bf16_reference(a, b):
    """SGLang 0.5.23 ``_maybe_apply_flashinfer_trtllm_bf16_block_layout`` built from FlashInfer's
    helpers: W13 is [up; gate] at load, per expert P13 on the uint8 view, convert_to_block_layout."""
    i = a.shape[1] // 2
    a = torch.cat([a[:, i:], a[:, :i]], 1)
    o13, o2 = [], []
    for x, y in zip(a, b):
        p13 = fi_core._maybe_get_cached_w3_w1_permute_indices({}, _u8(x), 128)
        p2 = fi_core.get_w2_permute_indices_with_cache({}, _u8(y), 128)
        o13.append(fi_core.convert_to_block_layout(_u8(x)[p13], 128).view(torch.bfloat16))
        o2.append(fi_core.convert_to_block_layout(_u8(y)[p2], 128).view(torch.bfloat16))
    return torch.stack(o13), torch.stack(o2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_sglang_equals_flashinfer_helpers(tp):
    e, i, h = 2, QWEN_I, 256
    g = _gen(tp)
    w13 = torch.randn(e, 2 * i, h, generator=g).bfloat16()
    w2 = torch.randn(e, h, i, generator=g).bfloat16()
    for r in range(tp):
        ref13, ref2 = _sglang_bf16_reference(*_rank_slice(w13, w2, i, tp, r))
        got = L.to_trtllm("bf16", "sglang", w13, w2, tp=tp, tp_rank=r)
        assert got["w13_weight"].shape == (e, h // 64, 2 * i // tp, 64)
        _eq(got["w13_weight"], ref13)
        _eq(got["w2_weight"], ref2)


def _mxfp8(e, i, h, seed):
    from qconvert.convert.numerics.mxfp8 import mxfp8_quantize

    g = _gen(seed)
    q13, s13 = mxfp8_quantize(torch.randn(e, 2 * i, h, generator=g).bfloat16())
    q2, s2 = mxfp8_quantize(torch.randn(e, h, i, generator=g).bfloat16())
    return q13, s13, q2, s2


@pytest.mark.vllm
@pytest.mark.parametrize("e,i,h,tp", [(2, QWEN_I, QWEN_H, 1), (2, QWEN_I, QWEN_H, 2), (3, 256, 384, 1)])
def test_mxfp8_vllm_equals_vllm_preparation(vllm_prep, cpu_block_scale_interleave, e, i, h, tp):
    """vLLM 0.32's prepare_fp8_moe_layer_for_fi (swap, reorder, shuffle, swizzle). The installed
    0.32 does not pad MXFP8, so shapes that need no padding are compared with padding off."""
    q13, s13, q2, s2 = _mxfp8(e, i, h, tp)
    layer = types.SimpleNamespace(
        moe_config=types.SimpleNamespace(is_act_and_mul=True),
        weight_block_size=[1, 32],
        activation=types.SimpleNamespace(is_gated=True),
    )
    for r in range(tp):
        a, b = _rank_slice(q13, q2, i, tp, r)
        sa, sb = _rank_slice(s13, s2, i, tp, r, per=32)
        ref = vllm_prep.fu.prepare_fp8_moe_layer_for_fi(layer, a, b, sa, None, sb, None, is_trtllm=True)
        got = L.to_trtllm("mxfp8", "vllm", q13, q2, s13, s2, tp=tp, tp_rank=r, padding=L.Padding())
        for k, v in zip(("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"), ref):
            _eq(got[k], v)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "e,i,h,tp", [(2, QWEN_I, QWEN_H, 1), (2, QWEN_I, QWEN_H, 4), (3, 80, 208, 1), (2, 192, 256, 3)]
)
def test_nvfp4_vllm_equals_vllm_preparation(vllm_prep, cpu_block_scale_interleave, e, i, h, tp):
    """prepare_nvfp4_moe_layer_for_fi_or_cutlass(FLASHINFER_TRTLLM) incl. hidden/intermediate
    padding (208 -> 256, 80 -> 128, 64 -> 64), then TrtLlmNvFp4ExpertsBase's scalar folding."""
    g = _gen(i + tp)
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(1, 127, (e, 2 * i, h // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s2 = torch.randint(1, 127, (e, h, i // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    ws13, ws2 = torch.rand(e, 2, generator=g), torch.rand(e, generator=g)
    a13, a2 = torch.rand(e, generator=g) + 0.5, torch.rand(e, generator=g) + 0.5
    for r in range(tp):
        a, b = _rank_slice(w13, w2, i, tp, r, per=2)
        sa, sb = _rank_slice(s13, s2, i, tp, r, per=16)
        mc = types.SimpleNamespace(
            is_act_and_mul=True,
            hidden_dim=h,
            hidden_dim_unpadded=None,
            intermediate_size_per_partition=i // tp,
            moe_parallel_config=types.SimpleNamespace(enable_eplb=False),
        )
        layer = types.SimpleNamespace(moe_config=mc, activation=types.SimpleNamespace(is_gated=True))
        ref = vllm_prep.f4.prepare_nvfp4_moe_layer_for_fi_or_cutlass(
            vllm_prep.backend,
            layer,
            a,
            sa,
            ws13[:, 0].contiguous(),
            a13.clone(),
            b,
            sb,
            ws2.clone(),
            a2.clone(),
            True,
        )
        got = L.to_trtllm(
            "nvfp4",
            "vllm",
            w13,
            w2,
            s13,
            s2,
            w13_weight_scale_2=ws13,
            w2_weight_scale_2=ws2,
            w13_input_scale=a13,
            w2_input_scale=a2,
            tp=tp,
            tp_rank=r,
        )
        names = ("w13_weight", "w13_weight_scale", None, None, "w2_weight", "w2_weight_scale")
        for k, v in zip(names, ref):
            if k:
                _eq(got[k], v)
        # the experts' process_weights_after_loading folds input scales and adds g1_scale_c
        mod = torch.nn.Module()
        for n, v in zip(("w13_weight_scale_2", "w13_input_scale"), ref[2:4]):
            mod.register_parameter(n, torch.nn.Parameter(v.clone(), requires_grad=False))
        for n, v in zip(("w2_weight_scale_2", "w2_input_scale"), ref[6:8]):
            mod.register_parameter(n, torch.nn.Parameter(v.clone(), requires_grad=False))
        ex = object.__new__(vllm_prep.experts)
        ex.quant_config = types.SimpleNamespace(g1_alphas=mod.w13_weight_scale_2, a2_gscale=1.0 / mod.w2_input_scale)
        ex.moe_config, ex.is_situ, ex.gemm1_alpha = mc, False, None
        ex._gemm1_clamp_limit_unfolded = ex._gemm1_beta_unfolded = None
        ex.process_weights_after_loading(mod)
        for k in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale", "g1_scale_c"):
            _eq(got[k], getattr(mod, k).data)


# ---------------------------------------------------------------------------------------------
# Padding, byte 0, refusals
# ---------------------------------------------------------------------------------------------


def test_mxfp8_vllm_padding_and_zero_bytes():
    """vLLM 0.33 MXFP8 rule (docs/layouts.md#padding): I -> 128, H -> 256 per half, weights 0, scale 127;
    E8M0 byte 0 is never written."""
    e, i, h = 2, 96, 160
    q13, s13, q2, s2 = _mxfp8(e, i, h, 5)
    s13[0, 3, 1] = 0
    got = L.to_trtllm("mxfp8", "vllm", q13, q2, s13, s2)
    assert got["w13_weight"].shape == (e, 256, 256) and got["w13_weight_scale"].shape == (e, 256, 8)
    assert got["w2_weight"].shape == (e, 256, 128) and got["w2_weight_scale"].shape == (e, 256, 4)
    assert int((_u8(got["w13_weight_scale"]) == 0).sum()) == 0
    assert int((_u8(got["w2_weight_scale"]) == 0).sum()) == 0
    # read back with padding kept: padded rows/cols hold 127 and zero weights
    full = L.from_trtllm("mxfp8", "vllm", got, intermediate_size=128, hidden_size=256, padding=L.Padding(scale_pad=127))
    s = full["w13_weight_scale"]
    assert torch.all(s[:, i:128] == 127) and torch.all(s[:, 128 + i :] == 127)
    assert torch.all(s[:, :, h // 32 :] == 127)
    assert torch.equal(s[:, 128 : 128 + i, : h // 32], s13[:, i:])  # up half, unpadded part
    assert int(s[0, 3, 1]) == 1
    assert torch.all(_u8(full["w13_weight"])[:, i:128] == 0)
    back = L.from_trtllm("mxfp8", "vllm", got, intermediate_size=i, hidden_size=h)
    s13[0, 3, 1] = 1
    _eq(back["w13_weight_scale"], s13)
    _eq(back["w2_weight"], q2)
    with pytest.raises(L.LayoutError):
        s13[0, 0, 0] = 0
        L.to_trtllm("mxfp8", "vllm", q13, q2, s13, s2, zero_scale_byte="error")


def test_refusals():
    q13, s13, q2, s2 = _mxfp8(1, 96, 256, 1)
    with pytest.raises(L.LayoutError, match="sglang"):  # would need padding 96 -> 128
        L.to_trtllm("mxfp8", "sglang", q13, q2, s13, s2)
    with pytest.raises(L.LayoutError, match="tp"):
        L.to_trtllm("mxfp8", "vllm", q13, q2, s13, s2, tp=5)
    with pytest.raises(L.LayoutError):
        L.to_trtllm("mxfp8", "vllm", q13, q2, s13[:, :, :4], s2)
    with pytest.raises(L.LayoutError):
        L.to_trtllm("fp16", "vllm", q13, q2)


# ---------------------------------------------------------------------------------------------
# Round trips, sharding, layer API, contract
# ---------------------------------------------------------------------------------------------


def _plain(scheme, e, i, h, g):
    if scheme == "bf16":
        return dict(
            w13=torch.randn(e, 2 * i, h, generator=g).bfloat16(), w2=torch.randn(e, h, i, generator=g).bfloat16()
        )
    if scheme == "mxfp8":
        w13 = torch.randint(0, 256, (e, 2 * i, h), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        w2 = torch.randint(0, 256, (e, h, i), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        return dict(
            w13=w13,
            w2=w2,
            w13_scale=torch.randint(1, 255, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g),
            w2_scale=torch.randint(1, 255, (e, h, i // 32), dtype=torch.uint8, generator=g),
        )
    return dict(
        w13=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g),
        w2=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g),
        w13_scale=torch.randint(0, 256, (e, 2 * i, h // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        w2_scale=torch.randint(0, 256, (e, h, i // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        w13_weight_scale_2=torch.rand(e, 2, generator=g),
        w2_weight_scale_2=torch.rand(e, generator=g),
        w13_input_scale=torch.rand(e, generator=g) + 0.1,
        w2_input_scale=torch.rand(e, generator=g) + 0.1,
    )


@settings(max_examples=25, deadline=None)
@given(
    scheme=st.sampled_from(L.SCHEMES),
    engine=st.sampled_from(L.ENGINES),
    e=st.integers(1, 3),
    i_units=st.integers(1, 6),
    h_units=st.integers(1, 5),
    tp=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_identity(scheme, engine, e, i_units, h_units, tp, seed):
    # SGLang never pads: give it kernel-aligned per-rank sizes; vLLM gets odd ones too
    unit = 64 if engine == "vllm" else 128
    i, h = tp * (i_units * unit if engine == "sglang" else i_units * 32), h_units * unit
    if scheme == "bf16" and engine == "sglang":
        h = h_units * 64
    p = _plain(scheme, e, i, h, _gen(seed))
    ranks = L.transform_moe_layer(
        {
            "w13_weight": p["w13"],
            "w2_weight": p["w2"],
            "w13_weight_scale": p.get("w13_scale"),
            "w2_weight_scale": p.get("w2_scale"),
            **{k: v for k, v in p.items() if "_scale_" in k or "input" in k},
        },
        scheme,
        engine,
        tp=tp,
        zero_scale_byte="keep",
    )
    back = L.untransform_moe_layer(ranks, scheme, engine, intermediate_size=i, hidden_size=h, tp=tp)
    _eq(back["w13_weight"], p["w13"])
    _eq(back["w2_weight"], p["w2"])
    if scheme != "bf16":
        _eq(back["w13_weight_scale"], p["w13_scale"])
        _eq(back["w2_weight_scale"], p["w2_scale"])
    if scheme == "nvfp4" and engine == "sglang":
        _eq(back["w13_weight_scale_2"], p["w13_weight_scale_2"])


@pytest.mark.parametrize("scheme", L.SCHEMES)
@pytest.mark.parametrize("engine", L.ENGINES)
def test_shard_of_full_transform_equals_rank_transform(scheme, engine):
    """docs/layouts.md#per-rank-cuts: per-rank tensors cut from the transformed full tensors."""
    e, i, h, tp = 2, 512, 256, 2
    p = _plain(scheme, e, i, h, _gen(7))
    full = L.to_trtllm(scheme, engine, **p)
    for r in range(tp):
        got = L.shard_transformed(scheme, engine, full, intermediate_size=i, hidden_size=h, tp=tp, tp_rank=r)
        ref = L.to_trtllm(scheme, engine, **p, tp=tp, tp_rank=r)
        for k, v in got.items():
            _eq(v, ref[k])


def test_ep_ranks_take_whole_experts():
    p = _plain("mxfp8", 4, 128, 256, _gen(2))
    full = L.to_trtllm("mxfp8", "sglang", **p)
    for q in range(2):
        got = L.to_trtllm("mxfp8", "sglang", **p, ep=2, ep_rank=q)
        for k, v in got.items():
            _eq(v, full[k][2 * q : 2 * q + 2])


def test_stack_hf_experts_round_trip():
    e, i, h, prefix = 3, 64, 128, "model.layers.0.mlp.experts"
    g = _gen(4)
    hf = {}
    for x in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            hf[f"{prefix}.{x}.{proj}.weight"] = torch.randn(shape, generator=g).bfloat16()
            hf[f"{prefix}.{x}.{proj}.weight_scale_2"] = torch.rand((), generator=g)
    plain = L.stack_hf_experts(hf, prefix)
    assert torch.equal(plain["w13_weight"][1, :i], hf[f"{prefix}.1.gate_proj.weight"])
    assert torch.equal(plain["w13_weight"][1, i:], hf[f"{prefix}.1.up_proj.weight"])
    assert plain["w13_weight_scale_2"].shape == (e, 2) and plain["w2_weight_scale_2"].shape == (e,)
    back = L.unstack_hf_experts(plain, prefix)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k].reshape(hf[k].shape), hf[k])
    del hf[f"{prefix}.2.up_proj.weight"]
    with pytest.raises(L.LayoutError, match="missing"):
        L.stack_hf_experts(hf, prefix)


def test_kernel_layout_contract():
    c = L.kernel_layout_contract("mxfp8", "vllm", num_experts=128, intermediate_size=QWEN_I, hidden_size=QWEN_H, tp=4)
    assert c["intermediate_size_per_rank"] == 192 and c["intermediate_size_per_rank_padded"] == 256
    assert c["padding"]["scale_pad"] == 127 and c["epilogue_tile_m"] == 128 and c["gate_up_order"] == "up,gate"
    assert c["param_names"] == ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"]
    import json

    stored = json.loads(json.dumps(c))
    L.check_kernel_layout_contract(stored, c)
    other = L.kernel_layout_contract(
        "mxfp8", "vllm", num_experts=128, intermediate_size=QWEN_I, hidden_size=QWEN_H, tp=2
    )
    with pytest.raises(L.LayoutError, match="tp"):
        L.check_kernel_layout_contract(stored, other)
    s = L.kernel_layout_contract("bf16", "sglang", num_experts=128, intermediate_size=QWEN_I, hidden_size=QWEN_H)
    assert s["weight_layout"] == "BlockMajorK" and s["block_k_bytes"] == 128
    with pytest.raises(L.LayoutError):
        L.check_kernel_layout_contract(
            s, L.kernel_layout_contract("bf16", "vllm", num_experts=128, intermediate_size=QWEN_I, hidden_size=QWEN_H)
        )
