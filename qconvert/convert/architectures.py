"""What qconvert knows about model architectures: names, layer counts, expected shapes.

Unknown architectures still convert by the generic name rules in :mod:`plan`; knowing one adds
shape checks against config.json and a "supported" line in the summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?layers)\.(?P<idx>\d+)\.")
EXPERT_RE = re.compile(r"\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class Arch:
    name: str
    family: str
    moe: bool
    #: config keys of the attention shape check (None: skip, e.g. DeepSeek MLA)
    standard_attention: bool = True


KNOWN: dict[str, Arch] = {a.name: a for a in [
    Arch("Qwen3ForCausalLM", "qwen3", False),
    Arch("Qwen3MoeForCausalLM", "qwen3-moe", True),
    Arch("Qwen2ForCausalLM", "qwen2", False),
    Arch("Qwen2MoeForCausalLM", "qwen2-moe", True),
    Arch("LlamaForCausalLM", "llama", False),
    Arch("MistralForCausalLM", "mistral", False),
    Arch("MixtralForCausalLM", "mixtral", True),
    Arch("DeepseekV3ForCausalLM", "deepseek-v3", True, standard_attention=False),
    Arch("DeepseekV2ForCausalLM", "deepseek-v2", True, standard_attention=False),
]}


def arch_of(config: dict) -> tuple[str, Arch | None]:
    archs = config.get("architectures") or []
    name = archs[0] if archs and isinstance(archs[0], str) else "<none>"
    return name, KNOWN.get(name)


def num_layers(config: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        v = config.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def expected_shapes(config: dict, arch: Arch) -> list[tuple[re.Pattern, tuple[int, ...], str]]:
    """(name pattern, shape, description) that must hold for a known architecture."""
    c = config
    out = []
    h = c.get("hidden_size")
    if not isinstance(h, int):
        return out
    v = c.get("vocab_size")
    if isinstance(v, int):
        out.append((re.compile(r"(^|\.)embed_tokens\.weight$"), (v, h), "vocab_size x hidden_size"))
        out.append((re.compile(r"^lm_head\.weight$"), (v, h), "vocab_size x hidden_size"))
    if arch.standard_attention and isinstance(c.get("num_attention_heads"), int):
        nh = c["num_attention_heads"]
        nkv = c.get("num_key_value_heads") or nh
        hd = c.get("head_dim") or h // nh
        out += [
            (re.compile(r"\.self_attn\.q_proj\.weight$"), (nh * hd, h), "num_attention_heads*head_dim x hidden_size"),
            (re.compile(r"\.self_attn\.[kv]_proj\.weight$"), (nkv * hd, h), "num_key_value_heads*head_dim x hidden_size"),
            (re.compile(r"\.self_attn\.o_proj\.weight$"), (h, nh * hd), "hidden_size x num_attention_heads*head_dim"),
        ]
    inter = c.get("intermediate_size")
    if isinstance(inter, int) and not arch.moe:
        out += [
            (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), (inter, h), "intermediate_size x hidden_size"),
            (re.compile(r"\.mlp\.down_proj\.weight$"), (h, inter), "hidden_size x intermediate_size"),
        ]
    mi = c.get("moe_intermediate_size") if arch.family != "mixtral" else inter
    if isinstance(mi, int) and arch.moe:
        out += [
            (re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"), (mi, h), "moe_intermediate_size x hidden_size"),
            (re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$"), (h, mi), "hidden_size x moe_intermediate_size"),
        ]
    ne = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if isinstance(ne, int) and arch.moe:
        out.append((re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$"), (ne, h), "num_experts x hidden_size"))
    return out
