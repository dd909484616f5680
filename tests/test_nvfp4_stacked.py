"""NVFP4 of a stack of tensors with a global amax each (``nvfp4.nvfp4_quantize_stacked``: a GPU
refit's one launch per tensor kind of a layer, docs/formats.md#nvfp4-shared-global-scales) gives,
item by item, the bytes of ``nvfp4_quantize`` of that tensor alone, which the other numerics tests
hold to TransformerEngine, FlashInfer and ModelOpt: on CPU through the C kernel item by item and
through the op chain with the global amax repeated per block; on CUDA through the Triton kernel
(one launch for the stack) and the eager chain. Inputs: random tensors at several scales, an
all-zero tensor (g == 0), a tensor whose g is tiny (S_enc clamped at FLT_MAX), one far above the
others, NaN/Inf (allowed through), and group amaxes larger than a member's own max|x| (fused
gate/up groups)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qconvert.convert.numerics import cpu_kernels, cuda_kernels
from qconvert.convert.numerics.nvfp4 import nvfp4_quantize, nvfp4_quantize_stacked

RECIPES = ["te", "modelopt", "4over6"]


def _stack(seed: int, n: int = 6, rows: int = 40, k: int = 64, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rows, k, generator=g) * 0.02
    x[1] *= 3.0e4  # far above the others
    x[2] = 0.0  # g == 0
    x[-1] *= 1e-36  # S_enc = 2688 / g clamps at FLT_MAX (te, 4over6)
    x[0, 3, 5] = -0.0
    return x.to(dtype)


def _amax(x: torch.Tensor, group: bool) -> torch.Tensor:
    a = x.float().abs().reshape(x.shape[0], -1).amax(dim=1)
    if group:  # a fused group's amax is at least each member's: pairs share the larger
        a = a.view(-1, 2).amax(dim=1).repeat_interleave(2)
    return a


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _check(x: torch.Tensor, g: torch.Tensor, recipe: str, **kw) -> None:
    p, s, s2 = nvfp4_quantize_stacked(x, g, recipe, **kw)
    assert p.shape == (*x.shape[:-1], x.shape[-1] // 2) and s.shape == (*x.shape[:-1], x.shape[-1] // 16)
    assert s2.shape == (x.shape[0],) and s2.dtype == torch.float32
    for i in range(x.shape[0]):
        pr, sr, s2r = nvfp4_quantize(x[i].cpu(), global_amax=g[i].cpu(), recipe=recipe)
        assert torch.equal(p[i].cpu(), pr), (recipe, i)
        assert torch.equal(_bits(s[i].cpu()), _bits(sr)), (recipe, i)
        assert torch.equal(_bits(s2[i].cpu().reshape(())), _bits(s2r.reshape(()))), (recipe, i, s2[i], s2r)


@pytest.mark.parametrize("group", [False, True], ids=["own-amax", "group-amax"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("path", ["c-kernel", "chain"])
def test_stacked_equals_per_tensor_cpu(recipe, group, path, monkeypatch):
    if path == "chain":
        monkeypatch.setattr(cpu_kernels, "usable", lambda x: False)
    elif cpu_kernels.library() is None:
        pytest.fail(f"the C kernels did not build here: {cpu_kernels.unavailable_reason()}")
    for seed, dtype in ((0, torch.bfloat16), (1, torch.float32)):
        x = _stack(seed, dtype=dtype)
        _check(x, _amax(x, group), recipe, workers=2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_stacked_non_finite_and_3d(recipe):
    x = _stack(2, n=4, rows=8, k=32)
    x[0, 1, 2] = float("nan")
    x[3, 0, 0] = float("inf")
    g = _amax(x, False)
    p, s, s2 = nvfp4_quantize_stacked(x, g, recipe)
    for i in (1, 2):  # the finite items are untouched by their neighbours
        pr, sr, s2r = nvfp4_quantize(x[i], global_amax=g[i], recipe=recipe)
        assert torch.equal(p[i], pr) and torch.equal(_bits(s[i]), _bits(sr)) and torch.equal(_bits(s2[i]), _bits(s2r))
    assert torch.isnan(s2[0]) and torch.isinf(s2[3])
    y = x[1:3].reshape(2, 2, 4, 32)  # any leading shape per item
    p3, s3, _ = nvfp4_quantize_stacked(y, g[1:3], recipe)
    assert torch.equal(p3.reshape(p[1:3].shape), p[1:3]) and torch.equal(_bits(s3.reshape(s[1:3].shape)), _bits(s[1:3]))


def test_stacked_refuses_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize_stacked(torch.zeros(2, 3, 24), torch.ones(2))
    with pytest.raises(TypeError, match="floating"):
        nvfp4_quantize_stacked(torch.zeros(2, 3, 32, dtype=torch.int32), torch.ones(2))


@pytest.mark.skipif(not cuda_kernels.available("cuda"), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("quantizer", ["triton", "eager"])
def test_stacked_equals_per_tensor_cuda(recipe, quantizer):
    fn = cuda_kernels.nvfp4_blocks_stacked if quantizer == "triton" else None
    for seed, group in ((0, False), (1, True)):
        # 128 experts of [96, 128] as a refit stacks them: blocks of neighbouring items share a program
        x = _stack(seed, n=128, rows=96, k=128)
        _check(x.cuda(), _amax(x, group).cuda(), recipe, stacked_fn=fn)
        x = _stack(seed, n=4, rows=5, k=48)  # items of 15 blocks: not a multiple of a program
        _check(x.cuda(), _amax(x, group).cuda(), recipe, stacked_fn=fn)


_INTERPRETED = """
import torch
import triton.language as tl
from qconvert.convert.numerics import cuda_kernels as ck

ck.HAVE_RCP_RN = tl.constexpr(False)  # the interpreter has no libdevice: IEEE division (numpy)
torch.manual_seed(0)
items, rows = 5, 24
x = (torch.randn(items, rows * 16) * 0.02).to(torch.bfloat16)
x[1] *= 1e4
x[2] = 0
x[3, 7] = float("nan")
g = x.float().abs().amax(dim=1)
g[4] *= 3  # a group amax above the item's own
xb = x.reshape(-1, 16)
n = xb.shape[0]
P, S, S2 = torch.empty(n, 8, dtype=torch.uint8), torch.empty(n, dtype=torch.float8_e4m3fn), torch.empty(items)
grid = ((n + 15) // 16,)
ck._nvfp4_kernel[grid](xb.view(torch.int32), P, S, g, S2, n, rows, TE=True, BF16_WORDS=True, BLOCKS=16, STACKED=True)
for i in range(items):
    p, s, s2 = torch.empty(rows, 8, dtype=torch.uint8), torch.empty(rows, dtype=torch.float8_e4m3fn), torch.empty(1)
    gi = g[i].reshape(1).clone()
    part = xb[i * rows : (i + 1) * rows]
    ck._nvfp4_kernel[((rows + 15) // 16,)](part.view(torch.int32), p, s, gi, s2, rows, 1, TE=True, BF16_WORDS=True, BLOCKS=16, STACKED=False)
    r = slice(i * rows, (i + 1) * rows)
    assert torch.equal(P[r], p), i
    assert torch.equal(S[r].view(torch.uint8), s.view(torch.uint8)), i
    assert S2[i].view(torch.int32) == s2[0].view(torch.int32), i

# 4over6 (its kernel rounds E4M3 itself, so the interpreter is exact): the stacked launch against
# the torch chain item by item, 3 items of 40 blocks (programs straddle items), group amaxes
from qconvert.convert.numerics import nvfp4

x = (torch.randn(3, 40, 16) * 0.02).to(torch.bfloat16)
x[1] *= 1e4
x[2, :20] = 0
g = x.float().abs().reshape(3, -1).amax(dim=1) * torch.tensor([1.0, 2.0, 1.0])
P, S, S2 = ck.nvfp4_blocks_stacked(x.reshape(-1, 16), g, "4over6")
for i in range(3):
    p, s, s2 = nvfp4.nvfp4_quantize(x[i], global_amax=g[i], recipe="4over6")
    r = slice(i * 40, (i + 1) * 40)
    assert torch.equal(P[r], p.reshape(-1, 8)), ("4over6", i)
    assert torch.equal(S[r].view(torch.uint8), s.reshape(-1).view(torch.uint8)), ("4over6", i)
    assert S2[i].view(torch.int32) == s2.view(torch.int32), ("4over6", i)
print("OK")
"""


def test_triton_stacked_launch_interpreted():
    """The Triton kernel's stacked launch (a global amax per tensor, programs that straddle two
    tensors, scale_2 written by each tensor's first block) against its one-tensor launch, both
    run by Triton's CPU interpreter (whose arithmetic is not the GPU's: the bytes against the
    torch chains are test_stacked_equals_per_tensor_cuda's job)."""
    pytest.importorskip("triton", reason="needs CUDA: Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_INTERPRETED)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
