"""Inputs shared by the kernel tests (test_cpu_kernels.py, test_cuda_kernels.py): every BF16 bit
pattern, sorted (neighbouring magnitudes share a block) and shuffled, with and without NaN/Inf;
adversarial blocks (ties of every rounding step, block maxima at 1.75 * 2^e, +-448 and +-6 edges,
zeros, -0.0, subnormals); FP16 and wide-range FP32 inputs."""

from __future__ import annotations

import torch


def _all_bf16(nan: bool) -> torch.Tensor:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    if not nan:
        x = x[torch.isfinite(x)]
    return x


def cases():
    """(name, bf16/fp16/fp32 tensor [rows, 64]) inputs."""
    g = torch.Generator().manual_seed(0)
    out = []
    for nan in (False, True):
        x = _all_bf16(nan)
        srt = x[x.float().abs().argsort()]
        shuf = x[torch.randperm(x.numel(), generator=g)]
        for name, t in (("sorted", srt), ("shuffled", shuf)):
            n = t.numel() // 64 * 64
            out.append((f"all-bf16-{name}{'-nan' if nan else ''}", t[:n].reshape(-1, 64)))
    # adversarial: each row of 64 = 4 NVFP4 blocks = 2 MXFP8 blocks
    ties = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    )
    rows = []
    for e in range(-140, 119, 3):
        m = 2.0**e
        rows.append(torch.cat([ties * m, ties * (m * 1.75), ties.flip(0) * m, ties * m / 6]))
        rows.append(
            torch.cat(
                [
                    torch.full((16,), 1.75 * m),
                    torch.full((16,), -448.0 * m),
                    torch.zeros(16),
                    torch.full((16,), 448.0 * m),
                ]
            )
        )
    adv = torch.stack(rows)
    adv[0, :8] = -0.0
    out.append(("adversarial-bf16", adv.bfloat16()))
    out.append(("adversarial-fp32", adv))
    out.append(("division-ties-bf16", _division_ties()))
    out.append(("zeros", torch.zeros(4, 64).bfloat16()))
    out.append(("random-fp16", (torch.randn(257, 64, generator=g) * 30).half()))
    out.append(("random-fp32-wide", torch.randn(129, 64, generator=g) * torch.logspace(-30, 30, 129).unsqueeze(1)))
    return out


def _division_ties() -> torch.Tensor:
    """NVFP4 blocks whose quotients x / (block scale * scale_2) are exactly E2M1 ties, or one BF16
    ulp either side, with block scales that are not powers of two (e4m3 mantissas 1..7). Built for
    a global amax of 2688 (scale_2 = 1); any 2688 * 2^j scales block scales and quotients alike,
    so the ties stay exact. A reciprocal-multiply in place of ModelOpt's division rounds a quarter
    of these quotients differently (the ModelOpt Triton and AVX2 paths correct it)."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for e in range(-6, 8):
        for m in range(1, 8):
            sc = (1 + m / 8) * 2.0**e
            exact = torch.cat([torch.tensor([6.0 * sc]), ties * sc, -ties * sc, torch.zeros(1)]).bfloat16()
            bits = exact.view(torch.int16)
            up, down = exact.clone(), exact.clone()
            up.view(torch.int16)[1:15] = bits[1:15] + 1  # one ulp away from zero
            down.view(torch.int16)[1:15] = bits[1:15] - 1  # one ulp towards zero
            rows.append(torch.cat([exact, up, down, -exact]))
    return torch.stack(rows)


CASES = cases()
IDS = [c[0] for c in CASES]


def finite_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mask of the blocks whose inputs are all finite. Elsewhere NaNs arise (an input NaN, or
    MXFP8's inf * 0 for a block holding inf) whose sign is not specified: CUDA's arithmetic
    returns its canonical NaN, x86 keeps or sets the sign."""
    return torch.isfinite(x.float()).reshape(-1, block).all(dim=1)


def global_amaxes(name: str, x: torch.Tensor) -> list:
    """Global amaxes to quantize ``x`` with: None (its own max|x|; left out for inputs holding NaN,
    where every block would be NaN), 4x its own, tiny (TE's S_enc clamp at FLT_MAX, and an fp32
    subnormal), huge, and powers of two across the fp32 range."""
    finite = x[torch.isfinite(x)].float().abs()
    gmax = float(finite.max()) if finite.numel() else 0.0
    own = [] if name.endswith("-nan") else [None]
    if name.startswith("division-ties"):
        return own + [2688.0 * 2.0**j for j in (-8, -3, 0, 3, 8)] + [2688.0 * 3, 7.2e-43]
    return own + [gmax * 4, 1e-38, 3e38, 7.2e-43] + [2.0**e for e in range(-140, 128, 17)]
