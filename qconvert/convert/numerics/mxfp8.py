"""MXFP8: E4M3 elements with one E8M0 scale byte per 1x32 block along the last axis.

Scale rule (docs/formats.md#mxfp8-scale-rule): RCEIL, ``E = ceil(log2(amax / 448))`` computed in fp32, elements
``e4m3_RNE(x * 2^-E)``. This is what SGLang's and vLLM's online quantizers, FlashInfer,
TransformerEngine and ModelOpt compute, so a checkpoint written here holds the same bytes an
engine would produce by quantizing the BF16 weight itself.

One declared deviation: an E8M0 byte of 0 (scale 2^-127) is never written, because the
FlashInfer TRT-LLM MoE kernels reject it. The exponent is clamped to at least -126 (byte 1),
as NeMo-RL does. This changes only blocks whose amax is below 448 * 2^-127 (about 2.5e-36):
all-zero blocks (elements are zero whatever the scale) and blocks of subnormal magnitudes.
"""

from __future__ import annotations

import threading

import torch

from ...formats.schemes import MXFP8_BLOCK  # noqa: F401 (re-exported: numerics.MXFP8_BLOCK)
from . import cpu_kernels
from .pool import run_all

E4M3_MAX = 448.0
#: Smallest scale byte qconvert writes (2^-126). See the module docstring.
MIN_SCALE_BYTE = 1


def mxfp8_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (int32 tensor) for fp32 block maxima under RCEIL, at least 1.

    A non-finite amax (NaN or inf in the block) gives 255, E8M0's NaN: callers that must refuse
    non-finite weights check for it instead of making another pass over the data.

    ceil(log2(t)) for t = amax/448 is read off the fp32 bit pattern: adding 0x7FFFFF to the
    bits carries into the exponent field unless the mantissa is zero, so the exponent field of
    ``bits + 0x7FFFFF`` is the biased exponent of the smallest power of two >= t, which is the
    E8M0 byte itself. Exhaustively equal to the exact ceil for BF16 inputs (docs/formats.md#mxfp8-ceil-implementations).
    """
    t = amax.float() / E4M3_MAX
    bits = t.view(torch.int32)
    byte = ((bits + 0x7FFFFF) >> 23) & 0xFF
    # A NaN amax's bits overflow the int32 add above (byte 1): map it to 255 as documented.
    byte = torch.where(torch.isnan(t), 255, byte)
    return byte.clamp_(min=MIN_SCALE_BYTE)


def _pow2_from_biased(biased: torch.Tensor) -> torch.Tensor:
    """fp32 power of two whose biased exponent field is ``biased`` (1..254)."""
    return (biased.to(torch.int32) << 23).view(torch.float32)


def _quantize_blocks(
    xb: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    fbuf: torch.Tensor | None = None,
    abuf: torch.Tensor | None = None,
) -> None:
    """Quantize blocks ``xb`` [n, 32] into ``q`` [n, 32] (e4m3) and ``s`` [n] (uint8), in place.

    ``fbuf``/``abuf`` are optional fp32 scratch of at least n rows; the CPU path passes
    cache-sized ones so that no temporary the size of the whole tensor is ever made.
    """
    n = xb.shape[0]
    f = torch.empty(xb.shape, dtype=torch.float32, device=xb.device) if fbuf is None else fbuf[:n]
    f.copy_(xb)  # never aliases the input, so the scaling below can be in place
    amax = torch.abs(f, out=None if abuf is None else abuf[:n]).amax(dim=-1, keepdim=True)
    byte = mxfp8_scale_bytes(amax)
    # 2^-E has biased exponent 127 - E = 254 - byte; byte <= 254 keeps it a normal fp32 >= 1.
    # For the bytes BF16 can produce (<= 247) it is always a normal number.
    f.mul_(_pow2_from_biased(254 - byte.clamp(max=254)))
    # RCEIL guarantees |scaled| <= 448 for BF16 inputs; the clamp protects wider inputs from
    # PyTorch's non-saturating CUDA cast (docs/formats.md#cuda-e4m3-cast-does-not-saturate).
    f.clamp_(-E4M3_MAX, E4M3_MAX)
    q.copy_(f)
    s.copy_(byte.view(n))


#: Blocks per CPU work item: 8192 blocks are 512 KB of BF16 and 1 MB of fp32 scratch, so the
#: intermediates of a chunk stay in cache instead of streaming whole-tensor temporaries.
CPU_CHUNK_BLOCKS = 8192
#: Tensors of at most this many blocks are quantized inline (torch does not split them either).
SMALL_BLOCKS = 1024


def quantize_cpu_chain(xb: torch.Tensor, q: torch.Tensor, s: torch.Tensor, workers: int) -> None:
    """The op chain on CPU blocks ``xb [n, 32]``: chunks of CPU_CHUNK_BLOCKS handed out to
    ``workers`` threads of the shared pool (``pool.py``), each single-threaded in torch. What the C
    kernel's self-check compares with."""
    n = xb.shape[0]
    chunk = CPU_CHUNK_BLOCKS
    if n <= SMALL_BLOCKS:  # below torch's parallel grain size: one pass in the calling thread
        _quantize_blocks(xb, q, s)
        return
    starts = iter(range(0, n, chunk))  # shared: next() under the GIL hands each chunk out once
    lock = threading.Lock()

    def work():
        fbuf = torch.empty(chunk, MXFP8_BLOCK)
        abuf = torch.empty_like(fbuf)
        while True:
            with lock:
                i = next(starts, None)
            if i is None:
                return
            _quantize_blocks(xb[i : i + chunk], q[i : i + chunk], s[i : i + chunk], fbuf, abuf)

    workers = max(1, workers)
    run_all(workers, [(work,)] * min(workers, -(-n // chunk)))  # every chunk has ended when this returns


def mxfp8_quantize_blocks(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure tensor core on blocks ``xb [n, 32]``: (e4m3 [n, 32], uint8 [n]). One flat shape, so
    ``torch.compile`` (:func:`compiled_mxfp8_blocks`) specializes it once per block count."""
    q = torch.empty(xb.shape, dtype=torch.float8_e4m3fn, device=xb.device)
    s = torch.empty(xb.shape[0], dtype=torch.uint8, device=xb.device)
    _quantize_blocks(xb, q, s)
    return q, s


_compiled: dict = {}


def compiled_mxfp8_blocks():
    """``torch.compile`` of :func:`mxfp8_quantize_blocks` (static shapes, for CUDA; a dynamic block
    count ran about 10x slower on an H200) with
    the Inductor settings that keep fp32 division IEEE (nvfp4.inductor_exact_options), or None."""
    if "fn" not in _compiled:
        from .nvfp4 import inductor_exact_options

        opts = inductor_exact_options()
        _compiled["fn"] = None if opts is None else torch.compile(mxfp8_quantize_blocks, dynamic=False, options=opts)
    return _compiled["fn"]


def mxfp8_quantize(x: torch.Tensor, workers: int | None = None, blocks_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last axis. Returns (float8_e4m3fn [..., K], uint8 [..., K/32]).

    The op chain of :func:`_quantize_blocks` defines the bytes. On CPU the one-pass C kernel
    (cpu_kernels.py, same bytes) runs where it could be built, else the chain in cache-sized
    chunks; either way on ``workers`` threads (default: torch's intra-op thread count). On other
    devices the whole tensor is one chunk, through ``blocks_fn`` if given (the Triton kernel or a
    compiled :func:`mxfp8_quantize_blocks`).
    """
    if x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {MXFP8_BLOCK}")
    k = x.shape[-1]
    if blocks_fn is not None and x.device.type != "cpu" and x.numel():
        q, s = blocks_fn(x.reshape(-1, MXFP8_BLOCK))
        return q.reshape(x.shape), s.reshape(*x.shape[:-1], k // MXFP8_BLOCK)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(*x.shape[:-1], k // MXFP8_BLOCK, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return q, s
    xb = x.reshape(-1, MXFP8_BLOCK)
    if x.device.type == "cpu":
        w = torch.get_num_threads() if workers is None else workers
        if cpu_kernels.usable(xb):  # the same bytes in one pass (cpu_kernels.c)
            cpu_kernels.mxfp8_into(xb, q.view(-1, MXFP8_BLOCK), s.view(-1), w)
        else:
            quantize_cpu_chain(xb, q.view(-1, MXFP8_BLOCK), s.view(-1), w)
    else:
        _quantize_blocks(xb, q.view(-1, MXFP8_BLOCK), s.view(-1))
    return q, s


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize`: ``q * 2^(byte - 127)``."""
    k = q.shape[-1]
    # float64 output: multiply in float64 (exact), since q * 2^E reaches 2^128, past fp32's range
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    qb = q.reshape(*q.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK).to(wide)
    b = scale.to(torch.int32)
    # byte 0 (2^-127) is an fp32 subnormal and 255 is NaN: handle both for foreign checkpoints.
    mult = _pow2_from_biased(b.clamp(1, 254))
    mult = torch.where(b == 0, torch.full_like(mult, 2.0**-127), mult)
    mult = torch.where(b == 255, torch.full_like(mult, float("nan")), mult).unsqueeze(-1).to(wide)
    return (qb * mult).reshape(q.shape).to(dtype)
