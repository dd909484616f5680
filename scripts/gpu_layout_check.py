"""GPU check and timing of the FlashInfer TRT-LLM MoE layouts (qconvert.convert.layouts.trtllm).

Run on a CUDA machine with flashinfer-python importable (0.7.4 was used; its fp4 module is
JIT-built on first use). What it does, for Qwen3-30B-A3B-shaped experts (I=768, H=2048):

1. Scales: ``swizzle_128x4`` (ours, on CUDA) == FlashInfer's CUDA ``block_scale_interleave``
   (batched) and, per expert, ``shuffle_matrix_sf_a`` (after ``reorder_rows_for_gated_act_gemm``
   for W13), for MXFP8 (uint8, 32 per scale) and NVFP4 (e4m3, 16 per scale), TP 1, 2, 4.
2. Whole expert tensors: ``to_trtllm`` for BF16 / MXFP8 / NVFP4 x vLLM / SGLang x TP 1, 2, 4
   == an engine-style per-expert pipeline built from FlashInfer's own functions (pad as the
   engine does, swap halves, ``reorder_rows_for_gated_act_gemm``, ``shuffle_matrix_a``,
   ``shuffle_matrix_sf_a``, ``convert_to_block_layout``). vLLM / SGLang are not installed on
   the GPU machine; their whole-output equality is tested on CPU (tests/test_layouts_trtllm.py).
   Round trip ``from_trtllm(to_trtllm(x)) == x`` on CUDA.
3. Timing per layer (128 experts), reported x48 layers: engine-style processing of plain
   tensors already on the GPU (per-expert FlashInfer loop; and our batched gathers) vs copying
   pre-shuffled tensors into existing parameters (device-to-device and from pinned host memory),
   plus the host-to-device copy of the plain tensors the engine path needs as well.

Prints a summary and writes ``gpu_layout_check.json`` to ``--out``. No thresholds: ratios
against the copy floor measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qconvert.convert.layouts import trtllm as L  # noqa: E402
from qconvert.convert.layouts import trtllm_index as X  # noqa: E402

QWEN_I, QWEN_H, QWEN_E, QWEN_LAYERS = 768, 2048, 128, 48


def import_flashinfer():
    """Import FlashInfer's layout helpers; if the package __init__ needs modules that are not
    installed (cutlass DSL ...), load the submodules under a bare package object."""
    try:
        import flashinfer  # noqa: F401
    except Exception as err:  # noqa: BLE001
        print(f"plain `import flashinfer` failed ({type(err).__name__}: {err}); using submodules")
        for k in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
            del sys.modules[k]
        spec = importlib.util.find_spec("flashinfer")
        pkg = types.ModuleType("flashinfer")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__version__ = "0.7.4?"
        sys.modules["flashinfer"] = pkg
    from flashinfer.fused_moe import core
    from flashinfer.quantization import fp4_quantization as fq

    return types.SimpleNamespace(
        reorder=core.reorder_rows_for_gated_act_gemm,
        block_layout=core.convert_to_block_layout,
        shuffle_a=fq.shuffle_matrix_a,
        shuffle_sf_a=fq.shuffle_matrix_sf_a,
        interleave=fq.block_scale_interleave,
        version=getattr(sys.modules["flashinfer"], "__version__", "?"),
    )


def u8(x):
    return x.contiguous().view(torch.uint8)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(u8(a), u8(b))


def rand_plain(scheme, e, i, h, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rb(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=dev, generator=g)

    if scheme == "bf16":
        return dict(w13=rb(e, 2 * i, 2 * h).view(torch.bfloat16), w2=rb(e, h, 2 * i).view(torch.bfloat16))
    if scheme == "mxfp8":
        return dict(
            w13=rb(e, 2 * i, h).view(torch.float8_e4m3fn),
            w2=rb(e, h, i).view(torch.float8_e4m3fn),
            w13_scale=rb(e, 2 * i, h // 32, lo=1, hi=255),
            w2_scale=rb(e, h, i // 32, lo=1, hi=255),
        )
    return dict(
        w13=rb(e, 2 * i, h // 2),
        w2=rb(e, h, i // 2),
        w13_scale=rb(e, 2 * i, h // 16, hi=127).view(torch.float8_e4m3fn),
        w2_scale=rb(e, h, i // 16, hi=127).view(torch.float8_e4m3fn),
        w13_weight_scale_2=torch.rand(e, 2, device=dev),
        w2_weight_scale_2=torch.rand(e, device=dev),
        w13_input_scale=torch.rand(e, device=dev) + 0.5,
        w2_input_scale=torch.rand(e, device=dev) + 0.5,
    )


def engine_reference(fi, scheme, engine, p, tp, r):
    """Engine-style per-expert preparation of one rank from FlashInfer's own functions."""
    e, m_full = p["w13"].shape[0], p["w13"].shape[1]
    i = m_full // 2
    pad = L.engine_padding(scheme, engine)
    per = 2 if scheme == "nvfp4" else 1
    sf = {"mxfp8": 32, "nvfp4": 16}.get(scheme)
    ir = i // tp
    ip = -(-ir // pad.intermediate_multiple) * pad.intermediate_multiple
    h = p["w2"].shape[1]
    hp = -(-h // pad.hidden_multiple) * pad.hidden_multiple

    def halves(x, div):
        a = x[:, r * ir // 1 : (r + 1) * ir]
        b = x[:, i + r * ir : i + (r + 1) * ir]
        return a, b

    def pad_w13(x, cols, fill):  # [up; gate] each half padded (engines: swap, then pad halves)
        gate, up = (u8(t) for t in halves(x, 1))
        out = torch.full((e, 2 * ip, cols), fill, dtype=torch.uint8, device=x.device)
        out[:, :ir, : gate.shape[2]] = up
        out[:, ip : ip + ir, : gate.shape[2]] = gate
        return out

    def pad_w2(x, cols_div, fill, k):
        y = u8(x[:, :, r * ir // cols_div : (r + 1) * ir // cols_div])
        out = torch.full((e, hp, k), fill, dtype=torch.uint8, device=x.device)
        out[:, :h, : y.shape[2]] = y
        return out

    w13 = pad_w13(p["w13"], hp // per * (2 if scheme == "bf16" else 1), 0)
    w2 = pad_w2(p["w2"], per, 0, ip // per * (2 if scheme == "bf16" else 1))
    out13, out2, o13s, o2s = [], [], [], []
    for x in range(e):
        a = fi.reorder(w13[x])
        if scheme == "bf16":
            a = a.view(torch.bfloat16)
            b16 = w2[x].view(torch.bfloat16)
            a = fi.shuffle_a(u8(a), 128)
            b = fi.shuffle_a(u8(b16), 128)
            out13.append(fi.block_layout(a, 128))
            out2.append(fi.block_layout(b, 128))
            continue
        out13.append(fi.shuffle_a(a, 128))
        out2.append(fi.shuffle_a(w2[x], 128))
    res = {}
    if scheme == "bf16":
        g13 = torch.stack(out13).view(torch.bfloat16)
        g2 = torch.stack(out2).view(torch.bfloat16)
        if engine == "vllm":
            g13, g2 = g13.reshape(e, 2 * ip, hp), g2.reshape(e, hp, ip)
        return {"w13_weight": g13, "w2_weight": g2}
    s13 = pad_w13(p["w13_scale"], hp // sf, pad.scale_pad)
    s2 = pad_w2(p["w2_scale"], sf, pad.scale_pad, ip // sf)
    for x in range(e):
        o13s.append(fi.shuffle_sf_a(fi.reorder(s13[x]), 128, sf).reshape(2 * ip, hp // sf))
        o2s.append(fi.shuffle_sf_a(s2[x], 128, sf).reshape(hp, ip // sf))
    name = L.default_scale_name(scheme, engine)
    wdt = torch.float8_e4m3fn if scheme == "mxfp8" else torch.uint8
    sdt = torch.uint8 if scheme == "mxfp8" else torch.float8_e4m3fn
    res["w13_weight"] = torch.stack(out13).view(wdt)
    res["w2_weight"] = torch.stack(out2).view(wdt)
    res[f"w13_{name}"] = torch.stack(o13s).view(sdt)
    res[f"w2_{name}"] = torch.stack(o2s).view(sdt)
    return res


def check_scales(fi, dev, results):
    for scheme, sf, dt in (("mxfp8", 32, torch.uint8), ("nvfp4", 16, torch.float8_e4m3fn)):
        for tp in (1, 2, 4):
            i = QWEN_I // tp
            e = 8
            g = torch.Generator(device=dev).manual_seed(tp)
            s13 = torch.randint(1, 127, (e, 2 * i, QWEN_H // sf), dtype=torch.uint8, device=dev, generator=g)
            s2 = torch.randint(1, 127, (e, QWEN_H, i // sf), dtype=torch.uint8, device=dev, generator=g)
            ok = True
            for s in (s13, s2):  # FlashInfer takes the bytes as uint8
                ref = fi.interleave(s).view(torch.uint8).reshape(e, -1)
                ok &= torch.equal(u8(X.swizzle_128x4(s.view(dt))).reshape(e, -1), ref)
            p13 = X.w13_row_permutation(2 * i)
            p2 = X.w2_row_permutation(QWEN_H)
            ours13 = u8(X.swizzle_128x4(s13.view(dt), p13))
            ours2 = u8(X.swizzle_128x4(s2.view(dt), p2))
            for x in range(e):
                ref13 = u8(fi.shuffle_sf_a(fi.reorder(s13[x]), 128, sf)).reshape(-1)
                ref2 = u8(fi.shuffle_sf_a(s2[x], 128, sf)).reshape(-1)
                ok &= torch.equal(ours13[x].reshape(-1), ref13) and torch.equal(ours2[x].reshape(-1), ref2)
            results["scales"][f"{scheme}_tp{tp}"] = bool(ok)
            print(f"scales {scheme} tp{tp}: {'EQUAL' if ok else 'DIFFERENT'}")


def check_full(fi, dev, results, experts=8):
    for scheme in L.SCHEMES:
        for engine in L.ENGINES:
            p = rand_plain(scheme, experts, QWEN_I, QWEN_H, dev, seed=hash((scheme, engine)) % 1000)
            for tp in (1, 2, 4):
                key = f"{scheme}_{engine}_tp{tp}"
                try:
                    ok = True
                    for r in range(tp):
                        got = L.to_trtllm(scheme, engine, **p, tp=tp, tp_rank=r)
                        ref = engine_reference(fi, scheme, engine, p, tp, r)
                        for k, v in ref.items():
                            ok &= same(got[k], v)
                        back = L.from_trtllm(scheme, engine, got, intermediate_size=QWEN_I, hidden_size=QWEN_H, tp=tp)
                        a13 = torch.cat(
                            [
                                p["w13"][:, r * QWEN_I // tp : (r + 1) * QWEN_I // tp],
                                p["w13"][:, QWEN_I + r * QWEN_I // tp : QWEN_I + (r + 1) * QWEN_I // tp],
                            ],
                            1,
                        )
                        ok &= same(back["w13_weight"], a13)
                    results["full"][key] = bool(ok)
                    print(f"full {key}: {'EQUAL' if ok else 'DIFFERENT'}")
                except L.LayoutError as err:
                    results["full"][key] = f"refused: {err}"
                    print(f"full {key}: refused ({err})")


def cuda_time(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]  # median ms


def timing(fi, dev, results, have_interleave):
    for scheme in ("bf16", "mxfp8", "nvfp4"):
        for tp in (1, 4):
            e = QWEN_E
            p = rand_plain(scheme, e, QWEN_I, QWEN_H, dev, seed=1)
            engine = "vllm"
            pre = L.to_trtllm(scheme, engine, **p, tp=tp, tp_rank=0)
            plain_r = {
                k: v
                for k, v in L.from_trtllm(
                    scheme, engine, pre, intermediate_size=QWEN_I, hidden_size=QWEN_H, tp=tp
                ).items()
            }
            # per-rank plain tensors as the engine would hold them after load
            args = dict(
                w13=plain_r["w13_weight"],
                w2=plain_r["w2_weight"],
                w13_scale=plain_r.get("w13_weight_scale"),
                w2_scale=plain_r.get("w2_weight_scale"),
            )
            if scheme == "nvfp4":
                args.update(
                    {k: p[k] for k in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale")}
                )
            dst = {k: torch.empty_like(v) for k, v in pre.items()}
            host = {k: v.cpu().pin_memory() for k, v in pre.items()}
            host_plain = {
                k: v.cpu().pin_memory() for k, v in args.items() if isinstance(v, torch.Tensor) and v.dim() >= 3
            }
            nbytes = sum(v.numel() * v.element_size() for v in pre.values())

            def copy_d2d():
                for k, v in pre.items():
                    dst[k].copy_(v)

            def copy_h2d():
                for k, v in host.items():
                    dst[k].copy_(v, non_blocking=True)

            def plain_h2d():
                for k, v in host_plain.items():
                    args[k].copy_(v, non_blocking=True)

            def ours():
                out = L.to_trtllm(scheme, engine, **args)  # the engine pads this rank, then shuffles
                for k, v in out.items():
                    dst[k].copy_(v)

            ref_args = {k: args[k] for k in ("w13", "w2", "w13_scale", "w2_scale") if args.get(k) is not None}

            def engine_loop():
                out = engine_reference(fi, scheme, engine, ref_args, 1, 0)
                for k, v in out.items():
                    dst[k].copy_(v)

            row = {
                "bytes_per_layer": nbytes,
                "copy_d2d_ms": cuda_time(copy_d2d),
                "copy_h2d_pinned_ms": cuda_time(copy_h2d),
                "plain_h2d_pinned_ms": cuda_time(plain_h2d),
                "ours_batched_gather_ms": cuda_time(ours),
            }
            if scheme == "bf16" or have_interleave:
                row["engine_per_expert_flashinfer_ms"] = cuda_time(engine_loop, reps=3)
            row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
            row["x48_s"] = {k[:-3]: round(v * QWEN_LAYERS / 1000, 3) for k, v in row.items() if k.endswith("_ms")}
            key = f"{scheme}_vllm_tp{tp}_rank0"
            results["timing"][key] = row
            print(f"timing {key}: {json.dumps(row)}")
            del p, pre, plain_r, args, dst, host, host_plain
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "scales": {},
        "full": {},
        "timing": {},
    }
    t0 = time.time()
    fi = import_flashinfer()
    results["flashinfer"] = fi.version
    have_interleave = True
    try:
        t = time.time()
        fi.interleave(torch.ones(128, 4, dtype=torch.uint8, device=dev))
        results["jit_build_s"] = round(time.time() - t, 1)
        print(f"FlashInfer fp4 module ready in {results['jit_build_s']} s")
    except Exception as err:  # noqa: BLE001
        have_interleave = False
        results["interleave_error"] = f"{type(err).__name__}: {err}"[-4000:]
        print("block_scale_interleave unavailable:", results["interleave_error"])
    if have_interleave:
        check_scales(fi, dev, results)
        check_full(fi, dev, results)
    if not args.skip_timing:
        timing(fi, dev, results, have_interleave)
    results["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_layout_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
