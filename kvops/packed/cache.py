"""``PackedCausalKVCache``: the streaming cache of docs/semantics.md §1 with quantized cold segments (§2).

Storage is chunk-aligned: chunk ``c`` holds global positions ``[c·N, (c+1)·N)`` (``N = chunk_tokens``). The current
chunk and the newest ``keep_recent_chunks`` completed chunks live in a dense ring (``R`` slots, chunk ``c`` in slot
``c % R``); when a chunk leaves the ring it is quantized once into a preallocated packed pool (``P`` slots, chunk
``c`` in slot ``c % P``) and its dense slot is reused by the next chunk. Sink chunks (those holding positions
``< sink_tokens``) live in their own dense buffer (or, with ``quantize_sink=True``, go through the ring and a packed
sink pool). Nothing is allocated after construction: ``nbytes`` is what a stream holds, all of it.

Bookkeeping is Python ints (``global_end`` and the current chunk's start); every tensor write goes through
``kvops.cache_write`` / ``kvops.quantize_kv``. The rows reported and shown are exactly those of a dense
``CausalKVCache`` of the same geometry (its window function, :func:`visible_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks.common import require_ndim
from .._checks.contiguous import TOKENS_LAYOUT, check_cache_write
from ..cache.causal import CausalKVView
from ..ops.contiguous import cache_write
from ..cache._window import visible_rows
from .ops import PackedKV, dequantize_kv, empty_packed, quantize_kv

Segment = torch.Tensor | PackedKV  # dense rows [B, n, H_in, D], or packed rows of one chunk


class PackedKVView(NamedTuple):
    """What :meth:`PackedCausalKVCache.update` returns: the visible window as segments, in token order.

    ``k``/``v`` are lists of segments, each either a dense view ``[B, n, H_in, D]`` of the cache or a
    :class:`PackedKV` of ``n`` rows (views of a pool slot). The four ints are those of :class:`CausalKVView`.
    """

    k: list
    v: list
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PackedCausalKVCache:
    """Streaming K/V cache of one attention layer whose cold chunks are stored quantized (docs/semantics.md §2).

    Same ``update_and_get_attention_kv`` contract, returned view and indices as :class:`kvops.CausalKVCache` for
    chunk-sequential streams (sinks, eviction, rewrites of the current chunk for denoising steps and the context
    pass, recent windows, head-sliced writers in lockstep); modelled on sglang's ``QVGPackedCausalKVCache`` (which
    is eager-only and LingBot-only) with preallocated pools, more formats and compile support.

    Args:
        batch_size, cache_size, num_kv_heads, head_dim: ``B``, ``S`` (rows of the equivalent dense cache: the
            retained window), ``H``, ``D``.
        chunk_tokens: ``N``, tokens per chunk; every append is exactly one chunk.
        quant: ``None`` (all dense: the bit-exact baseline), ``"int8"``, ``"fp8"``, ``"int4"`` or ``"int2"`` (see
            :func:`kvops.packed.packed_layout`).
        keep_recent_chunks: completed chunks kept dense besides the current one.
        sink_tokens: ``K``, positions never evicted (attention sinks); ``K + N <= S``.
        attention_window_size: ``W``, the whole visible budget in rows (default ``S``), as the dense cache.
        quantize_sink: store completed sink chunks packed too (default: dense).
        group_size, stages, num_clusters, kmeans_iters: format parameters (int4/int2; see ``quantize_kv``).
        dtype, device: of the dense rows and of the returned K/V.
        name: used in error messages (default ``"PackedCausalKVCache"``).

    Under ``torch.compile(fullgraph=True)`` use it as ``CausalKVCache`` (caches passed as an argument of the
    compiled function, built outside it): the cursors become dynamic ``SymInt``s and nothing reads a tensor to decide
    where to write. The window's segment structure (how many chunks are visible, which are packed) is Python
    control flow, so each chunk adds an append graph and a rewrite graph until the window is full; then the
    structure repeats and no graph is added. Bound (tests/test_packed_compile.py): ``2 * (ceil(S / N) + 1)``
    graphs per stream, more than Dynamo's default ``recompile_limit`` (8) for windows of more than 3 chunks --
    raise it in the generation loop's setup (kvops changes no config). Errors are raised at trace time (Dynamo
    reports them as ``torch._dynamo.exc.Unsupported`` carrying the original exception).

    Known limitation (torch 2.13): with the Inductor backend, a compiled stream of updates writes a quantized chunk
    into the wrong pool slot (observed: slot ``(c - 1) % P`` instead of ``c % P``, i.e. the slot index evaluated with
    another cursor's value); Dynamo with the ``"eager"`` and ``"aot_eager"`` backends is exact (tests). Until that is
    fixed, keep the cache update out of Inductor-compiled regions; ``packed_attention`` and ``dequantize_kv``
    compile with Inductor (the dequantize fuses into its consumer).

    Raises:
        ValueError: ``S < K + N``, negative sizes, bad format parameters.
    """

    def __init__(
        self, *, batch_size: int, cache_size: int, num_kv_heads: int, head_dim: int, chunk_tokens: int,
        quant: str | None, keep_recent_chunks: int = 1, sink_tokens: int = 0, attention_window_size: int | None = None,
        quantize_sink: bool = False, group_size: int | None = None, stages: int = 1, num_clusters: int = 16,
        kmeans_iters: int = 4, dtype: torch.dtype | None = None, device=None, name: str = "PackedCausalKVCache",
    ) -> None:
        b, s, h, d, n, k = batch_size, cache_size, num_kv_heads, head_dim, chunk_tokens, sink_tokens
        if n < 1 or k < 0 or keep_recent_chunks < 0:
            raise ValueError(
                f"{name}: chunk_tokens ({n}) must be >= 1, sink_tokens ({k}) and keep_recent_chunks "
                f"({keep_recent_chunks}) >= 0."
            )
        if s < k + n:
            raise ValueError(
                f"{name}: cache_size ({s}) must be >= sink_tokens + chunk_tokens ({k} + {n}) so that a chunk fits "
                f"after the sink."
            )
        if attention_window_size is not None and attention_window_size < 1:
            raise ValueError(f"{name}: attention_window_size must be >= 1 (or None), got {attention_window_size}.")
        self.name, self.quant, self.chunk_tokens, self.sink_tokens = name, quant, n, k
        self.cache_size = s
        self.attention_window_size = s if attention_window_size is None else attention_window_size
        self.num_kv_heads, self.head_dim = h, d
        self.kmeans_iters = kmeans_iters
        fmt = dict(group_size=group_size, stages=stages, num_clusters=num_clusters, device=device)
        self.sink_chunks = _cdiv(k, n)
        self.quantize_sink = quantize_sink and quant is not None and self.sink_chunks > 0
        retained = _cdiv(s - k, n)  # non-sink chunks a full window touches (the current one included)
        self.ring_chunks = retained if quant is None else min(keep_recent_chunks + 1, retained)
        self.pool_chunks = retained - self.ring_chunks
        self.k_ring = torch.zeros(b, self.ring_chunks * n, h, d, dtype=dtype, device=device)
        self.v_ring = torch.zeros_like(self.k_ring)
        dense_sink = 0 if self.quantize_sink else self.sink_chunks * n
        self.k_sink = torch.zeros(b, dense_sink, h, d, dtype=dtype, device=device)
        self.v_sink = torch.zeros_like(self.k_sink)
        self.k_pool = self.v_pool = self.k_sink_pool = self.v_sink_pool = None
        if quant is not None:
            pool = lambda slots: empty_packed(quant, b, n, h, d, leading=(slots,), **fmt)  # noqa: E731
            self.k_pool, self.v_pool = pool(self.pool_chunks), pool(self.pool_chunks)
            if self.quantize_sink:
                self.k_sink_pool, self.v_sink_pool = pool(self.sink_chunks), pool(self.sink_chunks)
        self._fmt = fmt
        self.global_end = 0  # G, tokens generated so far
        self.current_start = -1  # first position of the current chunk (-1: none yet)

    @classmethod
    def allocate(
        cls, batch_size: int, cache_size: int, num_kv_heads: int, head_dim: int, *, chunk_tokens: int,
        quant: str | None, keep_recent_chunks: int = 1, sink_tokens: int = 0, dtype: torch.dtype | None = None,
        device=None, **kwargs,
    ) -> PackedCausalKVCache:
        """Build a cache (every buffer and pool allocated now); arguments as the constructor."""
        return cls(
            batch_size=batch_size, cache_size=cache_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            chunk_tokens=chunk_tokens, quant=quant, keep_recent_chunks=keep_recent_chunks, sink_tokens=sink_tokens,
            dtype=dtype, device=device, **kwargs,
        )

    # --- accounting and cursors ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes resident for K and V: dense ring and sink rows, packed pools (codes, scales, zero points,
        centroids, cluster ids), all included. Constant over a stream (everything is preallocated)."""
        total = sum(t.numel() * t.element_size() for t in (self.k_ring, self.v_ring, self.k_sink, self.v_sink))
        for pool in (self.k_pool, self.v_pool, self.k_sink_pool, self.v_sink_pool):
            total += 0 if pool is None else pool.nbytes
        return total

    @property
    def local_end(self) -> int:
        """``L``: rows in use in the equivalent dense cache, ``min(G, S)``."""
        return min(self.global_end, self.cache_size)

    def reset_indices(self) -> None:
        """Start a new stream at position 0 (the buffers are not touched)."""
        self.global_end, self.current_start = 0, -1

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        """True when ``K == 0`` and ``S == W == num_new_tokens`` (as ``CausalKVCache``)."""
        n = num_new_tokens
        return self.sink_tokens == 0 and self.cache_size == n and self.attention_window_size == n

    # --- where chunk c lives ------------------------------------------------------------------------------------
    def _in_ring(self, c: int, cur: int) -> bool:
        return c > cur - self.ring_chunks and (c >= self.sink_chunks or self.quantize_sink)

    def _chunk(self, c: int, cur: int, packed_ok: bool = True):
        """Storage of chunk ``c`` while ``cur`` is the current chunk: ``(k, v)`` dense ``[B, N, H, D]`` views or
        :class:`PackedKV` slots."""
        n = self.chunk_tokens
        if self._in_ring(c, cur):
            row = (c % self.ring_chunks) * n
            return self.k_ring.narrow(1, row, n), self.v_ring.narrow(1, row, n)
        if c < self.sink_chunks:
            if not self.quantize_sink:
                return self.k_sink.narrow(1, c * n, n), self.v_sink.narrow(1, c * n, n)
            return _slot(self.k_sink_pool, c), _slot(self.v_sink_pool, c)
        slot = c % self.pool_chunks
        return _slot(self.k_pool, slot), _slot(self.v_pool, slot)

    # --- the update ---------------------------------------------------------------------------------------------
    def update(
        self, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int, cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
    ) -> PackedKVView:
        """Write a chunk and return the visible window as segments (dense views and packed slots).

        The contract is :meth:`update_and_get_attention_kv`'s; use this with :func:`kvops.packed.packed_attention`
        to attend without materializing the window densely.
        """
        name = self.name
        if recent_window_tokens is not None and recent_window_tokens < 0:
            raise ValueError("recent_window_tokens must be non-negative or None")
        require_ndim(name, "key", key, 4, TOKENS_LAYOUT)
        require_ndim(name, "value", value, 4, TOKENS_LAYOUT)
        if key.shape[2] != self.num_kv_heads and cache_head_start is None:
            raise ValueError(f"{name}: cache_head_start required for head slice")
        h0 = check_cache_write(
            key.narrow(1, 0, 0), value.narrow(1, 0, 0), self.k_ring, self.v_ring, 0, cache_head_start, op=name
        )
        h1 = h0 + key.shape[2]
        n, s, g, cur_start, size = key.shape[1], current_chunk_start, self.global_end, self.current_start, self.chunk_tokens
        # Equalities are tested as ``max(a - b, b - a) > 0``: under torch.compile a guard ``Eq(a, b)`` would merge the
        # two symbols, and Inductor (torch 2.13) then binds one of them but uses the other ("name 's72' is not
        # defined"); a Max inequality guards the same fact without merging them.
        if cur_start >= 0 and g - s > 0:  # s < G: the current chunk again (a denoising step, the context pass)
            if torch.sym_max(s - cur_start, cur_start - s) > 0:
                self._raise_non_sequential(s, g, cur_start)
            if torch.sym_max(s + n - g, g - s - n) > 0:
                raise NotImplementedError(f"{name}: current-chunk rewrite size changed")
        elif torch.sym_max(s - g, g - s) > 0:
            self._raise_non_sequential(s, g, cur_start)
        else:  # s == G: the next chunk
            if n != size:
                raise ValueError(
                    f"{name}: an appended chunk must have chunk_tokens={size} tokens, got {n} (key shape "
                    f"{tuple(key.shape)}); the packed cache stores chunk-aligned segments."
                )
            self._advance(s // size)
        cur = s // size
        k_rows, v_rows = self._chunk(cur, cur)
        cache_write(key, value, k_rows, v_rows, 0, None if cache_head_start is None else h0)
        self.global_end, self.current_start = s + n, s
        g = s + n
        local_end = torch.sym_min(g, self.cache_size)
        ls = local_end - n
        rows = visible_rows(local_end, self.attention_window_size, self.sink_tokens, chunk_start=ls,
                            recent_window_tokens=recent_window_tokens)
        ks, vs = [], []
        for p0, p1 in _positions(rows, self.sink_tokens, g - local_end):
            for i in range((p1 - 1) // size - p0 // size + 1):
                c = p0 // size + i
                a = _static(torch.sym_max(p0, c * size) - c * size, 0)
                rows = _static(torch.sym_min(p1, (c + 1) * size) - c * size - a, size)
                kc, vc = self._chunk(c, cur)
                ks.append(_segment(kc, a, rows, h0, h1))
                vs.append(_segment(vc, a, rows, h0, h1))
        return PackedKVView(ks, vs, ls, local_end, local_end, g)

    def _raise_non_sequential(self, s: int, g: int, cur_start: int) -> None:
        cur = None if cur_start < 0 else cur_start
        raise NotImplementedError(f"{self.name}: non-sequential write current_start={s} global_end={g} cur={cur}")

    def _advance(self, new: int) -> None:
        """Chunk ``new`` becomes current: the chunk leaving the ring is quantized into its pool slot if it is still
        retained (its rows after ``new`` is appended include positions the dense cache keeps)."""
        old = new - self.ring_chunks
        if self.quant is None or old < 0 or not self._in_ring(old, new - 1):
            return
        g = (new + 1) * self.chunk_tokens
        first_kept = self.sink_tokens + g - torch.sym_min(g, self.cache_size)  # first retained non-sink position
        if old >= self.sink_chunks and (old + 1) * self.chunk_tokens <= first_kept:
            return  # already evicted from the window: nothing to keep
        k_rows, v_rows = self._chunk(old, new - 1)
        k_out, v_out = self._chunk(old, new)
        q = dict(group_size=self._fmt["group_size"], stages=self._fmt["stages"], kmeans_iters=self.kmeans_iters)
        quantize_kv(k_rows, self.quant, out=k_out, **q)
        quantize_kv(v_rows, self.quant, out=v_out, **q)

    def update_and_get_attention_kv(
        self, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int, cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
    ) -> CausalKVView:
        """Write a chunk of K/V at its global position and return the rows it attends to (docs/semantics.md §1-2).

        Args:
            key: ``[B, n, H_in, D]``, value: ``[B, n, H_in, D]`` (cache dtype/device/B/D).
            current_chunk_start: ``s``: the global end ``G`` (an append of exactly ``chunk_tokens`` tokens) or the
                current chunk's start (a rewrite: later denoising steps, the clean context pass).
            cache_head_start: ``h0`` when ``H_in != H``: only heads ``[h0, h0 + H_in)`` are written and returned.
                Head-sliced writers of one step call with the same ``s``: the first one appends, the others
                rewrite, and all see the same indices.
            recent_window_tokens: ``r``: the sink rows and the ``r`` rows before the chunk, then the chunk.

        Returns:
            :class:`CausalKVView`: ``k``/``v`` ``[B, V, H_in, D]`` in the cache dtype (a view when the window is one
            dense segment, else a new tensor with packed segments dequantized) and the dense cache's indices.

        Raises (before anything is written):
            ValueError: ``"recent_window_tokens must be non-negative or None"``;
                ``"{name}: cache_head_start required for head slice"``; an append that is not ``chunk_tokens``
                long; dtype/device/batch/head_dim mismatches and head slices outside the cache (as
                ``kvops.cache_write``).
            NotImplementedError: ``"{name}: current-chunk rewrite size changed"``;
                ``"{name}: non-sequential write current_start={s} global_end={G} cur={cur_start}"``.
        """
        view = self.update(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
        dtype = self.k_ring.dtype
        k, v = materialize(view.k, dtype), materialize(view.v, dtype)
        return CausalKVView(k, v, *view[2:])


def _static(n: int, value: int) -> int:
    """``value`` (a plain int) when ``n == value``, else ``n``. Under torch.compile this is one guard, stable once the
    window is full, and makes whole-chunk segments static shapes instead of nested Min/Max size expressions of the
    cursors (which Inductor then need not evaluate)."""
    return value if n == value else n


def _slot(pool: PackedKV, i: int) -> PackedKV:
    return PackedKV(pool.quant, *(None if t is None else t[i] for t in pool[1:]))


def _segment(chunk, start: int, rows: int, h0: int, h1: int) -> Segment:
    if isinstance(chunk, PackedKV):
        return chunk.rows(start, rows).heads(h0, h1)
    return chunk.narrow(1, start, rows)[:, :, h0:h1]


def _positions(rows: list[tuple[int, int]], sink: int, shift: int) -> list[tuple[int, int]]:
    """Dense-cache row ranges -> global position ranges: row ``i < sink`` holds position ``i``, row ``i >= sink``
    position ``i + shift`` (``shift = G - L``)."""
    out = []
    for a, b in rows:
        if a < sink < b and shift != 0:
            out += [(a, sink), (sink + shift, b + shift)]
        elif a >= sink:
            out.append((a + shift, b + shift))
        else:
            out.append((a, b))
    return out


def materialize(segments: list, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[B, V, H, D]`` of a list of segments (a view when there is one dense segment)."""
    parts = [dequantize_kv(x, dtype) if isinstance(x, PackedKV) else x for x in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
