"""Pipeline jobs that write MoE experts pre-shuffled for the FlashInfer TRT-LLM kernels.

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

from ..errors import CheckpointError, QConvertError
from . import dialects
from .layouts import trtllm

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


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
        m = _EXPERT.match(t.name)
        if m:
            out.setdefault(m.group("prefix"), []).append(t)
        elif t.kind == "expert":
            raise QConvertError(f"tensor {t.name!r}: --layout flashinfer-trtllm supports gate_proj/up_proj/down_proj experts only")
    return out


def _placeholder_plain(scheme: str, e: int, i: int, h: int, input_scales: bool) -> dict[str, torch.Tensor]:
    def m(shape, dtype):
        return torch.zeros(shape, dtype=dtype)
    if scheme == "bf16":
        return {"w13_weight": m((e, 2 * i, h), torch.bfloat16), "w2_weight": m((e, h, i), torch.bfloat16)}
    if scheme == "mxfp8":
        return {"w13_weight": m((e, 2 * i, h), torch.float8_e4m3fn), "w2_weight": m((e, h, i), torch.float8_e4m3fn),
                "w13_weight_scale": torch.full((e, 2 * i, h // 32), 127, dtype=torch.uint8),
                "w2_weight_scale": torch.full((e, h, i // 32), 127, dtype=torch.uint8)}
    p = {"w13_weight": m((e, 2 * i, h // 2), torch.uint8), "w2_weight": m((e, h, i // 2), torch.uint8),
         "w13_weight_scale": m((e, 2 * i, h // 16), torch.float8_e4m3fn),
         "w2_weight_scale": m((e, h, i // 16), torch.float8_e4m3fn),
         "w13_weight_scale_2": torch.ones(e, 2), "w2_weight_scale_2": torch.ones(e)}
    if input_scales:
        p["w13_input_scale"] = torch.ones(e, 2)
        p["w2_input_scale"] = torch.ones(e)
    return p


_SPEC_CACHE: dict[tuple, dict] = {}


def rank_specs(scheme, engine, e, i, h, tp, ep, input_scales) -> dict[tuple[int, int], list[tuple[str, torch.dtype, tuple]]]:
    """Output (param, dtype, shape) per rank, found by transforming placeholder tensors once per shape."""
    key = (scheme, engine, e, i, h, tp, ep, input_scales)
    if key not in _SPEC_CACHE:
        ranks = trtllm.transform_moe_layer(_placeholder_plain(scheme, e, i, h, input_scales), scheme, engine, tp=tp, ep=ep)
        _SPEC_CACHE[key] = {rq: [(k, v.dtype, tuple(v.shape)) for k, v in params.items()] for rq, params in ranks.items()}
    return _SPEC_CACHE[key]


def moe_layer_job(prefix: str, members: list, scheme: str, engine: str, tp: int, ep: int, opts,
                  input_scales: dict | None, job_cls):
    """A pipeline Job for one MoE layer. ``scheme`` is this layer's format (bf16 for kept layers)."""
    experts: dict[int, dict[str, object]] = {}
    for t in members:
        m = _EXPERT.match(t.name)
        experts.setdefault(int(m.group("e")), {})[m.group("proj")] = t
    n_exp = len(experts)
    if sorted(experts) != list(range(n_exp)) or any(len(v) != 3 for v in experts.values()):
        raise CheckpointError(f"{prefix}: experts are not numbered 0..{n_exp - 1} with gate/up/down each")
    i, h = experts[0]["gate_proj"].shape
    w4a4 = scheme == "nvfp4"
    if scheme == "nvfp4" and opts.input_mode == "weight-only":
        raise QConvertError("--layout flashinfer-trtllm with NVFP4 needs activation scales (the TRT-LLM NVFP4 MoE "
                            "kernels are W4A4): add --input-scale unit or --input-scales-from CKPT")
    try:
        specs = rank_specs(scheme, engine, n_exp, i, h, tp, ep, w4a4)
    except trtllm.LayoutError as e:
        msg = str(e)
        if "--tp" not in msg and (tp > 1 or ep > 1):
            msg += f" (with --tp {tp} --ep {ep}: try a smaller --tp)"
        raise trtllm.LayoutError(f"{prefix}: {msg}") from None
    if sorted(specs) != [(r, q) for r in range(tp) for q in range(ep)] or not all(specs.values()):
        # every rank, each with tensors: the layer's experts are replaced by these outputs only
        raise trtllm.LayoutError(f"{prefix}: internal: ranks {sorted(specs)} for --tp {tp} --ep {ep}; "
                                 "no expert tensor may be dropped")
    outputs = []
    for (r, q), params in specs.items():
        tag = rank_tag(r, q, tp, ep)
        for name, dtype, shape in params:
            outputs.append(dialects.OutTensor(f"{prefix}.{tag}.{name}", dtype, shape, "layout"))
    order = [experts[e][p].name for e in range(n_exp) for p in ("gate_proj", "up_proj", "down_proj")]
    check = not opts.allow_non_finite
    device = opts.device

    def fn(src):
        def get(e, p):
            x = src[experts[e][p].name]
            return x.to(device, non_blocking=True) if device != "cpu" else x
        w13 = torch.stack([torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(n_exp)])
        w2 = torch.stack([get(e, "down_proj") for e in range(n_exp)])
        if scheme == "bf16":
            if check and not (bool(torch.isfinite(w13).all()) and bool(torch.isfinite(w2).all())):
                raise CheckpointError(f"{prefix}: expert weights contain NaN or Inf; fix the source or pass --allow-non-finite")
            plain = {"w13_weight": w13, "w2_weight": w2}
        elif scheme == "mxfp8":
            from .numerics.mxfp8 import mxfp8_quantize
            q13, s13 = mxfp8_quantize(w13)
            q2, s2 = mxfp8_quantize(w2)
            if check and (bool((s13 == 255).any()) or bool((s2 == 255).any())):
                raise CheckpointError(f"{prefix}: expert weights contain NaN or Inf; fix the source or pass --allow-non-finite")
            plain = {"w13_weight": q13, "w13_weight_scale": s13, "w2_weight": q2, "w2_weight_scale": s2}
        else:
            from .numerics.nvfp4 import nvfp4_quantize
            g13 = w13.abs().amax(dim=(1, 2)).float()  # gate and up of each expert share one global scale
            g2 = w2.abs().amax(dim=(1, 2)).float()
            if check and not (bool(torch.isfinite(g13).all()) and bool(torch.isfinite(g2).all())):
                raise CheckpointError(f"{prefix}: expert weights contain NaN or Inf; fix the source or pass --allow-non-finite")
            p13, s13, ws13, p2, s2, ws2 = [], [], [], [], [], []
            for e in range(n_exp):
                a, b, c = nvfp4_quantize(w13[e], global_amax=g13[e], recipe=opts.recipe)
                p13.append(a), s13.append(b), ws13.append(c)
                a, b, c = nvfp4_quantize(w2[e], global_amax=g2[e], recipe=opts.recipe)
                p2.append(a), s2.append(b), ws2.append(c)
            ws13_t = torch.stack(ws13)
            plain = {"w13_weight": torch.stack(p13), "w13_weight_scale": torch.stack(s13),
                     "w13_weight_scale_2": torch.stack([ws13_t, ws13_t], dim=1), "w2_weight": torch.stack(p2),
                     "w2_weight_scale": torch.stack(s2), "w2_weight_scale_2": torch.stack(ws2)}
            if input_scales is not None:
                a13 = torch.stack([torch.stack([input_scales[experts[e][p].module] for p in ("gate_proj", "up_proj")])
                                   for e in range(n_exp)])
                a2 = torch.stack([input_scales[experts[e]["down_proj"].module] for e in range(n_exp)])
            else:
                a13, a2 = torch.ones(n_exp, 2), torch.ones(n_exp)
            plain["w13_input_scale"], plain["w2_input_scale"] = a13.to(w13.device), a2.to(w13.device)
        ranks = trtllm.transform_moe_layer(plain, scheme, engine, tp=tp, ep=ep)
        out = {}
        for (r, q), params in ranks.items():
            tag = rank_tag(r, q, tp, ep)
            for name, t in params.items():
                out[f"{prefix}.{tag}.{name}"] = t.contiguous().cpu()
        return out

    return job_cls(order, outputs, fn, f"{scheme}+trtllm")


def layout_manifest(plan, layer_schemes: dict[str, str], engine: str, tp: int, ep: int) -> dict:
    """The layout contract per scheme used, and which scheme each MoE layer has."""
    contracts = {}
    for prefix, scheme in layer_schemes.items():
        if scheme in contracts:
            continue
        first = next(t for t in plan.tensors.values() if t.name.startswith(prefix + ".0.gate_proj."))
        e = len({t.name.split(".experts.")[1].split(".")[0] for t in plan.tensors.values()
                 if t.name.startswith(prefix + ".")})
        contracts[scheme] = trtllm.layout_contract(scheme, engine, num_experts=e, intermediate_size=first.shape[0],
                                                   hidden_size=first.shape[1], tp=tp, ep=ep)
    return {
        "name": trtllm.LAYOUT_NAME,
        "engine": engine,
        "tp": tp,
        "ep": ep,
        "tensor_names": "{prefix}.trtllm.{param}" if tp == ep == 1 else "{prefix}.trtllm_tp{r}_ep{q}.{param}",
        "layers": layer_schemes,
        "contracts": contracts,
    }
