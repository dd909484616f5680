"""Built-in tiny models in the real Hugging Face layout, made offline.

``qwen3-moe``: Qwen3MoeForCausalLM, 4 layers, 8 experts of 128x256, sharded safetensors with an
index. ``qwen3``: the dense Qwen3ForCausalLM counterpart. ``llama-tied``: a dense
LlamaForCausalLM with ``tie_word_embeddings: true`` and no ``lm_head.weight`` (the head is the
input embedding, as in Llama 3.2 1B/3B, Qwen3 0.6B-4B, SmolLM, Gemma). All carry a byte-level BPE tokenizer
trained locally on a built-in text, so vLLM can serve them. Weights are seeded random BF16 with
Kaiming-like scales, so activations stay O(1) and greedy decoding is not a coin toss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..errors import OutputError
from ..formats.exclusions import MODULES_TO_NOT_CONVERT
from .checkpoint import INDEX_NAME
from .safetensors_io import ShardWriter

ARCHS = ("qwen3-moe", "qwen3", "llama-tied")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A quantized checkpoint keeps the bytes an engine
expects. Reinforcement learning refits the weights of the inference server at every step.
MXFP8 stores eight-bit floating point elements with one shared power-of-two scale per block of
thirty-two values. NVFP4 stores four-bit elements with an FP8 scale per block of sixteen values and
one global scale per tensor. Mixture-of-experts layers route each token to a few experts.
Once upon a time there was a small model that learned to count: one two three four five six seven
eight nine ten. The capital of France is Paris. The sky is blue and the grass is green.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512


def _tokenizer_files(dst: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(dst / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 1024,
                "clean_up_tokenization_spaces": False,
                "added_tokens_decoder": {
                    str(tok.token_to_id(t)): {
                        "content": t,
                        "special": True,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "single_word": False,
                    }
                    for t in SPECIAL
                },
                "chat_template": template,
            },
            indent=2,
        )
    )
    return tok.token_to_id("<|endoftext|>")


def demo_config(arch: str, eos_id: int = 0) -> dict:
    common = {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "rope_scaling": None,
    }
    if arch == "qwen3-moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    if arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common, "intermediate_size": 512}
    if arch == "llama-tied":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "intermediate_size": 512,
            "tie_word_embeddings": True,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }
    raise ValueError(f"unknown demo architecture {arch!r}; choose one of {ARCHS}")


def demo_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random BF16 weights with the real HF names, in a stable order."""
    g = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def lin(n, k, gain=1.0):
        return (torch.randn(n, k, generator=g) * (gain / math.sqrt(k))).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    tied = config.get("tie_word_embeddings", False)
    # a tied embedding is also the head: the untied head's scale, so logits stay O(1)
    t = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * (4.0 / math.sqrt(h) if tied else 1.0)).to(
            torch.bfloat16
        )
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = lin(nh * hd, h)
        t[p + "self_attn.k_proj.weight"] = lin(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = lin(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, nh * hd)
        if config.get("model_type") != "llama":  # Llama has no q/k norms
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        if "num_experts" in config:
            ne, mi = config["num_experts"], config["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = lin(ne, h, 2.0)
            for e in range(ne):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = lin(mi, h)
                t[q + "up_proj.weight"] = lin(mi, h)
                t[q + "down_proj.weight"] = lin(h, mi)
        else:
            inter = config["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = lin(inter, h)
            t[p + "mlp.up_proj.weight"] = lin(inter, h)
            t[p + "mlp.down_proj.weight"] = lin(h, inter)
    t["model.norm.weight"] = norm(h)
    if not tied:
        t["lm_head.weight"] = lin(v, h, 4.0)
    return t


def write_sharded(dst: Path, tensors: dict[str, torch.Tensor], n_shards: int):
    """Write ``tensors`` as ``n_shards`` safetensors files plus an index (1 shard: no index)."""
    names = list(tensors)
    total = sum(x.numel() * x.element_size() for x in tensors.values())
    per = total / n_shards
    groups: list[list[str]] = [[]]
    acc = 0
    for n in names:
        nb = tensors[n].numel() * tensors[n].element_size()
        if acc >= per * len(groups) and len(groups) < n_shards:
            groups.append([])
        groups[-1].append(n)
        acc += nb
    if n_shards == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    wmap = {}
    for f, group in zip(files, groups):
        w = ShardWriter(dst / f, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in group])
        for n in group:
            w.write(n, tensors[n])
            wmap[n] = f
        w.close(fsync=False)
    if n_shards > 1:
        (dst / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, indent=2)
        )


def build_demo_model(
    dst: str | Path, arch: str = "qwen3-moe", seed: int = 0, n_shards: int = 3, overrides: dict | None = None
) -> Path:
    """Create the tiny demo checkpoint at ``dst`` (must not exist). Offline, deterministic.
    ``overrides``: config keys to change (sizes; scripts/bench_reload.py builds larger models so)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise OutputError(f"{dst}: already exists and is not empty; choose another directory")
    dst.mkdir(parents=True, exist_ok=True)
    eos = _tokenizer_files(dst)
    config = {**demo_config(arch, eos), **(overrides or {})}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}, indent=2)
    )
    title = f"{arch}, seed {seed}" if seed else arch  # seed 0: the same bytes as before --seed existed
    (dst / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: transformers\ntags:\n- qconvert-demo\n---\n\n"
        f"# qconvert demo model ({title})\n\nA tiny random {config['architectures'][0]} built offline by "
        "`qconvert demo` for tests and examples. Its outputs are meaningless.\n"
    )
    write_sharded(dst, demo_tensors(config, seed), n_shards)
    return dst


GPT_OSS_MXFP4 = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "mxfp4",
        MODULES_TO_NOT_CONVERT: [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}


def gpt_oss_mxfp4_tensors(config: dict, seed: int = 0, exponents: tuple[int, int] = (-10, -4)) -> dict:
    """A gpt-oss-shaped MXFP4 checkpoint's tensors (HF names): BF16 attention with biases and sinks,
    router, and per layer the fused experts as ``*_blocks`` [E, N, K/32, 16] / ``*_scales`` [E, N, K/32]
    uint8 (random nibbles, E8M0 exponents drawn from ``exponents``) with BF16 ``*_bias``."""
    g = torch.Generator().manual_seed(seed)
    h, v, inter, ne = (
        config["hidden_size"],
        config["vocab_size"],
        config["intermediate_size"],
        config["num_local_experts"],
    )
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def lin(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16)

    def vec(n, scale=0.02):
        return (torch.randn(n, generator=g) * scale).to(torch.bfloat16)

    def mx(rows, k):
        blocks = torch.randint(0, 256, (ne, rows, k // 32, 16), generator=g, dtype=torch.uint8)
        lo, hi = exponents
        scales = torch.randint(127 + lo, 128 + hi, (ne, rows, k // 32), generator=g).to(torch.uint8)
        return blocks, scales

    t = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).to(torch.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1.0 + vec(h, 0.1).float()).to(torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = (1.0 + vec(h, 0.1).float()).to(torch.bfloat16)
        for n, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            t[p + f"self_attn.{n}_proj.weight"] = lin(rows, h)
            t[p + f"self_attn.{n}_proj.bias"] = vec(rows)
        t[p + "self_attn.o_proj.weight"] = lin(h, nh * hd)
        t[p + "self_attn.o_proj.bias"] = vec(h)
        t[p + "self_attn.sinks"] = vec(nh, 1.0)
        t[p + "mlp.router.weight"] = lin(ne, h)
        t[p + "mlp.router.bias"] = vec(ne)
        q = p + "mlp.experts."
        t[q + "gate_up_proj_blocks"], t[q + "gate_up_proj_scales"] = mx(2 * inter, h)
        t[q + "gate_up_proj_bias"] = vec(2 * inter).expand(ne, -1).contiguous()
        t[q + "down_proj_blocks"], t[q + "down_proj_scales"] = mx(h, inter)
        t[q + "down_proj_bias"] = vec(h).expand(ne, -1).contiguous()
    t["model.norm.weight"] = (1.0 + vec(h, 0.1).float()).to(torch.bfloat16)
    t["lm_head.weight"] = lin(v, h)
    return t


def build_gpt_oss_mxfp4(
    dst: str | Path, seed: int = 0, mutate=None, n_shards: int = 2, overrides: dict | None = None, **kw
) -> Path:
    """The tiny gpt-oss-shaped MXFP4 checkpoint at ``dst`` (offline, deterministic): what gpt-oss
    ships (docs/formats.md#mxfp4-sources), for tests. ``mutate(config, tensors)`` edits both before
    they are written (bad-input tests); ``overrides``: config keys to change (sizes;
    scripts/bench_decode.py builds gpt-oss-20b-sized experts so); ``kw`` goes to
    :func:`gpt_oss_mxfp4_tensors`."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise OutputError(f"{dst}: already exists and is not empty; choose another directory")
    dst.mkdir(parents=True, exist_ok=True)
    eos = _tokenizer_files(dst)
    config = json.loads(json.dumps({**GPT_OSS_MXFP4, **(overrides or {}), "bos_token_id": eos, "eos_token_id": eos}))
    tensors = gpt_oss_mxfp4_tensors(config, seed, **kw)
    if mutate is not None:
        mutate(config, tensors)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    write_sharded(dst, tensors, n_shards)
    return dst


def convert_demo(
    root: str | Path,
    arch: str = "qwen3-moe",
    scheme: str = "mxfp8",
    last_n_bf16: int = 1,
    force: bool = False,
    log=None,
    seed: int = 0,
):
    """What ``qconvert demo`` does: build the tiny model in ``root/bf16`` (replaced with ``force``)
    and convert it to ``root/<scheme>`` (``root/<scheme>-last<N>-bf16`` with ``last_n_bf16``),
    NVFP4 as W4A16. ``seed`` picks the random weights (the same shapes and options for every
    seed). Returns the :class:`~qconvert.convert.pipeline.ConvertResult`."""
    from .pipeline import ConvertOptions, convert
    from .plan import PlanOptions

    log = log or (lambda s: None)
    root = Path(root)
    src = root / "bf16"
    out = root / f"{scheme}-last{last_n_bf16}-bf16" if last_n_bf16 else root / scheme
    if src.exists() and not force:
        raise OutputError(f"{src}: already exists; choose another DST or pass --force")
    if src.is_symlink():
        raise OutputError(
            f"{src}: is a symbolic link; demo writes its model there and does not follow links: choose another DST"
        )
    if src.exists():
        import shutil

        shutil.rmtree(src)
    build_demo_model(src, arch=arch, seed=seed)
    log(f"built demo model {arch} (seed {seed}) at {src}")
    opts = ConvertOptions(
        scheme=scheme,
        plan=PlanOptions(scheme=scheme, last_n_bf16=last_n_bf16),
        force=force,
        **({"input_mode": "weight-only"} if scheme == "nvfp4" else {}),
    )
    return convert(str(src), str(out), scheme, opts)
