"""Rolling-window cache: a ring buffer of the last ``W`` tokens (transformers' sliding layers; docs/semantics.md §9).

Token at global position ``g`` lives in row ``g % W``; a write of ``T`` tokens is one ``kvops.cache_write`` (two when
the chunk crosses the wrap point; a chunk longer than ``W`` keeps its last ``W`` tokens). So token-by-token, chunked
and oversized writes of the same tokens end in the same state, bit for bit. Reads return the window in position order
(:meth:`RollingKVCache.window`), with a tensor offset so a compiled decode loop does not specialize on whether the
window has filled yet.
"""

from __future__ import annotations

import numbers

import torch

from .._checks.contiguous import check_cache_write
from ..ops import cache_write
from ._alloc import allocate
from ._validate import check_writer


class RollingKVCache:
    """Sliding-window K/V cache of capacity ``W`` tokens, ``[B, W, H_kv, D]`` (NHD) ring buffers.

    Semantics are those of transformers' sliding-window cache layers (``StaticSlidingWindowLayer``,
    ``DynamicSlidingWindowLayer``): after ``G`` tokens the cache holds tokens ``[max(0, G - W), G)``; at ``G == W`` it
    has not rolled yet (row ``r`` holds token ``r``); at ``G == W + 1`` it holds tokens ``1..W``; a prefill longer
    than ``W`` keeps its last ``W`` tokens. Unlike :class:`~kvops.cache.CausalKVCache` (whose contract raises the
    write-range error for a chunk longer than its buffer), nothing is ever out of range here.

    Bookkeeping is one Python int, :attr:`global_end` (``G``); all tensor work goes through ``kvops.cache_write``, so
    under ``torch.compile`` the write fuses with the op producing K/V. Pass the cache to the compiled function as an
    argument (not as an ``nn.Module`` attribute) so ``G`` becomes a dynamic int after one recompile.

    Args:
        k_cache: ``[B, W, H_kv, D]`` (any strides), mutated in place.
        v_cache: ``[B, W, H_kv, D_v]``, mutated in place.

    Raises:
        ValueError: caches that are not 4-D or disagree in ``[B, W, H_kv]`` (the write op's validator raises the
            remaining dtype/device/shape errors with its own wording).
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(
                f"RollingKVCache: k_cache and v_cache must be [batch, window, num_kv_heads, head_dim] and agree in "
                f"[batch, window, num_kv_heads]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}."
            )
        self.k_cache, self.v_cache = k_cache, v_cache
        self.window_size = k_cache.shape[1]
        self.global_end = 0

    @classmethod
    def allocate(cls, batch: int, window_size: int, num_kv_heads: int, head_dim: int, *,
                 head_dim_v: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> "RollingKVCache":
        """Zero-initialized caches ``[batch, window_size, num_kv_heads, head_dim]``; ``dtype``/``device`` default to
        torch's defaults, as for torch factories (the rule of every kvops cache, docs/semantics.md)."""
        for name, x in (("batch", batch), ("window_size", window_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"RollingKVCache.allocate: {name} must be an int, got {type(x).__name__} {x!r}.")
        if window_size <= 0:
            raise ValueError(f"RollingKVCache: window_size must be positive, got {window_size}.")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        shape = (batch, window_size, num_kv_heads)
        sizes = dict(batch=batch, window_size=window_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     head_dim_v=head_dim_v)
        return cls(*allocate("RollingKVCache.allocate", sizes, [(*shape, head_dim), (*shape, head_dim_v)], dtype,
                             device))

    @property
    def length(self) -> int:
        """Tokens held: ``min(G, W)``."""
        return min(self.global_end, self.window_size)

    @property
    def window_start(self) -> int:
        """Global position of the oldest token held: ``max(0, G - W)``."""
        return max(0, self.global_end - self.window_size)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append ``T`` tokens ``key [B, T, H_kv, D]``, ``value [B, T, H_kv, D_v]`` (positions ``[G, G + T)``).

        The ring row of position ``g`` is ``g % W``. ``T == 1`` (decode) is a single write at that row; a longer
        chunk is split at the wrap point; a chunk longer than ``W`` writes only its last ``W`` tokens.

        Raises (before anything is written or ``global_end`` moves): ``ValueError`` for a key/value that is not 4-D,
        in SDPA's swapped layout, disagreeing in ``[B, T, H_kv]``, or mismatching the caches' dtype, device, batch,
        heads or head_dim (the wording of ``kvops.cache_write``).
        """
        # Everything the writes will check, before the cursor moves: a failing write changes nothing.
        # (Traced, a failing trace runs nothing and the write op's fake rule checks the same metadata.)
        check_writer("RollingKVCache.write", key, value, self.k_cache.shape[2], None)
        if not torch.compiler.is_compiling():
            check_cache_write(key, value, self.k_cache, self.v_cache, 0, None,
                              op="RollingKVCache.write", check_rows=False)
        w, t, g = self.window_size, key.shape[1], self.global_end
        if t == 1:
            cache_write(key, value, self.k_cache, self.v_cache, g % w)
            self.global_end = g + t
            return
        self.global_end = g + t
        if t > w:  # only the last W tokens survive
            key, value, g, t = key[:, t - w:], value[:, t - w:], g + t - w, w
        row = g % w
        first = min(t, w - row)
        cache_write(key[:, :first], value[:, :first], self.k_cache, self.v_cache, row)
        if first < t:  # the chunk crosses the wrap point
            cache_write(key[:, first:], value[:, first:], self.k_cache, self.v_cache, 0)

    def window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The held tokens in position order: ``(k [B, W, H_kv, D], v [B, W, H_kv, D_v], start)``.

        Row ``j`` of the returned tensors holds global position ``start + j`` for ``j < min(G, W)`` (rows past that
        are unfilled); ``start = max(0, G - W)`` is a 0-d int64 tensor computed on the device, so a compiled loop does
        not specialize on whether the window has filled. The K/V are gathered copies (``index_select``), not views.
        """
        w, device = self.window_size, self.k_cache.device
        start = torch.zeros((), dtype=torch.int64, device=device).add(self.global_end - w).clamp_min(0)
        rows = (torch.arange(w, device=device) + start) % w
        return self.k_cache.index_select(1, rows), self.v_cache.index_select(1, rows), start

    def reset(self) -> None:
        """Forget all tokens (the buffers keep their values until overwritten)."""
        self.global_end = 0
