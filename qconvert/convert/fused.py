"""Fused-expert MoE tensors: one 3-D tensor per layer (``…experts.gate_up_proj``, ``…experts.down_proj``).

transformers 5 holds every MoE it knows in such tensors and some checkpoints ship them on disk
(docs/formats.md#fused-expert-tensors). qconvert turns them into the per-expert matrices that
engines load (``…experts.{e}.gate_proj/up_proj/down_proj.weight``), so that everything after the
inventory (plan, exclusion list, ``--last-n-bf16``, jobs, layouts) is the per-expert path and the
bytes equal converting the split checkpoint.

Pure functions on names, shapes and config.json, plus :func:`view` (one expert's matrix of a fused
tensor) and :func:`merge_jobs` (jobs reading one fused tensor become one job, since every source
tensor feeds exactly one job).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ..errors import PlanError, QConvertError

#: a fused expert tensor: ``<prefix>.experts.gate_up_proj`` / ``.down_proj``, with or without ``.weight``
FUSED_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<w>\.weight)?$")
#: any tensor directly under an ``experts`` module (not ``experts.{e}.…``)
_UNDER_EXPERTS_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?!\d+\.)(?P<rest>.+)$")
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.\d+\.")

#: orientation codes: the fused tensor as transformers 5 holds it ([E, 2I, H] / [E, H, I], each
#: expert's matrix [out, in] like nn.Linear) or transposed ([E, H, 2I] / [E, I, H])
OUT_IN = "out_in"
IN_OUT = "in_out"

#: architectures whose fused experts are written as per-expert names, which vLLM and SGLang load for
#: them; gate is the first half of gate_up (docs/formats.md#fused-expert-tensors)
PER_EXPERT_ARCHS = frozenset(
    {
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM",
    }
)
#: architectures refused, and why (docs/formats.md#fused-expert-tensors)
REFUSED_ARCHS = {
    "GptOssForCausalLM": "gpt-oss experts (gate and up interleaved, with biases) load in no engine as NVFP4 or MXFP8 "
    "(docs/formats.md#gpt-oss-quantized-forms); serve the BF16 checkpoint as it is (vLLM reads its fused names, and "
    "its online --quantization fp8/mxfp8 keeps the biases)",
    "Llama4ForConditionalGeneration": "Llama 4's fused experts are not supported yet (not run in an engine here); "
    "split them per expert first",
    "Llama4ForCausalLM": "Llama 4's fused experts are not supported yet (not run in an engine here); "
    "split them per expert first",
    "MixtralForCausalLM": "transformers 5 renames Mixtral's block_sparse_moe.experts.{e}.w1/w2/w3 to mlp.experts.*; "
    "qconvert does not rename the layer back",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE's fused experts are not supported yet (not run in an "
    "engine here); split them per expert first",
}


class Refusal(enum.Enum):
    """Why fused expert tensors were refused (:attr:`FusedError.code`)."""

    UNKNOWN_TENSOR = "unknown-tensor"  # a tensor directly under experts that is not gate_up_proj / down_proj
    REFUSED_ARCH = "refused-architecture"  # REFUSED_ARCHS
    UNKNOWN_ARCH = "unknown-architecture"  # neither PER_EXPERT_ARCHS nor REFUSED_ARCHS
    CONFIG_KEYS = "config-keys"  # config.json lacks the sizes that decide orientation
    BOTH_FORMS = "both-forms"  # a layer held fused and per expert, or one fused tensor twice
    SHAPE = "shape"  # fits neither orientation of config.json's sizes
    SIBLINGS_DISAGREE = "siblings-disagree"  # gate_up_proj and down_proj of one layer in different orientations
    SQUARE = "square"  # fits both orientations and no sibling decides
    MIXED_ORIENTATIONS = "mixed-orientations"  # layers of one checkpoint in different orientations


class FusedError(PlanError):
    """A one-line refusal of fused expert tensors; ``code`` says which (a :class:`Refusal`)."""

    def __init__(self, code: Refusal, msg: str):
        super().__init__(msg)
        self.code = code


PROJ_OUT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class View:
    """One expert's 2-D matrix [out, in] inside a fused tensor."""

    source: str  # the fused tensor's name
    expert: int
    start: int  # rows [start, stop) of the expert's [out, in] matrix (gate: first half of gate_up)
    stop: int
    orientation: str  # OUT_IN | IN_OUT: how the fused tensor stores each expert


def _moe_sizes(config: dict) -> tuple[int | None, int | None, int | None]:
    """(experts, hidden, intermediate) from config.json (or its text_config)."""
    for c in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else None):
        if not c:
            continue
        e = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
        h = c.get("hidden_size")
        i = c.get("moe_intermediate_size") or c.get("intermediate_size")
        if e or h or i:
            return e, h, i
    return None, None, None


def fused_names(inventory) -> list[str]:
    return [n for n, (_, shape) in inventory.items() if FUSED_RE.match(n) and len(tuple(shape)) == 3]


def _orientations(proj: str, shape: tuple, e: int, h: int, i: int) -> set[str]:
    """The orientations ``shape`` fits (two when square)."""
    out_dim = 2 * i if proj == "gate_up_proj" else h
    in_dim = i if proj == "down_proj" else h
    found = set()
    if shape == (e, out_dim, in_dim):
        found.add(OUT_IN)
    if shape == (e, in_dim, out_dim):
        found.add(IN_OUT)
    return found


def expand(inventory: dict, config: dict, config_path=None) -> tuple[dict, dict[str, View]]:
    """``inventory`` (name -> (dtype tag, shape)) with each fused expert tensor replaced by its
    per-expert 2-D entries, and the views that read them. Refuses, in one line, what cannot be
    decided: unknown tensors under ``experts``, fused and per-expert tensors of one layer, an
    architecture whose engines do not load per-expert names, shapes that fit no orientation or
    both, and orientations that differ within the checkpoint."""
    where = str(config_path) if config_path else "config.json"
    fused = fused_names(inventory)
    archs = config.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else "<none>"
    if fused and arch in REFUSED_ARCHS:  # before its other tensors under experts (gpt-oss's biases)
        raise FusedError(
            Refusal.REFUSED_ARCH,
            f"tensor {fused[0]!r}: {REFUSED_ARCHS[arch]} ({arch}); see the README's fused-expert section",
        )
    for n, (_, shape) in inventory.items():
        m = _UNDER_EXPERTS_RE.match(n)
        if m and n not in fused and len(tuple(shape)) >= 2:
            raise FusedError(
                Refusal.UNKNOWN_TENSOR,
                f"tensor {n!r} {list(shape)} is a fused expert tensor qconvert does not know (it knows "
                "experts.gate_up_proj and experts.down_proj); convert it to per-expert "
                "experts.{e}.gate_proj/up_proj/down_proj weights first",
            )
    if not fused:
        return inventory, {}
    if arch not in PER_EXPERT_ARCHS:
        raise FusedError(
            Refusal.UNKNOWN_ARCH,
            f"tensor {fused[0]!r} is a fused expert tensor of architecture {arch}, for which qconvert "
            "does not know what engines load; supported: " + ", ".join(sorted(PER_EXPERT_ARCHS)),
        )
    per_expert_prefixes = {m.group("prefix") for n in inventory if (m := _PER_EXPERT_RE.match(n))}
    e, h, i = _moe_sizes(config)
    if not all(isinstance(v, int) and v > 0 for v in (e, h, i)):
        raise FusedError(
            Refusal.CONFIG_KEYS,
            f"tensor {fused[0]!r} is a fused expert tensor but {where} lacks num_experts/n_routed_experts, "
            "hidden_size or moe_intermediate_size, which decide its orientation; restore the original config.json",
        )
    by_prefix: dict[str, dict[str, str]] = {}
    for n in fused:
        m = FUSED_RE.match(n)
        if m.group("prefix") in per_expert_prefixes:
            raise FusedError(
                Refusal.BOTH_FORMS,
                f"tensor {n!r} is a fused expert tensor but {m.group('prefix')} also holds per-expert "
                "tensors (experts.{e}.…); the checkpoint holds the layer twice: keep one form",
            )
        if m.group("proj") in by_prefix.setdefault(m.group("prefix"), {}):
            raise FusedError(
                Refusal.BOTH_FORMS,
                f"tensor {n!r} and {by_prefix[m.group('prefix')][m.group('proj')]!r} are the same fused "
                "expert tensor; keep one",
            )
        by_prefix[m.group("prefix")][m.group("proj")] = n
    decided: dict[str, str] = {}  # orientation -> first tensor that decided it
    per_layer: dict[str, str] = {}
    for prefix, projs in by_prefix.items():
        fits = {}
        for proj, n in projs.items():
            shape = tuple(inventory[n][1])
            fits[n] = _orientations(proj, shape, e, h, i)
            if not fits[n]:
                want = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)
                raise FusedError(
                    Refusal.SHAPE,
                    f"tensor {n!r} has shape {list(shape)} but {where} implies {list(want)} or its "
                    f"transpose {[want[0], want[2], want[1]]} (num_experts, hidden_size, "
                    "moe_intermediate_size); the weights do not belong to this config.json",
                )
        common = set.intersection(*fits.values())
        if not common:
            a, b = sorted(fits)
            raise FusedError(
                Refusal.SIBLINGS_DISAGREE,
                f"tensors {a!r} and {b!r} are stored in different orientations ([out, in] and [in, out] "
                "per expert); transpose one of them so that both use the same",
            )
        if len(common) > 1:
            n = next(iter(projs.values()))
            raise FusedError(
                Refusal.SQUARE,
                f"tensor {n!r} has the square shape {list(inventory[n][1])}: qconvert cannot tell "
                "[E, out, in] from [E, in, out], and no sibling gate_up_proj/down_proj of that layer "
                "decides; add the sibling or split the tensor per expert",
            )
        o = common.pop()
        per_layer[prefix] = o
        decided.setdefault(o, next(iter(projs.values())))
    if len(decided) > 1:
        a, b = decided[OUT_IN], decided[IN_OUT]
        raise FusedError(
            Refusal.MIXED_ORIENTATIONS,
            f"fused expert tensors {a!r} ([E, out, in]) and {b!r} ([E, in, out]) are stored in "
            "different orientations in one checkpoint; a transposed tensor in the wrong orientation "
            "would quantize along the wrong axis: store them all one way",
        )
    out: dict = {}
    views: dict[str, View] = {}
    for name, entry in inventory.items():
        m = FUSED_RE.match(name)
        if name not in fused:
            out[name] = entry
            continue
        dtype, proj, prefix = entry[0], m.group("proj"), m.group("prefix")
        o = per_layer[prefix]
        rows = i if proj == "gate_up_proj" else h
        cols = h if proj == "gate_up_proj" else i
        for x in range(e):
            for k, part in enumerate(PROJ_OUT[proj]):
                vname = f"{prefix}.{x}.{part}.weight"
                if vname in inventory:  # (caught above as per-expert duplicates; kept as a guard)
                    raise FusedError(
                        Refusal.BOTH_FORMS, f"tensor {vname!r} exists beside fused {name!r}; keep one form"
                    )
                out[vname] = (dtype, (rows, cols))
                views[vname] = View(name, x, k * rows, (k + 1) * rows, o)
    return out, views


def keep_patterns(patterns: tuple[str, ...], views: dict[str, View]) -> tuple[str, ...]:
    """``--keep-bf16`` patterns with each one that names a fused tensor (``…experts.gate_up_proj``,
    as the user sees it in the checkpoint) and no per-expert tensor replaced by ``<prefix>.experts.*``
    for the layers it names: a MoE layer is kept or quantized whole, so that keeps the layer's experts."""
    import fnmatch

    sources = sorted({v.source for v in views.values()})
    out: list[str] = []
    for p in patterns:
        if any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n[: -len(".weight")], p) for n in views):
            out.append(p)
            continue
        hit = [
            n
            for n in sources
            if fnmatch.fnmatchcase(n, p) or (n.endswith(".weight") and fnmatch.fnmatchcase(n[: -len(".weight")], p))
        ]
        prefixes = sorted({FUSED_RE.match(n).group("prefix") for n in hit})
        out += [f"{x}.*" for x in prefixes] if prefixes else [p]
    return tuple(dict.fromkeys(out))


def plan_note(views: dict[str, View]) -> str | None:
    """The summary's line about fused expert tensors read per expert (None without any)."""
    if not views:
        return None
    n = len({v.source for v in views.values()})
    form = "[E, out, in]" if next(iter(views.values())).orientation == OUT_IN else "[E, in, out] (transposed)"
    return (
        f"{n} fused expert tensors ({form}) read per expert and written as experts.{{e}}.gate_proj/up_proj/"
        "down_proj, the names engines load (docs/formats.md#fused-expert-tensors)"
    )


def view(fused, v: View):
    """Expert ``v.expert``'s [out, in] matrix of tensor ``fused`` as a contiguous tensor (a copy
    where the fused tensor is stored [E, in, out])."""
    if v.orientation == OUT_IN:
        return fused[v.expert, v.start : v.stop, :].contiguous()
    return fused[v.expert, :, v.start : v.stop].t().contiguous()


def split_named(name: str, tensor, config: dict, expected_orientation: str = OUT_IN):
    """The per-expert (name, tensor) pairs of a fused tensor a trainer hands over (transformers 5's
    ``named_parameters()``: [E, 2I, H] / [E, H, I]); ``[(name, tensor)]`` for any other tensor.
    The shape must be the one config.json implies in that orientation."""
    m = FUSED_RE.match(name)
    if not m or tensor.dim() != 3:
        return [(name, tensor)]
    e, h, i = _moe_sizes(config)
    proj = m.group("proj")
    if expected_orientation not in _orientations(proj, tuple(tensor.shape), e, h, i):
        want = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)
        raise FusedError(
            Refusal.SHAPE,
            f"refit: tensor {name!r} has shape {list(tensor.shape)}, but the reference config.json "
            f"implies {list(want)} (transformers' [experts, out, in]); pass the model's own parameters",
        )
    rows = i if proj == "gate_up_proj" else h
    out = []
    for x in range(e):
        for k, part in enumerate(PROJ_OUT[proj]):
            v = View(name, x, k * rows, (k + 1) * rows, expected_orientation)
            out.append((f"{m.group('prefix')}.{x}.{part}.weight", view(tensor, v)))
    return out


def merge_jobs(jobs: list, views: dict[str, View]) -> list:
    """Jobs that read per-expert views become jobs that read the fused tensors: all jobs touching
    one fused tensor are merged into one (each source tensor feeds exactly one job), which slices
    the views and runs the per-expert jobs in order. Other jobs are returned as they are."""
    if not views:
        return jobs
    from .jobs import Job

    parent: dict[int, int] = {}

    def find(a):
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    owner: dict[str, int] = {}
    for k, j in enumerate(jobs):
        for s in j.sources:
            if s in views:
                f = views[s].source
                if f in owner:
                    parent[find(k)] = find(owner[f])
                else:
                    owner[f] = k
    merged: dict[int, list] = {}
    out = []
    for k, j in enumerate(jobs):
        if not any(s in views for s in j.sources):
            out.append(j)
            continue
        root = find(k)
        if root not in merged:
            merged[root] = []
            out.append(root)  # placeholder: the merged job, where its first part was
        merged[root].append(j)
    return [_merged_job(merged[x], views, Job) if isinstance(x, int) else x for x in out]


def _source_words(msg: str, names, views: dict[str, View]) -> str:
    """``msg`` with each per-expert view it quotes named as the fused tensor, expert and half."""
    for n in names:
        if n in views and repr(n) in msg:
            v = views[n]
            part = n.rsplit(".", 2)[-2]
            msg = msg.replace(repr(n), f"{v.source!r} (expert {v.expert}, {part})")
    return msg


def _merged_job(parts: list, views: dict[str, View], Job):
    sources: list[str] = []
    for p in parts:
        for s in p.sources:
            real = views[s].source if s in views else s
            if real not in sources:
                sources.append(real)

    from . import kernels
    from .jobs import run_all

    def fn(src):
        done: list = [None] * len(parts)

        def one(k):
            p = parts[k]
            try:
                done[k] = p.fn({s: view(src[views[s].source], views[s]) if s in views else src[s] for s in p.sources})
            except QConvertError as e:  # name the tensor the user has, not the per-expert view
                raise type(e)(_source_words(str(e), p.sources, views)) from None

        # the per-expert jobs side by side, one per core, as the split checkpoint's jobs run (CPU;
        # on a job thread kernels.workers() is 1 and they run in turn)
        parallel = kernels.workers() > 1 and not any(p.device_input for p in parts) and len(parts) > 1
        run_all(one, [(k,) for k in range(len(parts))], parallel)
        result = {}
        for d in done:
            result.update(d)
        return result

    fmt = parts[0].fmt
    return Job(
        sources,
        [o for p in parts for o in p.outputs],
        fn,
        fmt,
        device_input=any(p.device_input for p in parts),
        parts=parts,
    )


def split_stream(named_tensors, config: dict, views: dict[str, View]):
    """A trainer's (name, tensor) stream with fused expert tensors split per expert
    (:func:`split_named`): in the orientation the reference checkpoint stores that tensor in
    (``views`` of :func:`expand`), else transformers 5's [E, out, in]."""
    orient = {v.source: v.orientation for v in views.values()}
    for name, t in named_tensors:
        yield from split_named(name, t, config, orient.get(name, OUT_IN))


def source_entries(entries: dict, config: dict, config_path=None) -> tuple[dict, dict[str, View]]:
    """A checkpoint's tensor entries (name -> entry with ``dtype``, ``shape``, ``nbytes``) with each
    fused expert tensor replaced by entries of its per-expert matrices, and their views (verify,
    inspect)."""
    from types import SimpleNamespace

    inv, views = expand({n: (e.dtype, tuple(e.shape)) for n, e in entries.items()}, config, config_path)
    if not views:
        return entries, {}
    out = {}
    for n, (dtype, shape) in inv.items():
        if n in views:
            full = entries[views[n].source]
            out[n] = SimpleNamespace(
                name=n,
                dtype=dtype,
                shape=shape,
                nbytes=full.nbytes // (full.shape[0] * full.shape[1] * full.shape[2]) * shape[0] * shape[1],
            )
        else:
            out[n] = entries[n]
    return out, views
