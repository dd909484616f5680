#!/usr/bin/env python3
"""Write a synthetic BF16 checkpoint with Qwen3-30B-A3B's real tensor names and shapes.

Per decoder layer: q_proj 4096x2048, k/v_proj 512x2048, o_proj 2048x4096, q/k_norm 128, two
layer norms 2048, router (mlp.gate) 128x2048 and 128 experts of gate/up 768x2048 and down
2048x768 (about 1.25 GB of BF16 per layer). Plus embed_tokens and lm_head 151936x2048 and the
final norm. The real model has 48 layers; ``--layers`` picks how many fit the disk and time
budget. Shards are cut at ``--shard-gb`` (a tensor never straddles two shards), so the same
layers can be written as one shard or many.

Values are N(0, 0.02^2) BF16 drawn once into a 64 MB pool and read at a different offset for
each tensor: quantizer speed does not depend on the values, and generating 10 GB of fresh
normals would take longer than the benchmark itself.

    python scripts/make_synthetic.py /tmp/qwen3-30b-a3b-synth --layers 4 --shard-gb 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from qconvert.convert.safetensors_io import ShardWriter

HIDDEN = 2048
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
EXPERTS, MOE_INTER = 128, 768
VOCAB = 151936
POOL_ELEMS = 1 << 25


def qwen3_30b_a3b_config(layers: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "intermediate_size": 6144,
        "moe_intermediate_size": MOE_INTER,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def tensor_specs(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) in the order they are written."""
    specs = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate.weight", (EXPERTS, HIDDEN)),
        ]
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            specs += [
                (q + "gate_proj.weight", (MOE_INTER, HIDDEN)),
                (q + "up_proj.weight", (MOE_INTER, HIDDEN)),
                (q + "down_proj.weight", (HIDDEN, MOE_INTER)),
            ]
    specs += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return specs


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Values:
    """Tensor contents from one random pool, a different offset per tensor."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(POOL_ELEMS, generator=g) * 0.02).to(torch.bfloat16)
        self.ones = (1.0 + 0.1 * torch.randn(4096, generator=g)).to(torch.bfloat16)
        self.off = 0

    def get(self, name: str, shape) -> torch.Tensor:
        n = _numel(shape)
        if len(shape) == 1:  # norms: around 1
            return self.ones[:n].clone().reshape(shape)
        self.off = (self.off + 7919 * 32) % POOL_ELEMS
        parts, need, off = [], n, self.off
        while need:
            take = min(need, POOL_ELEMS - off)
            parts.append(self.pool[off : off + take])
            need -= take
            off = 0
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
        return t.reshape(shape)


def make(dst: Path, layers: int, shard_gb: float, seed: int = 0) -> dict:
    specs = tensor_specs(layers)
    limit = int(shard_gb * 1e9)
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in specs:
        nb = _numel(shape) * 2
        if groups[-1] and size + nb > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nb
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(qwen3_30b_a3b_config(layers), indent=2))
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645}))
    n = len(groups)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    vals = _Values(seed)
    wmap, total, sizes = {}, 0, []
    for f, group in zip(files, groups):
        w = ShardWriter(dst / f, [(name, torch.bfloat16, shape) for name, shape in group])
        for name, shape in group:
            w.write(name, vals.get(name, shape))
            wmap[name] = f
            total += _numel(shape) * 2
        w.close(fsync=False)
        sizes.append(w.size)
    if n > 1:
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, indent=2)
        )
    return {
        "path": str(dst),
        "layers": layers,
        "shards": n,
        "bytes": total,
        "largest_shard": max(sizes),
        "shard_sizes": sizes,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (real model: 48; ~1.25 GB each)")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="shard size limit in GB (large value: one shard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace DST")
    a = ap.parse_args(argv)
    dst = Path(a.dst)
    if dst.exists():
        if not a.force:
            sys.exit(f"error: {dst} exists; pass --force to replace it")
        shutil.rmtree(dst)
    t0 = time.perf_counter()
    info = make(dst, a.layers, a.shard_gb, a.seed)
    print(json.dumps({**info, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
