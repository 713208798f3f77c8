"""CPU kernels for the contiguous-cache ops.

They use slicing on the caches as given, so strided views (a head slice of a larger cache, K and V as two views of
one ``[B, S, 2, H, D]`` allocation) are written in place and never copied.
"""

from __future__ import annotations

from .paged_write import overlaps, unaliased


def cache_write(key, value, k_cache, v_cache, start: int, h0: int) -> None:
    """Copy ``key``/``value`` ``[B, T, H_in, D]`` into rows ``[start, start+T)``, heads ``[h0, h0+H_in)``; a source
    overlapping a cache is read before anything is written (copied first: docs/semantics.md §1)."""
    key, value = unaliased(key, k_cache, v_cache), unaliased(value, k_cache, v_cache)
    t, h = key.shape[1], key.shape[2]
    k_cache[:, start : start + t, h0 : h0 + h].copy_(key)
    v_cache[:, start : start + t, h0 : h0 + h].copy_(value)


def cache_roll(k_cache, v_cache, src: int, dst: int, n: int, h0: int, h1: int) -> None:
    """Move rows ``[src, src+n)`` to ``[dst, dst+n)`` within heads ``[h0, h1)``; correct when the ranges overlap and
    when the two caches share memory (``k_cache is v_cache``: both moves read the rows as they were before the call,
    as compiled code does)."""
    if n == 0 or src == dst:
        return
    caches = (k_cache, v_cache)
    moved = [cache[:, src : src + n, h0:h1] for cache in caches]
    if abs(src - dst) < n:  # copy_ refuses partially overlapping memory: stage the moved rows (not the cache)
        moved = [rows.clone() for rows in moved]
    elif overlaps(k_cache, v_cache):  # V's source rows may be K's destination: stage V's before writing K
        moved[1] = moved[1].clone()
    for cache, rows in zip(caches, moved):
        cache[:, dst : dst + n, h0:h1].copy_(rows)
