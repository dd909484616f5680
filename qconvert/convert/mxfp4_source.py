"""MXFP4 checkpoints (gpt-oss) as conversion sources (docs/formats.md#mxfp4-sources).

gpt-oss declares ``quantization_config.quant_method: mxfp4`` and stores each layer's experts fused:
``…mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] with ``…gate_up_proj_scales`` uint8
[E, 2I, H/32] (gate and up rows interleaved: gate even, up odd), ``…down_proj_blocks`` [E, H, I/32, 16]
with ``…down_proj_scales`` [E, H, I/32], and BF16 ``…_bias`` tensors beside them. Here:

* :func:`detect` pairs every ``*_blocks`` with its ``*_scales`` from the headers alone and refuses,
  with one line naming the tensor, a scale grid that does not match its blocks, non-U8 tensors, and a
  fused gate/up with an odd row count (or one that is not 2 x ``intermediate_size``);
* :meth:`Mxfp4Source.logical_inventory` / :func:`decode_bf16`: the BF16 tensors the pairs decode to
  (``qconvert bf16 SRC DST``, docs/formats.md#quantized-sources-decoded-to-bf16);
* :func:`to_nvfp4` / :func:`to_mxfp8` are the per-tensor casts of such a pair (numerics/mxfp4.py),
  refusing NaN scale bytes (0xFF) with the tensor and block named; NVFP4 uses one exponent ``k_max``
  per expert, shared by its interleaved gate and up rows;
* :func:`refusal`: what ``qconvert nvfp4|mxfp8`` (and ``verify``) of such a source says. Neither engine loads gpt-oss
  experts as NVFP4 or MXFP8 (docs/formats.md#gpt-oss-quantized-forms), so qconvert writes no such
  checkpoint; the casts stay library functions until an engine does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..formats.dialects import MXFP4_BLOCKS, MXFP4_SCALES
from .numerics import mxfp4
from .numerics.nvfp4 import e2m1_to_float

KIND = "mxfp4"
QUANT_METHOD = "mxfp4"
BLOCKS_SUFFIX = MXFP4_BLOCKS
SCALES_SUFFIX = MXFP4_SCALES
#: the fused gate/up tensor's base name (gate and up interleave by row)
GATE_UP = "gate_up_proj"
#: bytes per block of 32 E2M1 elements (the last dimension of ``*_blocks``)
BLOCK_BYTES = mxfp4.MXFP4_BLOCK // 2
U8 = "U8"


class Refusal(enum.Enum):
    """Why an MXFP4 source is not converted (rendered to text by :func:`refusal`)."""

    #: no engine loads gpt-oss experts in the target scheme (docs/formats.md#gpt-oss-quantized-forms)
    NO_ENGINE_FORM = "no-engine-form"


@dataclass
class Mxfp4Source:
    #: logical tensor (``…experts.gate_up_proj``) -> (blocks name, scales name)
    pairs: dict[str, tuple[str, str]]

    def logical_inventory(self, inventory: dict) -> dict:
        """``inventory`` (name -> (dtype tag, shape)) with each pair replaced by the BF16 tensor it
        decodes to (:func:`decoded_shape`), under the pair's base name; other tensors as they are."""
        paired = {n for pair in self.pairs.values() for n in pair}
        out = {n: v for n, v in inventory.items() if n not in paired}
        for base, (bname, _) in self.pairs.items():
            out[base] = ("BF16", decoded_shape(base, inventory[bname][1]))
        return out


def declared(config: dict) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def detect(config: dict, inventory: dict, where: str = "config.json") -> Mxfp4Source | None:
    """The MXFP4 source in ``inventory`` (name -> (dtype tag, shape)), or None unless config.json
    declares ``quant_method: mxfp4``. Headers only: no tensor is read."""
    if not declared(config):
        return None
    inter = config.get("intermediate_size")
    pairs: dict[str, tuple[str, str]] = {}
    for name, (tag, shape) in inventory.items():
        if name.endswith(SCALES_SUFFIX):
            base = name[: -len(SCALES_SUFFIX)]
            if base + BLOCKS_SUFFIX not in inventory:
                raise CheckpointError(
                    f"tensor {name!r} has no {base + BLOCKS_SUFFIX!r} beside it; the checkpoint is incomplete"
                )
            continue
        if not name.endswith(BLOCKS_SUFFIX):
            continue
        base = name[: -len(BLOCKS_SUFFIX)]
        sname = base + SCALES_SUFFIX
        if sname not in inventory:
            raise CheckpointError(f"tensor {name!r} has no {sname!r} beside it; the checkpoint is incomplete")
        stag, sshape = inventory[sname]
        shape, sshape = list(shape), list(sshape)
        if tag != U8 or stag != U8:
            raise CheckpointError(
                f"tensor {name if tag != U8 else sname!r} has dtype {tag if tag != U8 else stag}; MXFP4 blocks "
                "and scales are U8: the checkpoint is corrupt, re-download it"
            )
        if len(shape) < 3 or shape[-1] != BLOCK_BYTES:
            raise CheckpointError(
                f"tensor {name!r} has shape {shape}; MXFP4 blocks are [..., K/32, {BLOCK_BYTES}] (two E2M1 "
                "elements a byte): the checkpoint is corrupt, re-download it"
            )
        if sshape != shape[:-1]:
            raise CheckpointError(
                f"tensor {sname!r} has shape {sshape}, but {name!r} {shape} needs one E8M0 byte per block of 32, "
                f"{shape[:-1]}: the scales do not match the blocks; re-download the checkpoint"
            )
        if base.endswith(GATE_UP):
            rows = shape[-3]
            if rows % 2 or (isinstance(inter, int) and rows != 2 * inter):
                raise CheckpointError(
                    f"tensor {name!r} has {rows} rows; a fused gate/up interleaves gate and up rows in pairs and "
                    f"needs 2 x intermediate_size ({inter}) rows: fix intermediate_size in config.json or "
                    "re-download the checkpoint"
                )
        pairs[base] = (name, sname)
    if not pairs:
        raise CheckpointError(
            f"{where}: declares quant_method mxfp4 but no tensor is *{BLOCKS_SUFFIX} with *{SCALES_SUFFIX}; "
            "restore the original config.json"
        )
    return Mxfp4Source(pairs)


def _checked(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [..., K/2], e8m0 [..., K/32])`` of a blocks/scales pair; refuses a 0xFF scale byte."""
    bad = mxfp4.nan_scale_blocks(scales)
    if len(bad):
        where = list(bad[0].tolist())
        raise CheckpointError(
            f"tensor {name + SCALES_SUFFIX!r}: block {where} has scale byte 0xFF (NaN in E8M0); the "
            "checkpoint is corrupt, re-download it"
        )
    return blocks.reshape(*blocks.shape[:-2], -1), scales


def to_mxfp8(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of logical tensor ``name`` (E4M3 [..., K], E8M0 bytes [..., K/32]): lossless for every block."""
    return mxfp4.mxfp4_to_mxfp8(*_checked(name, blocks, scales))


def to_nvfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor):
    """NVFP4 of logical tensor ``name`` [E, N, …], expert by expert: ``(packed [E, N, K/2], block
    scales e4m3 [E, N, K/16], scale_2 fp32 [E], lossless bool [E, N, K/32])``; each expert's
    ``k_max`` covers all its rows (gate and up share it where they are fused)."""
    packed, e8m0 = _checked(name, blocks, scales)
    parts = [mxfp4.mxfp4_to_nvfp4(packed[e], e8m0[e], mxfp4.k_max_of(e8m0[e])) for e in range(packed.shape[0])]
    return (
        torch.stack([p[0] for p in parts]),
        torch.stack([p[1] for p in parts]),
        torch.stack([p[2] for p in parts]),
        torch.stack([p[3] for p in parts]),
    )


def decoded_shape(base: str, blocks_shape) -> tuple[int, ...]:
    """The BF16 shape a pair decodes to, as transformers' gpt-oss dequantize gives it
    (docs/formats.md#mxfp4-sources): blocks [E, N, K/32, 16] -> [E, K, N] (each expert's matrix
    transposed to [in, out]). Only 4-D blocks (per-expert stacks) have that form."""
    shape = list(blocks_shape)
    if len(shape) != 4:
        raise CheckpointError(
            f"tensor {base + BLOCKS_SUFFIX!r} has shape {shape}; qconvert decodes gpt-oss expert stacks "
            f"[E, N, K/32, {BLOCK_BYTES}] only"
        )
    e, n, g, _ = shape
    return (e, g * mxfp4.MXFP4_BLOCK, n)


def decode_bf16(name: str, blocks: torch.Tensor, scales: torch.Tensor, workers: int = 1) -> tuple[torch.Tensor, int]:
    """``(bf16 [E, K, N], rounded)``: logical tensor ``name``'s pair decoded to BF16, expert by expert
    (memory: the output and one expert's values), in transformers' gpt-oss orientation
    (:func:`decoded_shape`). Computed in BF16 (``numerics/mxfp4.py``, ``mxfp4_decode_bf16``): every
    finite MXFP4 value is a BF16 value, so ``rounded`` (values whose BF16 differs from the fp32
    decode) is 0; ``verify`` re-derives it from the fp32 decode. Refuses a 0xFF scale byte and a
    block that decodes beyond BF16's largest value (2^128 and up: byte 253 with an element of
    magnitude 4 or 6, byte 254 with 2 or more), naming the tensor and block."""
    from .numerics.pool import run_all

    packed, e8m0 = _checked(name, blocks, scales)
    e, n, k = packed.shape[0], packed.shape[1], e8m0.shape[-1] * mxfp4.MXFP4_BLOCK
    out = torch.empty((e, k, n), dtype=torch.bfloat16)

    def one(i: int) -> int:
        b = mxfp4.mxfp4_decode_bf16(packed[i], e8m0[i])  # [N, K], exact
        if bool(torch.isinf(b).any()):
            r, c = (int(v) for v in torch.isinf(b).nonzero()[0])
            g, byte = c // mxfp4.MXFP4_BLOCK, int(packed[i, r, c // 2])
            nib = torch.tensor([(byte >> 4) if c % 2 else (byte & 0xF)]) & 0x7
            raise CheckpointError(
                f"tensor {name + BLOCKS_SUFFIX!r}: block [{i}, {r}, {g}] decodes beyond the BF16 range "
                f"(scale byte {int(e8m0[i, r, g])} times an element of magnitude {float(e2m1_to_float(nib)[0]):g} "
                "is 2^128 or more): the checkpoint is corrupt, re-download it"
            )
        out[i].copy_(b.t())
        return 0

    return out, sum(run_all(max(1, workers), [(one, i) for i in range(e)]))


def decode_fp32(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [E, K, N]: the exact values of logical tensor ``name``'s pair in the orientation of
    :func:`decoded_shape` (``verify`` compares a decoded checkpoint with it); refuses a 0xFF scale byte."""
    packed, e8m0 = _checked(name, blocks, scales)
    return mxfp4.mxfp4_decode(packed, e8m0).transpose(1, 2)


def refusal(source: Mxfp4Source, where, code: Refusal = Refusal.NO_ENGINE_FORM) -> CheckpointError:
    """The one-line error for converting ``source`` (any scheme: none has an engine form)."""
    first = next(iter(source.pairs.values()))[0]
    if code is Refusal.NO_ENGINE_FORM:
        return CheckpointError(
            f"{where}: an MXFP4 checkpoint (gpt-oss experts, e.g. {first!r}): no engine loads gpt-oss experts as "
            "NVFP4 or MXFP8 (vLLM 0.32 and SGLang read them as MXFP4, FP8 or BF16 only; "
            "docs/formats.md#gpt-oss-quantized-forms), so qconvert writes neither: serve the MXFP4 checkpoint as it is, or its BF16 decode "
            "(qconvert bf16 SRC DST)"
        )
    raise AssertionError(code)


def check(config: dict, inventory: dict, where) -> None:
    """Raises for an MXFP4 source (bad input first, naming the tensor; then the refusal); returns
    for any other checkpoint. Headers only."""
    source = detect(config, inventory, where)
    if source is not None:
        raise refusal(source, where)
