"""Triton kernels of ``kvops::paged_kv_gather`` / ``kvops::paged_kv_scatter``: all layers in one launch.

As sglang's fused staging kernels: a table of the ``2 * L`` caches' data pointers (and their strides) is passed to
one kernel; program ``(c * n + t, j)`` moves elements ``[j * BLOCK, (j + 1) * BLOCK)`` of the ``h * D`` elements of
token ``t`` of cache ``c``. Values move as same-size integers (bit-exact for every dtype, fp8 included, no float
conversion). Offsets are int64. Tested on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, capability_of, run

_BLOCK = 1024  # elements per program
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _staging_kernel(
    ptr_table, stride_table, bt_ptr, staging_ptr,
    start, n, block_size, head0, HD, D,
    TO_STAGING: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    c = pid // n  # which cache (K layers then V layers)
    t = pid % n  # token of the segment
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < HD
    cache = tl.load(ptr_table + c).to(staging_ptr.dtype)  # int64 address -> pointer of the staging element type
    s_p = tl.load(stride_table + c * 4)
    s_b = tl.load(stride_table + c * 4 + 1)
    s_h = tl.load(stride_table + c * 4 + 2)
    s_d = tl.load(stride_table + c * 4 + 3)
    pos = start + t
    blk = tl.load(bt_ptr + pos // block_size).to(tl.int64)
    row = pos % block_size
    cache_off = blk * s_p + row * s_b + (head0 + e // D) * s_h + (e % D) * s_d
    staging_off = pid * HD + e
    if TO_STAGING:
        tl.store(staging_ptr + staging_off, tl.load(cache + cache_off, mask=mask), mask=mask)
    else:
        tl.store(cache + cache_off, tl.load(staging_ptr + staging_off, mask=mask), mask=mask)


def _launch(caches, block_table, start: int, head0: int, staging: torch.Tensor, to_staging: bool) -> None:
    n, h = staging.shape[2], staging.shape[3]
    if n == 0 or h == 0:
        return
    dev = staging.device
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=dev)
    strides = torch.tensor([list(c.stride()) for c in caches], dtype=torch.int64, device=dev)
    run(plan_staging(ptrs, strides, caches[0].shape[1], block_table, start, head0, staging, to_staging,
                     capability_of(staging)))


def plan_staging(ptrs, strides, block_size: int, block_table, start: int, head0: int, staging, to_staging: bool,
                 capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`_launch`: ``ptrs [2L]`` int64 data pointers and ``strides [2L, 4]`` of the caches."""
    n, h, d = staging.shape[2], staging.shape[3], staging.shape[4]
    grid = (ptrs.shape[0] * n, triton.cdiv(h * d, _BLOCK))
    return [Launch(_staging_kernel, grid, (
        ptrs, strides, block_table.contiguous(), staging.view(_INT[staging.dtype.itemsize]),
        start, n, block_size, head0, h * d, d), dict(TO_STAGING=to_staging, BLOCK=_BLOCK))]


def paged_kv_gather(caches, block_table, start: int, head_start: int, staging: torch.Tensor) -> None:
    """Fill ``staging [2, L, n, h, D]`` from ``caches`` (2L tensors ``[P, block_size, H_kv, D]``, any strides)."""
    _launch(caches, block_table, start, head_start, staging, True)


def paged_kv_scatter(staging: torch.Tensor, caches, block_table, start: int, cache_head_start: int) -> None:
    """Write ``staging [2, L, n, h, D]`` into ``caches`` at the request's ``block_table`` and ``cache_head_start``."""
    _launch(caches, block_table, start, cache_head_start, staging, False)
