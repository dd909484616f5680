"""verify's one-pass C statistics (encoded_compare) against its torch statement: decode with the
dequantizers, then compare() — on random, adversarial and garbage encodings."""

from __future__ import annotations

import math

import pytest
import torch

from qconvert.convert.numerics import cpu_kernels, mxfp8_quantize, nvfp4_quantize
from qconvert.inspect import Module
from qconvert.verify import _dequantize, compare, encoded_compare

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="C kernels not built here")

MX = Module("m", "mxfp8", [], 0, {}, scale_suffix="weight_scale")
NV = Module("m", "nvfp4", [], 0, {}, scale_suffix="weight_scale")


def _same(fast, slow):
    assert fast is not None
    (r1, q1, w1, f1), (r2, q2, w2, f2) = fast, slow
    for a, b in ((r1, r2), (q1, q2)):
        assert (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-9), (fast, slow)
    assert w1 == w2 and f1 == f2, (fast, slow)


def _check(x, ts, fmt, dialect="modelopt"):
    m = MX if fmt == "mxfp8" else NV
    slow = compare(x, *_dequantize(fmt, dialect, ts, m)[:1], fmt, _dequantize(fmt, dialect, ts, m)[1])
    for workers in (1, 3):
        _same(encoded_compare(x, ts, fmt, m, workers), slow)
    return slow


def _mx(x):
    q, s = mxfp8_quantize(x)
    return {"weight": q, "weight_scale": s}


def _nv(x, ct=False):
    p, s, s2 = nvfp4_quantize(x)
    if ct:
        return {"weight_packed": p, "weight_scale": s, "weight_global_scale": (1.0 / s2).reshape(1)}
    return {"weight": p, "weight_scale": s, "weight_scale_2": s2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_tensors(dtype):
    g = torch.Generator().manual_seed(1)
    for shape in [(96, 256), (3, 5, 64), (1, 32), (40000, 32)]:
        x = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        r, _, w, f = _check(x, _mx(x), "mxfp8")
        assert 0 < r < 0.06 and w <= 1 and f is None
        r, _, w, f = _check(x, _nv(x), "nvfp4")
        assert 0 < r < 0.16 and w <= 1 and f is None
        _check(x, _nv(x, ct=True), "nvfp4", "compressed-tensors")


def test_adversarial_sources():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g)
    x[0] = 0.0  # zero blocks
    x[1, :32] = 448.0 * torch.tensor([1.75, -1.75] * 16)  # block maxima at 1.75 * 2^e, +-448
    x[2, :16] = torch.tensor([6.0, -6.0] * 8)
    x[3] = 2.0**-133  # tiny values
    x[4, 5] = float("nan")  # a NaN source element
    x[5, 7] = float("inf")
    x = x.bfloat16()
    _check(x, _mx(x), "mxfp8")
    _check(x, _nv(x), "nvfp4")
    _check(torch.zeros(8, 64), _nv(torch.zeros(8, 64)), "nvfp4")  # all zero: rel 0


def test_corrupt_and_swapped_encodings():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(128, 256, generator=g) * 0.02).bfloat16()
    y = (torch.randn(128, 256, generator=g) * 0.02).bfloat16()
    slow = _check(x, _mx(y), "mxfp8")  # another tensor's bytes
    assert slow[0] > 1 and slow[2] > 1 and slow[3] == (0, 0)
    ts = _mx(x)
    ts["weight_scale"][17, 3] = 255  # the E8M0 NaN byte: non-finite decode
    assert _check(x, ts, "mxfp8")[3] == (17, 3)
    ts = _mx(x)
    ts["weight_scale"][5, 6] = 0  # 2^-127
    assert _check(x, ts, "mxfp8")[3] == (5, 6)
    ts = _nv(x)
    ts["weight_scale"].view(torch.uint8)[9, 2] = 0x7F  # e4m3 NaN
    assert _check(x, ts, "nvfp4")[3] == (9, 2)
    ts = _nv(x)
    ts["weight"][100, 40] ^= 0x77  # flipped codes
    _check(x, ts, "nvfp4")


def test_garbage_bytes_every_code():
    """Random bytes for every encoded tensor: every element code and scale byte, NaNs included."""
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        x = (torch.randn(512, 64, generator=g) * 10).bfloat16()
        q = torch.randint(0, 256, (512, 64), generator=g, dtype=torch.uint8)
        s = torch.randint(0, 256, (512, 2), generator=g, dtype=torch.uint8)
        _check(x, {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}, "mxfp8")
        p = torch.randint(0, 256, (512, 32), generator=g, dtype=torch.uint8)
        s16 = torch.randint(0, 256, (512, 4), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for s2 in (1e-3, 1.0, 3.0e38, 1e-40):
            _check(x, {"weight": p, "weight_scale": s16, "weight_scale_2": torch.tensor(s2)}, "nvfp4")


def test_shapes_that_do_not_fit_fall_back():
    x = (torch.randn(16, 64) * 0.02).bfloat16()
    ts = _mx(x)
    ts["weight_scale"] = ts["weight_scale"].t().contiguous()  # [2, 16]: not the layout decode expects
    assert encoded_compare(x, ts, "mxfp8", MX, 1) is None
    ts = _nv(x)
    ts["weight"] = ts["weight"][:8]
    assert encoded_compare(x, ts, "nvfp4", NV, 1) is None
    assert encoded_compare(x.half(), _nv(x), "nvfp4", NV, 1) is None  # FP16 source: torch path
