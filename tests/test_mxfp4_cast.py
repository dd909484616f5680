"""MXFP4 -> NVFP4 cast (docs/formats.md#mxfp4-to-nvfp4) byte for byte against ModelOpt 0.47's own
``quantize_mxfp4_to_nvfp4_lossless`` (CPU), on random and adversarial MXFP4 tensors."""

from __future__ import annotations

import pytest
import torch
from conftest import have

from qconvert.convert.numerics.mxfp4 import k_max_of, mxfp4_decode, mxfp4_to_nvfp4


@pytest.fixture(scope="module")
def modelopt_cast():
    if not have("modelopt"):
        pytest.skip("nvidia-modelopt not installed")
    from modelopt.torch.export.shard_cast_utils import quantize_mxfp4_to_nvfp4_lossless

    return quantize_mxfp4_to_nvfp4_lossless


def _mxfp4(rows, k, exp_lo, exp_hi, seed, zero_blocks=0.0, neg_zero=0.1):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    e8m0 = torch.randint(exp_lo + 127, exp_hi + 128, (rows, k // 32), generator=g).to(torch.uint8)
    nib = torch.stack((packed & 0xF, packed >> 4), -1).reshape(rows, k)
    nib = torch.where(torch.rand(rows, k, generator=g) < neg_zero, torch.full_like(nib, 8), nib)
    if zero_blocks:
        z = torch.rand(rows, k // 32, generator=g) < zero_blocks
        e8m0[z] = 0
        nib.view(rows, k // 32, 32)[z] = 0
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return packed.contiguous(), e8m0.contiguous()


CASES = [  # (exponent range, zero-block fraction): in range; spread past the 18-exponent window; tiny and huge
    ((-4, 2), 0.0),
    ((-3, 3), 0.2),
    ((-30, 4), 0.1),
    ((-120, -100), 0.05),
    ((60, 100), 0.0),
    ((-8, 9), 0.3),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cast_equals_modelopt(modelopt_cast, case):
    (lo, hi), zf = CASES[case]
    packed, e8m0 = _mxfp4(64, 256, lo, hi, seed=case, zero_blocks=zf)
    kmax = k_max_of(e8m0)
    p, s, s2, lossless = mxfp4_to_nvfp4(packed, e8m0)
    rp, rs, rs2, n_blocks, n_lossless = modelopt_cast(packed, e8m0, kmax, "cpu")
    assert torch.equal(p, rp.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    assert s2.item() == rs2.item()
    assert lossless.numel() == n_blocks and int(lossless.sum()) == n_lossless
    if hi - lo <= 17:
        assert n_lossless == n_blocks


def test_lossless_blocks_decode_to_the_source():
    packed, e8m0 = _mxfp4(16, 128, -20, 3, seed=9)
    p, s, s2, lossless = mxfp4_to_nvfp4(packed, e8m0)
    src = mxfp4_decode(packed, e8m0).view(16, 4, 32)
    lo, hi = (p & 0xF).long(), (p >> 4).long()
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    vals = table[torch.stack((lo, hi), -1).reshape(16, 128)].view(16, 8, 16)
    dec = (vals * (s.to(torch.float64) * s2.double()).unsqueeze(-1)).view(16, 4, 32)
    assert lossless.any() and (~lossless).any()
    assert torch.equal(dec[lossless], src[lossless].double())
