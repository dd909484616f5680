"""The direct form of dense MXFP8 linear layers on vLLM CPU (``Form.CPU_MXFP8_LINEAR``,
qconvert/engine/vllm_direct.py, docs/reload.md#vllm-direct-load), without a server.

Oracle: vLLM's own code. Real vLLM layers (``QKVParallelLinear`` with a bias and
``RowParallelLinear`` under the CPU plugin's MXFP8 config: ``ModelOptLinearMethod`` with
``EmulationMxfp8LinearKernel``) loaded with checkpoint B and processed by vLLM's
``process_weights_after_loading`` give the served tensors; the same layers serving checkpoint A and
then loaded directly with B must serve exactly those bytes (in the storage they served before),
and so after vLLM's own layerwise reload in between. The served model (tokens and logprobs against
a fresh server) is tests/test_reload_direct.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

K, HEADS, KV_HEADS, HEAD = 64, 4, 2, 16
NAMES = {"q_proj": (HEADS * HEAD, K), "k_proj": (KV_HEADS * HEAD, K), "v_proj": (KV_HEADS * HEAD, K)}
NAMES["o_proj"] = (K, HEADS * HEAD)


@pytest.fixture(scope="module")
def vllm_cpu():
    """vLLM's single-process parallel state (TP 1) and the CPU plugin registered."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    from qconvert.engine import vllm_cpu_plugin

    vllm_cpu_plugin.register()
    if not torch.distributed.is_initialized():
        with tempfile.NamedTemporaryFile() as f, set_current_vllm_config(VllmConfig()):
            init_distributed_environment(1, 0, f"file://{f.name}.init", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
    return vllm_cpu_plugin


def _model(plugin):
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    cfg = plugin.CpuMxfp8Config.from_config({"quant_method": "mxfp8", "ignored_layers": []})

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(K, HEAD, HEADS, KV_HEADS, bias=True, quant_config=cfg, prefix="qkv_proj")
            self.o_proj = RowParallelLinear(HEADS * HEAD, K, bias=False, quant_config=cfg, prefix="o_proj")

        def load_weights(self, weights):
            """vLLM's manner: q/k/v fused through the shard id, the rest by name."""
            params = dict(self.named_parameters())
            for name, t in weights:
                mod, suffix = name.split(".", 1)
                if mod in ("q_proj", "k_proj", "v_proj"):
                    p = params[f"qkv_proj.{suffix}"]
                    p.weight_loader(p, t, mod[0])
                else:
                    p = params[name]
                    p.weight_loader(p, t)

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = Attn()
    finally:
        torch.set_default_dtype(old)
    record_metadata_for_reloading(m)  # as vLLM's loader does at model build
    return m


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every E4M3 byte (NaN codes included) and E8M0 scales from 0 to 254."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, (n, k) in NAMES.items():
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w[0, :] = torch.arange(k, dtype=torch.uint8) + 192 * (seed % 2)
        s = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=g)
        s[0, 0], s[1, 0], s[2, 0] = 0, 254, 127
        out += [(f"{name}.weight", w.view(torch.float8_e4m3fn)), (f"{name}.weight_scale", s)]
        if name != "o_proj":  # q/k/v with a bias (Qwen2's), served as loaded
            out.append((f"{name}.bias", torch.randn(n, generator=g).to(torch.bfloat16)))
    return out


def _served(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _startup(plugin, ckpt):
    """A model as vLLM serves it after loading ``ckpt``: loaded, then processed by vLLM."""
    m = _model(plugin)
    with torch.no_grad():
        m.load_weights(ckpt)
        for mod in (m.qkv_proj, m.o_proj):
            mod.quant_method.process_weights_after_loading(mod)
    return m


def _assert_same_bytes(got: dict, want: dict):
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), n


def test_direct_mxfp8_linear_serves_what_vllm_processes(vllm_cpu):
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from qconvert.engine import vllm_direct

    a, b = _checkpoint(0), _checkpoint(1)
    fresh_a, fresh_b = _served(_startup(vllm_cpu, a)), _served(_startup(vllm_cpu, b))
    assert fresh_b["qkv_proj.weight"].dtype == torch.bfloat16  # vLLM served the dequantized weight
    m = _startup(vllm_cpu, a)
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}

    def direct(ckpt):
        forms = vllm_direct.plan(m)
        assert {f for f, _ in forms.values()} == {vllm_direct.Form.CPU_MXFP8_LINEAR}, forms
        stats = vllm_direct.load_direct(m, None, ckpt, forms)
        assert stats["cpu-mxfp8-linear"] == 2 and stats[vllm_direct.DEFERRED_KEY] == 0, stats
        assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs  # in place

    direct(b)
    _assert_same_bytes(_served(m), fresh_b)
    kept = m.qkv_proj._qc_mxfp8_weight
    with torch.no_grad():  # vLLM's own layerwise reload of A (the served tensors rebuilt by vLLM)
        initialize_layerwise_reload(m)
        m.load_weights(a)
        finalize_layerwise_reload(m, None)
    _assert_same_bytes(_served(m), fresh_a)
    direct(b)
    _assert_same_bytes(_served(m), fresh_b)
    assert m.qkv_proj._qc_mxfp8_weight is kept  # made once, written by every direct load
    direct(a)
    _assert_same_bytes(_served(m), fresh_a)


def test_mxfp8_linear_layerwise_when_vllm_serves_fp8(vllm_cpu, monkeypatch):
    """With ``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0`` vLLM serves the FP8 weight as loaded (and
    dequantizes per step): not this form, the layer goes through vLLM's layerwise reload."""
    from qconvert.engine import vllm_direct

    m = _startup(vllm_cpu, _checkpoint(0))
    assert vllm_direct.module_form(m.o_proj) == (vllm_direct.Form.CPU_MXFP8_LINEAR, None)
    monkeypatch.setenv("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "0")
    assert vllm_direct.module_form(m.o_proj) == (vllm_direct.Form.LAYERWISE, vllm_direct.Why.QUANT_METHOD)
