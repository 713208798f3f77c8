"""Where ``PackedCausalKVCache``'s rows live (``packed.py``): ``PackedStorage``, its base class, holds the cursors
and accounting (``nbytes``, ``local_end``, ``reset``, ``pin_current_chunk``), the map from a chunk to its storage
(dense sink, dense ring, packed pool, sink and pinned slots: ``_chunk``, ``_slot``, ``packed_slots``, ``_storage``),
and the moves between them (``_advance`` quantizes the chunk leaving the ring into its pool slot, ``_keep_pinned``
copies a pinned chunk aside).

The constructor (which allocates every buffer and sets the state these methods read) and the update
(``update_and_get_attention_kv``, ``update``) are in ``packed.py``; the pool's layout and the window gathers in
``_packed_pool.py``.
"""

from __future__ import annotations

import torch

from ..ops.contiguous import cache_write
from ..ops.packed import PackedKV, quantize_kv
from ._clamp import positive, smin
from ._packed_pool import pool_slot


class PackedStorage:
    """Cursors, accounting and chunk storage of :class:`~kvops.cache.PackedCausalKVCache` (see its docstring); the
    state (buffers, pool, slot bases, cursors) is set by its constructor."""

    # --- accounting and cursors ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes resident for K and V: dense ring and sink rows, the packed pool (codes, scales, zero points,
        centroids, cluster ids; with the scratch slot, one packed chunk), the pinned chunk's copy, all included.
        Constant over a stream (everything is preallocated)."""
        total = 0
        dense_pin = () if isinstance(self.k_pin, PackedKV) else (self.k_pin, self.v_pin)
        for t in (self.k_ring, self.v_ring, self.k_sink, self.v_sink, self.pool) + dense_pin:
            total += 0 if t is None else t.nbytes if isinstance(t, PackedKV) else t.numel() * t.element_size()
        return total

    def _slot(self, part: str, kv: int, i: int) -> PackedKV:
        """Packed slot ``i`` (an int or a SymInt) of ``part`` (``"pool"``, ``"sink"``, ``"pin"``) for K (``kv=0``)
        or V; ``part=None`` is the scratch slot."""
        if part is None:
            return pool_slot(self.pool, self._slots - 1, self._slots)
        base, count = self._slot_base[part]
        return pool_slot(self.pool, base + kv * count + i, self._slots)

    def packed_slots(self, part: str, kv: int) -> PackedKV:
        """Every slot of ``part`` for K (``kv=0``) or V as one :class:`PackedKV` of views, slots in order (a
        token-indexed format reads as ``count * N`` tokens)."""
        base, count = self._slot_base[part]
        first, slots = base + kv * count, self._slots
        return PackedKV(self.pool.quant, *(
            None if t is None else t.narrow(1, first * (t.shape[1] // slots), count * (t.shape[1] // slots))
            for t in self.pool[1:]
        ))

    @property
    def local_end(self) -> int:
        """``L``: rows in use in the equivalent dense cache, ``min(G, S)``."""
        return smin(self.global_end, self.cache_size)  # no Min term under torch.compile (kvops.cache._clamp)

    @property
    def pinned_chunk(self) -> int:
        """Index of the pinned chunk (-1 without a pin)."""
        return self._storage_pos(self.pinned_position) // self.chunk_tokens if self.pinned_len > 0 else -1

    def _storage_pos(self, p):
        """Storage position of global position ``p`` (an int or SymInt): ``p``, plus the first chunk's padding
        ``chunk_tokens - first_chunk_tokens`` once ``p >= first_chunk_tokens`` (branch-free)."""
        return p + self._pad * positive(p - self.first_chunk_tokens + 1) if self._pad else p

    def reset(self) -> None:
        """Start a new stream at position 0 and forget the pin (the buffers are not touched)."""
        self.global_end, self.current_start, self.pinned_position, self.pinned_len = 0, -1, -1, 0

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        """True when ``K == 0`` and ``S == W == num_new_tokens`` (as ``CausalKVCache``)."""
        n = num_new_tokens
        return self.sink_tokens == 0 and self.cache_size == n and self.attention_window_size == n

    def pin_current_chunk(self, num_tokens: int) -> None:
        """Pin the chunk just written (its last ``num_tokens`` tokens) as a "shot" sink of ``min(K, n)`` tokens, as
        :meth:`kvops.CausalKVCache.pin_current_chunk` (docs/semantics.md §1.2, §1.7): the pinned tokens are never
        evicted; they follow the rows after the global sink until they sit right after it. When the pinned chunk
        leaves the dense ring it is copied once (packed with ``quantize_sink=True``, else dense) and read from the
        copy. ``K == 0`` or ``num_tokens <= 0`` clears the pin.

        Raises:
            ValueError: the cache was built without ``pinnable=True``; ``num_tokens`` larger than the current
                chunk; the pinned rows would start inside the global sink (the wording of ``CausalKVCache``).
            NotImplementedError: a pin after tokens were evicted while rows after the global sink do not hold
                consecutive positions (an old sink ``sink_tokens > global_sink_tokens`` or a settled older pin).
        """
        name, g, l, gs = self.name, self.global_end, self.local_end, self.global_sink_tokens
        if self.sink_tokens <= 0 or num_tokens <= 0:
            self.pinned_position, self.pinned_len = -1, 0
            return
        if not self.pinnable:
            raise ValueError(
                f"{name}.pin_current_chunk: build the cache with pinnable=True (it preallocates one chunk for the "
                f"pinned copy)."
            )
        if self.current_start < 0 or num_tokens > g - self.current_start:
            raise ValueError(
                f"{name}.pin_current_chunk({num_tokens}): only tokens of the current chunk can be pinned (it holds "
                f"{max(0, g - self.current_start)} tokens); the packed cache stores chunk-aligned segments."
            )
        start = l - num_tokens
        if start < gs or start < 0:
            raise ValueError(
                f"{name}.pin_current_chunk({num_tokens}): the chunk would start at row {start} "
                f"(local_end={l} minus {num_tokens}), which is before row 0 or inside the global sink "
                f"[0, {gs}). Pin a chunk right after appending it past the global sink."
            )
        settled_pin = self.pinned_len > 0 and self.pinned_position - (g - l) <= gs
        if g > l and (settled_pin or (self.pinned_len == 0 and self.sink_tokens > gs)):
            raise NotImplementedError(
                f"{name}.pin_current_chunk: tokens were evicted and rows [{gs}, ...) after the global sink hold "
                f"{'a settled pinned chunk' if settled_pin else f'the sink [0, {self.sink_tokens})'}, not consecutive "
                f"positions; the packed cache pins before the first eviction, or with global_sink_tokens >= "
                f"sink_tokens."
            )
        self.pinned_position, self.pinned_len = g - num_tokens, min(self.sink_tokens, num_tokens)
        cur = self._storage_pos(self.current_start) // self.chunk_tokens
        if cur >= self.sink_chunks:  # (a sink chunk is kept anyway)
            self._keep_pinned(*self._chunk(cur, cur))

    # --- where chunk c lives ------------------------------------------------------------------------------------
    def _chunk(self, c: int, cur: int):
        """Storage of chunk ``c`` while ``cur`` is the current chunk: ``(k, v)`` dense ``[B, N, H, D]`` views or
        :class:`PackedKV` slots."""
        n = self.chunk_tokens
        if c < self.sink_chunks and not self.quantize_sink:
            return self.k_sink.narrow(1, c * n, n), self.v_sink.narrow(1, c * n, n)
        if c > cur - self.ring_chunks:
            row = (c % self.ring_chunks) * n
            return self.k_ring.narrow(1, row, n), self.v_ring.narrow(1, row, n)
        if c < self.sink_chunks:
            return self._slot("sink", 0, c), self._slot("sink", 1, c)
        if self.pinnable and self.pinned_len > 0 and c == self.pinned_chunk:
            return self.k_pin, self.v_pin
        slot = c % self.pool_chunks
        return self._slot("pool", 0, slot), self._slot("pool", 1, slot)

    def _storage(self, kv: int) -> list:
        """K (``kv = 0``) or V storage in row order (:func:`kvops.cache._packed_pool.storage_segments`): ``[(part, [rows,
        ...]), ...]``."""
        pick = lambda pair: pair[kv]  # noqa: E731
        parts = []
        if self.sink_chunks:
            parts.append(("sink", [self._slot("sink", kv, i) for i in range(self.sink_chunks)]
                          if self.quantize_sink else [pick((self.k_sink, self.v_sink))]))
        if self.pool_chunks:
            pool = self.packed_slots("pool", kv)
            slots = [pool] if self._per_token else [self._slot("pool", kv, i) for i in range(self.pool_chunks)]
            parts.append(("pool", slots))
        parts.append(("ring", [pick((self.k_ring, self.v_ring))]))
        if self.pinnable:
            parts.append(("pin", [pick((self.k_pin, self.v_pin))]))
        return parts

    # --- moving chunks between the ring, the pool and the pinned copy --------------------------------------------
    def _advance(self, new: int, append: int) -> None:
        """Chunk ``new`` is written (``append``: 1 when it just became current, else 0): the chunk that left the ring
        is quantized into its pool slot (whose older chunk is out of the window by then; with no pool, the chunk
        leaving the ring is). Under torch.compile a rewrite quantizes the ring slot into the pool's scratch slot instead
        (never read), so that appends and rewrites run one graph; in eager a rewrite quantizes nothing. The other
        branches here flip once per stream."""
        old = new - self.ring_chunks
        if self.quant is None or old < 0:
            return
        if not torch.compiler.is_compiling() and append == 0:  # (is_compiling first: no guard on append)
            return  # eager: nothing to quantize (the scratch write of a rewrite only keeps one graph when compiled)
        if old < self.sink_chunks:
            if not self.quantize_sink:
                return  # a dense sink chunk never enters the ring
            part, slot = "sink", old
        else:
            if self.pool_chunks == 0:
                return
            part, slot = "pool", old % self.pool_chunks
        base, count = self._slot_base[part]
        k_rows, v_rows = self._chunk(old, new - 1)
        q = dict(group_size=self._fmt["group_size"], stages=self._fmt["stages"], kmeans_iters=self.kmeans_iters)
        for kv, rows in ((0, k_rows), (1, v_rows)):
            i = append * (base + kv * count + slot) + (1 - append) * (self._slots - 1)  # a rewrite: the scratch
            quantize_kv(rows, self.quant, out=pool_slot(self.pool, i, self._slots), **q)

    def _keep_pinned(self, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        if isinstance(self.k_pin, PackedKV):
            q = dict(group_size=self._fmt["group_size"], stages=self._fmt["stages"], kmeans_iters=self.kmeans_iters)
            quantize_kv(k_rows, self.quant, out=self.k_pin, **q)
            quantize_kv(v_rows, self.quant, out=self.v_pin, **q)
        else:
            cache_write(k_rows, v_rows, self.k_pin, self.v_pin, 0)
