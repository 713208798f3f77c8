"""Validators for the contiguous-cache ops (``kvops::cache_write``, ``kvops::cache_roll``).

Caches are ``[B, S, H_cache, D]`` (``D_v`` for values); writers carry ``[B, T, H_in, D]``.
"""

from __future__ import annotations

import torch

from .overlap import check_caches_disjoint
from .common import (
    as_int,
    check_head_slice,
    check_kv_pair,
    index_fix,
    require_dim_match,
    require_ndim,
    require_same_device,
    require_same_dtype,
    require_writable,
)

CACHE_LAYOUT = "[batch, cache_len, num_kv_heads, head_dim]"
TOKENS_LAYOUT = "[batch, num_new_tokens, num_heads, head_dim]"


def check_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor | None) -> None:
    """K and V caches: both present, 4-D, same dtype, device, batch, length and heads (``D_v`` may differ), and
    writable in place."""
    check_kv_pair(op, k_cache, v_cache, CACHE_LAYOUT, "[batch, cache_len, num_kv_heads]")
    require_writable(op, "k_cache", k_cache)
    require_writable(op, "v_cache", v_cache)


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    start,
    cache_head_start: int | None,
    op: str = "kvops.cache_write",
    check_rows: bool = True,
) -> int:
    """Validate a write of ``T`` tokens at rows ``[start, start + T)``; returns the first cache head written.

    ``check_rows=False`` checks everything but the row range: the cache classes plan their rows themselves (a chunk
    may be longer than the rows it lands on after an eviction), and their messages show the key as given."""
    check_caches(op, k_cache, v_cache)
    check_caches_disjoint(op, [("k_cache", k_cache), ("v_cache", v_cache)])
    if value is None:
        raise ValueError(f"{op}: value must be provided (got value=None with a v_cache); pass value [B, T, H_in, D_v].")
    require_ndim(op, "key", key, 4, TOKENS_LAYOUT)
    require_ndim(op, "value", value, 4, TOKENS_LAYOUT)
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"{op}: key shape {tuple(key.shape)} and value shape {tuple(value.shape)} must agree in "
            f"[batch, num_new_tokens, num_heads]."
        )
    for name, t, cache_name, cache in (("key", key, "k_cache", k_cache), ("value", value, "v_cache", v_cache)):
        require_same_dtype(op, name, t, cache_name, cache)
        require_same_device(op, name, t, cache_name, cache)
        require_dim_match(op, "batch", name, t, 0, cache_name, cache, 0)
        require_dim_match(op, "head_dim", name, t, 3, cache_name, cache, 3)
    in_heads, cache_heads = key.shape[2], k_cache.shape[2]
    if cache_head_start is None and in_heads != cache_heads and in_heads == k_cache.shape[1]:
        raise ValueError(
            f"{op} requires cache_head_start when cache heads ({as_int(cache_heads)}) differ from input heads "
            f"({as_int(in_heads)}). k_cache of shape {tuple(k_cache.shape)} has the {as_int(in_heads)} input heads in "
            f"dim 1: it looks like SDPA's layout [batch, num_heads, seq_len, head_dim], with heads and tokens "
            f"swapped. kvops caches are {CACHE_LAYOUT}: pass k_cache.transpose(1, 2) and v_cache.transpose(1, 2) "
            f"(views of the same memory, no copy)."
        )
    h0 = check_head_slice(op, cache_heads, in_heads, cache_head_start)
    num_new, cache_len = key.shape[1], k_cache.shape[1]
    if check_rows and (start < 0 or start + num_new > cache_len):
        raise RuntimeError(write_range_message(op, as_int(start), as_int(num_new), as_int(cache_len)))
    return h0


def write_range_message(op: str, s: int, n: int, cache_len: int) -> str:
    """The write's range error (docs/semantics.md §1.5 wording), with the fix for the case at hand; shared by the int
    form and the tensor form's value check."""
    if n > cache_len:
        fix = (f"num_new_tokens exceeds kv_cache_size: write at most {cache_len} tokens per call, or allocate a cache "
               f"of at least {n} rows.")
    elif s < 0:
        fix = "Pass start >= 0 (the first cache row written)."
    else:
        fix = (f"Pass start <= {cache_len - n} (kv_cache_size - num_new_tokens), write at most {cache_len - s} "
               f"token{'s' if cache_len - s != 1 else ''} at start={s}, or allocate a cache of at least {s + n} rows "
               f"(kvops.CausalKVCache evicts old rows when its cache is full).")
    return (f"Invalid {op} write range: local=[{s}, {s + n}), kv_cache_size={cache_len}, num_new_tokens={n}. Rows "
            f"must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. {fix}")


def check_cache_roll(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    src,
    dst,
    num_tokens,
    cache_head_start: int | None,
    num_heads: int | None,
    op: str = "kvops.cache_roll",
) -> tuple[int, int]:
    """Validate moving rows ``[src, src + n)`` to ``[dst, dst + n)``; returns the head slice ``(h0, h1)``."""
    check_caches(op, k_cache, v_cache)
    cache_heads, cache_len = k_cache.shape[2], k_cache.shape[1]
    h0 = 0 if cache_head_start is None else cache_head_start
    if num_heads is None:
        if not 0 <= h0 < cache_heads:
            raise ValueError(
                f"{op}: cache_head_start={h0} is outside the cache's heads [0, {cache_heads}). Pass "
                f"0 <= cache_head_start < {cache_heads}."
            )
        num_heads = cache_heads - h0
    if num_heads <= 0:
        raise ValueError(
            f"{op}: num_heads must be positive, got {num_heads}. Pass the number of heads to move (or None for all "
            f"heads from cache_head_start)."
        )
    h0 = check_head_slice(op, cache_heads, num_heads, h0)
    if num_tokens < 0 or src < 0 or dst < 0 or src + num_tokens > cache_len or dst + num_tokens > cache_len:
        raise RuntimeError(roll_range_message(op, as_int(src), as_int(dst), as_int(num_tokens), cache_len))
    return h0, h0 + num_heads


def roll_range_message(op: str, src: int, dst: int, num_tokens: int, cache_len) -> str:
    """The roll's range error (docs/semantics.md §1.8), shared by the int form and the tensor form's value check."""
    s, d, n = src, dst, num_tokens
    return (f"Invalid {op} range: src=[{s}, {s + n}), dst=[{d}, {d + n}), kv_cache_size={cache_len}, "
            f"num_tokens={n}. Both ranges must lie in [0, kv_cache_size) and num_tokens must be >= 0.")


def check_roll_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, src, dst, num_tokens,
                    op: str = "kvops.cache_roll") -> None:
    """Metadata of a ``cache_roll`` whose ``src``/``dst``/``num_tokens`` include a tensor (compiled streaming loops
    keep positions in tensors): each tensor int32/int64, ``[]`` or ``[1]``, on the caches' device; ``k_cache`` and
    ``v_cache`` distinct (the tensor form moves rows through a cache write, which needs two caches; the int form
    accepts ``k_cache is v_cache``). Their values are a value contract (``kvops._checks.values.check_roll_rows``)."""
    for name, x in (("src", src), ("dst", dst), ("num_tokens", num_tokens)):
        if not isinstance(x, torch.Tensor):
            continue
        if x.dtype not in (torch.int32, torch.int64) or x.dim() > 1 or (x.dim() == 1 and x.shape[0] != 1):
            raise ValueError(
                f"{op}: {name} must be an int or an int32/int64 tensor holding one row count or row ([] or [1]); got "
                f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}. "
                + index_fix(name, x, None, (torch.int32, torch.int64), "[] or [1]")
            )
        require_same_device(op, name, x, "k_cache", k_cache)
    if k_cache.dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"{op}: a {k_cache.dtype} cache cannot be moved with tensor positions: the rows are moved by a cache "
            f"write, which quantizes into {k_cache.dtype} caches. Pass int positions (a plain copy)."
        )
    if v_cache is k_cache:
        raise ValueError(
            f"{op}: k_cache is v_cache; with tensor positions the rows are moved by a cache write, which needs two "
            f"distinct caches. Pass int positions to roll one tensor as both caches, or pass separate K and V caches."
        )


def check_write_rows(key: torch.Tensor, k_cache: torch.Tensor, start: torch.Tensor,
                     op: str = "kvops.cache_write") -> None:
    """Metadata of a ``start`` given as a tensor (compiled generate loops keep positions in tensors, e.g. gpt-fast's
    ``input_pos``): int32/int64 on the caches' device, ``[]`` or ``[1]`` (the first row of the ``T`` new tokens) or
    ``[T]`` (one row per token). Its values are a value contract (``kvops._checks.values.check_write_rows``); the
    only range fact known from shapes, a chunk longer than the cache, is a ``RuntimeError`` here."""
    num_new, cache_len = key.shape[1], k_cache.shape[1]
    if start.dtype not in (torch.int32, torch.int64) or start.dim() > 1 or (
            start.dim() == 1 and start.shape[0] != 1 and start.shape[0] != num_new):
        raise ValueError(
            f"{op}: start must be an int, or an int32/int64 tensor holding the first row ([] or [1]) or one row per "
            f"new token ([num_new_tokens] = [{as_int(num_new)}], as gpt-fast's input_pos); got a tensor of shape "
            f"{tuple(start.shape)} and dtype {start.dtype}. "
            + index_fix("start", start, None, (torch.int32, torch.int64), f"[1] or [{as_int(num_new)}]")
        )
    require_same_device(op, "start", start, "k_cache", k_cache)
    if num_new > cache_len and (start.dim() == 0 or start.shape[0] == 1):
        raise RuntimeError(
            f"Invalid {op} write range: num_new_tokens={as_int(num_new)} exceeds kv_cache_size={as_int(cache_len)}, "
            f"so no start row fits. Rows must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. Write at "
            f"most {as_int(cache_len)} tokens per call, or allocate a cache of at least {as_int(num_new)} rows."
        )
