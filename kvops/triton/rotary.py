"""Triton kernel for ``kvops::rotary_paged_cache_write``: the paged write with the rotation computed in the kernel.

One program per (token, head block), as ``kvops/triton/paged_write.py``: token ``i`` loads its slot and rotary
position, rotates its first ``rotary_dim`` dims in fp32 (GPT-NeoX or GPT-J pairs, FlashAttention's semantics),
rounds once to the key's dtype (then quantizes for fp8 caches) and stores into ``slot // block_size``,
``slot % block_size``; a negative slot writes nothing. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, capability_of, run
from .paged_write import _TILE, _e4m3_bits, scatter_tokens


@triton.jit
def _rotary_scatter_kernel(
    src_ptr, cache_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, scale_ptr,
    H, D, block_size,
    s_n, s_h, s_d,
    c_p, c_b, c_h, c_d,
    t_s, t_j, u_s, u_j,
    head0, scale_stride,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    num_heads = tl.where(slot >= 0, H, 0)  # a negative slot (padding) masks out every element
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :].to(tl.int64)
    mask = (h < num_heads) & (d < D)
    rot = mask & (d < 2 * HALF)
    if INTERLEAVED:  # pairs (2j, 2j + 1)
        partner = d + 1 - 2 * (d % 2)
        j = d // 2
        first = d % 2 == 0
    else:  # pairs (j, j + HALF)
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        j = tl.where(first, d, d - HALF)
    row = src_ptr + i * s_n + h * s_h
    x = tl.load(row + d * s_d, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(row + partner * s_d, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * t_s + j * t_j, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * u_s + j * u_j, mask=rot, other=0.0).to(tl.float32)
    out = tl.where(rot, tl.where(first, x * c - y * s, x * c + y * s), x)
    out = out.to(src_ptr.dtype.element_ty)  # rounded once to the key's dtype, as the CPU kernel
    if QUANT:
        scale = tl.load(scale_ptr + (head0 + h) * scale_stride, mask=h < H, other=1.0)
        out = _e4m3_bits(tl.math.div_rn(out.to(tl.float32), scale)).to(tl.uint8)  # cache_ptr: the cache as uint8
    blk = slot // block_size
    tl.store(cache_ptr + blk * c_p + (slot % block_size) * c_b + (head0 + h) * c_h + d * c_d, out, mask=mask)


def rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, cos, sin, interleaved: bool,
                             h0: int, k_scale, v_scale) -> None:
    """Launcher with the CPU kernel's signature (arguments already validated; slots and positions are not
    bounds-checked on the device, as in vLLM: use ``kvops.check_slot_mapping``)."""
    run(plan_rotary_write(key, k_cache, slot_mapping, positions, cos, sin, interleaved, h0, k_scale,
                          capability_of(k_cache)))
    scatter_tokens(value, v_cache, slot_mapping, h0, v_scale)


def plan_rotary_write(key, k_cache, slot_mapping, positions, cos, sin, interleaved: bool, h0: int, k_scale,
                      capability: tuple[int, int]) -> list[Launch]:
    """The key's launch of :func:`rotary_paged_cache_write` (the value goes through ``plan_scatter_tokens``)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return []
    _, h, d = key.shape
    slots, pos = slot_mapping.contiguous(), positions.contiguous()
    cache = k_cache if k_scale is None else k_cache.view(torch.uint8)  # fp8: store encoded bytes
    scale_stride = 0 if k_scale is None or k_scale.shape[0] == 1 else k_scale.stride(0)
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, _TILE // block_d))
    return [Launch(_rotary_scatter_kernel, (n, triton.cdiv(h, block_h)), (
        key, cache, slots, pos, cos, sin, k_scale if k_scale is not None else slots,
        h, d, cache.shape[1], *key.stride(), *cache.stride(), *cos.stride(), *sin.stride(), h0, scale_stride),
        dict(HALF=cos.shape[1], INTERLEAVED=interleaved, QUANT=k_scale is not None, BLOCK_H=block_h,
             BLOCK_D=block_d))]
