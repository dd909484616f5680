#!/usr/bin/env python3
"""Server-side reload of a shared-memory staging area into a vLLM CPU server, against a plain copy
of the same bytes measured in the same worker in the same run (issue 20 item 5; target <= 1.5x).

Per scheme (BF16, MXFP8): two checkpoints of one larger demo model (``--layers``, ``--hidden``,
``--experts``, ``--moe-inter``; Qwen3-MoE with the demo tokenizer; seeds 0 and 1), each staged with
``qconvert stage`` into ``--shm`` (RAM); a vLLM CPU server started on the first as
tests/test_reload_vllm.py starts it (dev mode, qconvert's worker extension). Then, alternating the
two areas so that the weights really change, ``--rounds`` times each:

- floor: ``qconvert_copy_floor``: in the worker, one ``copy_`` of every tensor the rank loads, from
  the same mappings into tensors of the same shapes allocated and touched beforehand (best of 3);
- direct: ``qconvert_load_staged`` (what ``qconvert reload vllm shm:NAME`` runs: the direct in-place
  load where exact, docs/reload.md#vllm-direct-load), the worker's own time, and the request's
  wall time;
- layerwise: ``qconvert_load_staged`` with ``direct=False`` (every layer through vLLM's layerwise
  reload, what the extension did before the direct load);
- stock: vLLM's own ``reload_weights`` of the same area directory (its disk loader: safetensors
  read of every tensor, then the same layerwise reload), for comparison.

MoE experts on the CPU build need ``qconvert_repack_cpu_moe`` after any reload; it runs after each
load and is reported on its own (a vLLM CPU artefact, not part of loading). A last direct load of
the first area ends the run (``--profile N``: profiled, its N most expensive functions printed,
cumulative), so the greedy text printed is always the first checkpoint's. Each direct load reports
whether it recorded or replayed its copy plan (docs/reload.md#vllm-direct-load).

    python scripts/bench_reload.py --work /tmp/bench-reload --schemes bf16,mxfp8 --rounds 3 --profile 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from scripts.vllm_server import CPU_TEST_FLAGS, VllmServer  # noqa: E402


def build(work: Path, scheme: str, seed: int, overrides: dict) -> Path:
    from qconvert.convert.demo import build_demo_model
    from qconvert.convert.pipeline import ConvertOptions, convert
    from qconvert.convert.plan import PlanOptions

    src = work / f"bf16-{seed}"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        build_demo_model(src, arch="qwen3-moe", seed=seed, n_shards=4, overrides=overrides)
    if scheme == "bf16":
        return src
    dst = work / f"{scheme}-{seed}"
    if not (dst / "config.json").is_file():
        shutil.rmtree(dst, ignore_errors=True)
        convert(
            str(src),
            dst,
            scheme,
            ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme), fsync=False, progress=False),
        )
    return dst


def bench_scheme(scheme: str, args, overrides: dict) -> dict:
    from qconvert.client import staging
    from qconvert.client.vllm_client import VllmClient
    from qconvert.engine import EXTENSION_FLAG, STAGED_RPC

    work = Path(args.work) / scheme
    work.mkdir(parents=True, exist_ok=True)
    ckpts = [build(Path(args.work), scheme, s, overrides) for s in (0, 1)]
    os.environ["QCONVERT_SHM_ROOT"] = str(args.shm)
    areas = [staging.stage_checkpoint(c, f"bench-{scheme}-{i}").path for i, c in enumerate(ckpts)]
    try:  # the CPU server of tests/test_reload_vllm.py: dev mode, qconvert's worker extension
        srv = VllmServer(
            ckpts[0],
            work / "server.log",
            [*CPU_TEST_FLAGS, *EXTENSION_FLAG.split()],
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"},
            timeout=600,
        )
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    c = VllmClient(srv.url, timeout=600, reload_timeout=3600)
    moe = True
    rec: dict = {
        "scheme": scheme,
        "floor": [],
        "staged": [],
        "staged_wall": [],
        "layerwise": [],
        "stock": [],
        "repack": [],
    }
    try:
        assert c.has_extension(), "server started without qconvert's worker extension"

        def repack() -> None:
            t = time.perf_counter()
            if moe:
                c.collective_rpc("qconvert_repack_cpu_moe")
            rec["repack"].append(time.perf_counter() - t)

        direct = args.direct.split(",") if args.direct else None
        c.collective_rpc(STAGED_RPC, area=str(areas[1]))  # warm-up: first touch of the area's pages
        repack()
        for _ in range(args.rounds):
            for area in (areas[0], areas[1]):
                (fl,) = c.collective_rpc("qconvert_copy_floor", area=str(area), repeat=3)
                rec["floor"].append(fl["seconds"])
                rec["bytes"] = fl["bytes"]
                rec["threads"] = fl["threads"]
                t = time.perf_counter()
                (st,) = c.collective_rpc(STAGED_RPC, area=str(area), direct=direct)
                rec["staged_wall"].append(time.perf_counter() - t)
                rec["staged"].append(st["load_seconds"] + st["map_seconds"])
                rec["released"] = st["mappings_released"]
                rec["path"], rec["modules"] = st.get("path"), st.get("modules")
                rec.setdefault("plans", []).append(st.get("plan"))
                rec.setdefault("copied", []).append((st["modules"] or {}).get("copied-modules"))
                if st.get("copies_recorded"):
                    rec["copies_recorded"] = st["copies_recorded"]
                repack()
                if (
                    args.copies_ab
                ):  # the same load with the replayed modules' loaders called (docs/reload.md#loader-copies)
                    (st,) = c.collective_rpc(STAGED_RPC, area=str(area), direct=direct, loader_copies=False)
                    rec.setdefault("calls", []).append(st["load_seconds"] + st["map_seconds"])
                    repack()
                (st,) = c.collective_rpc(STAGED_RPC, area=str(area), direct=False)
                rec["layerwise"].append(st["load_seconds"] + st["map_seconds"])
                repack()
                if not args.no_stock:
                    t = time.perf_counter()
                    c.reload_weights(str(area))
                    rec["stock"].append(time.perf_counter() - t)
                    repack()
        # a last direct load of the first area (profiled with --profile), so that the greedy text below
        # is the first checkpoint's whatever ran last in the rounds
        (st,) = c.collective_rpc(STAGED_RPC, area=str(areas[0]), profile=args.profile, direct=direct)
        rec["profile"] = st.get("profile")
        repack()
        # the server still answers and its weights are the first checkpoint's (the last load)
        rec["greedy"] = c.complete("The quick brown fox", 8)
    finally:
        srv.stop()
        if not args.keep:
            for i in range(2):
                staging.drop_area(f"bench-{scheme}-{i}")
    return rec


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rng(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="checkpoints and server logs go here")
    ap.add_argument("--shm", default="/dev/shm/qconvert-bench", help="staging root (RAM-backed)")
    ap.add_argument("--schemes", default="bf16,mxfp8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--profile", type=int, default=0, help="print the N most expensive functions of one staged load")
    ap.add_argument("--no-stock", action="store_true", help="skip vLLM's own reload_weights of the area")
    ap.add_argument("--keep", action="store_true", help="keep the staging areas")
    ap.add_argument("--json", help="write the raw record here")
    ap.add_argument(
        "--direct",
        help="the direct-load forms to take (comma list of vllm_direct.Form values; the others reload "
        "layerwise, their loader calls replayed, as every module of a GPU server does); default all",
    )
    ap.add_argument(
        "--copies-ab", action="store_true", help="also time each direct load with QCONVERT_LOADER_COPIES off (calls)"
    )
    args = ap.parse_args()
    heads = max(1, args.hidden // 64)
    overrides = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "num_experts": args.experts,
        "moe_intermediate_size": args.moe_inter,
        "max_window_layers": args.layers,
        "intermediate_size": 4 * args.moe_inter,
    }
    recs = [bench_scheme(s, args, overrides) for s in args.schemes.split(",")]
    print(
        f"model: Qwen3-MoE demo tokenizer, {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"x {args.moe_inter}; {args.rounds} rounds x 2 areas; medians (range)"
    )
    print(
        "| scheme | bytes loaded | worker threads | floor: copy into preallocated (s) | direct load (s) | "
        "**direct / floor** | request wall (s) | layerwise load (s) | layerwise / floor | "
        "stock reload_weights of the area (s) | stock / floor | CPU MoE repack (s) | repack / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        f = med(r["floor"])
        print(
            f"| {r['scheme']} | {r['bytes'] / 1e6:.0f} MB | {r['threads']} | {f:.3f} ({rng(r['floor'])}) | "
            f"{med(r['staged']):.3f} ({rng(r['staged'])}) | **{med(r['staged']) / f:.2f}** | "
            f"{med(r['staged_wall']):.3f} | {med(r['layerwise']):.3f} ({rng(r['layerwise'])}) | "
            f"{med(r['layerwise']) / f:.2f} | {med(r['stock']):.3f} ({rng(r['stock'])}) | "
            f"{med(r['stock']) / f:.2f} | {med(r['repack']):.3f} | {med(r['repack']) / f:.2f} |"
        )
    for r in recs:
        if r.get("profile"):
            print(f"\nprofile of one staged load, {r['scheme']} (cumulative):")
            for line in r["profile"]:
                print("   ", line)
        print(
            f"{r['scheme']}: mappings released after every load: {r.get('released')}; greedy after: {r.get('greedy')!r}"
        )
        print(f"{r['scheme']}: default load path {r.get('path')}, modules per form {r.get('modules')}")
        print(f"{r['scheme']}: copy plan of each timed direct load: {r.get('plans')}")
        print(
            f"{r['scheme']}: loader copies recorded {r.get('copies_recorded')}; modules copied per load {r.get('copied')}"
        )
        if r.get("calls"):
            f = med(r["floor"])
            print(
                f"{r['scheme']}: the same load with the replayed loader calls instead of their copies: "
                f"{med(r['calls']):.3f} s ({rng(r['calls'])}), {med(r['calls']) / f:.2f}x the floor, against "
                f"{med(r['staged']):.3f} s ({rng(r['staged'])}), {med(r['staged']) / f:.2f}x, with the copies"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
