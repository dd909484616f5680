"""MXFP8 numerics against other projects' quantizers (docs/formats.md#mxfp8-scale-rule).

Oracles: vLLM's ``_mxfp8_e4m3_quantize_torch`` (RCEIL), torchao's ``to_mx`` in RCEIL and FLOOR
modes, compressed-tensors' ``generate_mx_scales``. qconvert's one declared deviation is that
the scale byte is never 0 (clamped to 1), which changes only blocks with amax <= 448 * 2^-127.
"""

from __future__ import annotations

import math

import pytest
import torch

from qconvert.convert.numerics import MXFP8_BLOCK, mxfp8_dequantize, mxfp8_quantize

# Largest block amax for which RCEIL gives byte 0 (2^-127): amax / 448 <= 2^-127.
BYTE0_LIMIT = 448.0 * 2.0**-127
# BF16 mantissas used for block maxima: exactly 1, exactly 1.75 (RCEIL/CT/TE tie), the next
# BF16 above 1.75, and the largest BF16 mantissa.
MANTISSAS = (1.0, 1.75, 1.75 + 2.0**-7, 2.0 - 2.0**-7)
# Exponents from the BF16 subnormal range to the top of the BF16 range.
EXPONENTS = (-133, -130, -127, -126, -125, -120, -119, -118, -100, -60, -10, -1, 0, 1, 8, 9, 60, 100, 120, 126, 127)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _rceil_exponent(amax: float) -> int:
    """ceil(log2(amax / 448)) in exact rational arithmetic (Python floats are doubles, and
    amax / 448 for a BF16 amax is exact in double)."""
    m, e = math.frexp(amax / 448.0)  # amax/448 = m * 2^e, m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def _e4m3_midpoints() -> list[float]:
    """Values exactly halfway between neighbouring E4M3 numbers (RNE ties), normal and
    subnormal, up to 448."""
    mids = [(2 * k + 1) * 2.0**-10 for k in range(8)]  # subnormal grid 2^-9, plus 2^-6 edge
    for j in range(-6, 9):
        for k in range(8):
            v = (1 + (2 * k + 1) / 16) * 2.0**j
            if v < 448:
                mids.append(v)
    return mids


def adversarial_bf16(seed: int = 0) -> torch.Tensor:
    """Blocks whose maxima sit at m * 2^e for the mantissas and exponents above, filled with
    E4M3 ties at that block's scale, zeros (both signs), tiny values and +-448 * scale, plus
    all-zero blocks, blocks of BF16 subnormals, and the byte-0 boundary itself."""
    g = torch.Generator().manual_seed(seed)
    mids = torch.tensor(_e4m3_midpoints(), dtype=torch.float64)
    blocks = []
    for e in EXPONENTS:
        for m in MANTISSAS:
            amax = m * 2.0**e
            if amax < 2.0**-133:
                continue
            scale = 2.0 ** _rceil_exponent(amax)
            pool = torch.cat(
                [
                    mids * scale,
                    torch.tensor([0.0, -0.0, 448.0 * scale, 2.0**-133, 3 * 2.0**-133]),
                ]
            )
            for rep in range(2):
                idx = torch.randint(0, len(pool), (MXFP8_BLOCK,), generator=g)
                vals = pool[idx]
                vals = torch.where(vals.abs() <= amax, vals, vals.new_zeros(()))
                signs = torch.where(torch.rand(MXFP8_BLOCK, generator=g) < 0.5, -1.0, 1.0)
                vals = vals * signs
                vals[rep * 7 % MXFP8_BLOCK] = amax if rep == 0 else -amax
                blocks.append(vals)
    blocks.append(torch.zeros(MXFP8_BLOCK, dtype=torch.float64))
    blocks.append(torch.full((MXFP8_BLOCK,), -0.0, dtype=torch.float64))
    blocks.append(torch.arange(MXFP8_BLOCK, dtype=torch.float64) * 2.0**-133)
    boundary = torch.zeros(MXFP8_BLOCK, dtype=torch.float64)
    boundary[3] = BYTE0_LIMIT  # 1.75 * 2^-119, a BF16 normal: still byte 0 in vLLM
    blocks.append(boundary)
    above = boundary.clone()
    above[3] = (1.75 + 2.0**-7) * 2.0**-119
    blocks.append(above)
    for v in (448.0, -448.0):
        b = torch.linspace(-448, 448, MXFP8_BLOCK, dtype=torch.float64)
        b[0] = v
        blocks.append(b)
    while len(blocks) % 4:
        blocks.append(torch.zeros(MXFP8_BLOCK, dtype=torch.float64))
    x = torch.stack(blocks).to(torch.bfloat16)
    return x.reshape(-1, 4 * MXFP8_BLOCK)


def random_bf16(seed: int = 1, rows: int = 96, cols: int = 512) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes spread over 2^-40 .. 2^40, plus heavy tails."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x = x * torch.exp2(torch.randint(-40, 41, (rows, 1), generator=g).float())
    x[::7] = x[::7] ** 3
    return x.to(torch.bfloat16)


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], -1, MXFP8_BLOCK).abs().amax(-1)


@pytest.fixture(scope="module")
def vllm_quant():
    mod = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
    return mod


@pytest.fixture(scope="module")
def torchao_mx():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
    return mx.to_mx, cfg.ScaleCalculationMode


def test_adversarial_input_covers_intended_cases():
    x = adversarial_bf16()
    amax = _block_amax(x)
    assert (amax == 0).sum() >= 2
    assert ((amax > 0) & (amax <= BYTE0_LIMIT)).sum() >= 5
    assert (amax == BYTE0_LIMIT).any()
    assert (amax == 448).any()
    mant = amax / torch.exp2(torch.floor(torch.log2(amax.clamp(min=2.0**-126))))
    normal = amax >= 2.0**-126
    for m in MANTISSAS:
        assert (mant[normal] == m).sum() >= 10, m


@pytest.mark.vllm
@pytest.mark.parametrize("make", [adversarial_bf16, random_bf16], ids=["adversarial", "random"])
def test_matches_vllm_except_byte0_blocks(vllm_quant, make):
    x = make()
    q, s = mxfp8_quantize(x)
    vq, vs = vllm_quant._mxfp8_e4m3_quantize_torch(x)
    assert vs.dtype == torch.uint8 and vs.shape == s.shape and q.shape == vq.shape
    amax = _block_amax(x)
    byte0 = amax <= BYTE0_LIMIT
    # Scale bytes: equal everywhere except the documented clamp, where vLLM writes 0, we 1.
    assert torch.equal(s[~byte0], vs[~byte0])
    assert torch.equal(s != vs, byte0)
    assert (vs[byte0] == 0).all() and (s[byte0] == 1).all()
    # Elements: byte-for-byte in every other block.
    keep = (~byte0).unsqueeze(-1).expand(*byte0.shape, MXFP8_BLOCK).reshape(x.shape)
    assert torch.equal(_u8(q)[keep], _u8(vq)[keep])
    if make is adversarial_bf16:
        assert byte0.sum() >= 5 and (~byte0).sum() > 100


def test_byte0_blocks_elements():
    """Where the clamp applies, elements are e4m3(x * 2^126) and all-zero blocks stay zero."""
    x = adversarial_bf16()
    q, s = mxfp8_quantize(x)
    amax = _block_amax(x)
    byte0 = amax <= BYTE0_LIMIT
    qb = q.float().reshape(*amax.shape, MXFP8_BLOCK)
    xb = x.float().reshape(*amax.shape, MXFP8_BLOCK)
    assert (qb[amax == 0] == 0).all()
    expect = (xb[byte0].double() * 2.0**126).float().to(torch.float8_e4m3fn)
    assert torch.equal(_u8(q.reshape(qb.shape)[byte0]), _u8(expect))
    # Dequantizing with the clamped byte gives back the tiny values to E4M3 precision.
    deq = mxfp8_dequantize(q, s).reshape(qb.shape)[byte0]
    assert torch.equal(deq, qb[byte0] * 2.0**-126)


@pytest.mark.parametrize("make", [adversarial_bf16, random_bf16], ids=["adversarial", "random"])
def test_matches_torchao_rceil_except_byte0_blocks(torchao_mx, make):
    to_mx, mode = torchao_mx
    x = make()
    q, s = mxfp8_quantize(x)
    ts, tq = to_mx(x.contiguous(), torch.float8_e4m3fn, MXFP8_BLOCK, mode.RCEIL)
    ts = ts.view(torch.uint8)
    amax = _block_amax(x)
    byte0 = amax <= BYTE0_LIMIT
    assert torch.equal(s != ts, byte0)
    keep = (~byte0).unsqueeze(-1).expand(*byte0.shape, MXFP8_BLOCK).reshape(x.shape)
    assert torch.equal(_u8(q)[keep], _u8(tq)[keep])


def _mantissa_sweep(exponents=(-100, -10, 0, 5, 8, 60, 120)):
    """One block per (BF16 mantissa i/128, exponent): block max (1 + i/128) * 2^e."""
    rows = []
    ms = []
    for e in exponents:
        for i in range(128):
            m = 1 + i / 128
            b = torch.zeros(MXFP8_BLOCK, dtype=torch.float64)
            b[i % MXFP8_BLOCK] = -m * 2.0**e if i % 3 == 0 else m * 2.0**e
            b[(i + 5) % MXFP8_BLOCK] = 0.3 * m * 2.0**e
            rows.append(b)
            ms.append(m)
    x = torch.stack(rows).to(torch.bfloat16)
    return x, torch.tensor(ms, dtype=torch.float64), len(exponents)


def test_floor_and_compressed_tensors_differ_exactly_where_formats_md_says(torchao_mx):
    """docs/formats.md#mxfp8-other-scale-rules: FLOOR (torchao default) differs from RCEIL exactly for mantissas > 1.75 (31 of
    128 BF16 mantissas, ~24 %), compressed-tensors only at exactly 1.75 (1 of 128)."""
    ct = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    to_mx, mode = torchao_mx
    x, m, n_exp = _mantissa_sweep()
    _, s = mxfp8_quantize(x)
    s = s.squeeze(-1).to(torch.int32)

    fs, _ = to_mx(x.contiguous(), torch.float8_e4m3fn, MXFP8_BLOCK, mode.FLOOR)
    fs = fs.view(torch.uint8).squeeze(-1).to(torch.int32)
    floor_diff = fs != s
    assert int(floor_diff.sum()) == 31 * n_exp
    assert torch.equal(floor_diff, m > 1.75)
    assert torch.equal(s[floor_diff] - fs[floor_diff], torch.ones_like(s[floor_diff]))

    amax = _block_amax(x).squeeze(-1)
    cs = ct.generate_mx_scales(amax, num_bits=8).to(torch.int32)
    ct_diff = cs != s
    assert int(ct_diff.sum()) == 1 * n_exp
    assert torch.equal(ct_diff, m == 1.75)
    # At the tie CT picks the larger scale: the block max encodes as 224 instead of 448.
    assert torch.equal(cs[ct_diff] - s[ct_diff], torch.ones_like(s[ct_diff]))


def test_rates_on_random_data(torchao_mx):
    """On Gaussian BF16 blocks FLOOR differs from RCEIL on roughly a quarter of blocks and
    compressed-tensors on roughly 1 %, and every difference is of the predicted kind."""
    ct = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    to_mx, mode = torchao_mx
    x = random_bf16(seed=3, rows=256, cols=1024)
    _, s = mxfp8_quantize(x)
    amax = _block_amax(x)
    mant = amax / torch.exp2(torch.floor(torch.log2(amax)))
    fs, _ = to_mx(x.contiguous(), torch.float8_e4m3fn, MXFP8_BLOCK, mode.FLOOR)
    fdiff = fs.view(torch.uint8) != s
    cdiff = ct.generate_mx_scales(amax, num_bits=8).to(torch.uint8) != s
    normal = amax > BYTE0_LIMIT  # below it the clamp to byte 1 differs from every rule
    assert torch.equal(fdiff[normal], (mant > 1.75)[normal])
    assert torch.equal(cdiff[normal], (mant == 1.75)[normal])
    assert 0.10 < fdiff.float().mean() < 0.40
    assert 0.001 < cdiff.float().mean() < 0.03


@pytest.mark.parametrize("make", [adversarial_bf16, random_bf16], ids=["adversarial", "random"])
def test_dequantize_round_trip(make):
    x = make()
    q, s = mxfp8_quantize(x)
    deq = mxfp8_dequantize(q, s)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    # Exactly q * 2^(byte - 127), computed here independently in float64, then rounded to
    # fp32. Near the top of the BF16 range that overflows: (2 - 2^-7) * 2^127 has byte 247 and
    # element 256 (RNE of 255), and 256 * 2^120 = 2^128 is inf in fp32 (and in BF16).
    mult = torch.pow(2.0, s.double() - 127).repeat_interleave(MXFP8_BLOCK, dim=-1)
    assert torch.equal(deq, (q.double() * mult).float())
    finite = deq.isfinite()
    assert torch.equal(~finite, x.double().abs() > 2.0**127 * (2 - 2.0**-4)), "only BF16 max"
    # Error bound of RNE to E4M3 after a power-of-two scale: half an ulp (2^-4 relative) in
    # the normal range, half the subnormal step (2^-10 * scale) below it.
    xf = x.double()[finite]
    bound = torch.maximum(xf.abs() * 2.0**-4, mult[finite] * 2.0**-10)
    assert ((deq.double()[finite] - xf).abs() <= bound).all()
    # Dequantized values are reproduced exactly by a second round trip (the scale may halve
    # when the block max rounded down to 224 * scale, but every value stays representable).
    # Blocks that overflowed to inf are left out.
    deq2 = mxfp8_dequantize(*mxfp8_quantize(deq))
    rows = _block_amax(deq).isfinite()
    keep = rows.repeat_interleave(MXFP8_BLOCK, dim=-1)
    assert keep.float().mean() > 0.6
    assert torch.equal(deq2[keep], deq[keep])


@pytest.mark.vllm
def test_dequantize_matches_vllm(vllm_quant):
    x = random_bf16(seed=5)
    q, s = mxfp8_quantize(x)
    assert torch.equal(mxfp8_dequantize(q, s, dtype=torch.bfloat16), vllm_quant.dequant_mxfp8_to_bf16(q, s))


def test_shapes_and_errors():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q, s = mxfp8_quantize(x)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (2, 3, 2) and s.dtype == torch.uint8
    with pytest.raises(ValueError):
        mxfp8_quantize(torch.zeros(4, 48))
