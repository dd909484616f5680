"""Index arithmetic of the FlashInfer TRT-LLM MoE weight layouts (docs/layouts.md#building-blocks).

Everything here is a pure function of shapes, or a gather on tensors; nothing reads files and
nothing needs CUDA. All row permutations are *gathers*: ``out = x[idx]``, ``idx[new] = old``.

Building blocks, for one expert with ``M`` GEMM1 rows (``M = 2I`` gated) and ``K`` columns:

* ``R`` (:func:`gated_interleave_indices`): ``[X1; X2] -> (X1_0, X2_0, X1_1, X2_1, ...)``,
  FlashInfer ``reorder_rows_for_gated_act_gemm``.
* ``S`` (:func:`shuffle_row_indices`): the 32-row (epilogue tile 128) / 16-row (tile 64)
  shuffle, FlashInfer ``get_shuffle_matrix_a_row_indices``.
* ``P13 = R[S]`` (:func:`w13_row_permutation`), optionally composed with the gate/up half swap
  so that a ``[gate; up]`` (HF / vLLM checkpoint order) input goes to the kernel in one gather.
* 128x4 block-scale swizzle (:func:`swizzle_128x4`), FlashInfer ``block_scale_interleave``.
* BlockMajorK (:func:`to_block_major_k`), FlashInfer ``convert_to_block_layout`` applied to the
  byte view with 128-byte blocks.

The batched helpers take stacked ``[E, rows, cols]`` tensors and do one gather per call.
"""

from __future__ import annotations

from functools import lru_cache

import torch

EPILOGUE_TILE_M = 128
BLOCK_K_BYTES = 128
SF_ROW_TILE = 128
SF_COL_TILE = 4


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def shuffle_block_size(epilogue_tile_m: int = EPILOGUE_TILE_M) -> int:
    """Rows per shuffle block: 32 when the epilogue tile is a multiple of 128, else 16."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


# ---------------------------------------------------------------------------------------------
# Row permutations (CPU int64, cached; move with .to(device) where needed)
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _gated_interleave(m: int) -> torch.Tensor:
    if m % 2:
        raise ValueError(f"gated GEMM1 row count {m} is odd")
    half = m // 2
    j = torch.arange(m, dtype=torch.long)
    # even output row j takes row j/2 of the first half, odd j takes row (j-1)/2 of the second.
    return torch.where(j % 2 == 0, j // 2, half + j // 2)


@lru_cache(maxsize=256)
def _shuffle(m: int, epilogue_tile_m: int) -> torch.Tensor:
    b = shuffle_block_size(epilogue_tile_m)
    if m % b:
        raise ValueError(
            f"row count {m} is not a multiple of the {b}-row shuffle block (epilogue_tile_m={epilogue_tile_m})"
        )
    d = torch.arange(m, dtype=torch.long)
    # Output row d of a block of b rows reads source row (d % 8) * (b / 8) + (d % b) // 8:
    # the source row r = q*(b/8) + p lands at p*8 + q (p < b/8, q < 8).
    return (d // b) * b + (d % 8) * (b // 8) + (d % b) // 8


_DEVICE_COPIES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _on(idx: torch.Tensor, device) -> torch.Tensor:
    """``idx`` on ``device``; copies of index tensors are cached per device.

    The cache holds the source tensor too, so its address cannot be reused while cached.
    """
    if device is None or idx.device == torch.device(device):
        return idx
    key = (idx.data_ptr(), idx.numel(), str(torch.device(device)))
    hit = _DEVICE_COPIES.get(key)
    if hit is None:
        if len(_DEVICE_COPIES) > 512:
            _DEVICE_COPIES.clear()
        hit = _DEVICE_COPIES[key] = (idx, idx.to(device))
    return hit[1]


def gated_interleave_indices(m: int, device=None) -> torch.Tensor:
    """``R``: gather indices interleaving the two halves of ``m`` rows one row at a time."""
    return _on(_gated_interleave(m), device)


def shuffle_row_indices(m: int, epilogue_tile_m: int = EPILOGUE_TILE_M, device=None) -> torch.Tensor:
    """``S``: gather indices of TRT-LLM-gen ``shuffleMatrixA`` for ``m`` rows."""
    return _on(_shuffle(m, epilogue_tile_m), device)


@lru_cache(maxsize=256)
def _w13_perm(m: int, gated: bool, swap_halves: bool, epilogue_tile_m: int) -> torch.Tensor:
    s = _shuffle(m, epilogue_tile_m)
    p = _gated_interleave(m)[s] if gated else s.clone()
    if swap_halves:
        # Input is [gate; up] but R/S expect [up; gate]: source row q of [up; gate] is row
        # (q + m/2) % m of [gate; up].
        p = (p + m // 2) % m
    return p


def w13_row_permutation(
    m: int,
    *,
    gated: bool = True,
    swap_halves: bool = False,
    epilogue_tile_m: int = EPILOGUE_TILE_M,
    device=None,
) -> torch.Tensor:
    """Gather indices taking GEMM1 rows to kernel order: ``R[S]`` (``S`` if not gated).

    ``swap_halves=True`` composes the ``[gate; up] -> [up; gate]`` half swap in front, so a
    tensor in HF order needs a single gather. Equal to FlashInfer's
    ``_maybe_get_cached_w3_w1_permute_indices`` when ``swap_halves=False``.
    """
    if swap_halves and not gated:
        raise ValueError("the gate/up half swap only exists for gated activations")
    return _on(_w13_perm(m, gated, swap_halves, epilogue_tile_m), device)


def w2_row_permutation(h: int, epilogue_tile_m: int = EPILOGUE_TILE_M, device=None) -> torch.Tensor:
    """Gather indices of GEMM2 rows (``S``); FlashInfer ``get_w2_permute_indices_with_cache``."""
    return shuffle_row_indices(h, epilogue_tile_m, device)


def inverse_permutation(p: torch.Tensor) -> torch.Tensor:
    """``q`` with ``x[p][q] == x``."""
    q = torch.empty_like(p)
    q[p] = torch.arange(p.numel(), dtype=p.dtype, device=p.device)
    return q


# ---------------------------------------------------------------------------------------------
# Gathers on stacked tensors
# ---------------------------------------------------------------------------------------------

_BYTE_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """uint8 view of ``x`` with the last dimension multiplied by the element size."""
    if x.dtype == torch.uint8:
        return x
    return x.contiguous().view(torch.uint8)


def permute_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[..., idx, :]`` as one gather on the raw bits (any dtype, fp8 included)."""
    view = _BYTE_VIEW[x.element_size()]
    xb = x.contiguous().view(view) if x.dtype != view else x
    out = xb.index_select(x.dim() - 2, _on(idx, x.device))
    return out.view(x.dtype) if x.dtype != view else out


# ---------------------------------------------------------------------------------------------
# 128x4 block-scale swizzle
# ---------------------------------------------------------------------------------------------


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of one swizzled [rows, cols] scale matrix (rows -> 128, cols -> 4)."""
    return round_up(rows, SF_ROW_TILE) * round_up(cols, SF_COL_TILE)


@lru_cache(maxsize=256)
def _swizzle_src(rows: int, cols: int) -> torch.Tensor:
    """For each flat output position of the swizzle, the flat source position in the padded
    ``[Mp, Kp]`` matrix (pad then ``view(Mp/128, 4, 32, Kp/4, 4).permute(0, 3, 2, 1, 4)``)."""
    mp, kp = round_up(rows, SF_ROW_TILE), round_up(cols, SF_COL_TILE)
    src = torch.arange(mp * kp, dtype=torch.long).view(mp // 128, 4, 32, kp // 4, 4)
    return src.permute(0, 3, 2, 1, 4).reshape(-1)


def swizzle_128x4(sf: torch.Tensor, row_perm: torch.Tensor | None = None) -> torch.Tensor:
    """Swizzle linear scales ``[..., rows, cols]`` into the 128x4 layout.

    Returns ``[..., Mp * Kp]`` (one flat buffer per leading index) with ``Mp = roundup(rows,
    128)``, ``Kp = roundup(cols, 4)``; padding positions are 0, as FlashInfer's
    ``block_scale_interleave`` writes them. Byte offset of ``(r, c)``:
    ``(r//128)*128*Kp + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.

    ``row_perm`` (gather indices over ``rows``) is applied first, as in ``shuffle_matrix_sf_a``;
    when no padding is needed the permutation and the swizzle are one gather.
    """
    *lead, rows, cols = sf.shape
    mp, kp = round_up(rows, SF_ROW_TILE), round_up(cols, SF_COL_TILE)
    view = _BYTE_VIEW[sf.element_size()]
    x = sf.contiguous().view(view) if sf.dtype != view else sf.contiguous()
    x = x.reshape(-1, rows, cols)
    if mp == rows and kp == cols:
        src = _swizzle_src(rows, cols) if row_perm is None else _swizzle_src_perm(rows, cols, row_perm)
        out = x.reshape(x.shape[0], -1).index_select(1, _on(src, sf.device))
    else:
        if row_perm is not None:
            x = x.index_select(1, _on(row_perm, sf.device))
        padded = x.new_zeros((x.shape[0], mp, kp))
        padded[:, :rows, :cols] = x
        out = padded.reshape(x.shape[0], -1).index_select(1, _on(_swizzle_src(rows, cols), sf.device))
    out = out.reshape(*lead, mp * kp)
    return out.view(sf.dtype) if sf.dtype != view else out


_PERM_SWIZZLE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _swizzle_src_perm(rows: int, cols: int, row_perm: torch.Tensor) -> torch.Tensor:
    """Row gather folded into the swizzle gather: flat (r, c) reads (row_perm[r], c)."""
    key = (rows, cols, row_perm.data_ptr(), row_perm.numel(), str(row_perm.device))
    hit = _PERM_SWIZZLE.get(key)
    if hit is None:
        src = _swizzle_src(rows, cols)
        src = row_perm.cpu()[src // cols] * cols + src % cols
        if len(_PERM_SWIZZLE) > 256:
            _PERM_SWIZZLE.clear()
        hit = _PERM_SWIZZLE[key] = (row_perm, src)
    return hit[1]


@lru_cache(maxsize=256)
def _unswizzle_src(rows: int, cols: int) -> torch.Tensor:
    """For each (r, c) of the unpadded matrix, its position in the swizzled flat buffer."""
    kp = round_up(cols, SF_COL_TILE)
    r = torch.arange(rows, dtype=torch.long).view(-1, 1)
    c = torch.arange(cols, dtype=torch.long).view(1, -1)
    off = (r // 128) * 128 * kp + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return off.reshape(-1)


def unswizzle_128x4(buf: torch.Tensor, rows: int, cols: int, row_perm: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: ``[..., Mp*Kp]`` (or any shape with that many
    trailing bytes per leading index) back to linear ``[..., rows, cols]``.

    ``row_perm`` is the permutation given to :func:`swizzle_128x4`; it is undone too.
    """
    n = swizzled_size(rows, cols)
    view = _BYTE_VIEW[buf.element_size()]
    x = buf.contiguous().view(view) if buf.dtype != view else buf.contiguous()
    if x.dim() >= 1 and x.shape[-1] == n:
        lead = tuple(x.shape[:-1])
    elif x.dim() >= 2 and x.shape[-1] * x.shape[-2] == n:
        lead = tuple(x.shape[:-2])  # engines reshape the flat buffer to [..., rows, cols]
    else:
        raise ValueError(f"scale buffer {tuple(buf.shape)} does not end in {n} swizzled bytes")
    x = x.reshape(-1, n)
    src = _unswizzle_src(rows, cols)
    if row_perm is not None:
        # linear row r of the output was at row inv[r] of the permuted matrix
        inv = inverse_permutation(row_perm.cpu())
        r, c = torch.arange(rows).repeat_interleave(cols), torch.arange(cols).repeat(rows)
        src = src.view(rows, cols)[inv[r], c]
    out = x.index_select(1, src.to(buf.device)).reshape(*lead, rows, cols)
    return out.view(buf.dtype) if buf.dtype != view else out


# ---------------------------------------------------------------------------------------------
# BlockMajorK
# ---------------------------------------------------------------------------------------------


def block_k_elements(dtype: torch.dtype, block_k_bytes: int = BLOCK_K_BYTES) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return block_k_bytes // size


def to_block_major_k(
    x: torch.Tensor, block_k_bytes: int = BLOCK_K_BYTES, row_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., M, K] -> [..., K/bk, M, bk]`` with ``bk = block_k_bytes / element_size``.

    Same bytes as FlashInfer ``convert_to_block_layout(x.view(uint8), 128)``; ``row_perm`` is
    applied to the rows first, in the same gather.
    """
    *lead, m, k = x.shape
    bk = block_k_bytes // x.element_size()
    if k % bk:
        raise ValueError(f"K={k} is not a multiple of the BlockMajorK block of {bk} elements")
    blocks = x.reshape(-1, m, k // bk, bk).permute(0, 2, 1, 3)
    if row_perm is not None:
        view = _BYTE_VIEW[x.element_size()]
        b = blocks.view(view) if x.dtype != view else blocks
        out = b.index_select(2, _on(row_perm, x.device))
        out = out.view(x.dtype) if x.dtype != view else out
    else:
        out = blocks.contiguous()
    return out.reshape(*lead, k // bk, m, bk)


def from_block_major_k(x: torch.Tensor, row_perm: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`to_block_major_k`: ``[..., K/bk, M, bk] -> [..., M, K]``."""
    *lead, nb, m, bk = x.shape
    x = x.reshape(-1, nb, m, bk)
    if row_perm is not None:
        view = _BYTE_VIEW[x.element_size()]
        b = x.view(view) if x.dtype != view else x
        inv = inverse_permutation(row_perm.cpu()).to(x.device)
        b = b.index_select(2, inv)
        x = b.view(x.dtype) if x.dtype != view else b
    return x.permute(0, 2, 1, 3).reshape(*lead, m, nb * bk)
