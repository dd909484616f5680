"""A GPU server's MXFP8 MoE Marlin preparation as one byte gather per tensor (docs/reload.md#marlin-gather).

On Hopper vLLM serves MXFP8 experts with its Marlin kernels, and every reload runs
``prepare_mxfp8_moe_layer_for_marlin`` (``vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py``):
a Python loop over the experts with one repack launch per weight and about ten small operations per
scale tensor. What it does to each expert's bytes is a fixed rearrangement, the same for every expert.
This module learns that rearrangement once per tensor shape by running vLLM's own function on one
expert whose bytes encode their own positions, then applies it to all experts as one ``index_select``.
Every call still runs vLLM's function on the first expert (its side effects on the layer stay vLLM's)
and compares that expert's bytes with the gather's; any difference, a shape the learner refuses (the
function pads, or is not a byte permutation for this dtype), or an older vLLM without the function
leaves the call to vLLM.

Imported inside the vLLM worker only; vLLM itself is imported inside :func:`patched`.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

#: Server environment variable: ``0`` leaves the Marlin preparation to vLLM's per-expert loop.
ENV = "QCONVERT_GPU_MARLIN_GATHER"
#: Where vLLM defines the function (both 0.26.0 and 0.32.0 import it from here at each call).
TARGET_MODULE = "vllm.model_executor.layers.quantization.utils.marlin_utils_fp8"
TARGET = "prepare_mxfp8_moe_layer_for_marlin"


def enabled() -> bool:
    """Whether a GPU server gathers (on unless :data:`ENV` is ``0``)."""
    return os.environ.get(ENV, "1") != "0"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def learn_permutations(
    fn: Callable[..., Sequence[torch.Tensor]], like: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor] | None, str | None]:
    """The byte permutation ``fn`` applies to each argument (output ``k`` from argument ``k``).

    ``like`` gives each argument's shape, dtype and device. ``fn`` runs on probes whose bytes hold
    their position plus one, eight bits per pass; ``perm[k][j]`` is the input byte that output byte
    ``j`` of output ``k`` holds. Returns ``(None, reason)`` where an output has a different byte
    count (padding), a byte that is no input byte, or two bytes from one input byte."""
    sizes = [t.numel() * t.element_size() for t in like]
    passes = max(1, (max(sizes).bit_length() + 7) // 8)
    acc: list[torch.Tensor] | None = None
    for j in range(passes):
        probes = []
        for t, n in zip(like, sizes):
            code = torch.arange(1, n + 1, device=t.device, dtype=torch.int64)
            probes.append(((code >> (8 * j)) & 255).to(torch.uint8).view(t.dtype).view(t.shape))
        outs = fn(*probes)
        if len(outs) != len(like):
            return None, "outputs"
        got = [_bytes(o).to(torch.int64) << (8 * j) for o in outs]
        acc = got if acc is None else [a | g for a, g in zip(acc, got)]
    perms = []
    for k, (a, n) in enumerate(zip(acc, sizes)):
        if a.numel() != n:
            return None, f"size:{k}"
        p = a - 1
        if bool(((p < 0) | (p >= n)).any()):
            return None, f"range:{k}"
        if not torch.equal(torch.sort(p).values, torch.arange(n, device=p.device)):
            return None, f"bijection:{k}"
        perms.append(p.to(torch.int32) if n < 2**31 else p)  # half the index memory
    return perms, None


def gather(t: torch.Tensor, perm: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``'s experts (dimension 0) each rearranged by ``perm``, with ``like``'s dtype and per-expert shape."""
    e = t.shape[0]
    out = t.contiguous().view(torch.uint8).reshape(e, -1).index_select(1, perm)
    return out.view(like.dtype).reshape(e, *like.shape[1:])


class MarlinGather:
    """Wraps vLLM's function (:meth:`wrap`); keeps the learnt permutations per shape and counts calls."""

    def __init__(self):
        self.plans: dict[tuple, list[torch.Tensor] | None] = {}
        self.refused: dict[tuple, str] = {}
        self.counts: Counter = Counter()

    def _learn(self, original, layer, ins: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor] | None, str | None]:
        """(the permutations, None), or (None, why not)."""
        like = [torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in ins]
        try:
            perms, why = learn_permutations(lambda *a: original(layer, *a), like)
            if perms is None:
                return None, why
            # held once more on random bytes that include every byte value
            probe = []
            for t in like:
                b = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, device=t.device)
                b[: min(256, b.numel())] = torch.arange(min(256, b.numel()), dtype=torch.uint8, device=t.device)
                probe.append(b.view(t.dtype).view(t.shape))
            want = original(layer, *probe)
        except Exception as err:  # vLLM's function refused a probe: the calls are left to it
            return None, f"error:{type(err).__name__}"
        if not all(torch.equal(_bytes(gather(t, p, w)), _bytes(w)) for t, p, w in zip(probe, perms, want)):
            return None, "check"
        self.counts["learned"] += 1
        return perms, None

    @staticmethod
    def _key(ins: Sequence[torch.Tensor]) -> tuple:
        return (
            tuple((tuple(t.shape[1:]), t.dtype) for t in ins),
            str(ins[0].device),
            torch.get_default_dtype(),
        )

    def wrap(self, original: Callable) -> Callable:
        """A drop-in for vLLM's ``prepare_mxfp8_moe_layer_for_marlin(layer, w13, w2, w13_scale, w2_scale)``."""

        def prepare(layer, w13, w2, w13_scale, w2_scale):
            ins = (w13, w2, w13_scale, w2_scale)
            e = w13.shape[0]
            if any(t.shape[0] != e for t in ins) or e < 2:
                self.counts["vllm"] += 1
                return original(layer, *ins)
            key = self._key(ins)
            if key not in self.plans:
                self.plans[key], why = self._learn(original, layer, ins)
                if why is not None:
                    self.refused[key] = why
            plan = self.plans[key]
            if plan is None:
                self.counts["vllm"] += 1
                return original(layer, *ins)
            # vLLM's own function on the first expert: its side effects on the layer, and the check
            ref = original(layer, *(t[:1] for t in ins))
            outs = tuple(gather(t, p, r) for t, p, r in zip(ins, plan, ref))
            if not all(torch.equal(_bytes(o[:1]), _bytes(r)) for o, r in zip(outs, ref)):  # bytes: NaN scales
                self.plans[key] = None
                self.refused[key] = "mismatch"
                self.counts["mismatch"] += 1
                return original(layer, *ins)
            self.counts["gathered"] += 1
            return outs

        prepare.__wrapped__ = original
        prepare.qconvert_marlin_gather = True
        return prepare

    def summary(self, since: Counter | None = None) -> dict:
        """Calls since ``since`` (a copy of :attr:`counts`), and the refusals so far."""
        got = self.counts - (since or Counter())
        out = {k: got.get(k, 0) for k in ("gathered", "vllm", "learned", "mismatch")}
        if self.refused:
            out["refused"] = sorted(set(self.refused.values()))
        return out


#: The worker's one instance: its permutations are learnt at the first load and kept for the next.
GATHER = MarlinGather()


@contextmanager
def patched(g: MarlinGather = GATHER) -> Iterator[MarlinGather | None]:
    """vLLM's function replaced by ``g``'s wrapper for the duration (None where vLLM lacks it)."""
    try:
        mod = importlib.import_module(TARGET_MODULE)
    except ImportError:
        yield None
        return
    original = getattr(mod, TARGET, None)
    if original is None or getattr(original, "qconvert_marlin_gather", False):
        yield None
        return
    setattr(mod, TARGET, g.wrap(original))
    try:
        yield g
    finally:
        setattr(mod, TARGET, original)
