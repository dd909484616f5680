"""Pre-shuffled FlashInfer TRT-LLM MoE expert tensors for vLLM and SGLang (docs/layouts.md).

Plain tensors in, the engine's post-processing parameters out, and back, bit-exact.

Plain ("checkpoint") tensors of one MoE layer, stacked over all experts, are named as vLLM's
FusedMoE names its checkpoint-layout parameters:

==========================  ===========================================  =================
name                        shape (E experts, I intermediate, H hidden)  dtype
==========================  ===========================================  =================
``w13_weight``              [E, 2I, H] rows ``[gate; up]`` (HF order);    bf16 / fp8 e4m3 /
                            NVFP4 packed [E, 2I, H/2]                     uint8 (NVFP4)
``w2_weight``               [E, H, I] (NVFP4 [E, H, I/2])
``w13_weight_scale``        [E, 2I, H/32] (MXFP8) or [E, 2I, H/16]       uint8 E8M0 /
                            (NVFP4), *linear* (unswizzled)               float8_e4m3fn
``w2_weight_scale``         [E, H, I/32] / [E, H, I/16]
``w13_weight_scale_2``      NVFP4 global scales [E, 2] (gate, up) or [E]  float32
``w2_weight_scale_2``       [E]                                           float32
``w13_input_scale``         NVFP4 activation scales [E] or [E, 2]         float32
``w2_input_scale``          [E]                                           float32
==========================  ===========================================  =================

:func:`stack_hf_experts` builds them from per-expert HF names
(``{prefix}.{e}.gate_proj.weight``, ``...up_proj.weight_scale`` etc.) and
:func:`unstack_hf_experts` goes back.

Kernel parameters come out under the engine's names (``w13_weight``, ``w13_weight_scale`` or
``w13_weight_scale_inv``, ``g1_scale_c`` ...), per (TP rank, EP rank), with the engine's padding,
shapes and dtypes: see :func:`to_trtllm`. Every tensor transform is one gather per tensor kind
per layer, on the tensors' device (CPU or CUDA).

Targets: vLLM 0.33.0 and SGLang 0.5.23 with FlashInfer 0.7.4, ``epilogue_tile_m = 128``.
Only gated activations (SwiGLU: Qwen3, DeepSeek, Llama-4 ...) are handled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from qconvert.convert.layouts.trtllm_index import (
    BLOCK_K_BYTES,
    EPILOGUE_TILE_M,
    from_block_major_k,
    inverse_permutation,
    permute_rows,
    round_up,
    swizzle_128x4,
    to_block_major_k,
    unswizzle_128x4,
    w2_row_permutation,
    w13_row_permutation,
)
from qconvert.errors import QConvertError
from qconvert.formats.dialects import (
    ENGINE_VERSIONS,
    INPUT_SCALE,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    WEIGHT_SCALE_INV,
)
from qconvert.formats.schemes import BLOCK

SCHEMES = ("bf16", "mxfp8", "nvfp4")
ENGINES = ("vllm", "sglang")
LAYOUT_NAME = "flashinfer-trtllm"
LAYOUT_VERSION = 1
FLASHINFER_VERSION = "0.7.4"

#: elements per scale (block size along K: formats.schemes.BLOCK) and K elements per stored byte-column unit
_SF_BLOCK = BLOCK
_ELEMS_PER_ITEM = {"bf16": 1, "mxfp8": 1, "nvfp4": 2}  # NVFP4 packs two values per byte

#: E8M0 scale byte of 2^0, what vLLM writes into padded MXFP8 scale rows/columns
E8M0_ONE = 127


class LayoutError(QConvertError):
    """The tensors cannot be put into (or read back from) the requested kernel layout."""


@dataclass(frozen=True)
class Padding:
    """How an engine pads one rank's experts before the shuffle (docs/layouts.md#padding).

    ``intermediate_multiple`` pads I per rank, each gate/up half separately (zeros);
    ``hidden_multiple`` pads H. Weight padding is 0; scale padding is ``scale_pad``.
    ``pad_allowed=False`` means the engine's own padding is not usable (SGLang pads the fused
    W13 contiguously, which would put up rows into the gate half), so shapes that would need
    it are refused.
    """

    intermediate_multiple: int = 1
    hidden_multiple: int = 1
    scale_pad: int = 0
    pad_allowed: bool = True


def engine_padding(scheme: str, engine: str) -> Padding:
    """The padding rule of ``engine`` for ``scheme`` (gated activations)."""
    _check(scheme, engine)
    if engine == "vllm":
        if scheme == "bf16":  # align_moe_weights_for_fi(min_alignment=128)
            return Padding(intermediate_multiple=128)
        if scheme == "mxfp8":  # align_mxfp8_moe_weights_for_fi_trtllm (vLLM 0.33.0)
            return Padding(intermediate_multiple=128, hidden_multiple=256, scale_pad=E8M0_ONE)
        # align_fp4_moe_hidden_dim_for_fi(256), align_fp4_moe_weights_for_fi(64)
        return Padding(intermediate_multiple=64, hidden_multiple=256, scale_pad=0)
    # SGLang: _align_*_moe_weights pads I to 16 contiguously; refuse instead (see Padding).
    return Padding(intermediate_multiple=16, pad_allowed=False)


def _check(scheme: str, engine: str) -> None:
    if scheme not in SCHEMES:
        raise LayoutError(f"layout scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    if engine not in ENGINES:
        raise LayoutError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")


def default_scale_name(scheme: str, engine: str) -> str:
    """Suffix of the block-scale parameter: vLLM ModelOpt MXFP8/NVFP4 and SGLang NVFP4 use
    ``weight_scale``; SGLang's MXFP8 (``Fp8MoEMethod``) uses ``weight_scale_inv``."""
    return WEIGHT_SCALE_INV if (engine == "sglang" and scheme == "mxfp8") else WEIGHT_SCALE


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankShape:
    """Per-rank sizes: ``i``/``h`` before padding, ``ip``/``hp`` after."""

    num_experts: int
    i: int
    h: int
    ip: int
    hp: int


def check_parallel_sizes(tp, ep) -> None:
    """--tp and --ep must be positive integers: 0 once divided by zero, and -1 gave no ranks, so every
    expert tensor was dropped. Every layout entry point calls this before using them."""
    for flag, n in (("--tp", tp), ("--ep", ep)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LayoutError(f"{flag} {n!r}: the parallel size must be a positive integer")


def rank_shape(
    scheme: str,
    engine: str,
    num_experts: int,
    intermediate_size: int,
    hidden_size: int,
    tp: int = 1,
    ep: int = 1,
    padding: Padding | None = None,
) -> RankShape:
    """Sizes of one rank's kernel tensors; raises :class:`LayoutError` on impossible shapes."""
    _check(scheme, engine)
    pad = padding or engine_padding(scheme, engine)
    check_parallel_sizes(tp, ep)
    if num_experts % ep:
        raise LayoutError(f"{num_experts} experts do not split over --ep {ep}")
    if intermediate_size % tp:
        raise LayoutError(f"moe intermediate size {intermediate_size} does not split over --tp {tp}")
    i, h = intermediate_size // tp, hidden_size
    sf = _SF_BLOCK.get(scheme)
    if sf and i % sf:
        raise LayoutError(
            f"per-rank intermediate size {i} (= {intermediate_size} / tp {tp}) is not a multiple "
            f"of the {scheme} block of {sf}; choose a smaller --tp"
        )
    ip, hp = round_up(i, pad.intermediate_multiple), round_up(h, pad.hidden_multiple)
    if not pad.pad_allowed and (ip != i or hp != h):
        raise LayoutError(
            f"{engine} would pad the per-rank intermediate size {i} to {ip} over the fused "
            f"gate/up tensor, which the kernel layout cannot represent; choose another --tp"
        )
    _check_kernel_shape(scheme, engine, ip, hp)
    return RankShape(num_experts // ep, i, h, ip, hp)


def _check_kernel_shape(scheme: str, engine: str, ip: int, hp: int) -> None:
    m = 2 * ip
    problems = []
    if m % 32 or hp % 32:
        problems.append("2I and H must be multiples of 32 (32-row shuffle)")
    if scheme == "bf16" and (hp % 64 or ip % 64):
        problems.append("H and I must be multiples of 64 (BlockMajorK, 128-byte blocks)")
    if scheme in ("mxfp8", "nvfp4"):
        sf = _SF_BLOCK[scheme]
        if m % 128 or hp % 128:
            problems.append("2I and H must be multiples of 128 (scale shuffle)")
        # the engines reshape the swizzled buffer to the linear shape: no swizzle padding
        if (hp // sf) % 4 or (ip // sf) % 4:
            problems.append(f"H/{sf} and I/{sf} must be multiples of 4 (128x4 swizzle)")
    if problems:
        raise LayoutError(
            f"{scheme} experts with per-rank I={ip}, H={hp} do not fit the {engine} "
            f"FlashInfer TRT-LLM layout: " + "; ".join(problems)
        )


# ---------------------------------------------------------------------------------------------
# Shard and pad plain tensors
# ---------------------------------------------------------------------------------------------


def _split_halves(x: torch.Tensor, i: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [lo, hi) of each half of a fused [E, 2i, ...] tensor."""
    return x[:, lo:hi], x[:, i + lo : i + hi]


def _pad_halves(first: torch.Tensor, second: torch.Tensor, ip: int, cols: int, fill: int | float) -> torch.Tensor:
    """Stack two halves of [E, i, c] rows into [E, 2ip, cols], each padded with ``fill``."""
    e, i, c = first.shape
    if i == ip and c == cols:
        return torch.cat([first, second], dim=1)
    out = _full((e, 2 * ip, cols), fill, first)
    out[:, :i, :c] = first
    out[:, ip : ip + i, :c] = second
    return out


def _full(shape, fill, like: torch.Tensor) -> torch.Tensor:
    if fill == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if like.dtype == torch.uint8:
        return torch.full(shape, fill, dtype=torch.uint8, device=like.device)
    return torch.full(shape, fill, dtype=torch.float32, device=like.device).to(like.dtype)


def _pad2(x: torch.Tensor, rows: int, cols: int, fill) -> torch.Tensor:
    e, r, c = x.shape
    if r == rows and c == cols:
        return x
    out = _full((e, rows, cols), fill, x)
    out[:, :r, :c] = x
    return out


def _shape_of(scheme: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    e, m, k = w13.shape
    if m % 2:
        raise LayoutError(f"w13_weight has an odd row count {m}; expected [gate; up] rows")
    per = _ELEMS_PER_ITEM[scheme]
    i, h = m // 2, k * per
    if tuple(w2.shape) != (e, h, i // per):
        raise LayoutError(
            f"w2_weight has shape {tuple(w2.shape)}, expected {(e, h, i // per)} to match w13_weight {tuple(w13.shape)}"
        )
    return e, i, h


def _expected_dtype(scheme: str) -> tuple[torch.dtype, ...]:
    return {
        "bf16": (torch.bfloat16,),
        "mxfp8": (torch.float8_e4m3fn,),
        "nvfp4": (torch.uint8,),
    }[scheme]


def _check_inputs(scheme, w13, w2, w13_scale, w2_scale, e, i, h) -> None:
    for name, t in (("w13_weight", w13), ("w2_weight", w2)):
        if t.dtype not in _expected_dtype(scheme):
            raise LayoutError(f"{name} has dtype {t.dtype}; {scheme} expects {_expected_dtype(scheme)[0]}")
    if scheme == "bf16":
        return
    sf = _SF_BLOCK[scheme]
    sdt = torch.uint8 if scheme == "mxfp8" else torch.float8_e4m3fn
    for name, t, shape in (
        ("w13_weight_scale", w13_scale, (e, 2 * i, h // sf)),
        ("w2_weight_scale", w2_scale, (e, h, i // sf)),
    ):
        if t is None:
            raise LayoutError(f"{scheme} experts need {name}")
        if tuple(t.shape) != shape or t.dtype != sdt:
            raise LayoutError(f"{name} is {tuple(t.shape)} {t.dtype}; expected linear {shape} {sdt}")


# ---------------------------------------------------------------------------------------------
# Forward: plain -> kernel parameters of one rank
# ---------------------------------------------------------------------------------------------


def to_trtllm(
    scheme: str,
    engine: str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    w13_weight_scale_2: torch.Tensor | None = None,
    w2_weight_scale_2: torch.Tensor | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    tp: int = 1,
    tp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
    w13_order: str = "gate_up",
    padding: Padding | None = None,
    scale_name: str | None = None,
    zero_scale_byte: str = "replace",
) -> dict[str, torch.Tensor]:
    """Kernel parameters of one (TP, EP) rank from the plain stacked tensors of one layer.

    Returns ``{param_name: tensor}`` with the engine's post-``process_weights_after_loading``
    names, shapes and dtypes (names relative to the FusedMoE module, e.g. ``w13_weight``):

    * bf16, vllm: ``w13_weight`` [E, 2Ip, H] and ``w2_weight`` [E, H, Ip] bf16 whose bytes
      are BlockMajorK (vLLM keeps checkpoint-shaped parameters); sglang: [E, H/64, 2I, 64] and
      [E, I/64, H, 64].
    * mxfp8: ``w13_weight`` [E, 2Ip, Hp] e4m3 (rows ``P13``), ``w2_weight`` [E, Hp, Ip] (rows
      ``S``), scales uint8 [E, 2Ip, Hp/32] / [E, Hp, Ip/32] holding the 128x4-swizzled bytes,
      named ``w13_{scale_name}`` (vllm ``weight_scale``, sglang ``weight_scale_inv``).
    * nvfp4: packed uint8 weights as mxfp8, e4m3 scales [E, 2Ip, Hp/16] / [E, Hp, Ip/16],
      plus the engine's derived fp32 scalars (:func:`nvfp4_scalars`).

    ``w13_order`` says how the plain W13 halves are stacked: ``"gate_up"`` (HF / vLLM
    checkpoint order, the default) or ``"up_gate"``. MXFP8 scale bytes 0 are replaced by 1
    (``zero_scale_byte="replace"``; ``"error"`` refuses them, ``"keep"`` writes them).
    """
    _check(scheme, engine)
    if w13_order not in ("gate_up", "up_gate"):
        raise LayoutError(f"w13_order {w13_order!r} is not 'gate_up' or 'up_gate'")
    if not (0 <= tp_rank < tp and 0 <= ep_rank < ep):
        raise LayoutError(f"rank tp {tp_rank}/{tp}, ep {ep_rank}/{ep} is out of range")
    e, i_full, h = _shape_of(scheme, w13, w2)
    _check_inputs(scheme, w13, w2, w13_scale, w2_scale, e, i_full, h)
    pad = padding or engine_padding(scheme, engine)
    rs = rank_shape(scheme, engine, e, i_full, h, tp, ep, pad)
    scale_name = scale_name or default_scale_name(scheme, engine)

    # --- EP: whole experts; TP: rows of each W13 half, columns of W2 -----------------------
    e0, e1 = ep_rank * rs.num_experts, (ep_rank + 1) * rs.num_experts
    lo, hi = tp_rank * rs.i, (tp_rank + 1) * rs.i
    per = _ELEMS_PER_ITEM[scheme]
    w13 = w13[e0:e1]
    w2 = w2[e0:e1, :, lo // per : hi // per]
    first, second = _split_halves(w13, i_full, lo, hi)
    hp_items = rs.hp // per
    w13_r = _pad_halves(first, second, rs.ip, hp_items, 0)
    w2_r = _pad2(w2, rs.hp, rs.ip // per, 0)
    s13_r = s2_r = None
    if scheme != "bf16":
        sf = _SF_BLOCK[scheme]
        s13, s2 = w13_scale[e0:e1], w2_scale[e0:e1, :, lo // sf : hi // sf]
        if scheme == "mxfp8":
            s13, s2 = (
                _fix_zero_bytes(s13, "w13_weight_scale", zero_scale_byte),
                _fix_zero_bytes(s2, "w2_weight_scale", zero_scale_byte),
            )
        a, b = _split_halves(s13, i_full, lo, hi)
        s13_r = _pad_halves(a, b, rs.ip, rs.hp // sf, pad.scale_pad)
        s2_r = _pad2(s2, rs.hp, rs.ip // sf, pad.scale_pad)

    # --- layout: one gather per tensor kind -------------------------------------------------
    m = 2 * rs.ip
    p13 = w13_row_permutation(m, swap_halves=(w13_order == "gate_up"))
    p2 = w2_row_permutation(rs.hp)
    out: dict[str, torch.Tensor] = {}
    if scheme == "bf16":
        g13 = to_block_major_k(w13_r, BLOCK_K_BYTES, p13)  # [E, H/64, 2Ip, 64]
        g2 = to_block_major_k(w2_r, BLOCK_K_BYTES, p2)  # [E, Ip/64, H, 64]
        if engine == "vllm":  # same bytes, checkpoint-shaped parameters
            g13 = g13.reshape(rs.num_experts, m, rs.hp)
            g2 = g2.reshape(rs.num_experts, rs.hp, rs.ip)
        out["w13_weight"], out["w2_weight"] = g13, g2
        return out

    out["w13_weight"] = permute_rows(w13_r, p13)
    out["w2_weight"] = permute_rows(w2_r, p2)
    out[f"w13_{scale_name}"] = swizzle_128x4(s13_r, p13).reshape(s13_r.shape)
    out[f"w2_{scale_name}"] = swizzle_128x4(s2_r, p2).reshape(s2_r.shape)
    if scheme == "mxfp8":
        out["w13_weight"] = out["w13_weight"].view(torch.float8_e4m3fn)
        out["w2_weight"] = out["w2_weight"].view(torch.float8_e4m3fn)
        return out
    if w13_weight_scale_2 is None or w2_weight_scale_2 is None:
        raise LayoutError("nvfp4 experts need w13_weight_scale_2 and w2_weight_scale_2")
    if w13_input_scale is None or w2_input_scale is None:
        raise LayoutError("nvfp4 experts need w13_input_scale and w2_input_scale (static activations)")
    out.update(
        nvfp4_scalars(
            engine,
            w13_weight_scale_2[e0:e1],
            w2_weight_scale_2[e0:e1],
            w13_input_scale[e0:e1],
            w2_input_scale[e0:e1],
        )
    )
    return out


def _fix_zero_bytes(s: torch.Tensor, name: str, policy: str) -> torch.Tensor:
    if policy == "keep":
        return s
    zero = s == 0
    if policy == "replace" and s.device.type != "cpu":
        return torch.where(zero, torch.ones_like(s), s)  # the same bytes without a host sync (a GPU refit)
    if not bool(zero.any()):
        return s
    if policy == "error":
        raise LayoutError(
            f"{name} holds E8M0 byte 0, which the TRT-LLM MoE kernels reject; requantize with "
            f"qconvert's MXFP8 numerics or pass zero_scale_byte='replace'"
        )
    return torch.where(zero, torch.ones_like(s), s)


def nvfp4_scalars(
    engine: str,
    w13_weight_scale_2: torch.Tensor,
    w2_weight_scale_2: torch.Tensor,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per-expert fp32 NVFP4 scalars as the engine holds them after post-processing.

    vLLM (``ModelOptNvFp4FusedMoE`` + ``TrtLlmNvFp4ExpertsBase``): one activation scale
    ``a = max(input scales)`` per layer (no EPLB), repeated per expert;
    ``w13_weight_scale_2 = ws2[:, 0] * a13`` (gate's global scale, folded),
    ``w2_weight_scale_2 = ws2_2 * a2``, ``g1_scale_c = w13_weight_scale_2 * (1 / a2)``.

    SGLang (``align_fp4_moe_weights_for_flashinfer_trtllm``) [inferred: read in SGLang's main
    branch, not pinned to 0.5.23]: checkpoint scalars kept; ``w13_input_scale_quant = 1/a13``,
    ``w2_input_scale_quant = 1/a2`` (0-dim), ``g1_alphas = a13 * ws2[:, 0]``,
    ``g2_alphas = a2 * ws2_2``, ``g1_scale_c = (1/a2) * g1_alphas``.
    """
    ws13 = w13_weight_scale_2.float()
    gate_ws2 = ws13[:, 0] if ws13.dim() == 2 else ws13.reshape(ws13.shape[0])
    ws2 = w2_weight_scale_2.float().reshape(-1)
    n = gate_ws2.shape[0]
    a13 = w13_input_scale.max().to(torch.float32)
    a2 = w2_input_scale.max().to(torch.float32)
    if engine == "vllm":
        a13_rep, a2_rep = a13.repeat(n), a2.repeat(n)
        g1 = gate_ws2.contiguous().mul_(a13_rep)
        g2 = ws2.contiguous().mul_(a2_rep)
        return {
            "w13_weight_scale_2": g1,
            "w13_input_scale": a13_rep,
            "w2_weight_scale_2": g2,
            "w2_input_scale": a2_rep,
            "g1_scale_c": g1 * (1.0 / a2_rep),
        }
    a13q, a2q = (1.0 / a13).to(torch.float32), (1.0 / a2).to(torch.float32)
    g1 = (a13 * gate_ws2).to(torch.float32)
    return {
        "w13_weight_scale_2": w13_weight_scale_2,
        "w2_weight_scale_2": w2_weight_scale_2,
        "w13_input_scale": w13_input_scale,
        "w2_input_scale": w2_input_scale,
        "w13_input_scale_quant": a13q,
        "w2_input_scale_quant": a2q,
        "g1_alphas": g1,
        "g2_alphas": (a2 * ws2).to(torch.float32),
        "g1_scale_c": (a2q * g1).to(torch.float32),
    }


# ---------------------------------------------------------------------------------------------
# Inverse: kernel parameters of one rank -> plain tensors of that rank
# ---------------------------------------------------------------------------------------------


def from_trtllm(
    scheme: str,
    engine: str,
    params: dict[str, torch.Tensor],
    *,
    intermediate_size: int,
    hidden_size: int,
    tp: int = 1,
    w13_order: str = "gate_up",
    padding: Padding | None = None,
    scale_name: str | None = None,
) -> dict[str, torch.Tensor]:
    """Undo :func:`to_trtllm` for one rank: plain stacked tensors of that rank's experts and
    intermediate slice (``w13_weight`` [E, 2I/tp, H] in ``w13_order``, ``w2_weight``, linear
    scales), padding removed. ``intermediate_size``/``hidden_size`` are the model's (unpadded,
    before TP). Bit-exact for weights and block scales (except MXFP8 byte 0 replaced on the way
    in). NVFP4 scalars: SGLang keeps the checkpoint's, they are returned as they are; vLLM only
    holds folded values, so none are returned (keep the checkpoint's).
    """
    _check(scheme, engine)
    scale_name = scale_name or default_scale_name(scheme, engine)
    w13k, w2k = params["w13_weight"], params["w2_weight"]
    e = w13k.shape[0]
    pad = padding or engine_padding(scheme, engine)
    rs = rank_shape(scheme, engine, e, intermediate_size, hidden_size, tp, 1, pad)
    m = 2 * rs.ip
    p13 = w13_row_permutation(m, swap_halves=(w13_order == "gate_up"))
    p2 = w2_row_permutation(rs.hp)
    per = _ELEMS_PER_ITEM[scheme]
    if scheme == "bf16":
        bk = BLOCK_K_BYTES // 2
        w13_p = from_block_major_k(w13k.reshape(e, rs.hp // bk, m, bk), p13)
        w2_p = from_block_major_k(w2k.reshape(e, rs.ip // bk, rs.hp, bk), p2)
    else:
        w13_p = permute_rows(w13k, inverse_permutation(p13))
        w2_p = permute_rows(w2k, inverse_permutation(p2))
    out = {
        "w13_weight": _unpad_halves(w13_p, rs.i, rs.ip, rs.h // per),
        "w2_weight": w2_p[:, : rs.h, : rs.i // per].contiguous(),
    }
    if scheme != "bf16":
        sf = _SF_BLOCK[scheme]
        s13 = unswizzle_128x4(params[f"w13_{scale_name}"], m, rs.hp // sf, p13)
        s2 = unswizzle_128x4(params[f"w2_{scale_name}"], rs.hp, rs.ip // sf, p2)
        out["w13_weight_scale"] = _unpad_halves(s13, rs.i, rs.ip, rs.h // sf)
        out["w2_weight_scale"] = s2[:, : rs.h, : rs.i // sf].contiguous()
    if scheme == "nvfp4" and engine == "sglang":
        for k in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"):
            out[k] = params[k]
    return out


def _unpad_halves(x: torch.Tensor, i: int, ip: int, cols: int) -> torch.Tensor:
    """[E, 2ip, *] in kernel half order [up; gate] ... -> first i rows of each half.

    The gather in from_trtllm already restored the plain half order, so the halves are
    simply [first; second] of ip rows each."""
    return torch.cat([x[:, :i, :cols], x[:, ip : ip + i, :cols]], dim=1).contiguous()


# ---------------------------------------------------------------------------------------------
# Per-rank cuts of full transformed tensors (docs/layouts.md#per-rank-cuts)
# ---------------------------------------------------------------------------------------------


def shard_transformed(
    scheme: str,
    engine: str,
    full: dict[str, torch.Tensor],
    *,
    intermediate_size: int,
    hidden_size: int,
    tp: int,
    tp_rank: int,
    scale_name: str | None = None,
) -> dict[str, torch.Tensor]:
    """Cut one TP rank's weights and block scales out of the *full* (tp=1) kernel tensors.

    Valid only when the engine pads neither the full nor the per-rank shapes and each rank's
    W13 row count is a multiple of 128 (docs/layouts.md#per-rank-cuts); raises :class:`LayoutError`
    otherwise. W13 rows and W13 scale bytes are contiguous ranges, W2 values a column slice,
    W2 scales a slice of the middle axis of ``[H/128, (I/sf)/4, 512]``, BF16 BlockMajorK a
    slice of the row (W13) or block (W2) axis. Equal to :func:`to_trtllm` with ``tp_rank``.
    """
    _check(scheme, engine)
    scale_name = scale_name or default_scale_name(scheme, engine)
    e = full["w13_weight"].shape[0]
    pad = engine_padding(scheme, engine)
    whole = rank_shape(scheme, engine, e, intermediate_size, hidden_size, 1, 1, pad)
    rs = rank_shape(scheme, engine, e, intermediate_size, hidden_size, tp, 1, pad)
    if (whole.ip, whole.hp) != (whole.i, whole.h) or (rs.ip, rs.hp) != (rs.i, rs.h):
        raise LayoutError("the engine pads these shapes; transform each rank instead of cutting")
    if (2 * rs.i) % 128:
        raise LayoutError(f"per-rank W13 rows {2 * rs.i} are not a multiple of 128")
    i, h, r = rs.i, rs.h, tp_rank
    m_full = 2 * intermediate_size
    out: dict[str, torch.Tensor] = {}
    if scheme == "bf16":
        bk = BLOCK_K_BYTES // 2
        g13 = full["w13_weight"].reshape(e, h // bk, m_full, bk)[:, :, 2 * i * r : 2 * i * (r + 1)]
        g2 = full["w2_weight"].reshape(e, intermediate_size // bk, h, bk)[:, i // bk * r : i // bk * (r + 1)]
        if i % bk:
            raise LayoutError(f"per-rank I={i} is not a multiple of the BlockMajorK block {bk}")
        g13, g2 = g13.contiguous(), g2.contiguous()
        if engine == "vllm":
            g13, g2 = g13.reshape(e, 2 * i, h), g2.reshape(e, h, i)
        return {"w13_weight": g13, "w2_weight": g2}
    per, sf = _ELEMS_PER_ITEM[scheme], _SF_BLOCK[scheme]
    out["w13_weight"] = full["w13_weight"][:, 2 * i * r : 2 * i * (r + 1)].contiguous()
    out["w2_weight"] = full["w2_weight"][:, :, i // per * r : i // per * (r + 1)].contiguous()
    s13 = full[f"w13_{scale_name}"].reshape(e, -1)
    row_bytes = h // sf  # bytes per W13 row in the swizzled buffer (cols already /4-aligned)
    s13 = s13[:, 2 * i * r * row_bytes : 2 * i * (r + 1) * row_bytes]
    out[f"w13_{scale_name}"] = s13.reshape(e, 2 * i, h // sf).contiguous()
    c_full, c = intermediate_size // sf, i // sf
    s2 = full[f"w2_{scale_name}"].reshape(e, h // 128, c_full // 4, 512)
    s2 = s2[:, :, c // 4 * r : c // 4 * (r + 1)]
    out[f"w2_{scale_name}"] = s2.reshape(e, h, c).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# Layout contract (manifest)
# ---------------------------------------------------------------------------------------------


def installed_flashinfer_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:
        return None


def kernel_layout_contract(
    scheme: str,
    engine: str,
    *,
    num_experts: int,
    intermediate_size: int,
    hidden_size: int,
    tp: int = 1,
    ep: int = 1,
    padding: Padding | None = None,
    scale_name: str | None = None,
    zero_scale_byte: str = "replace",
) -> dict:
    """What a loader must agree with before copying these tensors in (JSON-serialisable)."""
    pad = padding or engine_padding(scheme, engine)
    rs = rank_shape(scheme, engine, num_experts, intermediate_size, hidden_size, tp, ep, pad)
    scale_name = scale_name or default_scale_name(scheme, engine)
    names = ["w13_weight", "w2_weight"]
    if scheme != "bf16":
        names += [f"w13_{scale_name}", f"w2_{scale_name}"]
    if scheme == "nvfp4":
        names += sorted(nvfp4_scalars(engine, *(torch.ones(1, 2), torch.ones(1), torch.ones(1), torch.ones(1))))
    return {
        "layout": LAYOUT_NAME,
        "layout_version": LAYOUT_VERSION,
        "flashinfer_version": FLASHINFER_VERSION,
        "engine": engine,
        "engine_version": ENGINE_VERSIONS[engine],
        "scheme": scheme,
        "activation": "gated (swiglu)",
        "gate_up_order": "up,gate",  # W13 halves as the kernel reads them ([W3; W1])
        "gated_row_interleave": True,  # reorder_rows_for_gated_act_gemm
        "epilogue_tile_m": EPILOGUE_TILE_M,
        "row_shuffle_block": 32,
        "weight_layout": "BlockMajorK" if scheme == "bf16" else "MajorK",
        "block_k_bytes": BLOCK_K_BYTES if scheme == "bf16" else None,
        "scale_swizzle": None if scheme == "bf16" else "128x4",
        "scale_name": None if scheme == "bf16" else scale_name,
        "zero_scale_byte": zero_scale_byte if scheme == "mxfp8" else None,
        "padding": asdict(pad),
        "tp": tp,
        "ep": ep,
        "num_experts": num_experts,
        "num_local_experts": rs.num_experts,
        "intermediate_size": intermediate_size,
        "hidden_size": hidden_size,
        "intermediate_size_per_rank": rs.i,
        "intermediate_size_per_rank_padded": rs.ip,
        "hidden_size_padded": rs.hp,
        "param_names": names,
    }


#: keys a loader must match exactly (sizes are checked against the model separately)
CONTRACT_KEYS = (
    "layout",
    "layout_version",
    "flashinfer_version",
    "engine",
    "scheme",
    "gate_up_order",
    "gated_row_interleave",
    "epilogue_tile_m",
    "row_shuffle_block",
    "weight_layout",
    "block_k_bytes",
    "scale_swizzle",
    "padding",
    "tp",
    "ep",
)


def check_kernel_layout_contract(stored: dict, expected: dict, where: str = "checkpoint") -> None:
    """Raise :class:`LayoutError` naming the first key where ``stored`` differs."""
    for k in CONTRACT_KEYS:
        if stored.get(k) != expected.get(k):
            raise LayoutError(
                f"{where}: layout contract {k}={stored.get(k)!r} but the loader expects "
                f"{expected.get(k)!r}; re-run qconvert with matching --engine/--tp/--ep"
            )


# ---------------------------------------------------------------------------------------------
# Streaming-pipeline API: one MoE layer in, all ranks out
# ---------------------------------------------------------------------------------------------

#: HF per-expert projection -> (fused plain tensor, half) ; half None = W2
_HF_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
#: HF tensor suffix -> plain suffix; scale suffixes of the dialects (docs/formats.md#tensor-names)
_HF_SUFFIX = {
    "weight": "weight",
    WEIGHT_SCALE: WEIGHT_SCALE,
    WEIGHT_SCALE_INV: WEIGHT_SCALE,  # MXFP8 dialect A (SGLang/miles): E8M0 bytes
    WEIGHT_SCALE_2: WEIGHT_SCALE_2,
    INPUT_SCALE: INPUT_SCALE,
}


def stack_hf_experts(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Stack per-expert HF tensors ``{prefix}.{e}.{gate,up,down}_proj.{suffix}`` of one layer.

    ``prefix`` is e.g. ``model.layers.3.mlp.experts``. Suffixes: ``weight``,
    ``weight_scale`` or ``weight_scale_inv`` (block scales, linear), ``weight_scale_2`` and
    ``input_scale`` (NVFP4 per-tensor scalars). Returns the plain names of this module's
    docstring (``w13_weight`` = ``[gate; up]``, ``w13_weight_scale_2`` [E, 2] ...).
    Raises :class:`LayoutError` if an expert or projection is missing.
    """
    found: dict[tuple[str, str], dict[int, list]] = {}
    head = prefix + "."
    for name, t in tensors.items():
        if not name.startswith(head):
            continue
        parts = name[len(head) :].split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _HF_PROJ or parts[2] not in _HF_SUFFIX:
            raise LayoutError(f"{name}: not an expert tensor of the form {prefix}.<e>.<proj>.<suffix>")
        e, (fused, half), suffix = int(parts[0]), _HF_PROJ[parts[1]], _HF_SUFFIX[parts[2]]
        slot = found.setdefault((fused, suffix), {}).setdefault(e, [None, None])
        slot[0 if half is None else half] = t
    if not found:
        raise LayoutError(f"no expert tensors under {prefix}")
    out: dict[str, torch.Tensor] = {}
    for (fused, suffix), per_e in sorted(found.items()):
        n = max(per_e) + 1
        rows = []
        for e in range(n):
            slot = per_e.get(e)
            need = 1 if fused == "w2" else 2
            if slot is None or any(x is None for x in slot[:need]):
                raise LayoutError(f"{prefix}.{e}: {fused} {suffix} is missing a projection")
            if fused == "w2":
                rows.append(slot[0])
            elif suffix in ("weight", WEIGHT_SCALE):
                rows.append(torch.cat([slot[0], slot[1]], dim=0))
            else:  # per-tensor scalars of gate and up: [2]
                rows.append(torch.stack([slot[0].reshape(()), slot[1].reshape(())]))
        out[f"{fused}_{suffix}"] = torch.stack(rows)
    if "w2_weight_scale_2" in out:
        out["w2_weight_scale_2"] = out["w2_weight_scale_2"].reshape(-1)
    if "w2_input_scale" in out:
        out["w2_input_scale"] = out["w2_input_scale"].reshape(-1)
    return out


def unstack_hf_experts(
    plain: dict[str, torch.Tensor], prefix: str, scale_suffix: str = WEIGHT_SCALE
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`stack_hf_experts` (block scales written as ``scale_suffix``)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in plain.items():
        fused, suffix = key.split("_", 1)
        hf_suffix = scale_suffix if suffix == WEIGHT_SCALE else suffix
        for e in range(t.shape[0]):
            if fused == "w2":
                out[f"{prefix}.{e}.down_proj.{hf_suffix}"] = t[e].clone()
            elif suffix in ("weight", WEIGHT_SCALE):
                half = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.{hf_suffix}"] = t[e, :half].clone()
                out[f"{prefix}.{e}.up_proj.{hf_suffix}"] = t[e, half:].clone()
            else:
                v = t[e].reshape(-1)
                gate, up = (v[0], v[1]) if v.numel() == 2 else (v[0], v[0])
                out[f"{prefix}.{e}.gate_proj.{hf_suffix}"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.{hf_suffix}"] = up.clone()
    return out


def transform_moe_layer(
    plain: dict[str, torch.Tensor],
    scheme: str,
    engine: str,
    tp: int = 1,
    ep: int = 1,
    **kwargs,
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """All ranks of one layer: ``{(tp_rank, ep_rank): {param_name: tensor}}``.

    ``plain`` holds the stacked names of this module's docstring (``stack_hf_experts`` output,
    or vLLM-style fused tensors). Param names are relative to the FusedMoE module; prefix
    them with e.g. ``model.layers.3.mlp.experts.`` when writing. Each rank is transformed from
    its own slice (engines pad per rank), one gather per tensor kind. ``kwargs`` go to
    :func:`to_trtllm` (``w13_order``, ``padding``, ``scale_name``, ``zero_scale_byte``).
    """
    args = dict(
        w13=plain["w13_weight"],
        w2=plain["w2_weight"],
        w13_scale=plain.get("w13_weight_scale"),
        w2_scale=plain.get("w2_weight_scale"),
        w13_weight_scale_2=plain.get("w13_weight_scale_2"),
        w2_weight_scale_2=plain.get("w2_weight_scale_2"),
        w13_input_scale=plain.get("w13_input_scale"),
        w2_input_scale=plain.get("w2_input_scale"),
    )
    return {
        (r, q): to_trtllm(scheme, engine, **args, tp=tp, tp_rank=r, ep=ep, ep_rank=q, **kwargs)
        for q in range(ep)
        for r in range(tp)
    }


def untransform_moe_layer(
    ranks: dict[tuple[int, int], dict[str, torch.Tensor]],
    scheme: str,
    engine: str,
    *,
    intermediate_size: int,
    hidden_size: int,
    tp: int = 1,
    ep: int = 1,
    **kwargs,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`transform_moe_layer`: the plain stacked tensors of the whole layer
    (NVFP4 scalars only where the engine keeps them: SGLang)."""
    per_ep = []
    for q in range(ep):
        parts = [
            from_trtllm(
                scheme,
                engine,
                ranks[(r, q)],
                intermediate_size=intermediate_size,
                hidden_size=hidden_size,
                tp=tp,
                **kwargs,
            )
            for r in range(tp)
        ]
        merged: dict[str, torch.Tensor] = {}
        for k in parts[0]:
            if k in ("w13_weight", "w13_weight_scale"):
                halves = [p[k].shape[1] // 2 for p in parts]
                gate = torch.cat([p[k][:, :n] for p, n in zip(parts, halves)], dim=1)
                up = torch.cat([p[k][:, n:] for p, n in zip(parts, halves)], dim=1)
                merged[k] = torch.cat([gate, up], dim=1)
            elif k in ("w2_weight", "w2_weight_scale"):
                merged[k] = torch.cat([p[k] for p in parts], dim=2)
            else:
                merged[k] = parts[0][k]
        per_ep.append(merged)
    return {k: torch.cat([m[k] for m in per_ep], dim=0) for k in per_ep[0]}
