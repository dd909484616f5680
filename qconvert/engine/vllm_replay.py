"""Engine side: vLLM's layerwise reload with its weight-loader calls recorded once and replayed.

vLLM's layerwise reload (docs/reload.md#vllm-reload_weights) spends most of a load in Python per
tensor before any byte moves: the model's ``load_weights`` maps each checkpoint name to a parameter
and shard (for an MoE layer, a loop over every expert's mapping), and the deferring wrapper vLLM
puts around every parameter's ``weight_loader`` binds the call's arguments, re-wraps late
parameters and runs the loader once on meta tensors under a dispatch mode to count elements. Only
when a module has all its elements does ``_layerwise_process`` do the work that touches bytes:
materialize the module's checkpoint-format parameters, call each buffered loader for real, run the
quant method's ``process_weights_after_loading`` and copy the result into the served tensors.

A replay keeps that last part, vLLM's own function, and skips the rest (docs/reload.md#loader-replay):

* **Record.** The first load of an area layout runs vLLM's layerwise reload as it is, with
  ``_layerwise_process`` wrapped so that each module's buffered calls are noted before they run:
  the parameter name and the bound arguments, every staged tensor among them as the staged tensor
  it is a view of plus the view's dtype, sizes, strides and offset. A call argument that is a
  tensor but not a view of a staged tensor (a copy the model made), a non-plain value, a staged
  tensor read by two modules or also by something the replay does not cover (an attention layer's
  scales, a direct module's copy, see vllm_direct) gives no plan.
* **Replay.** A later load of the same layout into the same model hands each recorded module, as
  soon as its staged tensors have arrived, the same calls with the new load's views and calls
  ``_layerwise_process`` on it: the same loaders with the same arguments, the same processing,
  the same copies into the served tensors. Tensors outside the plan still go through
  ``load_weights``.
"""

from __future__ import annotations

import bisect
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: ``replay`` of a load's statistics: the loader calls were recorded by this load or replayed
REPLAY_RECORDED = "recorded"
REPLAY_REPLAYED = "replayed"
#: key of the module counts: modules whose loader calls this load replayed
REPLAYED_KEY = "replayed-modules"

_PLAIN = (str, int, float, bool, type(None))


def _plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(_plain(x) for x in v))


def storage_key(t: torch.Tensor) -> tuple:
    """A tensor's storage as (device type, device index, address)."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class Call:
    """One buffered ``weight_loader`` call of a module: ``param`` is the parameter it fills,
    ``arguments`` the bound arguments with the parameter and the staged tensors left out, and
    ``tensors`` each staged argument as (argument, staged tensor, dtype, sizes, strides, offset in
    elements of that dtype from the staged tensor's first byte); ``order`` the bound names as
    ``args`` and ``kwargs`` give them once vLLM has set ``param`` (:func:`arg_order`; None:
    inspect's own properties)."""

    param: str
    signature: inspect.Signature
    arguments: tuple[tuple[str, object], ...]
    tensors: tuple[tuple[str, str, torch.dtype, tuple, tuple, int], ...]
    order: tuple | None = None

    def bind(self, got: dict[str, torch.Tensor]) -> inspect.BoundArguments:
        args = dict(self.arguments)
        for arg, name, dtype, size, stride, offset in self.tensors:
            t = got[name]
            if not offset and t.dtype == dtype and t.shape == size and t.stride() == stride:
                args[arg] = t  # the whole staged tensor, as recorded (an expert's weight): no new view
                continue
            base = t.reshape(-1)
            if base.dtype != dtype:
                base = base.view(torch.uint8).view(dtype)
            args[arg] = torch.as_strided(base, size, stride, base.storage_offset() + offset)
        if self.order is None:
            return inspect.BoundArguments(self.signature, args)
        bound = _Bound(self.signature, args)
        bound.order = self.order
        return bound


def arg_order(signature: inspect.Signature, names) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """Which of ``names`` ``BoundArguments.args`` and ``.kwargs`` give, in order: the same for every
    replay of a call, so computed once, by inspect's own properties on markers; None where a
    ``*args``/``**kwargs`` is among them."""
    params = signature.parameters
    if any(params[n].kind in (params[n].VAR_POSITIONAL, params[n].VAR_KEYWORD) for n in names if n in params):
        return None
    ba = inspect.BoundArguments(signature, {n: _Mark(n) for n in names})
    return tuple(m.name for m in ba.args), tuple(ba.kwargs)


class _Mark:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Bound(inspect.BoundArguments):
    """``inspect.BoundArguments`` whose ``args``/``kwargs`` follow an order computed once by inspect
    itself (:func:`arg_order`) instead of walking the signature at every call."""

    __slots__ = ("order",)

    @property
    def args(self) -> tuple:
        a = self.arguments
        return tuple(a[n] for n in self.order[0])

    @property
    def kwargs(self) -> dict:
        a = self.arguments
        return {n: a[n] for n in self.order[1]}


@dataclass
class ModuleCalls:
    module: weakref.ref
    calls: list[Call]
    names: frozenset[str]


class LoaderPlan:
    """The recorded loader calls of one area layout, per module in the order vLLM processed them."""

    def __init__(self, key: tuple, modules: list[ModuleCalls]):
        self.key = key
        self.modules = modules
        self.of_name = {n: i for i, mc in enumerate(modules) for n in mc.names}

    def replay(self, weights) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """Run each recorded module's calls through vLLM's ``_layerwise_process`` as soon as its
        staged tensors have come out of ``weights``; returns the other (name, tensor) pairs (for
        ``load_weights``) and the number of modules replayed."""
        from vllm.model_executor.model_loader.reload import layerwise

        others: list[tuple[str, torch.Tensor]] = []
        pending: dict[int, dict[str, torch.Tensor]] = {}
        done = 0
        for name, t in weights:
            i = self.of_name.get(name)
            if i is None:
                others.append((name, t))
                continue
            got = pending.setdefault(i, {})
            got[name] = t
            mc = self.modules[i]
            if len(got) == len(mc.names):
                del pending[i]
                layer = mc.module()
                if layer is None:
                    raise RuntimeError("a module of the recorded loader plan is gone")
                info = layerwise.get_layerwise_info(layer)
                info.loaded_weights = [(c.param, c.bind(got)) for c in mc.calls]
                layerwise._layerwise_process(layer, info)
                done += 1
        if pending:  # the key holds every tensor name: only a changed area can get here
            raise RuntimeError("the staged tensors of a recorded module did not all arrive")
        return others, done


class StagedIndex:
    """Where the staged tensors of one load lie, as they pass (:meth:`watch`): per storage (device
    and address), the byte range, name and dtype of each, in the order they came. The copy plan's
    recorder (vllm_direct) and the loader plan's recorder (:class:`_Recorder`) both ask it which
    staged tensor a tensor they see is a view of (:meth:`find`)."""

    def __init__(self):
        self.starts: dict[tuple, list[int]] = {}  # ascending byte starts per storage
        self.entries: dict[tuple, list[tuple[int, str, torch.dtype]]] = {}  # (end, name, dtype), same order

    def watch(self, weights):
        """``weights`` unchanged, each tensor noted (per file they come in offset order)."""
        for name, t in weights:
            if t.nbytes:
                key = storage_key(t)
                start = t.storage_offset() * t.element_size()
                starts = self.starts.setdefault(key, [])
                if starts and start <= starts[-1]:  # a new buffer at a freed one's address (device chunks)
                    starts.clear()
                    self.entries[key] = []
                starts.append(start)
                self.entries.setdefault(key, []).append((start + t.nbytes, name, t.dtype))
            yield name, t

    def find(self, t: torch.Tensor) -> tuple[str, torch.dtype, int, int] | None:
        """(name, dtype, first byte, end byte) of the staged tensor holding ``t``'s first byte, or
        None where that byte lies in none (not a view of a staged tensor)."""
        key = storage_key(t)
        starts = self.starts.get(key)
        if not starts:
            return None
        at = t.storage_offset() * t.element_size()
        i = bisect.bisect_right(starts, at) - 1
        if i < 0:
            return None
        end, name, dtype = self.entries[key][i]
        return (name, dtype, starts[i], end) if at < end else None


class _Recorder:
    """Notes the calls ``_layerwise_process`` receives, each staged tensor among their arguments
    found in ``index``."""

    def __init__(self, index: StagedIndex):
        self.index = index
        self.modules: list[ModuleCalls] = []
        self.captured: set[int] = set()
        self.refused: str | None = None

    def watch(self, weights):
        return self.index.watch(weights)

    def source(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(staged tensor, offset of ``t`` in elements of its dtype from that tensor's start), or
        None unless all of ``t`` lies in one staged tensor at a whole element."""
        got = self.index.find(t)
        if got is None:
            return None
        name, _, start, end = got
        at = t.storage_offset() * t.element_size()
        last = at + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        rel = at - start
        if t.numel() == 0 or last > end or rel % t.element_size():
            return None
        return name, rel // t.element_size()

    def names_of(self, loaded) -> set[str]:
        got = set()
        for _, ba in loaded:
            for v in ba.arguments.values():
                if isinstance(v, torch.Tensor) and not v.is_meta:
                    src = self.source(v)
                    if src is not None:
                        got.add(src[0])
        return got

    def capture(self, layer: torch.nn.Module, info) -> None:
        if self.refused is not None:
            return
        calls: list[Call] = []
        names: set[str] = set()
        for pname, ba in info.loaded_weights:
            plain, tensors = [], []
            for arg, v in ba.arguments.items():
                if arg == "param":
                    continue
                if isinstance(v, torch.Tensor):
                    src = self.source(v)
                    if src is None:
                        self.refused = "loader-argument-not-a-staged-view"
                        return
                    tensors.append((arg, src[0], v.dtype, tuple(v.shape), tuple(v.stride()), src[1]))
                    names.add(src[0])
                elif _plain(v):
                    plain.append((arg, v))
                else:
                    self.refused = "loader-argument-not-plain"
                    return
            names_bound = ["param", *(a for a, _ in plain), *(t[0] for t in tensors)]
            order = arg_order(ba.signature, names_bound)
            calls.append(Call(pname, ba.signature, tuple(plain), tuple(tensors), order))
        if not calls:
            return
        self.captured.add(id(layer))
        self.modules.append(ModuleCalls(weakref.ref(layer), calls, frozenset(names)))

    def pending(self, model: torch.nn.Module) -> list[tuple[int, set[str]]]:
        """Modules holding buffered calls before finalize (processed there, or left to it)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        out = []
        for m in model.modules():
            info = LAYERWISE_INFO.get(m)
            if info is not None and info.loaded_weights:
                out.append((id(m), self.names_of(info.loaded_weights)))
        return out

    def plan(self, key: tuple, pending: list[tuple[int, set[str]]], elsewhere: set[str]) -> tuple:
        if self.refused is not None:
            return None, self.refused
        otherwise: set[str] = set()
        for mid, names in pending:
            if mid not in self.captured:  # an attention layer's scales: left to load_weights
                otherwise |= names
        seen: set[str] = set()
        for mc in self.modules:
            if mc.names & seen:
                return None, "staged-tensor-read-by-two-modules"
            seen |= mc.names
        if seen & (otherwise | elsewhere):
            return None, "staged-tensor-also-used-otherwise"
        if not self.modules:
            return None, "no-layerwise-module"
        return LoaderPlan(key, self.modules), None


@contextmanager
def recording(model: torch.nn.Module, index: StagedIndex | None = None):
    """Around one layerwise load (``initialize_layerwise_reload`` to ``finalize_layerwise_reload``
    included): yields the :class:`_Recorder`; feed the staged tensors through its ``watch`` (its
    ``index``'s: a fresh one, or the one given), take its ``pending(model)`` between
    ``load_weights`` and ``finalize_layerwise_reload``, and its ``plan`` after."""
    from vllm.model_executor.model_loader.reload import layerwise

    rec = _Recorder(index if index is not None else StagedIndex())
    original = layerwise._layerwise_process

    def noting(layer, info):
        rec.capture(layer, info)
        return original(layer, info)

    layerwise._layerwise_process = noting
    try:
        yield rec
    finally:
        layerwise._layerwise_process = original


#: the loader plan of each served model (one per worker)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def known(model: torch.nn.Module, key: tuple) -> LoaderPlan | None:
    got = _PLANS.get(model)
    return got if got is not None and got.key == key else None


def keep(model: torch.nn.Module, plan: LoaderPlan | None) -> None:
    if plan is None:
        _PLANS.pop(model, None)
    else:
        _PLANS[model] = plan
