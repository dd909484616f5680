"""The NVFP4 4over6 Triton kernel (numerics/cuda_kernels.py) run by Triton's interpreter on this CPU
(``TRITON_INTERPRET=1``, numpy semantics, in a fresh process: the switch is read when the kernels
are defined), against the torch op chain: the kernel's logic is checked here; the GPU run of the same
comparison, with CUDA's arithmetic, is ``tests/test_cuda_kernels.py``.

The interpreter stands in for the GPU only where both give IEEE results: it has no libdevice (the
kernels divide by 1 instead of ``rcp.rn``, the same correctly rounded value) and truncates fp32 ->
fp8 casts (the 4over6 kernel rounds E4M3 scales with its own integer arithmetic, so no cast rounds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

_RUN = r"""
import json, sys
import numpy as np
import torch
sys.path.insert(0, "tests")
import kernel_cases as kc
from qconvert.convert.numerics import cuda_kernels, nvfp4
from tests.test_nvfp4_4over6 import adversarial_1536

cases = [(n, x) for n, x in kc.CASES if n not in ("all-bf16-sorted", "all-bf16-shuffled-nan")]
cases += [(f"adv1536-{k}", adversarial_1536(k, seed=k + 40)) for k in (-30, 0, 9)]
cases += [("rows-3x48", torch.randn(3, 48, generator=torch.Generator().manual_seed(1)).bfloat16())]
bad = []
for name, x in cases:
    keep = kc.finite_rows(x, 16)
    gs = kc.global_amaxes(name, x)
    gs = gs[:5] + gs[5::8]  # own, 4x, tiny, huge, subnormal, two powers of two
    for gv in gs:
        gt = None if gv is None else torch.tensor(gv)
        p_ref, s_ref, s2_ref = nvfp4.nvfp4_quantize(x, global_amax=gt, recipe="4over6")
        p, s, s2 = cuda_kernels.nvfp4_blocks(x.reshape(-1, 16), nvfp4._global_amax(x, gt), "4over6")
        sb, sr = s.view(torch.uint8), s_ref.reshape(-1).view(torch.uint8)
        pb, pr = p, p_ref.reshape(-1, 8)
        errs = {
            "scale_2": int(not torch.equal(s2.view(torch.int32), s2_ref.view(torch.int32))),
            "scales": int((sb[keep] != sr[keep]).sum()),
            "codes": int((pb[keep] != pr[keep]).sum()),
            "magnitudes": int(((pb & 0x77) != (pr & 0x77)).sum()),
        }
        if any(errs.values()):
            bad.append([name, gv, errs])
print(json.dumps({"bad": bad, "cases": len(cases)}))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_4over6_triton_kernel_in_the_interpreter_equals_torch_chain():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cases"] >= 12
    assert out["bad"] == [], out["bad"][:5]
