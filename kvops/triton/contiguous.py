"""Triton kernels for the contiguous-cache ops: a strided row copy used by write and roll."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.paged_write import overlaps, unaliased
from .launch import Launch, capability_of, run

_TILE = 4096  # elements per program: a head block of one token row (keeps registers bounded for wide caches)


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr,
    T, H, D,
    s_b, s_t, s_h, s_d,
    d_b, d_t, d_h, d_d,
    dst_row0, dst_head0,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (token, head block): src[b, t, hb, :D] -> dst[b, dst_row0 + t, dst_head0 + hb, :D]."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :].to(tl.int64)
    mask = (h < H) & (d < D)
    x = tl.load(src_ptr + b * s_b + t * s_t + h * s_h + d * s_d, mask=mask)
    tl.store(dst_ptr + b * d_b + (dst_row0 + t) * d_t + (dst_head0 + h) * d_h + d * d_d, x, mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, dst_row0: int, dst_head0: int) -> None:
    """``dst[:, dst_row0:dst_row0+T, dst_head0:dst_head0+H] = src`` for ``src [B, T, H, D]`` (any strides)."""
    run(plan_copy_rows(src, dst, dst_row0, dst_head0, capability_of(dst)))


def plan_copy_rows(src, dst, dst_row0: int, dst_head0: int, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`copy_rows` (none for an empty source)."""
    b, t, h, d = src.shape
    if b * t == 0:
        return []
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, _TILE // block_d))  # <= _TILE elements per program
    return [Launch(_copy_rows_kernel, (b * t, triton.cdiv(h, block_h)), (
        src, dst, t, h, d, *src.stride(), *dst.stride(), dst_row0, dst_head0),
        dict(BLOCK_H=block_h, BLOCK_D=block_d))]


def cache_write(key, value, k_cache, v_cache, start: int, h0: int) -> None:
    """A source overlapping a cache is read before anything is written (copied first: docs/semantics.md §1)."""
    key, value = unaliased(key, k_cache, v_cache), unaliased(value, k_cache, v_cache)
    copy_rows(key, k_cache, start, h0)
    copy_rows(value, v_cache, start, h0)


def cache_roll(k_cache, v_cache, src: int, dst: int, n: int, h0: int, h1: int) -> None:
    """Overlapping ranges, or caches sharing memory (``k_cache is v_cache``): the moved rows are staged before
    anything is written, so both moves read the rows as they were before the call (as compiled code does)."""
    if n == 0 or src == dst:
        return
    caches = (k_cache, v_cache)
    moved = [cache[:, src : src + n, h0:h1] for cache in caches]
    shared = overlaps(k_cache, v_cache)
    for i, rows in enumerate(moved):
        if abs(src - dst) < n or (shared and i == 1):  # stage the moved rows (never the cache), then write them
            staged = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            copy_rows(rows, staged, 0, 0)
            moved[i] = staged
    for cache, rows in zip(caches, moved):
        copy_rows(rows, cache, dst, h0)
