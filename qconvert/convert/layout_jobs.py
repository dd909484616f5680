"""The names, shapes and manifest of MoE experts written pre-shuffled for the FlashInfer TRT-LLM
kernels (the job that writes them is :func:`qconvert.convert.jobs.moe_layer_job`).

One job per MoE layer: every expert tensor of the layer in, the engine's post-processing
parameters out (docs/layouts.md), per (TP, EP) rank. Non-expert tensors keep their normal jobs.

Tensor names live under a namespace no engine's stock loader maps onto its parameters, so
kernel-layout bytes never land in checkpoint-layout parameters. Stock vLLM 0.32 skips such names
silently (leaving the experts uninitialized); qconvert's vLLM plugin guard
(engine/vllm_layout_loader.py, registered as a vllm.general_plugins entry point) turns that into
an error naming the tensor:

    {prefix}.trtllm.{param}                   (tp = ep = 1)
    {prefix}.trtllm_tp{r}_ep{q}.{param}       (per rank)

with ``prefix`` the HF experts module, e.g. ``model.layers.3.mlp.experts``.
"""

from __future__ import annotations

import re

import torch

from ..errors import QConvertError
from ..formats.schemes import MXFP8_BLOCK, NVFP4_BLOCK
from .layouts import trtllm

EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def rank_tag(r: int, q: int, tp: int, ep: int) -> str:
    return "trtllm" if tp == ep == 1 else f"trtllm_tp{r}_ep{q}"


def parse_rank_tag(tag: str) -> tuple[int, int] | None:
    if tag == "trtllm":
        return (0, 0)
    m = re.fullmatch(r"trtllm_tp(\d+)_ep(\d+)", tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


def expert_layers(plan) -> dict[str, list]:
    """HF experts prefix -> its expert TensorPlans (gate/up/down of every expert)."""
    out: dict[str, list] = {}
    for t in plan.tensors.values():
        m = EXPERT_NAME.match(t.name)
        if m:
            out.setdefault(m.group("prefix"), []).append(t)
        elif t.kind == "expert":
            raise QConvertError(
                f"tensor {t.name!r}: --layout flashinfer-trtllm supports gate_proj/up_proj/down_proj experts only"
            )
    return out


def _placeholder_plain(scheme: str, e: int, i: int, h: int, input_scales: bool) -> dict[str, torch.Tensor]:
    def m(shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    if scheme == "bf16":
        return {"w13_weight": m((e, 2 * i, h), torch.bfloat16), "w2_weight": m((e, h, i), torch.bfloat16)}
    if scheme == "mxfp8":
        return {
            "w13_weight": m((e, 2 * i, h), torch.float8_e4m3fn),
            "w2_weight": m((e, h, i), torch.float8_e4m3fn),
            "w13_weight_scale": torch.full((e, 2 * i, h // MXFP8_BLOCK), 127, dtype=torch.uint8),
            "w2_weight_scale": torch.full((e, h, i // MXFP8_BLOCK), 127, dtype=torch.uint8),
        }
    p = {
        "w13_weight": m((e, 2 * i, h // 2), torch.uint8),
        "w2_weight": m((e, h, i // 2), torch.uint8),
        "w13_weight_scale": m((e, 2 * i, h // NVFP4_BLOCK), torch.float8_e4m3fn),
        "w2_weight_scale": m((e, h, i // NVFP4_BLOCK), torch.float8_e4m3fn),
        "w13_weight_scale_2": torch.ones(e, 2),
        "w2_weight_scale_2": torch.ones(e),
    }
    if input_scales:
        p["w13_input_scale"] = torch.ones(e, 2)
        p["w2_input_scale"] = torch.ones(e)
    return p


_SPEC_CACHE: dict[tuple, dict] = {}


def rank_specs(
    scheme, engine, e, i, h, tp, ep, input_scales
) -> dict[tuple[int, int], list[tuple[str, torch.dtype, tuple]]]:
    """Output (param, dtype, shape) per rank, found by transforming placeholder tensors once per shape."""
    key = (scheme, engine, e, i, h, tp, ep, input_scales)
    if key not in _SPEC_CACHE:
        ranks = trtllm.transform_moe_layer(
            _placeholder_plain(scheme, e, i, h, input_scales), scheme, engine, tp=tp, ep=ep
        )
        _SPEC_CACHE[key] = {
            rq: [(k, v.dtype, tuple(v.shape)) for k, v in params.items()] for rq, params in ranks.items()
        }
    return _SPEC_CACHE[key]


def layout_manifest(plan, layer_schemes: dict[str, str], engine: str, tp: int, ep: int) -> dict:
    """The layout contract per scheme used, and which scheme each MoE layer has."""
    contracts = {}
    for prefix, scheme in layer_schemes.items():
        if scheme in contracts:
            continue
        first = next(t for t in plan.tensors.values() if t.name.startswith(prefix + ".0.gate_proj."))
        e = len(
            {
                t.name.split(".experts.")[1].split(".")[0]
                for t in plan.tensors.values()
                if t.name.startswith(prefix + ".")
            }
        )
        contracts[scheme] = trtllm.kernel_layout_contract(
            scheme, engine, num_experts=e, intermediate_size=first.shape[0], hidden_size=first.shape[1], tp=tp, ep=ep
        )
    return {
        "name": trtllm.LAYOUT_NAME,
        "engine": engine,
        "tp": tp,
        "ep": ep,
        "tensor_names": "{prefix}.trtllm.{param}" if tp == ep == 1 else "{prefix}.trtllm_tp{r}_ep{q}.{param}",
        "layers": layer_schemes,
        "contracts": contracts,
    }
