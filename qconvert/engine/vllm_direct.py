"""Engine side: the direct in-place load of checkpoint-format tensors into a running vLLM model.

vLLM's layerwise reload (docs/reload.md#vllm-reload_weights) rebuilds every layer it loads:
fresh parameters (first-touch page faults), the model's weight loaders into them, the quant
method's ``process_weights_after_loading``, and a copy back into the served (kernel) tensors. For a
layer whose kernel tensors ARE its loaded tensors, that rebuild only costs time: the model's own
``load_weights`` can copy each checkpoint tensor (q/k/v and gate/up fused, experts stacked, TP
shards sliced by the parameters' ``weight_loader``s) straight into the served storage, as RL
frameworks do (docs/reload.md#vllm-direct-load).

Which layers qualify is a value, :class:`Form`, decided per module by :func:`module_form` from the
module's quant method and backend (vLLM 0.32.0 CPU), never by trying and catching:

* ``Form.PLAIN``: no quant method (RMSNorm and the like): nothing processes the loaded weights.
* ``Form.CPU_MOE``: BF16 experts on vLLM's CPU backend. ``process_weights_after_loading`` on a
  weight update leaves the loaded layout in the kernel tensors (the prepack is skipped, which is
  why the client calls ``qconvert_repack_cpu_moe`` after every reload); the direct load leaves them
  in exactly that state.
* ``Form.CPU_MXFP8_MOE``: MXFP8 experts of qconvert's CPU emulation plugin: the FP8 weights and
  E8M0 scales are kept as loaded; the BF16 copy the experts run on is re-derived in place by the
  plugin's own function (``vllm_cpu_plugin.refresh_mxfp8_experts``).
* ``Form.CPU_NVFP4_MOE``: NVFP4 experts of the same plugin (W4A16 and W4A4): its
  ``process_weights_after_loading`` leaves every loaded tensor as loaded and derives the BF16 copy
  (and the W4A4 activation scales) beside them; the direct load re-derives them in place with the
  same function (``vllm_cpu_plugin.refresh_nvfp4_experts``).
* ``Form.CPU_MXFP8_LINEAR``: dense MXFP8 linear layers (ModelOpt / ``quant_method: mxfp8``) on
  vLLM's ``EmulationMxfp8LinearKernel`` (the CPU plugin registers it) with
  ``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD`` on (vLLM's default): vLLM serves the BF16
  ``dequant_mxfp8_to_bf16`` of the loaded weight as ``weight`` and the loaded E8M0 scales as
  ``weight_scale``, nothing else (no oneDNN packing: ``apply_weights`` is a plain ``F.linear``).
  The load writes the FP8 weight into a kept FP8 tensor of the module (:data:`KEPT_WEIGHT`, made at
  the module's first direct load) and the scales into the served ``weight_scale``; the served BF16
  weight is then re-derived in place by the plugin's ``mxfp8_experts_to_bf16`` (bit for bit
  vLLM's ``dequant_mxfp8_to_bf16``). The area must hold every tensor of such a module (a complete
  checkpoint, as the client's compatibility check requires): its BF16 weight is re-derived from
  the kept FP8 bytes whatever the load wrote.
* ``Form.LAYERWISE``: everything else (linear layers, whose CPU kernel tensor is a oneDNN or
  packed copy; embeddings; other quantized dense layers; attention), with a :class:`Why` code.
  Those layers still go through vLLM's layerwise reload, in the same pass over the tensors.

One pass: the direct modules are marked so that ``initialize_layerwise_reload`` leaves them alone,
their parameters are swapped for views of the storage their loads write (the served storage; the kept
FP8 weight of a ``Form.CPU_MXFP8_LINEAR`` module) carrying the attributes vLLM recorded
at model build (``weight_loader``, shard dims), ``model.load_weights`` runs over every tensor, the
kernel parameters are put back and ``finalize_layerwise_reload`` finishes the layerwise ones.

Replay (:class:`CopyPlan`): the first direct load of an area layout runs under a dispatch mode that
records every ``copy_`` from a staged tensor into a direct module's served storage (source and
destination as storage offset, sizes and strides). A tensor whose only uses in that load were such
copies is then, in the next loads of the same layout into the same served tensors, copied straight
to its recorded destinations without ``load_weights`` (no name mapping, no per-tensor weight-loader
Python); every other tensor still goes through ``load_weights`` in the same pass. A recording in
which a direct module's storage is written by anything but a copy from a staged view, or a tensor
both copied there and used otherwise, gives no plan (every load then runs as the first).
"""

from __future__ import annotations

import enum
import inspect
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager

import torch

from qconvert.engine.vllm_replay import written_by

#: ``path`` of a staged load's statistics: which load ran.
PATH_DIRECT = "direct"
PATH_LAYERWISE = "layerwise"
#: ``__name__`` of the deferring wrapper vLLM 0.32's layerwise reload puts on weight loaders
LAYERWISE_WRAPPER = "online_process_loader"
#: key of the module counts: direct modules whose loads vLLM's layerwise wrapper took (0 when right)
DEFERRED_KEY = "direct-deferred"
#: Server environment variable: ``0`` turns the direct load off (every load layerwise, as before).
DIRECT_ENV = "QCONVERT_DIRECT_RELOAD"
#: ``plan`` of a direct load's result: the copy plan was recorded by this load, replayed, or refused
PLAN_RECORDED = "recorded"
PLAN_REPLAYED = "replayed"
#: key of the module counts: tensors this load copied by the replayed plan (not through load_weights)
PLANNED_KEY = "planned-tensors"
#: attribute of a :data:`Form.CPU_MXFP8_LINEAR` module: the kept FP8 weight its loads write
KEPT_WEIGHT = "_qc_mxfp8_weight"


def direct_enabled() -> bool:
    import os

    return os.environ.get(DIRECT_ENV, "1") != "0"


def enabled_forms() -> frozenset | None:
    """The forms :data:`DIRECT_ENV` allows: None for all (unset or ``1``); else its comma-separated
    :class:`Form` values (:func:`parse_forms`; ``0``: none, see :func:`direct_enabled`)."""
    import os

    got = os.environ.get(DIRECT_ENV, "1").strip()
    if got in ("1", "0"):
        return None
    return parse_forms([x for x in got.split(",") if x.strip()], f"{DIRECT_ENV}={got}")


def parse_forms(names, where: str = "direct") -> frozenset:
    """The :class:`Form` values ``names`` (a list of strings: the server's :data:`DIRECT_ENV`, or
    the load RPC's ``direct``), every other form reloading layerwise (:data:`Why.FORM_DISABLED`);
    one line naming the first unknown name."""
    known = {f.value: f for f in Form if f is not Form.LAYERWISE}
    got = [str(n).strip() for n in names]
    bad = [n for n in got if n not in known]
    if bad:
        raise ValueError(
            f"{where}: unknown direct-load form {bad[0]!r}; use a list of " + ", ".join(known) + " (or 0 / 1)"
        )
    return frozenset(known[n] for n in got)


class Form(enum.Enum):
    """How a module's checkpoint tensors become its served tensors."""

    PLAIN = "plain"
    CPU_MOE = "cpu-moe"
    CPU_MXFP8_MOE = "cpu-mxfp8-moe"
    CPU_NVFP4_MOE = "cpu-nvfp4-moe"
    CPU_MXFP8_LINEAR = "cpu-mxfp8-linear"
    LAYERWISE = "layerwise"


class Why(enum.Enum):
    """Why a module (or the whole load) goes through vLLM's layerwise reload."""

    QUANT_METHOD = "quant-method-transforms"  # a quant method whose processing is not known to be identity
    ATTENTION = "deferred-attention"  # processed by vLLM at the end of every reload
    ZENTORCH = "zentorch-experts"  # CPU experts on zentorch (weights in its own layout)
    NO_METADATA = "no-build-metadata"  # vLLM recorded no build-time parameters for it
    SHAPE = "kernel-shape-differs"  # a served tensor's shape/dtype/stride differs from the built one
    FIRST_LOAD = "not-yet-processed"  # the MoE kernel was never set up (no weight update yet)
    # whole-load reasons
    DISABLED = "direct-disabled"  # QCONVERT_DIRECT_RELOAD=0, direct=False, or a LoRA server
    FORM_DISABLED = "form-disabled"  # QCONVERT_DIRECT_RELOAD lists forms, not this module's
    PRESHUFFLED = "preshuffled-area"
    NOT_CPU = "not-cpu"  # the forms above are established for vLLM's CPU backend only


def _param_metadata(module: torch.nn.Module) -> dict | None:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    if info is None:
        return None
    return info.restore_metadata[0]


def _kernel_matches_build(module: torch.nn.Module, meta: dict, served_dtype: dict | None = None) -> bool:
    """Every built parameter is still served with its build shape, dtype (``served_dtype[name]``
    where given) and strides."""
    for name, m in meta.items():
        p = module._parameters.get(name)
        dtype = (served_dtype or {}).get(name, m.dtype)
        if p is None or p.is_meta or p.shape != m.shape or p.dtype != dtype or p.stride() != m.stride():
            return False
    return True


def module_form(module: torch.nn.Module) -> tuple[Form, Why | None]:
    """The :class:`Form` of one module that owns parameters (vLLM 0.32.0, CPU)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    if is_deferred_attention_layer(module):
        return Form.LAYERWISE, Why.ATTENTION
    meta = _param_metadata(module)
    if meta is None or not meta:
        return Form.LAYERWISE, Why.NO_METADATA
    qm = getattr(module, "quant_method", None)
    served_dtype = None
    if qm is None:
        form = Form.PLAIN
    else:
        form = _mxfp8_linear_form(module, qm) or _moe_form(module, qm)
        if isinstance(form, Why):
            return Form.LAYERWISE, form
        if form is Form.CPU_MXFP8_LINEAR:
            from qconvert.formats.dialects import WEIGHT_SCALE  # vLLM's parameter is the checkpoint's name

            if set(meta) - {"weight", WEIGHT_SCALE, "bias"} or WEIGHT_SCALE not in meta:
                return Form.LAYERWISE, Why.QUANT_METHOD
            served_dtype = {"weight": torch.bfloat16}  # dequant_mxfp8_to_bf16's dtype, whatever the model's
    if not _kernel_matches_build(module, meta, served_dtype):
        return Form.LAYERWISE, Why.SHAPE
    return form, None


def _mxfp8_linear_form(module, qm) -> Form | Why | None:
    """:data:`Form.CPU_MXFP8_LINEAR` for a dense MXFP8 layer whose ``process_weights_after_loading``
    (vLLM 0.32.0 ``ModelOptLinearMethod``, ``EmulationMxfp8LinearKernel``) serves exactly
    ``dequant_mxfp8_to_bf16(weight, weight_scale)`` and ``weight_scale``; ``Why.QUANT_METHOD`` for
    an MXFP8 layer that does anything else; None for any other quant method."""
    from vllm.model_executor.layers.quantization.modelopt import (
        FormatScheme,
        KDynamicNoParam,
        KMxfp8Static,
        ModelOptLinearMethod,
    )

    if type(qm) is not ModelOptLinearMethod or type(qm.wkey) is not KMxfp8Static:
        return None
    import vllm.envs as envs
    from vllm.model_executor.kernels.linear import EmulationMxfp8LinearKernel
    from vllm.model_executor.utils import is_weights_pre_processed

    if (
        type(qm.kernel) is not EmulationMxfp8LinearKernel  # other kernels repack or swizzle
        or not envs.VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD  # then the FP8 weight is served as loaded
        or type(qm.fmt) is not FormatScheme  # a format hook around the schemes' processing
        or not (qm.akey is None or type(qm.akey) is KDynamicNoParam)  # an activation scale to process
        or getattr(module, "is_bmm", False)
        or getattr(module, "_retain_weight_for_gather", False)
        or is_weights_pre_processed()
    ):
        return Why.QUANT_METHOD
    return Form.CPU_MXFP8_LINEAR


def _moe_form(module, qm) -> Form | Why:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from qconvert.engine import vllm_cpu_plugin

    if isinstance(qm, UnquantizedFusedMoEMethod):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

        if qm.unquantized_backend != UnquantizedMoeBackend.CPU:
            return Why.QUANT_METHOD
        if qm.moe_kernel is None:
            return Why.FIRST_LOAD
        fe = qm.moe_kernel.fused_experts
        if not isinstance(fe, CPUUnquantizedExperts):
            return Why.QUANT_METHOD
        if getattr(fe, "_use_zentorch", False):
            return Why.ZENTORCH
        return Form.CPU_MOE
    if vllm_cpu_plugin.is_mxfp8_experts_method(qm):
        return Form.CPU_MXFP8_MOE
    if vllm_cpu_plugin.is_nvfp4_experts_method(qm):
        return Form.CPU_NVFP4_MOE
    return Why.QUANT_METHOD


def _owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that own parameters."""
    return [m for m in model.modules() if any(p is not None for p in m._parameters.values())]


def plan(model: torch.nn.Module, forms: frozenset | None = None) -> dict[torch.nn.Module, tuple[Form, Why | None]]:
    """:func:`module_form` of every module that owns parameters; with ``forms``, a module of any
    other form is layerwise (:data:`Why.FORM_DISABLED`)."""
    got = {m: module_form(m) for m in _owners(model)}
    if forms is not None:
        got = {
            m: (f, why) if f is Form.LAYERWISE or f in forms else (Form.LAYERWISE, Why.FORM_DISABLED)
            for m, (f, why) in got.items()
        }
    return got


def summary(forms: dict) -> dict[str, int]:
    """Module counts per form and per reason (JSON-serialisable, for the load statistics)."""
    c = Counter(f.value if why is None else f"{f.value}:{why.value}" for f, why in forms.values())
    return dict(sorted(c.items()))


def _view_with_build_attrs(module: torch.nn.Module, live: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A parameter over ``live``'s storage with the attributes (weight loader, shard dims) vLLM
    recorded for it at model build, bound to ``module``."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    attrs = torch.empty(0, device="meta")
    attrs.__dict__ = meta.__dict__.copy()
    restore_layer_refs(attrs, module)
    view = live.data
    view.__class__ = meta.__class__
    view.__dict__ = attrs.__dict__
    loader = getattr(view, "weight_loader", None)  # an attribute, or a property over _weight_loader
    if loader is not None and getattr(loader, "__name__", None) == LAYERWISE_WRAPPER:
        # an earlier layerwise reload left its deferring wrapper on the recorded attributes (it wraps
        # the meta tensors it registers, which are the recorded ones): load with what it wraps
        view.weight_loader = inspect.unwrap(loader, stop=lambda f: getattr(f, "__name__", None) != LAYERWISE_WRAPPER)
    return view


def _targets(module: torch.nn.Module, form: Form) -> dict[str, torch.Tensor]:
    """The tensors a direct module's loads write, by parameter name: its served parameters, except
    the weight of a :data:`Form.CPU_MXFP8_LINEAR` module, which is the kept FP8 weight (made here
    at the module's first direct load, with the build's shape and dtype)."""
    got = {n: p for n, p in module._parameters.items() if p is not None}
    if form is Form.CPU_MXFP8_LINEAR:
        meta = _param_metadata(module)["weight"]
        kept = getattr(module, KEPT_WEIGHT, None)
        if not isinstance(kept, torch.Tensor) or kept.shape != meta.shape or kept.dtype != meta.dtype:
            kept = torch.empty(meta.shape, dtype=meta.dtype, device=got["weight"].device)
            setattr(module, KEPT_WEIGHT, kept)
        got["weight"] = kept
    return got


def refresh_mxfp8_linear(module: torch.nn.Module) -> None:
    """A :data:`Form.CPU_MXFP8_LINEAR` module's served BF16 weight, re-derived in place from its
    kept FP8 weight and served E8M0 scales: what vLLM's ``EmulationMxfp8LinearKernel.
    process_weights_after_loading`` serves (``dequant_mxfp8_to_bf16``; the plugin's function is
    that bit for bit, tests/test_reload_staged.py)."""
    from qconvert.engine.vllm_cpu_plugin import mxfp8_experts_to_bf16

    w = module._parameters["weight"]
    mxfp8_experts_to_bf16(
        getattr(module, KEPT_WEIGHT).unsqueeze(0), module.weight_scale.data.unsqueeze(0), out=w.data.unsqueeze(0)
    )


@contextmanager
def _direct_modules(forms: dict, direct: list[torch.nn.Module]):
    """Mark ``direct`` as in-load (so ``initialize_layerwise_reload`` skips them) and serve them
    views of the storage their loads write (:func:`_targets`) with build attributes; undo both on
    exit, on every path."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for m in direct:
            info = get_layerwise_info(m)
            info.load_numel_total = 0  # can_load(): initialize_layerwise_reload passes it by
            targets = _targets(m, forms[m][0])
            for name, meta in info.restore_metadata[0].items():
                swapped.append((m, name, m._parameters[name]))
                setattr(m, name, _view_with_build_attrs(m, targets[name], meta))
        yield
    finally:
        for m, name, live in swapped:
            m.register_parameter(name, live)
        for m in direct:
            get_layerwise_info(m).reset()  # finalize_layerwise_reload passes it by


# ------------------------------------------------------------------------------- copy plan


def _storage_key(t: torch.Tensor) -> int | None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return None
    return t.untyped_storage().data_ptr()


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _served(forms: dict, direct: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, name, tensor the loads write: :func:`_targets`) of every parameter of the direct modules."""
    return [(m, n, p) for m in direct for n, p in _targets(m, forms[m][0]).items()]


def _served_signature(forms: dict, direct: list[torch.nn.Module]) -> tuple:
    return tuple(
        (id(m), n, p.untyped_storage().data_ptr(), p.dtype, *_geometry(p)) for m, n, p in _served(forms, direct)
    )


class CopyPlan:
    """Where each staged tensor of one area layout goes in the direct modules' served storage,
    recorded from a real load (see the module docstring). Holds no reference into the area."""

    def __init__(self, key: tuple, copies: dict[str, list[tuple[torch.Tensor, str, torch.dtype, tuple]]]):
        self.key = key
        #: tensor name -> [(destination view of served storage, source file, dtype, (sizes, strides,
        #: offset) in the file's mapping as that dtype)]
        self.copies = copies

    def replay(self, staged) -> int:
        """Copy the planned tensors of ``staged`` (vllm_staged.StagedTensors) to their places;
        returns how many. Their views are made from the file mappings here, not by ``staged``."""
        for recs in self.copies.values():
            for dst, file, dtype, (size, stride, offset) in recs:
                dst.copy_(torch.as_strided(staged.whole(file, dtype), size, stride, offset))
        return len(self.copies)


class _Recorder:
    """Dispatch mode over the first load of a layout (see :class:`CopyPlan`)."""

    def __init__(self, served: list[tuple[torch.nn.Module, str, torch.Tensor]], index):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.dst_of = {p.untyped_storage().data_ptr(): p for _, _, p in served}
        self.index = index  # vllm_replay.StagedIndex of the staged tensors of this load
        self.copies: dict[str, list[tuple[torch.Tensor, tuple]]] = {}
        self.other: set[str] = set()
        self.refused: str | None = None
        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                rec.see(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _source(self, t) -> tuple[str, bool] | None:
        """None when ``t`` does not start inside a staged tensor; else (that staged tensor,
        whether ``t`` has its dtype)."""
        got = self.index.find(t) if _storage_key(t) is not None else None
        return None if got is None else (got[0], got[1] == t.dtype)

    def see(self, func, args, kwargs) -> None:
        import torch.utils._pytree as pytree

        if self.refused is not None:
            return
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            got = self._source(src)
            served = self.dst_of.get(_storage_key(dst))
            if served is None:
                if got is not None:
                    self.other.add(got[0])
                return
            if got is None or not got[1] or dst.dtype != served.dtype:
                self.refused = "direct-write-not-a-staged-copy"
                return
            self.copies.setdefault(got[0], []).append((dst, src.dtype, _geometry(src)))
            return
        if func.is_view:
            return
        for t in pytree.arg_tree_leaves(*args, **kwargs):
            got = self._source(t) if isinstance(t, torch.Tensor) else None
            if got is not None:
                self.other.add(got[0])
        if any(_storage_key(t) in self.dst_of for t in written_by(func, args, kwargs)):
            self.refused = f"direct-write-by-{func}"

    def plan(self, key: tuple, file_of) -> tuple[CopyPlan | None, str | None]:
        if self.refused is not None:
            return None, self.refused
        if any(n in self.other for n in self.copies):
            return None, "staged-tensor-copied-and-used-otherwise"
        copies = {
            name: [
                (torch.as_strided(self.dst_of[_storage_key(d)].data, *_geometry(d)), file_of(name), dtype, g)
                for d, dtype, g in recs
            ]
            for name, recs in self.copies.items()
        }
        return CopyPlan(key, copies), None


def record_plan(served: list[tuple], staged, load, key: tuple, index=None) -> tuple[CopyPlan | None, str | None]:
    """Run ``load(iterator over staged)`` (a real load) while recording where the staged tensors
    are copied in ``served`` ((module, name, parameter) of the direct modules); returns the
    :class:`CopyPlan` for ``key``, or (None, the reason there is none). ``index``: the
    vllm_replay.StagedIndex the staged tensors are noted in (shared with the loader plan's
    recorder), a fresh one by default."""
    from qconvert.engine.vllm_replay import StagedIndex

    index = index if index is not None else StagedIndex()
    recorder = _Recorder(served, index)
    with recorder.mode:
        load(index.watch(staged))
    return recorder.plan(key, staged.file_of)


#: the copy plan of each served model (one per worker)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_key(layout: tuple, direct: list[torch.nn.Module], forms: dict) -> tuple:
    return (layout, tuple((id(m), forms[m][0]) for m in direct), _served_signature(forms, direct))


def load_direct(model: torch.nn.Module, model_config, staged, forms: dict, copies: bool | None = None) -> dict:
    """One pass of ``model.load_weights`` over ``staged`` (vllm_staged.StagedTensors, or any
    iterable of (name, tensor)): modules of a direct form receive their tensors in their served
    storage (:func:`_targets`), the rest through vLLM's layerwise reload; then each direct form's
    own step (:data:`Form.CPU_MXFP8_MOE`, :data:`Form.CPU_NVFP4_MOE`: the BF16 copy re-derived in place;
    :data:`Form.CPU_MXFP8_LINEAR`: :func:`refresh_mxfp8_linear`). A ``staged`` with a ``layout``
    gets the :class:`CopyPlan` and the layerwise modules' loader plan (vllm_replay): recorded by
    the first load of a layout, replayed by the next. Returns the module counts (:func:`summary`),
    the tensors the copy plan copied, the modules whose loader calls were replayed (and of them,
    made as their recorded copies: ``copies``, default :func:`vllm_replay.copies_enabled`),
    ``plan`` and ``replay`` (what happened to each plan; at a recording, ``copies_recorded``: the
    modules with copies, their copies and batches, and why the others keep their loader calls)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
        initialize_layerwise_reload,
    )

    from qconvert.engine import vllm_cpu_plugin, vllm_replay

    direct = [m for m, (f, _) in forms.items() if f is not Form.LAYERWISE]
    layout = getattr(staged, "layout", None)
    key = _plan_key(layout, direct, forms) if layout is not None else None
    known = _PLANS.get(model)
    outcome, replay, planned, replayed, copied = "off", "off", 0, 0, 0
    copies = vllm_replay.copies_enabled() if copies is None else bool(copies)
    copies_recorded = None
    with torch.no_grad(), ExitStack() as stack:
        with _direct_modules(forms, direct):
            initialize_layerwise_reload(model)
            if key is not None and known is not None and known.key == key:
                # the planned tensors' destinations are written by nothing else (CopyPlan), so
                # they go first, then the recorded loader calls, then load_weights over the others
                planned = known.replay(staged)
                rest = staged.others(known.copies)
                loaders = vllm_replay.known(model, key)
                if loaders is not None:
                    rest, replayed, copied = loaders.replay(rest, copies)
                    replay = vllm_replay.REPLAY_REPLAYED
                model.load_weights(rest)
                outcome = PLAN_REPLAYED
            elif key is not None:
                _PLANS.pop(model, None)
                vllm_replay.keep(model, None)
                index = vllm_replay.StagedIndex()  # one index of the staged tensors for both recorders
                lrec = stack.enter_context(vllm_replay.recording(model, index, copies))
                if direct:
                    got, refused = record_plan(_served(forms, direct), staged, model.load_weights, key, index)
                else:  # nothing to copy directly (a GPU server): no dispatch mode over the load
                    model.load_weights(index.watch(iter(staged)))
                    got, refused = CopyPlan(key, {}), None
                if got is not None:
                    _PLANS[model] = got
                outcome = PLAN_RECORDED if got is not None else f"refused:{refused}"
                pending = lrec.pending(model)
            else:
                model.load_weights(iter(staged))
            # a direct module whose loads went through vLLM's deferring wrapper would show buffered
            # loads, or a reset (processed) entry: counted, and held at 0 by tests/test_reload_direct.py
            deferred = sum(
                1 for m in direct if get_layerwise_info(m).load_numel_total != 0 or get_layerwise_info(m).loaded_weights
            )
        finalize_layerwise_reload(model, model_config)
        if outcome == PLAN_RECORDED:
            loaders, refused = lrec.plan(key, pending, set(_PLANS[model].copies))
            vllm_replay.keep(model, loaders)
            replay = vllm_replay.REPLAY_RECORDED if loaders is not None else f"refused:{refused}"
            copies_recorded = {**lrec.copies_made, "refused": dict(lrec.copies_refused)}
        for m in direct:
            if forms[m][0] is Form.CPU_MXFP8_MOE:
                vllm_cpu_plugin.refresh_mxfp8_experts(m)
            elif forms[m][0] is Form.CPU_NVFP4_MOE:
                vllm_cpu_plugin.refresh_nvfp4_experts(m)
            elif forms[m][0] is Form.CPU_MXFP8_LINEAR:
                refresh_mxfp8_linear(m)
    return {
        **summary(forms),
        DEFERRED_KEY: deferred,
        PLANNED_KEY: planned,
        vllm_replay.REPLAYED_KEY: replayed,
        vllm_replay.COPIED_KEY: copied,
        "plan": outcome,
        "replay": replay,
        **({"copies_recorded": copies_recorded} if copies_recorded is not None else {}),
    }


def choose(
    model: torch.nn.Module, *, enabled: bool, layout: dict | None, forms: frozenset | None = None
) -> tuple[dict | None, Why | None]:
    """The forms for a direct load of ``model``, or (None, why) when the whole load goes through
    vLLM's layerwise reload (``enabled`` False: turned off, or a LoRA server). A model without a
    direct module still takes the direct load for its loader plan (vllm_replay). On a GPU server
    every module is layerwise (:data:`Why.NOT_CPU`: the direct forms were established on vLLM's CPU
    backend), and the load is the loader plan's unless :func:`gpu_replay_enabled` says it is off. ``forms``:
    the only forms to take (:func:`plan`), all when None."""
    if not enabled:
        return None, Why.DISABLED
    if layout is not None:
        return None, Why.PRESHUFFLED
    if any(p.device.type != "cpu" for p in model.parameters()):
        if not gpu_replay_enabled():
            return None, Why.NOT_CPU  # docs/reload.md#vllm-direct-load: GPU servers reload layerwise
        return {m: (Form.LAYERWISE, Why.NOT_CPU) for m in _owners(model)}, None
    return plan(model, forms), None


#: Server environment variable: ``0`` turns off the replay of the recorded loader calls on a GPU
#: server (docs/reload.md#loader-replay; on by default since it was held to vLLM's layerwise reload
#: on a GPU)
GPU_REPLAY_ENV = "QCONVERT_GPU_LOADER_REPLAY"


def gpu_replay_enabled() -> bool:
    import os

    return os.environ.get(GPU_REPLAY_ENV, "1") != "0"
