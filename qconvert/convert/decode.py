"""Quantized checkpoints decoded to BF16: ``qconvert bf16 SRC DST`` (no ``--layout``) of an MXFP4
(gpt-oss) or FP8 block-scaled source (docs/formats.md#quantized-sources-decoded-to-bf16).

Every quantized tensor is decoded in fp32 (the engines' and transformers' value) and rounded to
BF16 once; every other tensor is copied as it is. The output is the source architecture's BF16
checkpoint: the same tensor names for FP8 weights, and for an MXFP4 pair ``…experts.gate_up_proj``
[E, H, 2I] / ``…experts.down_proj`` [E, I, H] (transformers' dequantize orientation,
docs/formats.md#mxfp4-sources); config.json loses ``quantization_config`` (metadata.output_config).

Each decoded tensor records how many of its elements BF16 does not hold exactly (``rounded``
elements, counted by its job; for shards a ``--resume`` kept, counted again at the end): MXFP4 is
exact wherever it decodes to a finite value (computed in BF16, 0 by construction; ``verify``
re-derives it from the fp32 decode), an FP8 block's product is exact where its scale is a
power of two and otherwise often is not. The manifest's ``source.quantized`` says so per tensor.

Here: :func:`prepare` (the plan and the jobs, shard by shard through the converter's
:class:`~qconvert.convert.runner.Runner`), :class:`DecodedSource` (what the manifest, the summary
and ``verify`` are told), :func:`source_of` (which decode a checkpoint needs, for ``verify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PlanError
from ..formats.dialects import OutTensor
from . import fp8_source, kernels, mxfp4_source
from .architectures import arch_of, num_layers
from .jobs import BuiltJobs, Job, check_finite, keep_job
from .numerics import fp8_block
from .plan import KEEP, Plan, Reason, TensorPlan, classify, natural_key

#: per-tensor path codes (manifest ``source.quantized.tensor_paths``), and what they mean
PATHS = {
    "exact": "decoded in fp32; BF16 holds every value, so the tensor is the source's decode bit for bit",
    "rounded": "decoded in fp32 and rounded to BF16 (nearest even): rounded_elements values differ from the "
    "fp32 decode",
}
#: the MXFP4 form qconvert decodes (the one formats/detect.py names gpt-oss)
GPT_OSS = "gpt-oss"


@dataclass
class DecodedSource:
    """A quantized source as ``qconvert bf16`` decodes it."""

    kind: str  # mxfp4_source.KIND | fp8_source.KIND
    form: str  # GPT_OSS | fp8_source.DEEPSEEK | fp8_source.COMPRESSED_TENSORS
    #: output tensor -> the source tensors it decodes ([blocks, scales] or [weight, scale])
    decoded: dict[str, list[str]]
    block: tuple[int, int] | None = None  # FP8 block sources: the declared block
    #: output tensor -> elements whose BF16 differs from the fp32 decode (filled by the jobs, then :meth:`finish`)
    rounded: dict[str, int] = field(default_factory=dict)
    #: module -> path code, for the manifest's ``tensors.<module>.source_path`` (FP8 weights)
    paths: dict[str, str] = field(default_factory=dict)

    def decode(self, name: str, src: dict[str, torch.Tensor], check: bool) -> torch.Tensor:
        """The BF16 of output tensor ``name`` from its source tensors ``src``; records its rounded count."""
        a, b = self.decoded[name]
        if self.kind == mxfp4_source.KIND:
            out, n = mxfp4_source.decode_bf16(name, src[a], src[b], kernels.workers())
        else:
            x = fp8_block.dequantize(src[a], fp8_source.checked_scale(b, src[b]), self.block)
            out = x.to(torch.bfloat16)
            n = int((out.float().view(torch.int32) != x.view(torch.int32)).sum())
        if check:
            check_finite(name, out)
        self.rounded[name] = n
        return out

    def finish(self, read) -> list[str]:
        """Counts the tensors whose jobs did not run (a resumed shard) from the source
        (``read(name)`` reads a source tensor), fills :attr:`paths`, and returns the summary's notes."""
        for name, srcs in self.decoded.items():
            if name not in self.rounded:
                self.decode(name, {s: read(s) for s in srcs}, check=False)
        for name in self.decoded:
            if name.endswith(".weight"):
                self.paths[name[: -len(".weight")]] = self.code(name)
        exact = sum(1 for n in self.decoded if not self.rounded[n])
        notes = [f"decoded: {exact} of {len(self.decoded)} tensors exactly (BF16 holds every decoded value)"]
        if exact < len(self.decoded):
            total = sum(self.rounded.values())
            notes.append(
                f"decoded: {len(self.decoded) - exact} tensors rounded to BF16 ({total} values differ from the fp32 "
                "decode; the manifest's source.quantized.rounded_elements lists them)"
            )
        return notes

    def code(self, name: str) -> str:
        return "rounded" if self.rounded.get(name) else "exact"

    def label(self) -> str:
        if self.kind == mxfp4_source.KIND:
            return "MXFP4 (gpt-oss *_blocks/*_scales)"
        return f"FP8 block-scaled ({fp8_source.form_label(self.form, list(self.block))})"

    def manifest(self) -> dict:
        out = {"kind": self.kind, "form": self.form, "decoded_to": "bf16"}
        if self.block is not None:
            out["weight_block_size"] = list(self.block)
        out["lossless"] = all(not self.rounded.get(n) for n in self.decoded)
        out["tensor_paths"] = {n: self.code(n) for n in self.decoded}
        out["rounded_elements"] = {n: v for n, v in self.rounded.items() if v}
        out["path_codes"] = dict(PATHS)
        return out


def source_of(config: dict, inventory: dict, where) -> tuple[DecodedSource | None, dict]:
    """``(source, logical inventory)``: the decode a checkpoint with ``config`` and ``inventory``
    (name -> (dtype tag, shape)) needs and the tensors it decodes to; ``(None, inventory)`` for a
    checkpoint that declares no quantization. Refuses bad pairs and scales naming the tensor."""
    mx = mxfp4_source.detect(config, inventory, where)
    if mx is not None:
        logical = mx.logical_inventory(inventory)
        return DecodedSource(mxfp4_source.KIND, GPT_OSS, {b: list(p) for b, p in mx.pairs.items()}), logical
    fp = fp8_source.detect(config, inventory, where)
    if fp is None:
        return None, inventory
    src = DecodedSource(fp8_source.KIND, fp.form, {w: [w, s] for w, s in fp.scales.items()}, tuple(fp.block))
    return src, fp.logical_inventory(inventory)


def prepare(ckpt, opts) -> tuple[Plan, BuiltJobs]:
    """The plan and jobs of ``qconvert bf16 SRC DST`` for a quantized ``ckpt``: one job per output
    tensor (a decode, or a copy), so memory follows the largest tensor."""
    from .safetensors_io import DTYPES

    inventory = {n: (e.dtype, e.shape) for n, e in ckpt.tensors.items()}
    source, logical = source_of(ckpt.config, inventory, ckpt.root / "config.json")
    if source is None:
        raise PlanError(
            f"{ckpt.root}: a BF16 checkpoint (no quantization_config): qconvert bf16 decodes quantized "
            "checkpoints (MXFP4, FP8 block-scaled) and re-lays out a BF16 one's experts with --layout "
            "flashinfer-trtllm; pass --layout, or use qconvert mxfp8/nvfp4"
        )
    what = "MXFP4" if source.kind == mxfp4_source.KIND else "FP8 blocks"
    check = not opts.allow_non_finite
    arch_name, arch = arch_of(ckpt.config)
    tensors: dict[str, TensorPlan] = {}
    jobs = []
    for name in sorted(logical, key=natural_key):
        tag, shape = logical[name]
        shape = tuple(shape)
        kind, module, layer = classify(name, shape)
        t = TensorPlan(name, tag, shape, KEEP, "", module, layer, kind)
        if name in source.decoded:
            t.decide(KEEP, Reason.DECODED, what=what)
            jobs.append(_decode_job(source, name, shape, check))
        else:
            t.decide(KEEP, Reason.SOURCE_FLOAT)
            jobs.append(keep_job(name, DTYPES[tag][0], shape, check))
        tensors[name] = t
    notes = [
        f"source: {source.label()}; {len(source.decoded)} tensors decoded to BF16, {len(tensors) - len(source.decoded)} "
        "copied as they are"
    ]
    plan = Plan(opts.plan, arch_name, arch, num_layers(ckpt.config), tensors, [], [], notes)
    return plan, BuiltJobs(jobs, source=source)


def _decode_job(source: DecodedSource, name: str, shape: tuple, check: bool) -> Job:
    def fn(src):
        return {name: source.decode(name, src, check)}

    return Job(list(source.decoded[name]), [OutTensor(name, torch.bfloat16, shape, "bf16")], fn, "bf16")


def logical_entries(entries: dict, logical: dict) -> dict:
    """A checkpoint's tensor entries (name -> entry with ``dtype``, ``shape``, ``nbytes``) with each
    MXFP4 pair replaced by an entry of the BF16 tensor it decodes to (``logical``, from
    :func:`source_of`); for ``verify``."""
    from types import SimpleNamespace

    out = {}
    for n, (tag, shape) in logical.items():
        if n in entries:
            out[n] = entries[n]
        else:
            k = 1
            for d in shape:
                k *= d
            out[n] = SimpleNamespace(name=n, dtype=tag, shape=tuple(shape), nbytes=2 * k)
    return out


def read_decoded(source: DecodedSource, name: str, read) -> torch.Tensor:
    """The fp32 decode of output tensor ``name`` (``read(n)`` reads a source tensor): what the
    BF16 output must round to, and equal where it is ``exact``."""
    a, b = source.decoded[name]
    if source.kind == mxfp4_source.KIND:
        return mxfp4_source.decode_fp32(name, read(a), read(b))
    return fp8_block.dequantize(read(a), fp8_source.checked_scale(b, read(b)), source.block)


def summarize(quantized: dict | None) -> str | None:
    """One line from a manifest's ``source.quantized`` (inspect and the model card say it): a decoded
    source's counts here, an FP8 conversion's through :func:`fp8_source.summarize`."""
    if not isinstance(quantized, dict) or quantized.get("decoded_to") != "bf16":
        return fp8_source.summarize(quantized)
    paths = quantized.get("tensor_paths") or {}
    n = len(paths)
    exact = sum(1 for v in paths.values() if v == "exact")
    kind = quantized.get("kind")
    if kind == mxfp4_source.KIND:
        what = f"MXFP4 ({quantized.get('form')})"
    else:
        what = f"FP8 block-scaled ({fp8_source.form_label(str(quantized.get('form')), quantized.get('weight_block_size'))})"
    return f"{what}, decoded to BF16: {exact} of {n} tensors exactly, {n - exact} rounded to BF16"
