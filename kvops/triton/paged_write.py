"""Triton kernel for ``kvops::paged_cache_write``: one program per token, strided, fp8 quantization in the kernel.

As vLLM's ``reshape_and_cache_flash``: token ``i`` with slot ``x = slot_mapping[i]`` lands in block
``x // block_size``, row ``x % block_size``; a negative slot is padding and writes nothing. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.paged_write import unaliased
from .launch import Launch, capability_of, run

_TILE = 4096  # elements per program: a head block of one token (keeps registers bounded for wide caches)


@triton.jit
def _e4m3_bits(y):
    """fp32 ``y`` -> float8_e4m3fn bit pattern (int32 in [0, 255]), exactly as torch's ``y.clamp(-448, 448).to(fp8)``.

    Saturates to ``±448``, rounds to nearest (ties to even), keeps the sign of zero, NaN -> 0x7F | sign. Encoded by
    hand with integer ops, so the GPU and the Triton interpreter agree bit for bit (the interpreter's own fp32->fp8
    cast is wrong for NaN, at binade carries such as 124.0 and for fp8 subnormals) and no fp8 hardware is needed.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(y), 448.0)  # (NaN is replaced below)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a); -127 for 0 and fp32 subnormals
    e = tl.maximum(e, -6)  # e4m3 binade of a; below 2^-6 (subnormals) the spacing stays 2^-9
    inv_spacing = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(3-e): e4m3 has 3 mantissa bits
    magic = 12582912.0  # 1.5 * 2^23: (t + magic) - magic rounds 0 <= t < 2^22 to an integer, ties to even
    m = ((a * inv_spacing + magic) - magic).to(tl.int32)  # the product is exact (power of two); m in [0, 16]
    code = (e + 6) * 8 + m  # exponent field e + 7, mantissa m - 8; m == 16 carries into the next binade
    return tl.where(y != y, 0x7F, code) | sign


@triton.jit
def _paged_scatter_kernel(
    src_ptr, cache_ptr, slot_ptr, scale_ptr,
    H, D, block_size,
    s_n, s_h, s_d,
    c_p, c_b, c_h, c_d,
    head0, scale_stride,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(i, j)``: ``cache[slot // block_size, slot % block_size, head0 + hb, :D] = src[i, hb, :D]`` for the
    ``j``-th block ``hb`` of ``BLOCK_H`` heads."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    num_heads = tl.where(slot >= 0, H, 0)  # a negative slot (padding) masks out every element
    blk = slot // block_size
    row = slot % block_size
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :].to(tl.int64)
    mask = (h < num_heads) & (d < D)
    x = tl.load(src_ptr + i * s_n + h * s_h + d * s_d, mask=mask, other=0.0)
    if QUANT:
        scale = tl.load(scale_ptr + (head0 + h) * scale_stride, mask=h < H, other=1.0)
        x = _e4m3_bits(tl.math.div_rn(x.to(tl.float32), scale)).to(tl.uint8)  # cache_ptr: the cache as uint8
    tl.store(cache_ptr + blk * c_p + row * c_b + (head0 + h) * c_h + d * c_d, x, mask=mask)


def scatter_tokens(
    src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, h0: int, scale: torch.Tensor | None
) -> None:
    """Scatter ``src [N', H_in, D]`` rows ``[0, N)`` into ``cache [P, block_size, H_kv, D]`` (any strides)."""
    run(plan_scatter_tokens(src, cache, slot_mapping, h0, scale, capability_of(cache)))


def plan_scatter_tokens(src, cache, slot_mapping, h0: int, scale, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`scatter_tokens` (none for an empty ``slot_mapping``)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return []
    _, h, d = src.shape
    slot_mapping = slot_mapping.contiguous()  # the kernel reads slot i at slot_ptr + i (metadata, never the cache)
    scale_arg = scale if scale is not None else slot_mapping  # unused pointer when QUANT is off
    scale_stride = 0 if scale is None or scale.shape[0] == 1 else scale.stride(0)
    if scale is not None:  # fp8 cache: the kernel stores the encoded bytes into a uint8 view of it (same strides)
        cache = cache.view(torch.uint8)
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, _TILE // block_d))  # <= _TILE elements per program
    return [Launch(_paged_scatter_kernel, (n, triton.cdiv(h, block_h)), (
        src, cache, slot_mapping, scale_arg, h, d, cache.shape[1], *src.stride(), *cache.stride(), h0, scale_stride),
        dict(QUANT=scale is not None, BLOCK_H=block_h, BLOCK_D=block_d))]


def paged_cache_write(key, value, k_cache, v_cache, slot_mapping, h0: int, k_scale, v_scale) -> None:
    """Launcher with the CPU kernel's signature (arguments already validated). Slots ``>= P * block_size`` are not
    checked here (no host sync): they are undefined behaviour, as in vLLM; use ``kvops.check_slot_mapping``.
    A source overlapping a cache is read before anything is written (copied first: docs/semantics.md §3)."""
    n = slot_mapping.shape[0]
    key, value = unaliased(key[:n], k_cache, v_cache), unaliased(value[:n], k_cache, v_cache)
    scatter_tokens(key, k_cache, slot_mapping, h0, k_scale)
    scatter_tokens(value, v_cache, slot_mapping, h0, v_scale)
