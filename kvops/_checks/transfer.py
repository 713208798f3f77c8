"""Validator shared by ``kvops::paged_kv_gather`` and ``kvops::paged_kv_scatter`` (docs/semantics.md §6, the ops' side).

Both ops move the head slice ``[h0, h0 + h)`` of tokens ``[start, start + n)`` of one request between its pages (its
``block_table`` row) in ``2 * L`` paged caches ``[P, block_size, H_kv, D]`` (K layers then V layers) and one
contiguous staging buffer ``[2, L, n, h, D]``. Only metadata is checked (block ids are content; the CPU kernel checks
them, see ``kvops.cpu.transfer``).

The caches are NHD only (as vLLM's and sglang's transfer paths): when the staged head slice does not fit a cache's
``num_kv_heads`` but fits its ``block_size`` dim, the error says the cache may be HND and how to get an NHD view
(``cache.transpose(1, 2)``, no copy). An HND cache whose misread head count still holds the slice (e.g.
``H_kv == block_size``) cannot be told from an NHD one by its shape: it is read as NHD.
"""

from __future__ import annotations

import torch

from .overlap import check_caches_disjoint
from .common import as_int, index_fix, require_ndim, require_same_device, require_writable
from .paged_write import layout_hint

CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
STAGING_LAYOUT = "[2, num_layers, num_tokens, num_heads, head_dim]"


def check_paged_kv_transfer(
    op: str,
    caches: list[torch.Tensor],
    block_table: torch.Tensor,
    staging: torch.Tensor,
    start,
    head_start: int,
    head_arg: str,
    writes_caches: bool,
) -> None:
    """Validate a gather (``writes_caches=False``) or scatter (``True``) between ``caches`` and ``staging``.

    Raises ``ValueError`` for: an empty or odd-length ``caches`` list; a cache that is not 4-D NHD or differs from
    ``caches[0]`` in shape, dtype or device; a cache with a stride-0 dim (scatter only); a ``block_table`` that is not
    1-D int32/int64 on the caches' device; a ``staging`` that is not 5-D ``[2, L, n, h, D]`` matching the caches
    (layers, ``head_dim``, dtype, device) or is not contiguous; a head slice ``[head_start, head_start + h)`` outside
    ``[0, H_kv)`` (the message names ``head_arg``, and says when the cache may be HND); a negative ``start``; tokens
    ``[start, start + n)`` beyond the ``block_table``'s capacity (``blocks * block_size``); a ``staging`` that shares
    memory with a cache (checked from storages and strides before anything is written; the message names both).
    """
    if len(caches) == 0 or len(caches) % 2:
        raise ValueError(
            f"{op}: caches must hold the K caches of all layers then their V caches (2 * num_layers tensors), got "
            f"{len(caches)} tensors. Pass k_caches and v_caches of equal length >= 1."
        )
    first = caches[0]
    require_ndim(op, "caches[0]", first, 4, CACHE_LAYOUT)
    for i, c in enumerate(caches):
        require_ndim(op, f"caches[{i}]", c, 4, CACHE_LAYOUT)
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError(
                f"{op}: caches[{i}] (shape {tuple(c.shape)}, {c.dtype}, {c.device}) differs from caches[0] (shape "
                f"{tuple(first.shape)}, {first.dtype}, {first.device}); every layer's K and V cache must have one "
                f"shape [P, block_size, H_kv, D] (V head_dim equal to K's), dtype and device."
            )
        if writes_caches:
            require_writable(op, f"caches[{i}]", c)
    if writes_caches:
        check_caches_disjoint(op, [(f"caches[{i}]", c) for i, c in enumerate(caches)])
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: block_table must be the request's 1-D int32 or int64 row [num_blocks_of_request], got shape "
            f"{tuple(block_table.shape)} and dtype {block_table.dtype}. "
            + index_fix("block_table", block_table, 1, (torch.int32, torch.int64),
                        "[num_blocks_of_request] (one request's row, e.g. block_table[b])", torch.int32)
        )
    require_same_device(op, "block_table", block_table, "caches[0]", first)

    num_layers = len(caches) // 2
    _, block_size, num_kv_heads, head_dim = first.shape
    require_ndim(op, "staging", staging, 5, STAGING_LAYOUT)
    if staging.shape[0] != 2 or staging.shape[1] != num_layers or staging.shape[4] != head_dim:
        raise ValueError(
            f"{op}: staging shape {tuple(staging.shape)} must be [2, num_layers={num_layers}, num_tokens, num_heads, "
            f"head_dim={as_int(head_dim)}] ({STAGING_LAYOUT}: K layers then V layers)."
        )
    if staging.dtype != first.dtype:
        raise ValueError(
            f"{op}: staging dtype {staging.dtype} does not match the caches' dtype {first.dtype}; the transfer moves "
            f"bits unchanged. Allocate staging as {first.dtype}."
        )
    require_same_device(op, "staging", staging, "caches[0]", first)
    if not staging.is_contiguous():
        raise ValueError(
            f"{op}: staging of shape {tuple(staging.shape)} and strides {staging.stride()} is not contiguous; it is "
            f"sent as one buffer. Allocate it with torch.empty(shape) (or a contiguous slice of a larger buffer)."
        )
    harm = "the scatter would overwrite the staging buffer it reads" if writes_caches else \
        "the gather would overwrite the cache it reads"
    for i, c in enumerate(caches):
        if _overlaps(staging, c):
            raise ValueError(
                f"{op}: staging (shape {tuple(staging.shape)}) and caches[{i}] (the {'K' if i < num_layers else 'V'} "
                f"cache of layer {i % num_layers}, shape {tuple(c.shape)}) share memory: {harm}. Allocate staging "
                f"as its own buffer (torch.empty({list(staging.shape)}, dtype={staging.dtype}))."
            )
    num_tokens, num_heads = staging.shape[2], staging.shape[3]
    if head_start < 0 or head_start + num_heads > num_kv_heads:
        fix = (
            f"Pass 0 <= {head_arg} <= {as_int(num_kv_heads - num_heads)} for {as_int(num_heads)} staged heads."
            if num_heads <= num_kv_heads else
            f"Pass staging with at most {as_int(num_kv_heads)} heads (it carries {as_int(num_heads)})."
        )
        raise ValueError(
            f"{op}: head slice [{head_start}, {head_start + as_int(num_heads)}) is outside the caches' heads "
            f"[0, {as_int(num_kv_heads)}). {fix}"
            + layout_hint(first, "NHD", f"{as_int(num_heads)} staged heads from {head_arg}={head_start}",
                          lambda h: 0 <= head_start and head_start + num_heads <= h, op)
        )
    if start < 0:
        raise ValueError(f"{op}: start must be >= 0 (a token position in the request), got {as_int(start)}.")
    capacity = block_table.shape[0] * block_size
    if start + num_tokens > capacity:
        raise ValueError(
            f"{op}: tokens [{as_int(start)}, {as_int(start + num_tokens)}) exceed the request's block_table capacity "
            f"of {as_int(block_table.shape[0])} blocks x block_size {as_int(block_size)} = {as_int(capacity)} tokens. "
            f"Pass a block_table covering start + num_tokens tokens."
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Element range ``[first, last + 1)`` of ``t``'s storage that ``t`` can address (metadata only)."""
    first = t.storage_offset()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return first, first + extent + 1


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` can address a common element: same storage (also for fake tensors, whose storages
    follow the real ones' sharing) and intersecting spans. Empty tensors overlap nothing."""
    if a.numel() == 0 or b.numel() == 0 or not torch._C._is_alias_of(a, b):
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    ia, ib = a.element_size(), b.element_size()
    return a0 * ia < b1 * ib and b0 * ib < a1 * ia
