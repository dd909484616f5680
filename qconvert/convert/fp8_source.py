"""FP8 block-scaled checkpoints as conversion sources (docs/formats.md#fp8-block-sources).

A source whose config.json says ``quantization_config.quant_method: fp8`` with
``weight_block_size: [bn, bk]`` (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8) stores each quantized Linear
as ``X.weight`` F8_E4M3 [N, K] plus ``X.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]. Here:

* :func:`detect` reads the declaration and pairs every FP8 weight with its scale, refusing
  mismatches with one line naming the tensor;
* :meth:`Fp8BlockSource.logical_inventory` is the inventory the planner sees: each FP8 weight as a
  BF16-like float source, its scale gone; the plan is made as for a BF16 checkpoint (a BF16 Linear
  in the same checkpoint is planned and converted as BF16: a mixed checkpoint works by kind);
* :meth:`Fp8BlockSource.wrap_jobs` makes each job read the scales too and hand the job the
  dequantized fp32 weight (BF16 for a weight kept unquantized); a plain MXFP8 job also keeps the
  E4M3 bytes of power-of-two-scale blocks (numerics/fp8_block.py), so those decode exactly to the
  source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from ..formats.dialects import WEIGHT_SCALE_INV
from .numerics import fp8_block

KIND = "fp8-block"
SCALE_SUFFIX = WEIGHT_SCALE_INV  # DeepSeek-style block scales (docs/formats.md#fp8-block-sources)
SCALE_TAGS = ("F32", "BF16", "F16")
#: per-tensor path codes (manifest ``source.quantized.tensor_paths``), and what they mean
PATHS = {
    "lossless": "every block's E4M3 bytes kept (power-of-two scales): decodes exactly to the source",
    "lossless-partial": "power-of-two blocks' E4M3 bytes kept, the other blocks requantized",
    "lossless-rceil": "power-of-two scales, quantized with RCEIL (a kernel layout): decodes exactly to the source",
    "requantized": "quantized from the fp32 decode",
    "bf16-decode": "kept unquantized: the BF16 of the fp32 decode",
    "bf16-source": "BF16 in the source (a mixed checkpoint), quantized from its own values",
}
#: codes under which the conversion kept the source's E4M3 bytes (verify re-makes them so)
BYTES_KEPT = ("lossless", "lossless-partial")


@dataclass
class Fp8BlockSource:
    block: tuple[int, int]
    #: FP8 weight name -> its scale tensor name
    scales: dict[str, str]
    #: Linear weights of the checkpoint that are not FP8 (converted as BF16 sources)
    float_weights: list[str] = field(default_factory=list)
    #: filled by :meth:`describe`: module -> path code (:data:`PATHS`)
    paths: dict[str, str] = field(default_factory=dict)
    #: module -> [power-of-two blocks, blocks] for "lossless-partial"
    partial: dict[str, list[int]] = field(default_factory=dict)
    #: FP8 weights whose plain MXFP8 job keeps the E4M3 bytes (set by :meth:`wrap_jobs`)
    bytes_kept: set = field(default_factory=set)

    @property
    def lossless_mxfp8(self) -> bool:
        """Power-of-two blocks keep their bytes only where a block row holds whole 1x32 blocks."""
        return self.block[1] % fp8_block.MXFP8_BLOCK == 0

    def logical_inventory(self, inventory: dict) -> dict:
        scale_names = set(self.scales.values())
        return {
            n: (("BF16", shape) if n in self.scales else (tag, shape))
            for n, (tag, shape) in inventory.items()
            if n not in scale_names
        }

    def wrap_jobs(self, jobs: list) -> list:
        return [self._wrap(j) for j in jobs]

    def _wrap(self, job):
        fp8 = [n for n in job.sources if n in self.scales]
        if not fp8:
            return job
        inner, block, scales = job.fn, self.block, self.scales
        plain_mxfp8 = job.fmt == "mxfp8" and len(job.sources) == 1 and len(job.outputs) == 2 and self.lossless_mxfp8
        if plain_mxfp8:
            self.bytes_kept.add(fp8[0])

        def fn(src):
            view = {n: t for n, t in src.items() if n not in scales.values()}
            for n in fp8:
                s = src[scales[n]]
                bad = fp8_block.bad_scale_blocks(s)
                if len(bad):
                    r, c = bad[0].tolist()
                    raise CheckpointError(
                        f"tensor {scales[n]!r}: block [{r}, {c}] scale is {float(s[r, c])!r}; a "
                        "block decode scale must be finite and >= 0: the checkpoint is corrupt, "
                        "re-download it"
                    )
                x = fp8_block.dequantize(src[n], s, block)
                view[n] = x.to(torch.bfloat16) if job.fmt == "bf16" else x
            out = inner(view)
            if plain_mxfp8:
                n = fp8[0]
                q, sc = out[job.outputs[0].name], out[job.outputs[1].name]
                fp8_block.mxfp8_patch_lossless(q, sc, src[n], src[scales[n]], block)
            return out

        # the same job (outputs, format, device, fused parts) reading the scales too
        return dataclasses.replace(job, sources=list(job.sources) + [scales[n] for n in fp8], fn=fn)

    def describe(self, plan, scheme: str, read_scale) -> list[str]:
        """Per-module path (``self.paths``) and the notes the summary and dry-run print.
        ``read_scale(name)`` reads a scale tensor (small: one value per block)."""
        from .plan import QUANTIZE

        lossless = mixed = requant = kept = 0
        for w, sname in self.scales.items():
            t = plan.tensors.get(w)
            if t is None or t.module is None:
                continue
            if t.action != QUANTIZE:
                self.paths[t.module] = "bf16-decode"
                kept += 1
            elif scheme == "mxfp8":
                mask = fp8_block.pow2_blocks(read_scale(sname))
                a, b = int(mask.sum()), mask.numel()
                kept_bytes = w in self.bytes_kept
                if a == b:
                    self.paths[t.module], lossless = ("lossless" if kept_bytes else "lossless-rceil"), lossless + 1
                elif a == 0 or not kept_bytes:
                    self.paths[t.module], requant = "requantized", requant + 1
                else:
                    self.paths[t.module], mixed = "lossless-partial", mixed + 1
                    self.partial[t.module] = [a, b]
            else:
                self.paths[t.module], requant = "requantized", requant + 1
        bf16_linear = 0
        for w in self.float_weights:
            t = plan.tensors.get(w)
            if t is not None and t.module is not None and t.action == QUANTIZE:
                self.paths[t.module] = "bf16-source"
                bf16_linear += 1
        bn, bk = self.block
        notes = [
            f"source: FP8 block-scaled checkpoint (weight_block_size [{bn}, {bk}]); {len(self.scales)} FP8 weights: "
            f"{lossless} lossless (power-of-two block scales: decode exactly), {mixed} partly lossless, "
            f"{requant} requantized from their fp32 decode, {kept} kept as BF16"
        ]
        if bf16_linear:
            notes.append(
                f"source: {bf16_linear} quantized Linear weights are not FP8 in this checkpoint and are "
                "converted from their own values (a mixed checkpoint)"
            )
        return notes

    def manifest(self) -> dict:
        return {
            "kind": KIND,
            "weight_block_size": list(self.block),
            "tensor_paths": dict(self.paths),
            "lossless_blocks": dict(self.partial),
            "path_codes": dict(PATHS),
        }


def scale_reader(ckpt):
    """``read(name)``: one scale tensor of ``ckpt`` (a fresh mapping each time; scales are small)."""
    from .safetensors_io import ShardReader

    shard_of = ckpt.shard_of()

    def read(name: str) -> torch.Tensor:
        with ShardReader(ckpt.shards[shard_of[name]], hash_file=False, mapped=True) as rd:
            return rd.read(name).clone()

    return read


def declared_block(config: dict, where: str = "config.json") -> tuple[int, int] | None:
    """(bn, bk) if config.json declares an FP8 block-scaled checkpoint, None if it declares no
    quantization; raises for a declaration qconvert cannot read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    qm = qc.get("quant_method") if isinstance(qc, dict) else None
    if qm != "fp8":
        raise CheckpointError(
            f"{where}: checkpoint is already quantized (quant_method={qm!r}); qconvert converts "
            "BF16 checkpoints and FP8 block-scaled ones (quant_method fp8 with weight_block_size)"
        )
    bs = qc.get("weight_block_size")
    if bs is None:
        raise CheckpointError(
            f"{where}: checkpoint is already quantized (quant_method='fp8' without "
            "weight_block_size: per-tensor FP8), which qconvert does not read; dequantize it to "
            "BF16 first"
        )
    if not (
        isinstance(bs, list)
        and len(bs) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)
    ):
        raise CheckpointError(
            f"{where}: weight_block_size {bs!r} is not two positive integers; restore the original config.json"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: FP8 format {fmt!r}; qconvert reads E4M3 block-scaled checkpoints only")
    return bs[0], bs[1]


def detect(config: dict, inventory: dict, where: str = "config.json") -> Fp8BlockSource | None:
    """The FP8 block-scaled source in ``inventory`` (name -> (dtype tag, shape)), or None for a
    checkpoint without quantization_config. Every FP8 weight needs a scale of the declared grid."""
    block = declared_block(config, where)
    if block is None:
        return None
    scales: dict[str, str] = {}
    float_weights = []
    for name, (tag, shape) in inventory.items():
        if name.endswith("." + SCALE_SUFFIX):
            w = name[: -len(SCALE_SUFFIX)] + "weight"
            if w not in inventory:
                raise CheckpointError(f"tensor {name!r} has no weight {w!r} beside it; the checkpoint is incomplete")
            continue
        if tag == "F8_E5M2":
            raise CheckpointError(f"tensor {name!r} is F8_E5M2; qconvert reads E4M3 block-scaled weights only")
        if tag != "F8_E4M3":
            if (
                name.endswith(".weight")
                and len(shape) == 2
                and (name[: -len("weight")] + SCALE_SUFFIX) not in inventory
            ):
                float_weights.append(name)
            continue
        sname = name[: -len("weight")] + SCALE_SUFFIX if name.endswith(".weight") else None
        if sname is None or sname not in inventory:
            raise CheckpointError(
                f"tensor {name!r} is FP8 but has no {SCALE_SUFFIX} beside it; the checkpoint is "
                "incomplete or not block-scaled"
            )
        if len(shape) != 2:
            raise CheckpointError(f"tensor {name!r} is FP8 with shape {list(shape)}; block-scaled weights are 2-D")
        stag, sshape = inventory[sname]
        want = fp8_block.scale_grid(shape, block)
        if stag not in SCALE_TAGS:
            raise CheckpointError(f"tensor {sname!r} has dtype {stag}; block scales are F32 (or BF16/F16)")
        if tuple(sshape) != want:
            raise CheckpointError(
                f"tensor {sname!r} has shape {list(sshape)}, but weight {list(shape)} with the "
                f"declared weight_block_size {list(block)} needs {list(want)}: the scales do not "
                "match the declared block size; fix weight_block_size in config.json"
            )
        scales[name] = sname
    if not scales:
        raise CheckpointError(
            f"{where}: declares FP8 block quantization but no tensor is F8_E4M3 with a "
            f"{SCALE_SUFFIX}; restore the original config.json"
        )
    return Fp8BlockSource(block, scales, sorted(float_weights))


class DecodingReader:
    """A source shard reader (``read``/``close``) that returns FP8 block-scaled weights decoded to
    fp32 (their scales may live in other shards: ``readers`` and ``shard_of`` cover all)."""

    def __init__(self, reader, readers: dict, shard_of: dict, source: Fp8BlockSource):
        self._rd, self._all, self._shard_of, self.source = reader, readers, shard_of, source

    def raw(self, name: str) -> torch.Tensor:
        return self._all[self._shard_of[name]]._rd.read(name)

    def read(self, name: str) -> torch.Tensor:
        sname = self.source.scales.get(name)
        if sname is None:
            return self._rd.read(name)
        return fp8_block.dequantize(self._rd.read(name), self.raw(sname), self.source.block)

    def close(self):
        self._rd.close()


def decoding_readers(readers: dict, shard_of: dict, source: Fp8BlockSource | None) -> dict:
    """``readers`` (shard name -> reader) as :class:`DecodingReader` s where ``source`` is an FP8
    block-scaled checkpoint; unchanged otherwise."""
    if source is None:
        return readers
    out: dict = {}
    for k, rd in readers.items():
        out[k] = DecodingReader(rd, out, shard_of, source)
    return out


def mxfp8_reference(source: Fp8BlockSource, name: str, reader: DecodingReader, q: torch.Tensor, s: torch.Tensor):
    """The conversion's MXFP8 bytes of FP8 weight ``name``: ``q, s`` (RCEIL of the decode, patched
    in place) with the power-of-two blocks' source bytes, as the conversion writes them."""
    if source.lossless_mxfp8 and name in source.scales:
        fp8_block.mxfp8_patch_lossless(q, s, reader.raw(name), reader.raw(source.scales[name]), source.block)


def summarize(quantized: dict | None) -> str | None:
    """One line from a manifest's ``source.quantized`` (inspect and the model card say it)."""
    if not isinstance(quantized, dict) or quantized.get("kind") != KIND:
        return None
    paths = quantized.get("tensor_paths") or {}
    count: dict[str, int] = {}
    for v in paths.values():
        key = {"lossless-rceil": "lossless", "lossless-partial": "partly lossless"}.get(str(v), str(v))
        count[key] = count.get(key, 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in sorted(count.items(), key=lambda kv: -kv[1]))
    return f"FP8 block-scaled (weight_block_size {quantized.get('weight_block_size')}): {parts or 'no tensors'}"
