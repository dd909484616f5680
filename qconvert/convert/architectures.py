"""What qconvert knows about model architectures: names, layer counts, expected shapes.

Unknown architectures still convert by the generic name rules in :mod:`plan`; knowing one adds
shape checks against config.json and a "supported" line in the summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import PlanError

LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?layers)\.(?P<idx>\d+)\.")
EXPERT_RE = re.compile(r"\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class Arch:
    name: str
    family: str
    moe: bool
    #: config keys of the attention shape check (None: skip, e.g. DeepSeek MLA)
    standard_attention: bool = True
    #: transformers' default for a config.json without ``tie_word_embeddings`` (its config class);
    #: every architecture here defaults to False, Gemma-style ones to True
    tie_default: bool = False


KNOWN: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("Qwen3ForCausalLM", "qwen3", False),
        Arch("Qwen3MoeForCausalLM", "qwen3-moe", True),
        Arch("Qwen2ForCausalLM", "qwen2", False),
        Arch("Qwen2MoeForCausalLM", "qwen2-moe", True),
        Arch("LlamaForCausalLM", "llama", False),
        Arch("MistralForCausalLM", "mistral", False),
        Arch("MixtralForCausalLM", "mixtral", True),
        Arch("DeepseekV3ForCausalLM", "deepseek-v3", True, standard_attention=False),
        Arch("DeepseekV2ForCausalLM", "deepseek-v2", True, standard_attention=False),
    ]
}


def arch_of(config: dict) -> tuple[str, Arch | None]:
    archs = config.get("architectures") or []
    name = archs[0] if archs and isinstance(archs[0], str) else "<none>"
    return name, KNOWN.get(name)


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _where(config_path) -> str:
    return str(config_path) if config_path else "config.json"


def _bad(config_path, key: str, v, want: str) -> PlanError:
    shown = "null" if v is None else repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    return PlanError(
        f"{_where(config_path)}: {key} is {shown} ({type(v).__name__}), but must be {want}; "
        "restore the original config.json"
    )


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_config(config: dict, arch: Arch | None, config_path=None) -> None:
    """Refuse, in one line naming config.json and the key, values of the keys the plan reads that
    have the wrong type (a string, a list, null, a bool, zero or a negative count). Keys that are
    absent are not required; for an unknown architecture only the keys it uses are checked."""
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _bad(config_path, "architectures", archs, "a list of class names")
    for where, c in (("", config), ("text_config.", config.get("text_config"))):
        if where and c is None:
            continue
        if not isinstance(c, dict):
            raise _bad(config_path, "text_config", c, "an object")
        v = c.get("tie_word_embeddings")
        if v is not None and not isinstance(v, bool):
            raise _bad(config_path, where + "tie_word_embeddings", v, "true or false")
    for key in LAYER_KEYS:
        if key in config:
            if not _pos_int(config[key]) and not (config[key] is None and arch is None):
                raise _bad(config_path, key, config[key], "a positive integer")
            if config[key] is not None:
                break
    v = config.get("num_nextn_predict_layers")
    if v is not None and not (_pos_int(v) or v == 0 and not isinstance(v, bool)):
        raise _bad(config_path, "num_nextn_predict_layers", v, "an integer >= 0")
    if arch is None:
        return
    keys = ["hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"]
    if arch.moe:
        keys += ["moe_intermediate_size", "num_experts", "n_routed_experts", "num_local_experts"]
    for key in keys:
        if key in config and not _pos_int(config[key]):
            raise _bad(config_path, key, config[key], "a positive integer")
    for key in ("num_key_value_heads", "head_dim"):  # null: transformers' default (heads, hidden/heads)
        if config.get(key) is not None and not _pos_int(config[key]):
            raise _bad(config_path, key, config[key], "a positive integer or null")


def num_layers(config: dict) -> int | None:
    """The decoder layer count config.json declares (the first layer-count key present)."""
    for key in LAYER_KEYS:
        v = config.get(key)
        if _pos_int(v):
            return v
    return None


def layer_key(config: dict) -> str:
    return next((k for k in LAYER_KEYS if _pos_int(config.get(k))), "num_hidden_layers")


def tie_word_embeddings(config: dict, arch: Arch | None) -> bool | None:
    """Whether the output head is the input embedding, as transformers and the engines read the
    config: true when the top-level key or ``text_config``'s (multimodal wrappers build their
    language model from it) says so, false when one says false, else the architecture's default;
    None when unknown (no key, unknown architecture)."""
    said = [
        c["tie_word_embeddings"]
        for c in (config, config.get("text_config"))
        if isinstance(c, dict) and isinstance(c.get("tie_word_embeddings"), bool)
    ]
    if said:
        return any(said)
    return arch.tie_default if arch is not None else None


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
            (
                re.compile(r"\.self_attn\.[kv]_proj\.weight$"),
                (nkv * hd, h),
                "num_key_value_heads*head_dim x hidden_size",
            ),
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
            (
                re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"),
                (mi, h),
                "moe_intermediate_size x hidden_size",
            ),
            (re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$"), (h, mi), "hidden_size x moe_intermediate_size"),
        ]
    ne = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if isinstance(ne, int) and arch.moe:
        out.append((re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$"), (ne, h), "num_experts x hidden_size"))
    return out
