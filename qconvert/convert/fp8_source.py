"""FP8 block-scaled checkpoints as conversion sources (docs/formats.md#fp8-block-sources).

Two forms store the same thing (:class:`Declaration`): a source whose config.json says
``quantization_config.quant_method: fp8`` with ``weight_block_size: [bn, bk]`` (DeepSeek-V3/R1,
Kimi-K2, Qwen3-FP8) stores each quantized Linear as ``X.weight`` F8_E4M3 [N, K] plus
``X.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]; a compressed-tensors one (llm-compressor's
``FP8_BLOCK``, docs/formats.md#compressed-tensors-fp8-block-sources) as ``X.weight`` plus
``X.weight_scale`` of the same grid, with an ``ignore`` list of the modules left BF16. Both scales
are the decode multiplier. Here:

* :func:`detect` reads the declaration (:func:`declaration`) and pairs every FP8 weight with its
  scale, refusing mismatches with one line naming the tensor;
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
from ..formats import exclusions
from ..formats.dialects import WEIGHT_SCALE, WEIGHT_SCALE_INV
from ..formats.exclusions import IGNORE
from .numerics import fp8_block

KIND = "fp8-block"
#: source forms (the dialect names formats/detect.py gives such a checkpoint)
DEEPSEEK, COMPRESSED_TENSORS = "deepseek", "compressed-tensors"
#: per form: the scale tensor beside ``weight`` (docs/formats.md#fp8-block-sources,
#: docs/formats.md#compressed-tensors-fp8-block-sources), and the config key of the block
SCALE_SUFFIXES = {DEEPSEEK: WEIGHT_SCALE_INV, COMPRESSED_TENSORS: WEIGHT_SCALE}
BLOCK_KEYS = {DEEPSEEK: "weight_block_size", COMPRESSED_TENSORS: "block_structure"}
#: compressed-tensors formats whose FP8 weights are one F8_E4M3 byte each (the naive compressor
#: writes both; docs/formats.md#compressed-tensors-fp8-block-sources)
CT_FORMATS = ("float-quantized", "naive-quantized")
#: the block compressed-tensors FP8 sources must declare (llm-compressor's FP8_BLOCK)
CT_BLOCK = (128, 128)
SCALE_TAGS = ("F32", "BF16", "F16")
#: per-tensor path codes (manifest ``source.quantized.tensor_paths``), and what they mean
PATHS = {
    "lossless": "every block's E4M3 bytes kept (power-of-two scales): decodes exactly to the source",
    "lossless-partial": "power-of-two blocks' E4M3 bytes kept, the other blocks requantized",
    "lossless-rceil": "power-of-two scales, quantized with RCEIL (a kernel layout): decodes exactly to the source",
    "requantized": "quantized from the fp32 decode",
    "bf16-decode": "kept unquantized: the BF16 of the fp32 decode",
    "bf16-source": "BF16 in the source (a mixed checkpoint), quantized from its own values",
    "bf16-ignored": "BF16 in the source (on its compressed-tensors ignore list), quantized from its own values",
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
    #: the form (:data:`DEEPSEEK` or :data:`COMPRESSED_TENSORS`)
    form: str = DEEPSEEK
    #: float Linear weights on a compressed-tensors ``ignore`` list (BF16 by the producer's choice)
    ignored: list[str] = field(default_factory=list)

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
                s = checked_scale(scales[n], src[scales[n]])
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
        bf16_linear = bf16_ignored = 0
        ignored = set(self.ignored)
        for w in self.float_weights:
            t = plan.tensors.get(w)
            if t is not None and t.module is not None and t.action == QUANTIZE:
                if w in ignored:
                    self.paths[t.module], bf16_ignored = "bf16-ignored", bf16_ignored + 1
                else:
                    self.paths[t.module], bf16_linear = "bf16-source", bf16_linear + 1
        notes = [
            f"source: FP8 block-scaled checkpoint ({self.label()}); {len(self.scales)} FP8 weights: "
            f"{lossless} lossless (power-of-two block scales: decode exactly), {mixed} partly lossless, "
            f"{requant} requantized from their fp32 decode, {kept} kept as BF16"
        ]
        if bf16_linear:
            notes.append(
                f"source: {bf16_linear} quantized Linear weights are not FP8 in this checkpoint and are "
                "converted from their own values (a mixed checkpoint)"
            )
        if bf16_ignored:
            notes.append(
                f"source: {bf16_ignored} quantized Linear weights are on the source's quantization_config.{IGNORE} "
                "list (BF16 there) and are converted from their own values; --keep-bf16 keeps them BF16"
            )
        return notes

    def label(self) -> str:
        """The form and block as the notes, inspect and the card name them."""
        return form_label(self.form, list(self.block))

    def manifest(self) -> dict:
        return {
            "kind": KIND,
            "form": self.form,
            "weight_block_size": list(self.block),
            "tensor_paths": dict(self.paths),
            "lossless_blocks": dict(self.partial),
            "path_codes": dict(PATHS),
        }


def checked_scale(sname: str, s: torch.Tensor) -> torch.Tensor:
    """``s`` (block scale tensor ``sname``), refused in one line naming the block if a scale is not
    finite or negative."""
    bad = fp8_block.bad_scale_blocks(s)
    if len(bad):
        r, c = bad[0].tolist()
        raise CheckpointError(
            f"tensor {sname!r}: block [{r}, {c}] scale is {float(s[r, c])!r}; a block decode scale must be "
            "finite and >= 0: the checkpoint is corrupt, re-download it"
        )
    return s


def scale_reader(ckpt):
    """``read(name)``: one scale tensor of ``ckpt`` (a fresh mapping each time; scales are small)."""
    from .safetensors_io import ShardReader

    shard_of = ckpt.shard_of()

    def read(name: str) -> torch.Tensor:
        with ShardReader(ckpt.shards[shard_of[name]], hash_file=False, mapped=True) as rd:
            return rd.read(name).clone()

    return read


@dataclass(frozen=True)
class Declaration:
    """What config.json's ``quantization_config`` declares about an FP8 block-scaled source: its
    form (docs/formats.md#fp8-block-sources, docs/formats.md#compressed-tensors-fp8-block-sources),
    the block (bn, bk) and, for compressed-tensors, the ``ignore`` list (modules left BF16)."""

    form: str  # DEEPSEEK | COMPRESSED_TENSORS
    block: tuple[int, int]
    ignore: tuple[str, ...] = ()

    @property
    def scale_suffix(self) -> str:
        return SCALE_SUFFIXES[self.form]

    @property
    def block_key(self) -> str:
        """The config key that declares the block (named in errors)."""
        return BLOCK_KEYS[self.form]


def _block_pair(bs, where: str, key: str) -> tuple[int, int]:
    if not (
        isinstance(bs, list)
        and len(bs) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)
    ):
        raise CheckpointError(f"{where}: {key} {bs!r} is not two positive integers; restore the original config.json")
    return bs[0], bs[1]


def _deepseek_declaration(qc: dict, where: str) -> Declaration:
    bs = qc.get("weight_block_size")
    if bs is None:
        raise CheckpointError(
            f"{where}: checkpoint is already quantized (quant_method='fp8' without "
            "weight_block_size: per-tensor FP8), which qconvert does not read; dequantize it to "
            "BF16 first"
        )
    block = _block_pair(bs, where, "weight_block_size")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: FP8 format {fmt!r}; qconvert reads E4M3 block-scaled checkpoints only")
    return Declaration(DEEPSEEK, block)


def _ct_declaration(qc: dict, where: str) -> Declaration:
    """compressed-tensors FP8 block (llm-compressor's ``FP8_BLOCK``;
    docs/formats.md#compressed-tensors-fp8-block-sources): every config group's weights 8-bit
    float, ``strategy: block``, ``block_structure`` CT_BLOCK, static and symmetric; its format
    float-quantized (or naive-quantized, the same bytes); input activations dynamic or none."""
    q = "quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(
            f"{where}: {q}.config_groups is missing or empty (quant_method 'compressed-tensors'); "
            "restore the original config.json"
        )
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise CheckpointError(
            f"{where}: {q}.quantization_status is {status!r}: the weights are not stored compressed "
            "(F8_E4M3 with block scales); save the checkpoint compressed (llm-compressor's default) or "
            "convert its BF16 weights"
        )
    for key, what in (
        ("transform_config", "online rotations/transforms the weights were folded with"),
        ("sparsity_config", "a sparsity compression"),
    ):
        if qc.get(key):
            raise CheckpointError(
                f"{where}: {q}.{key} is set ({what}); an MXFP8/NVFP4 output cannot carry it: qconvert reads "
                "compressed-tensors FP8 block checkpoints without transforms or sparsity"
            )
    top_fmt = qc.get("format")
    block = None
    for gname, g in groups.items():
        at = f"{where}: {q}.config_groups.{gname}"
        if not isinstance(g, dict):
            raise CheckpointError(f"{at} is not an object; restore the original config.json")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise CheckpointError(f"{at}.weights is missing; qconvert reads weight-quantized checkpoints only")
        if not (w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "block"):
            raise CheckpointError(
                f"{at}.weights is {w.get('num_bits')}-bit {w.get('type')} with strategy {w.get('strategy')!r}: "
                "checkpoint is already quantized (quant_method='compressed-tensors') in a form qconvert does not "
                "read; it reads FP8 block checkpoints (num_bits 8, type float, strategy block); dequantize it to "
                "BF16 first"
            )
        fmt = g.get("format") or top_fmt
        key = f"{q}.config_groups.{gname}.format" if g.get("format") else f"{q}.format"
        if fmt not in CT_FORMATS:
            raise CheckpointError(
                f"{where}: {key} is {fmt!r}; qconvert reads compressed-tensors FP8 block weights stored "
                f"{CT_FORMATS[0]!r} (one F8_E4M3 byte per weight) only; re-export the checkpoint with "
                f"format {CT_FORMATS[0]!r} or dequantize it to BF16 first"
            )
        bs = _block_pair(w.get("block_structure"), at, "weights.block_structure")
        if bs != CT_BLOCK:
            raise CheckpointError(
                f"{at}.weights.block_structure is {list(bs)}; qconvert reads compressed-tensors FP8 "
                f"block checkpoints with block_structure {list(CT_BLOCK)} (llm-compressor's FP8_BLOCK); "
                "restore the original config.json"
            )
        if w.get("symmetric") is False or w.get("dynamic") not in (False, None):
            raise CheckpointError(
                f"{at}.weights: symmetric={w.get('symmetric')!r}, dynamic={w.get('dynamic')!r}; FP8 block "
                "weights are static and symmetric (no zero point); restore the original config.json"
            )
        a = g.get("input_activations")
        if isinstance(a, dict) and a.get("dynamic") is not True:
            raise CheckpointError(
                f"{at}.input_activations are static (dynamic={a.get('dynamic')!r}): their input scales "
                "would be carried into an output that quantizes activations its own way; qconvert reads "
                "FP8 block checkpoints with dynamic (or no) input activations"
            )
        block = bs
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(
            f"{where}: {q}.kv_cache_scheme is set (an FP8 KV cache with its scales); qconvert converts "
            "weights only: remove kv_cache_scheme and the k_scale/v_scale tensors, or convert a checkpoint "
            "without them"
        )
    ignore = qc.get(IGNORE) or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise CheckpointError(f"{where}: {q}.{IGNORE} is not a list of names; restore the original config.json")
    return Declaration(COMPRESSED_TENSORS, block, tuple(ignore))


def declaration(config: dict, where: str = "config.json") -> Declaration | None:
    """The FP8 block-scaled source config.json declares, None if it declares no quantization;
    raises for a declaration qconvert cannot read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    qm = qc.get("quant_method") if isinstance(qc, dict) else None
    if qm == "fp8":
        return _deepseek_declaration(qc, where)
    if qm == COMPRESSED_TENSORS:
        return _ct_declaration(qc, where)
    raise CheckpointError(
        f"{where}: checkpoint is already quantized (quant_method={qm!r}); qconvert converts "
        "BF16 checkpoints and FP8 block-scaled ones (quant_method fp8 with weight_block_size, or "
        "compressed-tensors FP8 block)"
    )


def detect(config: dict, inventory: dict, where: str = "config.json") -> Fp8BlockSource | None:
    """The FP8 block-scaled source in ``inventory`` (name -> (dtype tag, shape)), or None for a
    checkpoint without quantization_config. Every FP8 weight needs a scale of the declared grid;
    a compressed-tensors module on the ``ignore`` list must not be FP8."""
    decl = declaration(config, where)
    if decl is None:
        return None
    sfx, block = decl.scale_suffix, decl.block
    scales: dict[str, str] = {}
    float_weights, ignored = [], []
    for name, (tag, shape) in inventory.items():
        if name.endswith("." + sfx):
            w = name[: -len(sfx)] + "weight"
            if w not in inventory:
                raise CheckpointError(f"tensor {name!r} has no weight {w!r} beside it; the checkpoint is incomplete")
            continue
        if tag == "F8_E5M2":
            raise CheckpointError(f"tensor {name!r} is F8_E5M2; qconvert reads E4M3 block-scaled weights only")
        if tag != "F8_E4M3":
            if name.endswith(".weight") and len(shape) == 2 and (name[: -len("weight")] + sfx) not in inventory:
                float_weights.append(name)
                if decl.ignore and exclusions.ct_excluded(name[: -len(".weight")], list(decl.ignore)):
                    ignored.append(name)
            continue
        sname = name[: -len("weight")] + sfx if name.endswith(".weight") else None
        if sname is None or sname not in inventory:
            raise CheckpointError(
                f"tensor {name!r} is FP8 but has no {sfx} beside it; the checkpoint is incomplete or not block-scaled"
            )
        if len(shape) != 2:
            raise CheckpointError(f"tensor {name!r} is FP8 with shape {list(shape)}; block-scaled weights are 2-D")
        if decl.ignore and exclusions.ct_excluded(name[: -len(".weight")], list(decl.ignore)):
            raise CheckpointError(
                f"tensor {name!r} is FP8 but its module is on quantization_config.{IGNORE} (left unquantized): "
                "config.json and the tensors disagree; restore the original config.json"
            )
        stag, sshape = inventory[sname]
        want = fp8_block.scale_grid(shape, block)
        if stag not in SCALE_TAGS:
            raise CheckpointError(f"tensor {sname!r} has dtype {stag}; block scales are F32 (or BF16/F16)")
        if tuple(sshape) != want:
            raise CheckpointError(
                f"tensor {sname!r} has shape {list(sshape)}, but weight {list(shape)} with the "
                f"declared {decl.block_key} {list(block)} needs {list(want)}: the scales do not "
                f"match the declared block size; fix {decl.block_key} in config.json"
            )
        scales[name] = sname
    if not scales:
        raise CheckpointError(
            f"{where}: declares FP8 block quantization but no tensor is F8_E4M3 with a "
            f"{sfx}; restore the original config.json"
        )
    return Fp8BlockSource(block, scales, sorted(float_weights), form=decl.form, ignored=sorted(ignored))


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
    label = form_label(str(quantized.get("form") or DEEPSEEK), quantized.get("weight_block_size"))
    return f"FP8 block-scaled ({label}): {parts or 'no tensors'}"


def form_label(form: str, block) -> str:
    if form == COMPRESSED_TENSORS:
        return f"compressed-tensors, {BLOCK_KEYS[form]} {block}"
    return f"{BLOCK_KEYS[DEEPSEEK]} {block}"
