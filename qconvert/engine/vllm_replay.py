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
* **Copies.** Where a recorded module's loaders did nothing to tensors but copy staged views into
  the module's parameters (an MoE layer's per-expert ``weight_loader``: a narrow of the expert's
  slice and one ``copy_``), the recording also notes each copy (a dispatch mode around each loader
  call), and a replay hands ``_layerwise_process`` one call per parameter that makes those copies
  instead of calling the loaders, the copies of one shape batched into strided ``copy_`` s per
  parameter and staged buffer (:class:`CopyBatch`, docs/reload.md#loader-copies). A module whose
  loaders wrote a parameter otherwise (a fill, a computed value, copies that overlap) or read a
  staged tensor otherwise keeps its loader calls.
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

#: key of the module counts: replayed modules whose loader calls were made as their recorded copies
COPIED_KEY = "copied-modules"
#: Server environment variable: ``0`` turns the loader copies off (replays then call vLLM's loaders)
COPIES_ENV = "QCONVERT_LOADER_COPIES"

_PLAIN = (str, int, float, bool, type(None))
#: an integer dtype of each element size: batched copies move bytes, never values (NaN payloads kept)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copies_enabled() -> bool:
    import os

    return os.environ.get(COPIES_ENV, "1") != "0"


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


class CopyBatch:
    """Copies of one shape into one parameter from staged tensors lying a fixed step apart in one
    staged buffer to destinations a fixed step apart in the parameter, made as one ``copy_`` of a
    strided view of the buffer into a strided view of the parameter.

    ``names``: the staged tensors in buffer order; ``deltas``: each one's byte distance from the
    first, checked at every replay; ``dtype``: how the copies viewed the staged bytes; ``src``:
    (sizes, strides, offset in elements of ``dtype`` from the first staged tensor's start) and
    ``dst`` (sizes, strides, offset in the parameter's elements) of the whole batch, the first
    dimension one row per staged tensor."""

    def __init__(self, names, deltas, dtype, src, dst):
        self.names, self.deltas, self.dtype = tuple(names), tuple(deltas), dtype
        self.src, self.dst = src, dst

    def apply(self, got: dict[str, torch.Tensor], param: torch.Tensor) -> None:
        (ssize, sstride, soff), (dsize, dstride, doff) = self.src, self.dst
        target = param.data
        same = target.dtype == self.dtype  # then bytes, not values, move (NaN payloads kept)
        if same:
            target = target.view(_BITS[target.element_size()])
        dst = torch.as_strided(target, dsize, dstride, target.storage_offset() + doff)
        first = got[self.names[0]]
        p0 = first.data_ptr()
        if len(self.names) > 1 and any(got[n].data_ptr() - p0 != d for n, d in zip(self.names, self.deltas)):
            # not where the recording had them (cannot happen for the same layout): one copy each
            for row, n in enumerate(self.names):
                b = self._flat(got[n], same)
                dst[row].copy_(torch.as_strided(b, ssize[1:], sstride[1:], b.storage_offset() + soff))
            return
        b = self._flat(first, same)
        dst.copy_(torch.as_strided(b, ssize, sstride, b.storage_offset() + soff))

    def _flat(self, t: torch.Tensor, same: bool) -> torch.Tensor:
        """``t`` as a flat tensor of ``dtype`` (its integer twin where ``same``), at ``t``'s first byte."""
        base = t.reshape(-1)
        if base.dtype != self.dtype:
            base = base.view(torch.uint8).view(self.dtype)
        return base.view(_BITS[base.element_size()]) if same else base


def _apply_copies(param, work) -> None:
    """The loader :func:`LoaderPlan.replay` hands ``_layerwise_process`` for a module with copies:
    ``work`` is (the batches into ``param``, the load's staged tensors)."""
    batches, got = work
    for b in batches:
        b.apply(got, param)


_APPLY_SIGNATURE = inspect.signature(_apply_copies)


@dataclass
class ModuleCalls:
    module: weakref.ref
    calls: list[Call]
    names: frozenset[str]
    #: per parameter of the calls (in their order), the batches of copies the loaders made; None
    #: where the loaders did anything else (the calls are then replayed)
    copies: dict[str, tuple[CopyBatch, ...]] | None = None


class LoaderPlan:
    """The recorded loader calls of one area layout, per module in the order vLLM processed them."""

    def __init__(self, key: tuple, modules: list[ModuleCalls]):
        self.key = key
        self.modules = modules
        self.of_name = {n: i for i, mc in enumerate(modules) for n in mc.names}

    def replay(self, weights, copies: bool = True) -> tuple[list[tuple[str, torch.Tensor]], int, int]:
        """Run each recorded module's calls through vLLM's ``_layerwise_process`` as soon as its
        staged tensors have come out of ``weights`` (with ``copies``, a module's recorded copies
        in place of its loader calls where it has them); returns the other (name, tensor) pairs
        (for ``load_weights``), the number of modules replayed and how many of them by copies."""
        from vllm.model_executor.model_loader.reload import layerwise

        others: list[tuple[str, torch.Tensor]] = []
        pending: dict[int, dict[str, torch.Tensor]] = {}
        done = copied = 0
        with _loaders_replaced(layerwise) as use_copies:
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
                    if copies and mc.copies is not None:
                        # one call per parameter, as vLLM's loop makes them: _apply_copies
                        info.loaded_weights = [
                            (p, inspect.BoundArguments(_APPLY_SIGNATURE, {"work": (b, got)}))
                            for p, b in mc.copies.items()
                        ]
                        use_copies[0] = True
                        try:
                            layerwise._layerwise_process(layer, info)
                        finally:
                            use_copies[0] = False
                        copied += 1
                    else:
                        info.loaded_weights = [(c.param, c.bind(got)) for c in mc.calls]
                        layerwise._layerwise_process(layer, info)
                    done += 1
        if pending:  # the key holds every tensor name: only a changed area can get here
            raise RuntimeError("the staged tensors of a recorded module did not all arrive")
        return others, done, copied


@contextmanager
def _loaders_replaced(layerwise):
    """While the yielded flag ``[0]`` is set, ``_layerwise_process`` unwraps every parameter's
    loader to :func:`_apply_copies` (its loop sets ``param.weight_loader =
    _get_original_loader(param)`` after materializing the layer, then calls it)."""
    saved = getattr(layerwise, "_get_original_loader", None)
    flag = [False]
    if saved is None:  # a vLLM without it: nothing was recorded as copies (see recording)
        yield flag
        return

    def original_loader(tensor):
        return _apply_copies if flag[0] else saved(tensor)

    layerwise._get_original_loader = original_loader
    try:
        yield flag
    finally:
        layerwise._get_original_loader = saved


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

    def within(self, t: torch.Tensor) -> tuple[str, int, int] | bool | None:
        """(staged tensor, offset of ``t`` in elements of its dtype from that tensor's start, its
        first byte) where all of ``t`` lies in one staged tensor at a whole element; False where
        ``t`` only starts in one; None where it starts in none."""
        got = self.find(t)
        if got is None:
            return None
        name, _, start, end = got
        at = t.storage_offset() * t.element_size()
        size = t.element_size()
        if t.numel() == 0 or at + _span(t.shape, t.stride()) * size > end or (at - start) % size:
            return False
        return name, (at - start) // size, start


def written_by(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an aten op (in a dispatch mode) writes: its arguments its schema marks as
    written, and an ``out``."""
    got = [
        a
        for a, arg in zip(args, func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor)
    ]
    return got + [v for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)]


def _span(sizes, strides) -> int:
    """Elements from a view's first element to one past its last."""
    return 1 + sum((n - 1) * st for n, st in zip(sizes, strides)) if all(sizes) else 0


class _CopyCapture:
    """Dispatch mode around each loader call of one module's ``_layerwise_process`` (the recording
    load): notes every ``copy_`` from a staged view into one of the module's tensors; anything else
    that writes a module tensor or reads a staged tensor is the reason the module keeps its calls."""

    def __init__(self, index: StagedIndex, layer: torch.nn.Module):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.index, self.layer = index, layer
        self.tensors: dict[tuple, tuple[str, torch.Tensor]] | None = None  # storage -> (name, tensor)
        #: (parameter, (sizes, strides, offset), staged tensor, dtype, (sizes, strides, offset in
        #: elements from its start), its storage, its first byte)
        self.copies: list[tuple] = []
        self.refused: str | None = None
        cap = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                cap.see(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def wrap(self, original_loader):
        """vLLM's ``_get_original_loader`` with each loader it gives run under the mode."""
        from vllm.model_executor.model_loader.reload import layerwise

        def get(tensor):
            fn = original_loader(tensor)

            def loader(*args, **kwargs):
                if self.tensors is None:  # the layer is materialized by now
                    self.tensors = {
                        storage_key(t): (n, t) for n, t in layerwise.get_layer_tensors(self.layer).items() if t.nbytes
                    }
                with self.mode:
                    return fn(*args, **kwargs)

            return loader

        return get

    def _staged(self, t) -> tuple | None:
        """(staged tensor, offset in elements from its start, its storage, its first byte) of ``t``
        lying wholly in one staged tensor at a whole element; False where ``t`` only starts in
        one; None where it starts in none."""
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return None
        got = self.index.within(t)
        return got and (got[0], got[1], storage_key(t), got[2])

    def see(self, func, args, kwargs) -> None:
        import torch.utils._pytree as pytree

        if self.refused is not None:
            return
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            hit = self.tensors.get(storage_key(dst))
            got = self._staged(src)
            if hit is None:
                if got is not None:
                    self.refused = "staged-tensor-copied-elsewhere"
                return
            pname, p = hit
            if not got:
                self.refused = "parameter-written-not-from-a-staged-view"
            elif dst.dtype != p.dtype:
                self.refused = "parameter-written-as-another-dtype"
            else:
                name, rel, key, start = got
                geo = (tuple(dst.shape), tuple(dst.stride()), dst.storage_offset() - p.storage_offset())
                self.copies.append(
                    (pname, geo, name, src.dtype, (tuple(src.shape), tuple(src.stride()), rel), key, start)
                )
            return
        if func.is_view:
            return
        leaves = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        if any(self._staged(t) is not None for t in leaves):
            self.refused = "staged-tensor-read-otherwise"
            return
        if any(storage_key(t) in self.tensors for t in written_by(func, args, kwargs) if t.nbytes):
            self.refused = "parameter-written-otherwise"

    def batches(self, params: list[str]) -> tuple[dict[str, tuple[CopyBatch, ...]] | None, str | None]:
        """The copies as :class:`CopyBatch` es per parameter of the calls (each once, in order), or
        (None, the reason the module keeps its calls)."""
        if self.refused is not None:
            return None, self.refused
        if not self.copies:
            return None, "loaders-copied-nothing"
        order = list(dict.fromkeys(params))
        dtype_of = {n: t.dtype for n, t in (self.tensors or {}).values()}
        by_param: dict[str, list[tuple]] = {p: [] for p in order}
        for c in self.copies:
            if c[0] not in by_param:
                return None, "copy-into-another-parameter"
            by_param[c[0]].append(c)
        out = {}
        for p, cs in by_param.items():
            extents = sorted((g[2], g[2] + _span(g[0], g[1])) for _, g, *_ in cs)
            if any(b[0] < a[1] for a, b in zip(extents, extents[1:])):
                return None, "loader-copies-overlap"
            out[p] = tuple(_batch(cs, dtype_of[p]))
        return out, None


def _one(name: str, dtype, src: tuple, dst: tuple) -> CopyBatch:
    """One copy as a batch of one row."""
    (ssize, sstride, soff), (dsize, dstride, doff) = src, dst
    return CopyBatch([name], [0], dtype, ((1, *ssize), (0, *sstride), soff), ((1, *dsize), (0, *dstride), doff))


def _progressions(members: list[tuple], item: int, most: int = 8) -> list[list[tuple]]:
    """``members`` (sorted by their staged tensor's first byte, ``[2]``) as runs each a fixed step
    apart (a multiple of ``item`` bytes): every k-th member for the smallest k up to ``most`` that
    makes each such run a progression (an expert's gate and up shards alternate in a checkpoint's
    order: k = 2), else the longest runs in order."""

    def steady(run) -> bool:
        steps = {b[2] - a[2] for a, b in zip(run, run[1:])}
        return len(steps) <= 1 and all(st % item == 0 for st in steps)

    for k in range(1, min(most, len(members)) + 1):
        runs = [members[i::k] for i in range(k)]
        if all(steady(r) for r in runs):
            return runs
    runs, run = [], [members[0]]
    for m in members[1:]:
        step = m[2] - run[-1][2]
        if step % item == 0 and (len(run) == 1 or step == run[1][2] - run[0][2]):
            run.append(m)
        else:
            runs.append(run)
            run = [m]
    return [*runs, run]


def _batch(copies: list[tuple], param_dtype: torch.dtype):
    """:class:`CopyBatch` es of one parameter's copies (disjoint destinations, so any order): those
    of one destination shape, source view and staged buffer whose staged tensors lie a fixed step
    apart in the buffer and whose destinations lie a fixed step apart, at least one destination's
    extent, in the parameter go together; a copy that converts dtypes goes alone, as recorded."""
    buckets: dict[tuple, list[tuple]] = {}
    for _, dst, name, dtype, src, key, start in copies:
        if dtype != param_dtype:
            yield _one(name, dtype, src, dst)
            continue
        buckets.setdefault((dst[0], dst[1], dtype, src, key), []).append((dst[2], name, start))
    for (dsize, dstride, dtype, (ssize, sstride, soff), _), members in buckets.items():
        members.sort(key=lambda m: m[2])
        span = _span(dsize, dstride)
        for progression in _progressions(members, dtype.itemsize):
            runs, run = [], [progression[0]]
            for m in progression[1:]:  # split where the destinations' step changes
                step = m[0] - run[-1][0]
                if step >= max(span, 1) and (len(run) == 1 or step == run[1][0] - run[0][0]):
                    run.append(m)
                else:
                    runs.append(run)
                    run = [m]
            runs.append(run)
            for r in runs:
                n = len(r)
                dstep = r[1][0] - r[0][0] if n > 1 else 0
                sstep = (r[1][2] - r[0][2]) // dtype.itemsize if n > 1 else 0
                yield CopyBatch(
                    [m[1] for m in r],
                    [m[2] - r[0][2] for m in r],
                    dtype,
                    ((n, *ssize), (sstep, *sstride), soff),
                    ((n, *dsize), (dstep, *dstride), r[0][0]),
                )


class _Recorder:
    """Notes the calls ``_layerwise_process`` receives, each staged tensor among their arguments
    found in ``index``."""

    def __init__(self, index: StagedIndex):
        self.index = index
        self.modules: list[ModuleCalls] = []
        self.captured: set[int] = set()
        self.refused: str | None = None
        #: why modules keep their loader calls instead of copies: reason -> modules
        self.copies_refused: dict[str, int] = {}
        #: the modules with copies, their copies and the batches those make
        self.copies_made = {"modules": 0, "copies": 0, "batches": 0}

    def watch(self, weights):
        return self.index.watch(weights)

    def source(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(staged tensor, offset of ``t`` in elements of its dtype from that tensor's start), or
        None unless all of ``t`` lies in one staged tensor at a whole element."""
        got = self.index.within(t)
        return got[:2] if got else None

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
def recording(model: torch.nn.Module, index: StagedIndex | None = None, copies: bool = True):
    """Around one layerwise load (``initialize_layerwise_reload`` to ``finalize_layerwise_reload``
    included): yields the :class:`_Recorder`; feed the staged tensors through its ``watch`` (its
    ``index``'s: a fresh one, or the one given), take its ``pending(model)`` between
    ``load_weights`` and ``finalize_layerwise_reload``, and its ``plan`` after. With ``copies``,
    each recorded module's loader calls run under :class:`_CopyCapture` (its copies noted)."""
    from vllm.model_executor.model_loader.reload import layerwise

    rec = _Recorder(index if index is not None else StagedIndex())
    original = layerwise._layerwise_process
    loaders = getattr(layerwise, "_get_original_loader", None)
    copies = copies and loaders is not None  # a vLLM whose _layerwise_process unwraps loaders otherwise

    def noting(layer, info):
        rec.capture(layer, info)
        mc = rec.modules[-1] if rec.modules else None
        if mc is None or mc.module() is not layer or not copies:
            return original(layer, info)
        cap = _CopyCapture(rec.index, layer)
        layerwise._get_original_loader = cap.wrap(loaders)
        try:
            got = original(layer, info)
        finally:
            layerwise._get_original_loader = loaders
        mc.copies, why = cap.batches([c.param for c in mc.calls])
        if why is not None:
            rec.copies_refused[why] = rec.copies_refused.get(why, 0) + 1
        else:
            rec.copies_made["modules"] += 1
            rec.copies_made["copies"] += len(cap.copies)
            rec.copies_made["batches"] += sum(len(b) for b in mc.copies.values())
        return got

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
