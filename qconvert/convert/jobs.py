"""Every job a conversion runs: one per output group (a kept tensor, an MXFP8 tensor, an NVFP4
fused group, an MoE layer written in a kernel layout), each turning source tensors into output
tensors whose names, dtypes and shapes are known before any byte is read.

:func:`build_jobs` decides the jobs of a plan and returns them with what it decided
(:class:`BuiltJobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, QConvertError
from ..formats import dialects
from ..formats.schemes import NVFP4_INPUT_MODES
from . import kernels
from .checkpoint import Checkpoint
from .layout_jobs import EXPERT_NAME, expert_layers, rank_specs, rank_tag
from .layouts import trtllm
from .numerics import cpu_kernels
from .numerics.mxfp8 import mxfp8_quantize
from .numerics.nvfp4 import encode_global_scale, encode_global_scale_tensor
from .options import ConvertOptions, PlanRow
from .plan import KEEP, QUANTIZE, Plan
from .safetensors_io import ShardReader


@dataclass
class Job:
    """Turns source tensors into output tensors; ``outputs`` is known before any byte is read."""

    sources: list[str]
    outputs: list[dialects.OutTensor]
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    fmt: str
    device_input: bool = False  # the reader thread moves its sources to opts.device (CUDA overlap)
    #: the per-expert jobs a job reading fused expert tensors runs (fused.merge_jobs); None otherwise
    parts: list | None = None
    #: an NVFP4 group job's outputs per member (nvfp4_group_job), for nvfp4_stack_job; None otherwise
    nvfp4: Nvfp4Parts | None = None
    #: a stacked job's outputs as byte ranges of a few stacks (mxfp8_stack_job, nvfp4_stack_job); None otherwise
    stacked: Stacked | None = None


@dataclass(frozen=True)
class Stacked:
    """A stacked job's outputs as byte ranges of a few tensors, the stacks: ``fn(src)`` returns the
    stacks, stack ``k`` of dtype and shape ``stacks[k]``; output ``i`` (in ``Job.outputs`` order) is
    the ``nbytes`` bytes at ``tiles[i] = (k, offset)`` of stack ``k`` in row-major order. The tiles
    of a stack cover it exactly, without overlap (outputs with the same bytes, the members of an
    NVFP4 group and their global scale, share one tile), so a refit copies a layer's outputs from the
    stacks without a Python step per output; ``Job.fn`` is :func:`stacked_outputs` of these."""

    fn: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]
    stacks: list[tuple[torch.dtype, tuple[int, ...]]]
    tiles: list[tuple[int, int]]


def _stacked(outputs: list[dialects.OutTensor], fn, stacks: list, tiles: list) -> Stacked:
    """A :class:`Stacked`, its tiling checked (each stack covered exactly, in its own dtype)."""
    st = Stacked(fn, [(d, tuple(int(x) for x in s)) for d, s in stacks], tiles)
    cover: dict[int, list] = {}
    for o, (k, off) in zip(outputs, tiles, strict=True):
        if o.dtype != st.stacks[k][0]:
            raise AssertionError(f"{o.name}: {o.dtype} in a stack of {st.stacks[k][0]}")
        cover.setdefault(k, []).append((off, out_nbytes(o)))
    for k, (dtype, shape) in enumerate(st.stacks):
        end = 0
        for off, n in sorted(set(cover.get(k, []))):  # members of one group share its global scale
            if off != end:
                raise AssertionError(f"stack {k} of {outputs[0].name}: tiles leave a gap or overlap at byte {off}")
            end += n
        if end != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise AssertionError(f"stack {k} of {outputs[0].name}: tiles cover {end} bytes of {shape}")
    return st


def stacked_outputs(st: Stacked, outputs: list[dialects.OutTensor], stacks: list[torch.Tensor]) -> dict:
    """``{output name: tensor}`` of a stacked job: views of its stacks' bytes (see :class:`Stacked`)."""
    flat = [s.reshape(-1).view(torch.uint8) for s in stacks]
    out = {}
    for o, (k, off) in zip(outputs, st.tiles):
        out[o.name] = flat[k][off : off + out_nbytes(o)].view(o.dtype).view(o.shape)
    return out


@dataclass(frozen=True)
class Nvfp4Parts:
    """What an NVFP4 group job (:func:`nvfp4_group_job`) writes for each member: its outputs
    (packed, block scale, global scale[, input scale]) and the input-scale tensor, which does not
    depend on the weights."""

    outs: dict[str, list]  # member source name -> its OutTensors
    input_scale: dict[str, torch.Tensor]  # member source name -> its input-scale output (CPU)


@dataclass
class BuiltJobs:
    """What :func:`build_jobs` decided: the jobs, and the scheme of each MoE layer written in a
    kernel layout (HF experts prefix -> scheme; empty without ``--layout``)."""

    jobs: list[Job]
    layout_layers: dict[str, str] = field(default_factory=dict)
    #: a quantized source (fp8_source.Fp8BlockSource) the jobs decode, None for BF16 sources
    source: object = None


def non_finite_error(name: str) -> CheckpointError:
    return CheckpointError(f"tensor {name!r} contains NaN or Inf; fix the source weights or pass --allow-non-finite")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise :func:`non_finite_error` if ``t`` holds NaN or +-Inf (one pass, see kernels.all_finite)."""
    if t.is_floating_point() and t.numel() and not kernels.all_finite(t):
        raise non_finite_error(name)


def quantize_mxfp8(name: str, x: torch.Tensor, check: bool, blocks_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP8 step of every job: ``x`` (source tensor ``name``, on its device) quantized on this
    thread's workers (kernels.workers) through ``blocks_fn`` (kernels.blocks_fn), and, with
    ``check``, a NaN/Inf check for free: such a block gets the scale byte 255, which nothing else
    does."""
    q, s = mxfp8_quantize(x, workers=kernels.workers(), blocks_fn=blocks_fn)
    if check and bool((s == 255).any()):
        raise non_finite_error(name)
    return q, s


def quantize_nvfp4_group(xs: dict[str, torch.Tensor], check: bool, recipe: str, blocks_fn):
    """The NVFP4 step of every job: the members of one fused group (source name -> tensor on its
    device) share one global scale, the max amax over the group. Returns ``(g, {name: (packed,
    block scale, scale_2)})``; ``g`` is a numpy fp32 scalar where the CPU kernels ran, else a
    0-dim fp32 tensor. With ``check``, a member holding NaN/Inf raises (naming it)."""
    from .numerics.nvfp4 import nvfp4_quantize

    if all(cpu_kernels.usable(x) for x in xs.values()):  # fp32 scalars in numpy, not 0-dim tensors
        amaxes = {n: cpu_kernels.abs_max_f32(x, kernels.workers()) for n, x in xs.items()}
        g = np.max(np.array(list(amaxes.values()), dtype=np.float32))  # NaN propagates
        finite = bool(np.isfinite(g))
    else:
        amaxes = {n: kernels.abs_max(x).float() for n, x in xs.items()}
        g = torch.stack(list(amaxes.values())).amax()
        finite = bool(torch.isfinite(g)) if check else True  # a host sync: only when it is asked for
    if check and not finite:
        raise non_finite_error(next(n for n, a in amaxes.items() if not bool(np.isfinite(float(a)))))
    return g, {
        n: nvfp4_quantize(x, global_amax=g, recipe=recipe, workers=kernels.workers(), blocks_fn=blocks_fn)
        for n, x in xs.items()
    }


#: Devices on which tensors of one shape (a layer's experts) are quantized to MXFP8 as one stack:
#: one kernel launch instead of one per tensor, the same bytes (MXFP8 blocks lie within a row). On
#: CPU they are quantized side by side on the cores instead. Tests add "cpu" to run this path.
STACKED_DEVICES = {"cuda"}


def quantize_mxfp8_stacked(names: list[str], xs: list[torch.Tensor], check: bool, blocks_fn):
    """:func:`quantize_mxfp8` of tensors of one shape, stacked: ``(q [N, ...], s [N, ...])``; with
    ``check``, one host sync for all of them, naming the first tensor that holds NaN/Inf."""
    q, s = mxfp8_quantize(torch.stack(xs), workers=kernels.workers(), blocks_fn=blocks_fn)
    if check:
        bad = (s == 255).reshape(len(xs), -1).any(dim=1)
        if bool(bad.any()):
            raise non_finite_error(names[int(bad.nonzero()[0, 0])])
    return q, s


def quantize_nvfp4_stacked(
    names: list[str], xs: list[torch.Tensor], per_group: int, check: bool, recipe: str, stacked_fn
):
    """:func:`quantize_nvfp4_group` of ``len(xs) / per_group`` fused groups, each ``per_group``
    consecutive members (2-D tensors of one K and dtype, on one device), in one call: each group's
    members concatenated along rows, the groups stacked ``[G, R, K]`` and quantized by
    ``nvfp4_quantize_stacked`` with the group amaxes (the max of the members' ``max|x|``, NaN
    propagating). Returns ``(packed [G, R, K/2], block scale [G, R, K/16], scale_2 [G], g [G])``.
    With ``check``, one host sync for all, naming the first member holding NaN/Inf."""
    from .numerics.nvfp4 import nvfp4_quantize_stacked

    k = xs[0].shape[-1]
    x = torch.cat(xs).view(len(xs) // per_group, -1, k)  # one copy: members back to back, group by group
    if x.device.type == "cpu" or len({tuple(t.shape) for t in xs}) > 1:
        amax = torch.stack([kernels.abs_max(t).float() for t in xs])
    else:  # one reduction over the stack, no |x| copy
        lo, hi = torch.aminmax(x.view(len(xs), -1), dim=1)
        amax = torch.maximum(lo.abs(), hi.abs()).float()
    if check:
        bad = ~torch.isfinite(amax)
        if bool(bad.any()):
            raise non_finite_error(names[int(bad.nonzero()[0, 0])])
    g = amax.view(-1, per_group).amax(dim=1)
    packed, scale, scale_2 = nvfp4_quantize_stacked(x, g, recipe, kernels.workers(), stacked_fn)
    return packed, scale, scale_2, g


def nvfp4_stack_job(jobs: list[Job], dialect: str, opts: ConvertOptions, check: bool) -> Job:
    """One job for NVFP4 group jobs (:func:`nvfp4_group_job`) whose members have the same shapes
    and dtype, in the same order, with one K (a layer's experts: the gate/up pairs, or the downs;
    or a single group), quantized as a stack (:func:`quantize_nvfp4_stacked`); each output is what
    its own job gives, byte for byte. Every output is on ``opts.device``, the input scales too
    (copied there once, here), so that a refit copies a group's outputs back as one run. The
    outputs are tiles of four stacks (:class:`Stacked`): packed ``[G, R, K/2]`` and block scales
    ``[G, R, K/16]`` (member ``m`` of group ``i`` is rows ``starts[m]:starts[m+1]`` of item ``i``),
    the global scales ``[G]`` (``scale_2``, or its encoding) and the input scales ``[C]``."""
    device = opts.device
    stacked_fn = kernels.stacked_blocks_fn("nvfp4", device)
    names = [n for j in jobs for n in j.sources]
    per_group = len(jobs[0].sources)
    rows = [jobs[0].nvfp4.outs[n][0].shape[0] for n in jobs[0].sources]
    starts = [sum(rows[:m]) for m in range(per_group + 1)]
    const_of = {n: i for i, n in enumerate(n for j in jobs for n in j.sources if n in j.nvfp4.input_scale)}
    consts = (
        torch.cat([j.nvfp4.input_scale[n].reshape(1) for j in jobs for n in j.sources if n in const_of]).to(device)
        if const_of
        else None
    )
    first = jobs[0].nvfp4.outs[jobs[0].sources[0]]
    g_n, r_n = len(jobs), starts[-1]
    stacks = [
        (first[0].dtype, (g_n, r_n, first[0].shape[-1])),
        (first[1].dtype, (g_n, r_n, first[1].shape[-1])),
        (first[2].dtype, (g_n,)),
    ]
    if consts is not None:
        stacks.append((consts.dtype, tuple(consts.shape)))
    tiles = []
    for i, j in enumerate(jobs):
        for m, n in enumerate(j.sources):
            outs = j.nvfp4.outs[n]
            for k, o in enumerate(outs[:2]):
                row = out_nbytes(o) // rows[m]
                tiles.append((k, (i * r_n + starts[m]) * row))
            tiles.append((2, i * out_nbytes(outs[2])))
            if len(outs) > 3:
                tiles.append((3, const_of[n] * out_nbytes(outs[3])))
    outputs = [o for j in jobs for o in j.outputs]
    if [o.name for o in outputs] != [o.name for j in jobs for n in j.sources for o in j.nvfp4.outs[n]]:
        raise AssertionError(f"{names[0]}: an NVFP4 group job's outputs are not its members' in order")

    def stack_fn(src):
        xs = [src[n].to(device, non_blocking=True) if device != "cpu" else src[n] for n in names]
        packed, scale, scale_2, g = quantize_nvfp4_stacked(names, xs, per_group, check, opts.recipe, stacked_fn)
        glob = scale_2 if dialect == "modelopt" else encode_global_scale_tensor(g, opts.recipe)
        return [packed, scale, glob] + ([consts] if consts is not None else [])

    st = _stacked(outputs, stack_fn, stacks, tiles)
    return Job(
        names,
        outputs,
        lambda src: stacked_outputs(st, outputs, stack_fn(src)),
        "nvfp4",
        device_input=device != "cpu",
        stacked=st,
    )


def mxfp8_stack_job(jobs: list[Job], device: str, check: bool) -> Job:
    """One job for plain MXFP8 jobs (:func:`mxfp8_job`) whose sources share a shape, quantized as a
    stack (:func:`quantize_mxfp8_stacked`); each output is what its own job gives, byte for byte:
    tiles of two stacks (:class:`Stacked`), the data ``[N, R, K]`` and the scales ``[N, R, K/32]``."""
    blocks_fn = kernels.blocks_fn("mxfp8", device)
    names = [j.sources[0] for j in jobs]
    outputs = [o for j in jobs for o in j.outputs]
    q0, s0 = jobs[0].outputs
    stacks = [(q0.dtype, (len(jobs), *q0.shape)), (s0.dtype, (len(jobs), *s0.shape))]
    tiles = [(k, i * out_nbytes(o)) for i, j in enumerate(jobs) for k, o in enumerate(j.outputs)]

    def stack_fn(src):
        xs = [src[n].to(device, non_blocking=True) if device != "cpu" else src[n] for n in names]
        return list(quantize_mxfp8_stacked(names, xs, check, blocks_fn))

    st = _stacked(outputs, stack_fn, stacks, tiles)
    return Job(
        names,
        outputs,
        lambda src: stacked_outputs(st, outputs, stack_fn(src)),
        "mxfp8",
        device_input=device != "cpu",
        stacked=st,
    )


def keep_job(name: str, dtype: torch.dtype, shape: tuple, check: bool) -> Job:
    def fn(src):
        t = src[name]
        if check:
            check_finite(name, t)
        return {name: t}

    return Job([name], [dialects.OutTensor(name, dtype, tuple(shape), "bf16")], fn, "bf16")


def mxfp8_job(tp, dialect: str, device: str, check: bool) -> Job:
    outs = dialects.mxfp8_out_tensors(tp.module, tp.shape, dialect)
    blocks_fn = kernels.blocks_fn("mxfp8", device)

    def fn(src):
        x = src[tp.name]
        if device != "cpu":
            x = x.to(device, non_blocking=True)
        q, s = quantize_mxfp8(tp.name, x, check, blocks_fn)
        return {outs[0].name: q, outs[1].name: s}  # the writer thread copies device tensors back

    return Job([tp.name], outs, fn, "mxfp8", device_input=device != "cpu")


def nvfp4_group_job(members, dialect: str, opts: ConvertOptions, input_scales: dict | None, check: bool) -> Job:
    """One job per fused group: members share one global scale (max amax over the group)."""
    outs_of = {tp.name: dialects.nvfp4_out_tensors(tp.module, tp.shape, dialect, opts.input_mode) for tp in members}
    device = opts.device
    blocks_fn = kernels.blocks_fn("nvfp4", device)

    inputs = {}  # the input-scale outputs: decode convention (modelopt) or its reciprocal
    for n, outs in outs_of.items():
        if len(outs) > 3:
            dec = input_scales[n[: -len(".weight")]] if input_scales is not None else torch.tensor(1.0)
            inputs[n] = dec.reshape(()) if dialect == "modelopt" else (1.0 / dec).reshape(1)

    def fn(src):
        xs = {n: (src[n].to(device, non_blocking=True) if device != "cpu" else src[n]) for n in outs_of}
        g, quantized = quantize_nvfp4_group(xs, check, opts.recipe, blocks_fn)
        result = {}
        for n, (packed, scale, scale_2) in quantized.items():
            outs = outs_of[n]
            result[outs[0].name] = packed  # the writer thread copies device tensors back
            result[outs[1].name] = scale
            if dialect == "modelopt":
                result[outs[2].name] = scale_2.reshape(())  # the writer copies device tensors back
            elif isinstance(g, torch.Tensor) and g.device.type != "cpu":  # no host sync per group
                result[outs[2].name] = encode_global_scale_tensor(g, opts.recipe)
            else:
                # encode convention: S_enc = 2688/g (1536/g for 4over6), fp32, clamped at FLT_MAX
                result[outs[2].name] = torch.tensor([encode_global_scale(g, opts.recipe)], dtype=torch.float32)
            if len(outs) > 3:
                result[outs[3].name] = inputs[n]
        return result

    return Job(
        [tp.name for tp in members],
        [o for tp in members for o in outs_of[tp.name]],
        fn,
        "nvfp4",
        device_input=device != "cpu",
        nvfp4=Nvfp4Parts(outs_of, inputs),
    )


def load_input_scales(path: str, modules: list[str]) -> dict[str, torch.Tensor]:
    """Calibrated activation scales (decode convention) from an existing NVFP4 checkpoint."""
    root = Path(path).expanduser()
    if not root.is_dir() or not any(root.glob("*.safetensors")):
        raise CheckpointError(
            f"{root}: --input-scales-from needs a directory with an NVFP4 checkpoint's .safetensors files"
        )
    from .checkpoint import open_checkpoint

    found: dict[str, torch.Tensor] = {}
    for h in open_checkpoint(root, strict=False, require_config=False).shards:  # guarded, headers validated
        f = h.path
        names = [n for n in h.entries if n.endswith((".input_scale", ".input_global_scale"))]
        if not names:
            continue
        with ShardReader(h, hash_file=False) as r:
            for n in names:
                e = h.entries[n]
                if e.dtype not in ("F32", "BF16", "F16") or len(e.shape) > 1 or (e.shape and e.shape[0] != 1):
                    raise CheckpointError(
                        f"{f}: tensor {n!r} has dtype {e.dtype} shape {list(e.shape)}; expected a scalar fp32 input scale"
                    )
                v = r.read(n).float().reshape(())
                if n.endswith(".input_global_scale"):
                    mod, v = n[: -len(".input_global_scale")], 1.0 / v
                else:
                    mod = n[: -len(".input_scale")]
                if not bool(torch.isfinite(v)) or not bool(v > 0):
                    raise CheckpointError(f"{f}: input scale {n!r} is {v.item()}; expected a finite positive value")
                found[mod] = v
    if not found:
        raise CheckpointError(
            f"{root}: holds no input_scale / input_global_scale tensors; it is not a W4A4 NVFP4 checkpoint"
        )
    missing = [m for m in modules if m not in found]
    if missing:
        raise CheckpointError(
            f"{root}: no input scale for {missing[0]!r} ({len(missing)} of {len(modules)} modules missing); "
            "the checkpoints differ in architecture or exclusions"
        )
    return {m: found[m] for m in modules}


def build_jobs(plan: Plan, scheme: str, dialect: str, opts: ConvertOptions) -> BuiltJobs:
    """The jobs of ``plan``: every tensor of the plan's inventory (its dtype tag and shape are all
    a job needs, so a checkpoint's header or a trainer's tensor list serve alike), one job per
    output group. ``scheme`` is ``opts.scheme``."""
    from .safetensors_io import DTYPES

    jobs = []
    check = not opts.allow_non_finite
    input_scales = None
    if scheme == "nvfp4":
        if opts.input_mode not in NVFP4_INPUT_MODES:
            raise QConvertError(f"unknown input-scale mode {opts.input_mode!r}")
        if opts.input_mode == "copied":
            if not opts.input_scales_from:
                raise QConvertError("input mode 'copied' needs --input-scales-from CKPT")
            input_scales = load_input_scales(opts.input_scales_from, [t.module for t in plan.quantized])
    groups: dict[str, list] = {}
    in_layout: set[str] = set()
    layout_layers: dict[str, str] = {}
    if opts.layout:
        if opts.layout != "flashinfer-trtllm":
            raise QConvertError(f"unknown layout {opts.layout!r}; the only layout is flashinfer-trtllm")
        layers = expert_layers(plan)
        if not layers:
            raise QConvertError("--layout flashinfer-trtllm: this model has no MoE experts to pre-shuffle")
        for prefix, members in layers.items():
            acts = {t.action for t in members}
            lscheme = scheme if acts == {QUANTIZE} else "bf16"
            layout_layers[prefix] = lscheme
            jobs.append(moe_layer_job(prefix, members, lscheme, opts.engine, opts.tp, opts.ep, opts, input_scales))
            in_layout |= {t.name for t in members}
    for name, tp in plan.tensors.items():
        if name in in_layout:
            continue
        if tp.action == KEEP:
            jobs.append(keep_job(name, DTYPES[tp.dtype][0], tp.shape, check))
        elif scheme == "mxfp8":
            jobs.append(mxfp8_job(tp, dialect, opts.device, check))
        elif scheme == "nvfp4":
            if tp.group:
                groups.setdefault(tp.group, []).append(tp)
            else:
                jobs.append(nvfp4_group_job([tp], dialect, opts, input_scales, check))
        else:
            raise QConvertError(f"scheme {scheme!r} is not implemented in this version")
    for members in groups.values():
        jobs.append(nvfp4_group_job(members, dialect, opts, input_scales, check))
    return BuiltJobs(jobs, layout_layers)


def out_nbytes(o: dialects.OutTensor) -> int:
    n = 1
    for d in o.shape:
        n *= d
    return n * o.dtype.itemsize  # (a torch.tensor([]) per output cost 16 us: 0.4 s per 8-layer model)


def plan_rows(ckpt: Checkpoint, plan: Plan, jobs: list[Job]) -> list[PlanRow]:
    from .safetensors_io import DTYPES

    entries = ckpt.tensors

    def nbytes(s):  # a per-expert view of a fused tensor (fused.py) is not in the checkpoint
        if s in entries:
            return entries[s].nbytes
        t = plan.tensors[s]
        return int(np.prod(t.shape)) * DTYPES[t.dtype][0].itemsize

    rows = []
    for j in (part for job in jobs for part in (job.parts or [job])):
        # a decoded MXFP4 pair (decode.py) is planned under its output's name, not its sources'
        tp = plan.tensors.get(j.sources[0]) or plan.tensors[j.outputs[0].name]
        rows.append(
            PlanRow(
                tp.module or tp.name,
                tp.action,
                j.fmt,
                tp.shape,
                sum(nbytes(s) for s in j.sources),
                sum(out_nbytes(o) for o in j.outputs),
                tp.reason,
                tuple(j.sources),
            )
        )
    return rows


def source_for_outputs(j: Job) -> list[str]:
    """Source name per output: outputs named after a source module stay in that source's shard."""
    out = []
    for o in j.outputs:
        best = j.sources[0]
        for s in j.sources:
            mod = s[: -len(".weight")] if s.endswith(".weight") else s
            if o.name == s or o.name.startswith(mod + "."):
                best = s
                break
        out.append(best)
    return out


def moe_layer_job(
    prefix: str, members: list, scheme: str, engine: str, tp: int, ep: int, opts, input_scales: dict | None
) -> Job:
    """A pipeline Job for one MoE layer. ``scheme`` is this layer's format (bf16 for kept layers)."""
    experts: dict[int, dict[str, object]] = {}
    for t in members:
        m = EXPERT_NAME.match(t.name)
        experts.setdefault(int(m.group("e")), {})[m.group("proj")] = t
    n_exp = len(experts)
    if sorted(experts) != list(range(n_exp)) or any(len(v) != 3 for v in experts.values()):
        raise CheckpointError(f"{prefix}: experts are not numbered 0..{n_exp - 1} with gate/up/down each")
    i, h = experts[0]["gate_proj"].shape
    w4a4 = scheme == "nvfp4"
    if scheme == "nvfp4" and opts.input_mode == "weight-only":
        raise QConvertError(
            "--layout flashinfer-trtllm with NVFP4 needs activation scales (the TRT-LLM NVFP4 MoE "
            "kernels are W4A4): add --input-scale unit or --input-scales-from CKPT"
        )
    trtllm.check_parallel_sizes(tp, ep)
    try:
        specs = rank_specs(scheme, engine, n_exp, i, h, tp, ep, w4a4)
    except trtllm.LayoutError as e:
        msg = str(e)
        if "--tp" not in msg and (tp > 1 or ep > 1):
            msg += f" (with --tp {tp} --ep {ep}: try a smaller --tp)"
        raise trtllm.LayoutError(f"{prefix}: {msg}") from None
    if sorted(specs) != [(r, q) for r in range(tp) for q in range(ep)] or not all(specs.values()):
        # every rank, each with tensors: the layer's experts are replaced by these outputs only
        raise trtllm.LayoutError(
            f"{prefix}: internal: ranks {sorted(specs)} for --tp {tp} --ep {ep}; no expert tensor may be dropped"
        )
    outputs = []
    for (r, q), params in specs.items():
        tag = rank_tag(r, q, tp, ep)
        for name, dtype, shape in params:
            outputs.append(dialects.OutTensor(f"{prefix}.{tag}.{name}", dtype, shape, "layout"))
    order = [experts[e][p].name for e in range(n_exp) for p in ("gate_proj", "up_proj", "down_proj")]
    check = not opts.allow_non_finite
    device = opts.device
    blocks_fn = kernels.blocks_fn(scheme, device) if scheme != "bf16" else None
    per_rank = n_exp // ep
    # NVFP4's per-rank scalars (a max over the rank's experts); every other output is per expert
    scalars = (
        set(trtllm.nvfp4_scalars(engine, torch.ones(1, 2), torch.ones(1), torch.ones(1, 2), torch.ones(1)))
        if scheme == "nvfp4"
        else set()
    )

    stacked_fn = kernels.stacked_blocks_fn(scheme, device) if scheme == "nvfp4" else None
    a13_all = a2_all = None
    if scheme == "nvfp4":  # the activation scales (decode convention), on the job's device once
        if input_scales is not None:
            a13_all = torch.stack(
                [
                    torch.stack([input_scales[experts[e][p].module] for p in ("gate_proj", "up_proj")])
                    for e in range(n_exp)
                ]
            )
            a2_all = torch.stack([input_scales[experts[e]["down_proj"].module] for e in range(n_exp)])
        else:
            a13_all, a2_all = torch.ones(n_exp, 2), torch.ones(n_exp)
        a13_all, a2_all = a13_all.to(device), a2_all.to(device)

    def get(src, e, p):
        x = src[experts[e][p].name]
        return x.to(device, non_blocking=True) if device != "cpu" else x

    def stack13(pairs):
        return torch.stack([torch.cat([a, b]) for a, b in pairs])

    def plain_of(src, es: range) -> dict[str, torch.Tensor]:
        """The plain stacked tensors of experts ``es``. Each expert matrix is checked and quantized
        alone, by the helpers every job uses (same kernels, threads and NaN/Inf checks as the plain
        jobs), then stacked: quantization is row-local, so quantize(cat(gate, up)) ==
        cat(quantize(gate), quantize(up)) byte for byte."""
        if scheme == "bf16":
            if check:
                for e in es:
                    for p in ("gate_proj", "up_proj", "down_proj"):
                        check_finite(experts[e][p].name, src[experts[e][p].name])
            return {
                "w13_weight": stack13([(get(src, e, "gate_proj"), get(src, e, "up_proj")) for e in es]),
                "w2_weight": torch.stack([get(src, e, "down_proj") for e in es]),
            }
        if scheme == "mxfp8" and device in STACKED_DEVICES:  # one launch per projection, not per expert
            st = {
                p: quantize_mxfp8_stacked(
                    [experts[e][p].name for e in es], [get(src, e, p) for e in es], check, blocks_fn
                )
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            return {
                "w13_weight": torch.cat([st["gate_proj"][0], st["up_proj"][0]], dim=1),
                "w13_weight_scale": torch.cat([st["gate_proj"][1], st["up_proj"][1]], dim=1),
                "w2_weight": st["down_proj"][0],
                "w2_weight_scale": st["down_proj"][1],
            }
        if scheme == "mxfp8":
            q = {
                (e, p): quantize_mxfp8(experts[e][p].name, get(src, e, p), check, blocks_fn)
                for e in es
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            return {
                "w13_weight": stack13([(q[e, "gate_proj"][0], q[e, "up_proj"][0]) for e in es]),
                "w13_weight_scale": stack13([(q[e, "gate_proj"][1], q[e, "up_proj"][1]) for e in es]),
                "w2_weight": torch.stack([q[e, "down_proj"][0] for e in es]),
                "w2_weight_scale": torch.stack([q[e, "down_proj"][1] for e in es]),
            }
        if device in STACKED_DEVICES:  # one launch per projection kind, not per expert
            n13 = [experts[e][p].name for e in es for p in ("gate_proj", "up_proj")]
            p13, s13, ws13, _ = quantize_nvfp4_stacked(
                n13, [src[n].to(device, non_blocking=True) for n in n13], 2, check, opts.recipe, stacked_fn
            )  # gate and up of each expert share one global scale: one group, gate's rows first
            n2 = [experts[e]["down_proj"].name for e in es]
            p2, s2, ws2, _ = quantize_nvfp4_stacked(
                n2, [src[n].to(device, non_blocking=True) for n in n2], 1, check, opts.recipe, stacked_fn
            )
            return {
                "w13_weight": p13,
                "w13_weight_scale": s13,
                "w13_weight_scale_2": torch.stack([ws13, ws13], dim=1),
                "w2_weight": p2,
                "w2_weight_scale": s2,
                "w2_weight_scale_2": ws2,
                "w13_input_scale": a13_all[es.start : es.stop],
                "w2_input_scale": a2_all[es.start : es.stop],
            }
        p13, s13, ws13, p2, s2, ws2 = [], [], [], [], [], []
        for e in es:  # gate and up of each expert share one global scale
            gate, up, down = (experts[e][p].name for p in ("gate_proj", "up_proj", "down_proj"))
            _, qgu = quantize_nvfp4_group(
                {gate: get(src, e, "gate_proj"), up: get(src, e, "up_proj")}, check, opts.recipe, blocks_fn
            )
            p13.append(torch.cat([qgu[gate][0], qgu[up][0]]))
            s13.append(torch.cat([qgu[gate][1], qgu[up][1]]))
            ws13.append(qgu[gate][2])
            _, qd = quantize_nvfp4_group({down: get(src, e, "down_proj")}, check, opts.recipe, blocks_fn)
            p2.append(qd[down][0]), s2.append(qd[down][1]), ws2.append(qd[down][2])
        ws13_t = torch.stack(ws13).to(device)  # 0-dim fp32 on the CPU where the C kernels ran
        return {
            "w13_weight": torch.stack(p13),
            "w13_weight_scale": torch.stack(s13),
            "w13_weight_scale_2": torch.stack([ws13_t, ws13_t], dim=1),
            "w2_weight": torch.stack(p2),
            "w2_weight_scale": torch.stack(s2),
            "w2_weight_scale_2": torch.stack(ws2).to(device),
            "w13_input_scale": a13_all[es.start : es.stop],
            "w2_input_scale": a2_all[es.start : es.stop],
        }

    def fn(src):
        # Experts are laid out chunk by chunk (the layout moves rows within each expert; only
        # NVFP4's scalars span a rank's experts), each chunk into its slice of the outputs, the
        # chunks side by side on all cores (CPU), as the plain jobs run one per core.
        # on the job's device: a GPU job's outputs leave it once, whole (the writer / refit copy)
        out = {
            rq: {
                name: torch.empty(shape, dtype=dtype, device=device)
                for name, dtype, shape in params
                if name not in scalars
            }
            for rq, params in specs.items()
        }
        per_expert = (
            {
                "w13_weight_scale_2": (n_exp, 2),
                "w2_weight_scale_2": (n_exp,),
                "w13_input_scale": (n_exp, 2),
                "w2_input_scale": (n_exp,),
            }
            if scalars
            else {}
        )
        # on the job's device: the per-rank scalars are computed there (no device-to-host copy and
        # sync per chunk; every operation of trtllm.nvfp4_scalars is IEEE fp32 on both)
        nv = {k: torch.empty(shape, dtype=torch.float32, device=device) for k, shape in per_expert.items()}

        def chunk(c0: int, c1: int):
            q, base = c0 // per_rank, (c0 // per_rank) * per_rank
            plain = plain_of(src, range(c0, c1))
            for k in nv:
                nv[k][c0:c1].copy_(plain[k])
            for (r, _), params in trtllm.transform_moe_layer(plain, scheme, engine, tp=tp, ep=1).items():
                for name, t in params.items():
                    if name not in scalars:
                        out[(r, q)][name][c0 - base : c1 - base].copy_(t)

        parallel = device == "cpu" and kernels.workers() > 1
        size = max(1, -(-n_exp // (2 * kernels.workers()))) if parallel else per_rank
        run_all(
            chunk,
            [
                (c0, min(c0 + size, q * per_rank + per_rank))
                for q in range(ep)
                for c0 in range(q * per_rank, (q + 1) * per_rank, size)
            ],
            parallel,
        )
        for r, q in out:
            if scalars:
                e0, e1 = q * per_rank, (q + 1) * per_rank
                out[(r, q)].update(trtllm.nvfp4_scalars(engine, *(nv[k][e0:e1] for k in per_expert)))
        return {
            f"{prefix}.{rank_tag(r, q, tp, ep)}.{name}": t.contiguous()
            for (r, q), params in out.items()
            for name, t in params.items()
        }

    return Job(order, outputs, fn, f"{scheme}+trtllm")


def run_all(fn, args: list[tuple], parallel: bool) -> None:
    """``fn(*a)`` for each ``a`` of ``args``: here one after the other, or with ``parallel`` on
    one thread per core (kernels.workers), each quantizing single-threaded, as job threads do.
    The first exception (in ``args`` order) is raised once every started call has ended."""
    if not parallel or len(args) < 2:
        for a in args:
            fn(*a)
        return
    pool = ThreadPoolExecutor(
        min(kernels.workers(), len(args)),
        thread_name_prefix="qconvert-layout",
        initializer=kernels.single_threaded_job_thread,
    )
    try:
        futures = [pool.submit(fn, *a) for a in args]
        for f in futures:
            f.result()
    finally:
        kernels.settle([lambda: pool.shutdown(wait=True, cancel_futures=True)])
