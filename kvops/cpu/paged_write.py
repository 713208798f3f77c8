"""CPU kernel for ``kvops::paged_cache_write`` (docs/semantics.md §3).

Vectorized: one ``index_copy_`` per cache on a ``[P * block_size, H_kv, D]`` *view* of the cache when the block and
row dims can be merged without a copy (contiguous caches, K/V views of a ``[P, block_size, 2, H_kv, D]`` allocation);
otherwise (e.g. K/V views of a ``[P, 2, block_size, H_kv, D]`` allocation) one ``index_put_`` with (block, row)
indices, which also writes in place. The cache is never copied.
"""

from __future__ import annotations

import torch

from .._checks.common import FP8_MAX


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, h0: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [N, H_in, D] / scale`` in fp32, saturated to ``±448``, cast to ``dtype`` (round to nearest even).

    ``scale`` is fp32 ``[1]`` or ``[H_kv]``; with ``[H_kv]``, input head ``i`` uses the scale of cache head ``h0 + i``.
    """
    s = scale if scale.shape[0] == 1 else scale[h0 : h0 + x.shape[1]]
    return (x.to(torch.float32) / s.view(1, -1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, last]`` that ``t`` (non-empty) can touch."""
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        step = (size - 1) * stride * t.element_size()
        if step < 0:
            lo += step
        else:
            hi += step
    return lo, hi + t.element_size() - 1


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` may share bytes: the same storage and intersecting byte ranges (conservative: K/V views
    of one joint allocation count as overlapping). Cheap when the storages differ (two pointers compared)."""
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() or not x.numel() or not y.numel():
        return False
    (lo, hi), (y_lo, y_hi) = _span(x), _span(y)
    return lo <= y_hi and y_lo <= hi


def unaliased(x: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when its memory overlaps one of ``caches`` (which the caller writes afterwards).

    The cache writes read their sources as they were before the call (snapshot semantics, as the compiled code's:
    docs/semantics.md §1, §3), whatever order a kernel writes in. Cheap when nothing aliases (storage pointers
    compared; byte ranges only for a shared storage); the copy is of the source only, never of a cache.
    """
    return x.clone() if any(overlaps(x, cache) for cache in caches) else x


def _flat_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache [P, block_size, H, D]`` viewed as ``[P * block_size, H, D]`` without a copy, or None if impossible."""
    p, block_size = cache.shape[0], cache.shape[1]
    stride = cache.stride()
    if p > 1 and block_size > 1 and stride[0] != block_size * stride[1]:
        return None  # block and row dims cannot be merged for these strides (e.g. kv[:, 0] of [P, 2, bs, H, D])
    return cache.view(-1, *cache.shape[2:])


def scatter_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, h0: int) -> None:
    """``cache[slot // block_size, slot % block_size, h0:h0+H_in] = x[i]`` for every (non-negative) ``slots[i]``."""
    h = x.shape[1]
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:  # fp8: index_copy_ has no fp8 CPU kernel
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)  # same-size reinterpretation, still a view
    if h != cache.shape[2]:
        cache = cache[:, :, h0 : h0 + h]
    flat = _flat_rows(cache)
    if flat is not None:
        flat.index_copy_(0, slots, x)
    else:
        block_size = cache.shape[1]
        cache.index_put_((slots // block_size, slots % block_size), x)


def slot_error(top: int, num_blocks: int, block_size: int) -> IndexError:
    """The CPU kernels' own error for a slot ``top >= num_blocks * block_size`` (raised whatever the value-check
    mode: reading the slots is free on CPU)."""
    num_slots = num_blocks * block_size
    return IndexError(
        f"kvops.paged_cache_write: slot_mapping holds slot {top} but the cache has only {num_slots} slots "
        f"({num_blocks} blocks x block_size {block_size}); valid slots are [0, {num_slots}) or negative (skip)."
    )


def paged_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    h0: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Write token ``i`` of ``key``/``value`` into slot ``slot_mapping[i]`` (skipped when negative), in place.

    Arguments were validated by ``kvops._checks.paged_write.check_paged_cache_write`` (which returned ``h0``).
    Raises ``IndexError`` for a slot ``>= P * block_size`` (the CPU kernel reads the slots anyway, so this is free).
    Duplicate non-negative slots in one call: which token lands is unspecified (as in vLLM).
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots = slot_mapping.to(torch.int64)
    key, value = key[:n], value[:n]  # rows >= N are ignored (each cut on its own: the rotary write passes N keys)
    key, value = unaliased(key, k_cache, v_cache), unaliased(value, k_cache, v_cache)  # read before any write
    low, top = torch.aminmax(slots)  # the CPU kernel may read the slots: one pass for both checks
    low, top = int(low), int(top)
    if low < 0:  # padding: keep the non-negative slots
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
    if top >= k_cache.shape[0] * k_cache.shape[1]:
        raise slot_error(top, k_cache.shape[0], k_cache.shape[1])
    if k_scale is not None:
        key = quantize_fp8(key, k_scale, h0, k_cache.dtype)
        value = quantize_fp8(value, v_scale, h0, v_cache.dtype)
    scatter_rows(key, k_cache, slots, h0)
    scatter_rows(value, v_cache, slots, h0)
