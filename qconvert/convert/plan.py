"""Which tensor becomes what: quantize or keep, fused groups, and the exclusion list.

Pure: works on the tensor inventory (name -> dtype tag, shape) and config.json, does no I/O.

The exclusion list uses only entry forms that mean the same under SGLang's dotted-path matcher and
vLLM's substring + fnmatch matcher (docs/formats.md#exclusion-entry-forms): ``model.layers.{i}.`` (trailing dot) for a
whole BF16 layer, exact module paths otherwise, ``...mlp.experts`` for BF16 expert groups, never a
glob.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass, field

from ..errors import PlanError
from ..formats.exclusions import experts_entry, whole_layer_entry
from ..formats.schemes import SCHEME_BLOCK
from .architectures import (
    EXPERT_RE,
    LAYER_RE,
    Arch,
    arch_of,
    check_config,
    expected_shapes,
    layer_key,
    num_layers,
    tie_word_embeddings,
)

QUANTIZE = "quantize"
KEEP = "keep"


class Reason(enum.Enum):
    """Why a tensor is quantized or kept: the decision as a value; the value is the text's template
    (rendered into ``TensorPlan.reason``, which the dry-run plan and the manifest print)."""

    NOT_A_WEIGHT = "not a weight"
    NOT_2D = "{ndim}-D"
    EMBEDDING = "embedding"
    NORM = "norm"
    ROUTER = "MoE router"
    TIED_HEAD = "lm_head tied to the input embedding (tie_word_embeddings)"
    LM_HEAD = "lm_head (pass --quantize-lm-head to quantize it)"
    BF16_SCHEME = "bf16 scheme"
    BF16_LAYER = "BF16 layer ({which} layers)"
    EXPERTS_ONLY = "--experts-only"
    KEEP_BF16 = "--keep-bf16"
    K_NOT_MULTIPLE = "K={k} not a multiple of {block}"
    EMPTY = "empty"
    LINEAR = "linear"
    FUSED_WITH = "fused with {module} ({why})"  # kept because a fused-group member is kept
    EXPERTS_OF_LAYER = "experts of this layer stay BF16 ({name}: {why})"  # kept because another expert is
    DECODED = "decoded to BF16 from {what}"  # qconvert bf16 of a quantized source (decode.py)
    SOURCE_FLOAT = "not quantized in the source: copied"  # qconvert bf16 of a quantized source (decode.py)


#: reasons a conversion summary calls out: a weight kept that the user did not ask to keep
NOTABLE_REASONS = frozenset({Reason.K_NOT_MULTIPLE, Reason.FUSED_WITH, Reason.EXPERTS_OF_LAYER})
_KIND_REASON = {"embed": Reason.EMBEDDING, "norm": Reason.NORM, "router": Reason.ROUTER}

FLOAT_SOURCE_TAGS = {"BF16", "F16", "F32"}
QUANTIZED_TAGS = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8"}
FP8_TAGS = {"F8_E4M3", "F8_E5M2", "F8_E8M0"}

_ROUTER_RE = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.shared_expert_gate$")
_GROUP_MEMBER = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "w1": "gate_up",
    "w3": "gate_up",
}


def index_ranges(nums) -> str:
    """Layer or expert numbers as ranges: 0,1,2,5,7,8 -> "0-2,5,7-8" (the dry-run plan, the card)."""
    nums = sorted(set(nums))
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class PlanOptions:
    scheme: str = "mxfp8"  # mxfp8 | nvfp4 | bf16 (layout only)
    last_n_bf16: int = 0
    first_n_bf16: int = 0
    keep_bf16: tuple[str, ...] = ()
    quantize_lm_head: bool = False
    experts_only: bool = False


@dataclass
class TensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    action: str  # QUANTIZE | KEEP
    reason: str
    module: str | None = None  # name without ".weight" for weights
    layer: int | None = None
    kind: str = "other"  # attn | mlp | expert | shared_expert | router | embed | norm | lm_head | other
    group: str | None = None  # fused-group id: members share a global scale (NVFP4) and a format
    code: Reason | None = None  # the decision; ``reason`` is its text

    def decide(self, action: str, code: Reason, **args) -> None:
        self.action, self.code, self.reason = action, code, code.value.format(**args)


@dataclass
class Plan:
    options: PlanOptions
    arch_name: str
    arch: Arch | None
    num_layers: int | None
    tensors: dict[str, TensorPlan]
    bf16_layers: list[int]
    exclusions: list[str]
    notes: list[str] = field(default_factory=list)
    moe_layers: list[int] = field(default_factory=list)
    #: True when the output head is the input embedding (tie_word_embeddings), None when unknown
    tied_lm_head: bool | None = None

    @property
    def quantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors.values() if t.action == QUANTIZE]

    @property
    def kept(self) -> list[TensorPlan]:
        return [t for t in self.tensors.values() if t.action == KEEP]

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self.tensors.values():
            if t.group and t.action == QUANTIZE:
                out.setdefault(t.group, []).append(t.name)
        return out


def natural_key(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def classify(name: str, shape) -> tuple[str, str | None, int | None]:
    """(kind, module, layer) from the tensor name alone."""
    module = name[: -len(".weight")] if name.endswith(".weight") else None
    m = LAYER_RE.match(name)
    layer = int(m.group("idx")) if m else None
    if module is None:
        return "other", None, layer
    last = module.rsplit(".", 1)[-1]
    if module == "lm_head" or module.endswith(".lm_head"):
        return "lm_head", module, layer
    if "embed" in last or last in ("wte", "wpe"):
        return "embed", module, layer
    if "norm" in last or last.startswith("ln"):
        return "norm", module, layer
    if _ROUTER_RE.search(module):
        return "router", module, layer
    if EXPERT_RE.search(name):
        return "expert", module, layer
    if ".shared_expert." in module or ".shared_experts." in module:
        return "shared_expert", module, layer
    if ".self_attn." in module or ".attention." in module or ".attn." in module:
        return "attn", module, layer
    if ".mlp." in module or ".feed_forward." in module:
        return "mlp", module, layer
    return "other", module, layer


def group_id(t: TensorPlan) -> str | None:
    if t.module is None:
        return None
    parent, last = t.module.rsplit(".", 1) if "." in t.module else ("", t.module)
    g = _GROUP_MEMBER.get(last)
    return f"{parent}.{g}" if g else None


def decoder_layers(names, arch: Arch | None) -> tuple[str | None, list[int]]:
    """(prefix, sorted indices) of the decoder layers present in the weights: ``model.layers`` for
    a known architecture, else the ``…layers`` prefix holding the most tensors."""
    per: dict[str, set[int]] = {}
    count: dict[str, int] = {}
    for n in names:
        m = LAYER_RE.match(n)
        if m:
            per.setdefault(m.group("prefix"), set()).add(int(m.group("idx")))
            count[m.group("prefix")] = count.get(m.group("prefix"), 0) + 1
    if not per:
        return None, []
    prefix = "model.layers" if arch is not None and "model.layers" in per else max(count, key=count.get)
    return prefix, sorted(per[prefix])


def _check_layer_count(inventory, config, arch, n_layers, options, config_path, notes):
    """config.json's layer count against the decoder layers in the weights (issue: a wrong count
    made --last-n-bf16 keep the wrong layers). Refused when the count is used (--last-n-bf16 /
    --first-n-bf16) and for known architectures, whose engines build exactly that many layers (so
    the checkpoint would not load, or would run layers without weights); only a note for unknown
    architectures, where the plan does not use the count and the weights' layout is not known."""
    flags = [f for f, n in (("--last-n-bf16", options.last_n_bf16), ("--first-n-bf16", options.first_n_bf16)) if n]
    prefix, idx = decoder_layers(inventory, arch)
    where = str(config_path) if config_path else "config.json"
    if flags and not idx:
        raise PlanError(
            f"{flags[0]}: no tensor is named …layers.{{i}}.…, so qconvert cannot tell the decoder layers "
            "of this checkpoint; use --keep-bf16 patterns"
        )
    if n_layers is None or not idx:
        return
    nextn = config.get("num_nextn_predict_layers") or 0  # DeepSeek-V3-style MTP layers follow the decoder
    if idx in (list(range(n_layers)), list(range(n_layers + nextn))):
        return
    held = f"{len(idx)} decoder layers ({prefix}.{idx[0]} to {prefix}.{idx[-1]}"
    held += f", {idx[-1] + 1 - len(idx)} missing in between)" if idx[-1] + 1 != len(idx) else ")"
    msg = (
        f"{where}: {layer_key(config)} is {n_layers}"
        + (f" (+{nextn} num_nextn_predict_layers)" if nextn else "")
        + f" but the weights hold {held}"
    )
    if flags or arch is not None:
        raise PlanError(msg + "; config.json does not describe these weights: restore the original config.json")
    notes.append(msg + "; engines build the config's count, check that config.json belongs to these weights")


def _head_names(tensors: dict[str, TensorPlan]) -> list[str]:
    """Module names an engine gives a head it builds from the embedding: ``lm_head``, and
    ``X.lm_head`` when the embedding is ``X.model.embed_tokens`` (wrapped language models)."""
    out = ["lm_head"]
    for t in tensors.values():
        if t.kind == "embed" and t.module and t.module.endswith(".model.embed_tokens"):
            out.append(t.module[: -len("model.embed_tokens")] + "lm_head")
    return sorted(set(out))


def build_plan(
    inventory: dict[str, tuple[str, tuple[int, ...]]], config: dict, options: PlanOptions, config_path=None
) -> Plan:
    """Decide every tensor's fate. ``inventory`` maps tensor name -> (safetensors dtype tag, shape).
    ``config_path`` only names config.json in error messages."""
    if options.scheme not in SCHEME_BLOCK:
        raise PlanError(f"unknown scheme {options.scheme!r}; use mxfp8, nvfp4 or bf16")
    block = SCHEME_BLOCK[options.scheme]
    arch_name, arch = arch_of(config)
    check_config(config, arch, config_path)
    n_layers = num_layers(config)
    notes: list[str] = []
    if arch is None:
        notes.append(
            f"architecture {arch_name} is not one qconvert knows; converted by the generic name rules "
            "(2-D Linear weights quantized; embeddings, norms, routers, lm_head kept)"
        )

    # Whole-layer BF16 sets.
    for flag, n in (("--last-n-bf16", options.last_n_bf16), ("--first-n-bf16", options.first_n_bf16)):
        if n < 0:
            raise PlanError(f"{flag} must be >= 0, got {n}")
        if n and n_layers is None:
            raise PlanError(
                f"{flag} needs num_hidden_layers in config.json, which this model lacks; use --keep-bf16 patterns"
            )
        if n_layers is not None and n > n_layers:
            raise PlanError(f"{flag} {n} exceeds the model's {n_layers} layers")
    _check_layer_count(inventory, config, arch, n_layers, options, config_path, notes)
    tied = tie_word_embeddings(config, arch)
    bf16_layers: set[int] = set()
    if n_layers:
        bf16_layers |= set(range(n_layers - options.last_n_bf16, n_layers)) if options.last_n_bf16 else set()
        bf16_layers |= set(range(0, options.first_n_bf16))

    shape_rules = expected_shapes(config, arch) if arch else []
    tensors: dict[str, TensorPlan] = {}
    for name in sorted(inventory, key=natural_key):
        dtype, shape = inventory[name]
        shape = tuple(shape)
        if dtype in FP8_TAGS:  # a kept FP8 tensor would be copied as if it were BF16
            raise PlanError(
                f"tensor {name!r} is already quantized ({dtype}); qconvert converts BF16 checkpoints: "
                "dequantize it (or the checkpoint) to BF16 first"
            )
        kind, module, layer = classify(name, shape)
        for pat, want, desc in shape_rules:
            if pat.search(name) and shape != want:
                raise PlanError(
                    f"tensor {name!r} has shape {list(shape)} but config.json implies {list(want)} "
                    f"({desc}); the weights do not belong to this config.json"
                )
        t = TensorPlan(name, dtype, shape, KEEP, "", module, layer, kind)
        t.group = group_id(t) if kind in ("attn", "mlp", "expert", "shared_expert") else None
        if module is None:
            t.decide(KEEP, Reason.NOT_A_WEIGHT)
        elif len(shape) == 3 and kind != "norm" and ".experts" in name:
            raise PlanError(
                f"tensor {name!r} is a fused 3-D expert tensor {list(shape)}; qconvert supports per-expert "
                "2-D expert weights (experts.{e}.gate_proj/up_proj/down_proj) only"
            )
        elif len(shape) != 2:
            t.decide(KEEP, Reason.NOT_2D, ndim=len(shape))
        elif kind in _KIND_REASON:
            t.decide(KEEP, _KIND_REASON[kind])
        elif kind == "lm_head" and tied:
            t.decide(KEEP, Reason.TIED_HEAD)
        elif kind == "lm_head" and not options.quantize_lm_head:
            t.decide(KEEP, Reason.LM_HEAD)
        elif block is None:
            t.decide(KEEP, Reason.BF16_SCHEME)
        elif dtype in QUANTIZED_TAGS:
            raise PlanError(f"tensor {name!r} is already quantized ({dtype}); qconvert converts BF16 checkpoints")
        elif dtype not in FLOAT_SOURCE_TAGS:
            raise PlanError(
                f"tensor {name!r} has dtype {dtype}, which qconvert cannot quantize; convert the checkpoint to BF16"
            )
        elif layer is not None and layer in bf16_layers:
            t.decide(
                KEEP,
                Reason.BF16_LAYER,
                which="last" if n_layers and layer >= n_layers - options.last_n_bf16 else "first",
            )
        elif options.experts_only and kind != "expert":
            t.decide(KEEP, Reason.EXPERTS_ONLY)
        elif any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(name, p) for p in options.keep_bf16):
            t.decide(KEEP, Reason.KEEP_BF16)
        elif shape[1] % block:
            t.decide(KEEP, Reason.K_NOT_MULTIPLE, k=shape[1], block=block)
        elif shape[0] == 0:
            t.decide(KEEP, Reason.EMPTY)
        else:
            t.decide(QUANTIZE, Reason.LINEAR)
        tensors[name] = t

    # The output head. With tied embeddings (or no lm_head tensor) engines still build a head
    # module, from the config, and take its quantization from the exclusion list: vLLM builds a
    # quantized ParallelLMHead, then ties its weight to the BF16 embedding (garbage logits; for
    # ModelOpt NVFP4 a weight_scale that is never loaded). So the head is listed as excluded
    # whether or not its tensor exists.
    where = str(config_path) if config_path else "config.json"
    has_head = any(t.kind == "lm_head" for t in tensors.values())
    head_names: list[str] = []
    if options.quantize_lm_head and (tied or not has_head):
        why = (
            "ties it to the input embedding (tie_word_embeddings: true)"
            if tied
            else "has no lm_head tensor (the head is the input embedding)"
        )
        raise PlanError(
            f"--quantize-lm-head: {where} {why}; engines use the BF16 embedding as the head "
            "(vLLM ties lm_head to embed_tokens), so a quantized head cannot be tied: drop --quantize-lm-head"
        )
    if not has_head:
        if tied or (tied is None and arch_name.endswith(("ForCausalLM", "ForConditionalGeneration"))):
            head_names = _head_names(tensors)
            notes.append(
                f"the output head is the input embedding (tie_word_embeddings); {', '.join(head_names)} "
                "listed as excluded so every engine keeps it BF16"
            )

    moe_layers = sorted({t.layer for t in tensors.values() if t.kind == "expert" and t.layer is not None})
    _harmonize_groups(tensors, notes)
    _harmonize_experts(tensors, notes)

    for p in options.keep_bf16:
        if not any(
            fnmatch.fnmatchcase(t.module or "", p) or fnmatch.fnmatchcase(t.name, p) for t in tensors.values()
        ) and not any(fnmatch.fnmatchcase(h, p) for h in head_names):
            notes.append(f"--keep-bf16 {p!r} matched no tensor")
    if block is not None and not any(t.action == QUANTIZE for t in tensors.values()):
        raise PlanError(
            "no tensor would be quantized (no 2-D Linear weights with a suitable K outside the kept layers); "
            "nothing to convert"
        )
    exclusions = sorted(
        set(exclusion_list(tensors, sorted(bf16_layers), options, moe_layers)) | set(head_names), key=natural_key
    )
    return Plan(options, arch_name, arch, n_layers, tensors, sorted(bf16_layers), exclusions, notes, moe_layers, tied)


def _keep_mixed_groups(groups: dict[str, list[TensorPlan]], reason, note) -> list[str]:
    """A group whose members disagree is kept BF16 whole (engines give it one format); the first
    kept member is the cause. ``reason(member, cause)`` decides the member; ``note(group_id, cause)``
    words the plan note."""
    notes = []
    for gid, members in groups.items():
        if len({m.action for m in members}) > 1:
            why = next(m for m in members if m.action == KEEP)
            for m in members:
                if m.action == QUANTIZE:
                    reason(m, why)
            notes.append(note(gid, why))
    return notes


def _harmonize_groups(tensors: dict[str, TensorPlan], notes: list[str]):
    """Fused shards (q/k/v, gate/up) must share one format: engines fuse them into one layer."""
    groups: dict[str, list[TensorPlan]] = {}
    for t in tensors.values():
        if t.group and t.kind != "expert":
            groups.setdefault(t.group, []).append(t)
    notes += _keep_mixed_groups(
        groups,
        lambda m, why: m.decide(KEEP, Reason.FUSED_WITH, module=why.module, why=why.reason),
        lambda gid,
        why: f"{gid}: kept BF16 as a whole because {why.module} is ({why.reason}); engines fuse these shards",
    )


def _harmonize_experts(tensors: dict[str, TensorPlan], notes: list[str]):
    """All experts of one MoE layer share one format: the engine's FusedMoE has one quant method."""
    per_layer: dict[str, list[TensorPlan]] = {}
    for t in tensors.values():
        if t.kind == "expert":
            per_layer.setdefault(t.module.split(".experts.")[0] + ".experts", []).append(t)
    notes += _keep_mixed_groups(
        per_layer,
        lambda m, why: m.decide(KEEP, Reason.EXPERTS_OF_LAYER, name=why.name, why=why.reason),
        lambda gid,
        why: f"{gid}: all experts kept BF16 because {why.name} is ({why.reason}); a MoE layer has one format",
    )


def exclusion_list(
    tensors: dict[str, TensorPlan], bf16_layers: list[int], options: PlanOptions, moe_layers: list[int]
) -> list[str]:
    """The list written under the config's exclusion keys (docs/formats.md#exclusion-entry-forms)."""
    entries: set[str] = set()
    layer_prefix: dict[int, str] = {}
    for t in tensors.values():
        if t.layer is not None and t.layer in bf16_layers and t.layer not in layer_prefix:
            m = LAYER_RE.match(t.name)
            layer_prefix[t.layer] = whole_layer_entry(m.group("prefix"), t.layer)
    entries |= set(layer_prefix.values())
    expert_prefixes_kept: set[str] = set()
    expert_prefixes_quant: set[str] = set()
    for t in tensors.values():
        if t.module is None:
            continue
        if t.kind == "expert":
            pre = experts_entry(t.module)
            (expert_prefixes_kept if t.action == KEEP else expert_prefixes_quant).add(pre)
            continue
        if t.action == KEEP:
            entries.add(t.module)
    # BF16 experts: the layer prefix covers them for dotted/substring matchers, but SGLang's
    # ModelOpt FusedMoE matcher needs the experts module itself (docs/formats.md#exclusion-matchers).
    entries |= expert_prefixes_kept - expert_prefixes_quant
    return sorted(entries, key=natural_key)
