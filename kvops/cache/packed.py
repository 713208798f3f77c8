"""``PackedCausalKVCache``: the streaming cache of docs/semantics.md §1 with quantized cold segments (§2).

Storage is chunk-aligned: chunk ``c`` holds global positions ``[c·N, (c+1)·N)`` (``N = chunk_tokens``). The current
chunk and the newest ``keep_recent_chunks`` completed chunks live in a dense ring (``R`` slots, chunk ``c`` in slot
``c % R``); when a chunk leaves the ring it is quantized once into a preallocated packed pool (``P`` slots, chunk
``c`` in slot ``c % P``; K, V, packed sink chunks, a packed pinned chunk and one scratch slot share one allocation,
slots being slices of it: kvops/cache/_packed_pool.py) and its dense slot is reused by the next chunk. Sink chunks (those
holding positions ``< max(sink_tokens, global_sink_tokens)``) live in their own dense buffer (or, with
``quantize_sink=True``, go through the ring and packed sink slots). A pinned chunk is copied aside (dense, or packed
with ``quantize_sink``). Nothing is allocated after construction: ``nbytes`` is what a stream holds, all of it.

Bookkeeping is Python ints (``global_end``, the current chunk's start, the pinned chunk's position); every tensor
write goes through ``kvops.cache_write`` / ``kvops.quantize_kv``. The rows reported and shown are exactly those of a
dense ``CausalKVCache`` of the same geometry (its window function, :func:`visible_rows`), mapped to positions and
then to storage rows.

This module holds the constructor and the update (``update_and_get_attention_kv``, ``update``); the cursors, the
accounting and where each chunk is stored are in ``_packed_storage.py`` (``PackedStorage``, the base class), the
pool's layout and the window gathers in ``_packed_pool.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks.common import as_int
from .._checks.contiguous import check_cache_write
from .._deprecation import renamed_method
from ..ops.contiguous import cache_write
from ..ops.packed import PackedSegments
from ._alloc import check_size
from ._clamp import relu, smin
from ._packed_pool import alloc_pool, gather_window, row_positions, window_counts
from ._packed_storage import PackedStorage
from ._placement import CausalKVView
from ._validate import check_update_args, check_window_mode
from ._window import visible_rows


class PackedKVView(NamedTuple):
    """What :meth:`PackedCausalKVCache.update` returns: the visible window of K and V as :class:`PackedSegments`
    (the storage + a row mask, so that a compiled stream runs a fixed graph whatever the window's chunk structure).
    The four ints are those of :class:`CausalKVView`."""

    k: PackedSegments
    v: PackedSegments
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PackedCausalKVCache(PackedStorage):
    """Streaming K/V cache of one attention layer whose cold chunks are stored quantized (docs/semantics.md §2).

    Same ``update_and_get_attention_kv`` contract, returned view and indices as :class:`kvops.CausalKVCache` for
    chunk-sequential streams (sinks, eviction, rewrites of the current chunk for denoising steps and the context
    pass, recent windows, head-sliced writers in lockstep); modelled on sglang's ``QVGPackedCausalKVCache`` (which
    is eager-only and LingBot-only) with preallocated pools, more formats and compile support.

    Args:
        batch_size, cache_size, num_kv_heads, head_dim: ``B``, ``S`` (rows of the equivalent dense cache: the
            retained window), ``H``, ``D``.
        chunk_tokens: ``N``, tokens per chunk; every append is exactly one chunk (the first: ``first_chunk_tokens``).
        first_chunk_tokens: ``f`` in ``[1, N]`` (default ``N``): the length of the chunk at position 0 (Self-Forcing's
            ``independent_first_frame``: one frame, then blocks of three; sglang's QVG cache). Its storage slot is
            padded to ``N`` rows (never shown); the visible rows are a dense ``CausalKVCache``'s of the same stream.
        quant: ``None`` (all dense: the bit-exact baseline), ``"int8"``, ``"fp8"``, ``"int4"`` or ``"int2"`` (see
            :func:`kvops.packed.packed_layout`).
        keep_recent_chunks: completed chunks kept dense besides the current one.
        sink_tokens: ``K``, positions never evicted (attention sinks); ``K + N <= S``.
        attention_window_size: ``W``, the whole visible budget in rows (default ``S``), as the dense cache.
        quantize_sink: store completed sink chunks (and a pinned chunk's copy) packed too (default: dense).
        global_sink_tokens: rows kept in front of a pinned chunk (``CausalKVCache``'s; the sink without a pin is
            ``max(sink_tokens, global_sink_tokens)``).
        pinnable: allocate the pinned chunk's copy (one chunk) so that :meth:`pin_current_chunk` can be used.
        group_size, stages, num_clusters, kmeans_iters: format parameters (int4/int2; see ``quantize_kv``).
        dtype, device: of the dense rows and of the returned K/V.
        window_mode: ``"sink"`` (default) or ``"tail"``, as :class:`kvops.CausalKVCache`'s (docs/porting.md "Window
            with a sink").
        name: used in error messages (default ``"PackedCausalKVCache"``).

    Under ``torch.compile(fullgraph=True)`` use it as ``CausalKVCache`` (caches passed as an argument of the
    compiled function, built outside it): the cursors become dynamic ``SymInt``s and nothing reads a tensor to decide
    where to write. :meth:`update_and_get_attention_kv` gathers the visible rows by tensor arithmetic on the cursors
    (:func:`kvops.cache._packed_pool.gather_window`) and an append and a rewrite run the same graph (a rewrite quantizes
    into a scratch slot), so a stream compiles a few graphs whatever the window's length (measured on torch 2.13,
    tests/packed/test_packed_compile.py, windows of 3, 6 and 10 chunks): 3 without a sink, 5 with one, 6 with a packed
    sink and a recent window or with a sink and a pinned chunk; none per chunk after the first 4 chunks. All within
    Dynamo's default ``recompile_limit`` (8). A second process on the same warm on-disk caches (FX graph, AOTAutograd)
    compiles no more graphs: the cursor clamps have no ``Min``/``Max`` term (kvops/cache/_clamp.py; with
    ``torch.sym_min``/``sym_max`` an int8 stream compiled 5 graphs cold and 7 warm, tests/export/test_warm_cache.py).
    :meth:`update` (the storage as a fixed segment list + a row mask from the same arithmetic) compiles the same few
    graphs (tests/packed/test_packed_compile.py). Errors are raised at trace time (Dynamo
    reports them as ``torch._dynamo.exc.Unsupported`` carrying the original exception).

    Pool slots are slices of one allocation (``narrow`` of dim 1), never ``pool[i]``: Inductor (torch 2.13)
    regenerates a mutated ``select`` view as ``as_strided(pool, ..., sym_storage_offset(view))`` without a lowering
    for ``aten.sym_storage_offset`` and wrote every quantized chunk to slot 0 (pytorch/pytorch#198068).

    Pinned chunks (``pinnable=True``; :meth:`pin_current_chunk`, as ``CausalKVCache`` with ``sink_tokens`` the pin's
    maximum length and ``global_sink_tokens`` the rows kept in front of it): the pinned chunk is copied once more
    (packed with ``quantize_sink``, else dense) and never evicted.

    Raises:
        ValueError: ``S < K + N``, negative sizes, bad format parameters.
    """

    def __init__(
        self, *, batch_size: int, cache_size: int, num_kv_heads: int, head_dim: int, chunk_tokens: int,
        quant: str | None, keep_recent_chunks: int = 1, sink_tokens: int = 0, global_sink_tokens: int = 0,
        attention_window_size: int | None = None, quantize_sink: bool = False, pinnable: bool = False,
        group_size: int | None = None, stages: int = 1, num_clusters: int = 16, kmeans_iters: int = 4,
        dtype: torch.dtype | None = None, device=None, window_mode: str = "sink", first_chunk_tokens: int | None = None,
        name: str = "PackedCausalKVCache",
    ) -> None:
        check_window_mode(name, window_mode)
        self.window_mode = window_mode
        b, s, h, d, n = batch_size, cache_size, num_kv_heads, head_dim, chunk_tokens
        k, gs = sink_tokens, global_sink_tokens
        if n < 1 or k < 0 or gs < 0 or keep_recent_chunks < 0:
            raise ValueError(
                f"{name}: chunk_tokens ({n}) must be >= 1, sink_tokens ({k}), global_sink_tokens ({gs}) and "
                f"keep_recent_chunks ({keep_recent_chunks}) >= 0."
            )
        f = n if first_chunk_tokens is None else first_chunk_tokens
        if isinstance(f, bool) or not isinstance(f, int) or not 1 <= f <= n:
            raise ValueError(
                f"{name}: first_chunk_tokens must be an int in [1, chunk_tokens={n}] (the first chunk's length, e.g. "
                f"one frame before blocks of three), got {first_chunk_tokens!r}."
            )
        # The first chunk's storage slot is padded to N rows: position p >= f is stored at p + pad (_storage_pos).
        self.first_chunk_tokens, self._pad = f, n - f
        sink = max(k, gs)  # the effective sink without a pin (docs/semantics.md §1.2)
        if s < sink + n:
            raise ValueError(
                f"{name}: cache_size ({s}) must be >= sink_tokens + chunk_tokens ({sink} + {n}) so that a chunk fits "
                f"after the sink."
            )
        if attention_window_size == 0:  # sglang's QVG cache: `attention_window_size or cache_size`
            attention_window_size = None
        if attention_window_size is not None and attention_window_size < 1:
            raise ValueError(f"{name}: attention_window_size must be >= 1 (or None or 0 for the cache size, as "
                             f"sglang's), got {attention_window_size}.")
        self.name, self.quant, self.chunk_tokens, self.sink_tokens = name, quant, n, k
        self.global_sink_tokens, self.pinnable, self.cache_size = gs, pinnable and k > 0, s
        self.attention_window_size = s if attention_window_size is None else attention_window_size
        self.num_kv_heads, self.head_dim = h, d
        self.kmeans_iters = kmeans_iters
        fmt = dict(group_size=group_size, stages=stages, num_clusters=num_clusters)
        self.sink_chunks = _cdiv(sink + (self._pad if sink > f else 0), n)  # storage chunks holding the sink
        self.quantize_sink = quantize_sink and quant is not None and self.sink_chunks > 0
        # non-sink chunks a full window touches (the current one included); with a pin the rows after the global
        # sink are contiguous positions (the pinned chunk's copy is kept apart)
        retained = _cdiv(s - (gs if self.pinnable else sink), n) + (1 if self._pad else 0)
        self.ring_chunks = retained if quant is None else min(keep_recent_chunks + 1, retained)
        self.pool_chunks = retained - self.ring_chunks
        # the dense rows (ring, sink, pin: at most cache_size + 2 chunks each of K and V) bound the buffers' size
        check_size(name, dict(batch_size=b, cache_size=s, num_kv_heads=h, head_dim=d, chunk_tokens=n),
                   2 * b * (s + 2 * n) * h * d, dtype)
        dense = lambda rows: torch.zeros(b, rows, h, d, dtype=dtype, device=device)  # noqa: E731
        pool = lambda slots: alloc_pool(quant, slots, b, n, h, d, device=device, **fmt)  # noqa: E731
        self.k_ring, self.v_ring = dense(self.ring_chunks * n), dense(self.ring_chunks * n)
        dense_sink = 0 if self.quantize_sink else self.sink_chunks * n
        self.k_sink, self.v_sink = dense(dense_sink), dense(dense_sink)
        # One packed pool for K and V: slots [K chunks (P)][V chunks (P)][K, V sink chunks][K, V pinned][scratch]
        # (the scratch slot takes the quantization a rewrite runs, so that appends and rewrites are one graph).
        sink_slots = self.sink_chunks if self.quantize_sink else 0
        pin_slots = 1 if self.pinnable and self.quantize_sink else 0
        self._slot_base = {"pool": (0, self.pool_chunks), "sink": (2 * self.pool_chunks, sink_slots),
                           "pin": (2 * (self.pool_chunks + sink_slots), pin_slots)}
        self._slots = 2 * (self.pool_chunks + sink_slots + pin_slots) + 1
        self.pool = None if quant is None else pool(self._slots)
        # whether every stored tensor is token-indexed (int8, int4): then the pool dequantizes in one call
        self._per_token = quant is not None and all(
            x is None or x.shape[1] != y.shape[1] for x, y in zip(
                alloc_pool(quant, 1, b, n, h, d, device="meta", **fmt)[1:],
                alloc_pool(quant, 1, b, n + 1, h, d, device="meta", **fmt)[1:]))
        self.k_pin = self.v_pin = None
        if self.pinnable:  # the pinned chunk's copy once it leaves the ring: packed or dense as the sink
            self.k_pin, self.v_pin = (self._slot("pin", 0, 0), self._slot("pin", 1, 0)) if pin_slots else (
                dense(n), dense(n))
        self._fmt = fmt
        self.global_end = 0  # G, tokens generated so far
        self.current_start = -1  # first position of the current chunk (-1: none yet)
        self.pinned_position, self.pinned_len = -1, 0  # the pinned chunk: first position and length (0: none)

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

    reset_indices = renamed_method("reset_indices", "reset")  # (reset: _packed_storage.py)

    # --- the update ---------------------------------------------------------------------------------------------
    def _write(self, key, value, current_chunk_start, cache_head_start, recent_window_tokens, debug_name=None):
        """Validate, advance (quantize the chunk leaving the ring) and write; returns ``(h0, h1, cur, G, L, ls)``."""
        name = self.name if debug_name is None else debug_name
        check_update_args(name, key, value, self.num_kv_heads, current_chunk_start, cache_head_start, recent_window_tokens)
        if key.shape[2] != self.num_kv_heads and cache_head_start is None:
            raise ValueError(
                f"{name}: cache_head_start required for head slice (key has {as_int(key.shape[2])} heads, the cache "
                f"{self.num_kv_heads}; pass cache_head_start with 0 <= cache_head_start <= "
                f"{self.num_kv_heads - as_int(key.shape[2])}, or key/value with all {self.num_kv_heads} heads)"
            )
        h0 = check_cache_write(
            key, value, self.k_ring, self.v_ring, 0, cache_head_start, op=name, check_rows=False
        )
        n, s, size = key.shape[1], current_chunk_start, self.chunk_tokens
        g, cur_start = self.global_end, self.current_start
        # One graph for appends and rewrites under torch.compile: each check is one comparison, of a product of
        # distances (an equality guard ``Eq(a, b)`` would also merge the two symbols, and Inductor (torch 2.13) then
        # binds one of them but uses the other: "name 's72' is not defined"; a ``Min``/``Max`` re-specializes a warm
        # FX graph cache hit, kvops/cache/_clamp.py).
        if abs(s - cur_start) * abs(s - g) > 0:  # neither the current chunk nor the global end
            self._raise_non_sequential(s, g, cur_start, name)
        if self._pad and s == 0:  # the first chunk: first_chunk_tokens long
            size = self.first_chunk_tokens
        if n != size:  # an append is exactly one chunk, so a rewrite (s == current start) of another size differs
            if g - s > 0:
                raise NotImplementedError(
                    f"{name}: current-chunk rewrite size changed (the current chunk at current_start={as_int(s)} "
                    f"holds {as_int(g - s)} tokens, the rewrite {as_int(n)}; rewrite it with the same "
                    f"{as_int(g - s)} tokens)"
                )
            raise ValueError(
                f"{name}: an appended chunk must have {size} token{'s' if size != 1 else ''} (chunk_tokens={self.chunk_tokens}, "
                f"first_chunk_tokens={self.first_chunk_tokens} for the chunk at position 0), got {n} (key shape "
                f"{tuple(key.shape)}); the packed cache stores chunk-aligned segments (a first chunk of another "
                f"length: build it with first_chunk_tokens)."
            )
        cur = self._storage_pos(s) // self.chunk_tokens
        self._advance(cur, relu(1 + s - g))  # 1 for an append (s == G), 0 for a rewrite
        k_rows, v_rows = self._chunk(cur, cur)
        cache_write(key, value, k_rows, v_rows, 0, None if cache_head_start is None else h0)
        pinned = self.pinned_chunk
        if pinned >= self.sink_chunks and not abs(cur - pinned) > 0:  # a rewrite of the pinned chunk
            self._keep_pinned(k_rows, v_rows)
        self.global_end, self.current_start = s + n, s
        g = s + n
        local_end = smin(g, self.cache_size)
        return h0, h0 + key.shape[2], cur, g, local_end, local_end - n

    def _window(self, local_end: int, ls: int, g: int, recent: int | None):
        """Visible dense-cache rows (:func:`visible_rows`) and their position map ``(sink, shift, pin)`` (see
        :func:`row_positions`)."""
        shift, gs = g - local_end, self.global_sink_tokens
        if self.pinned_len > 0:
            settled = self.pinned_position - shift <= gs  # the pin sits right after the global sink
            pinned_row = gs if settled else self.pinned_position - shift  # max(gs, ...) on the guard already taken
            sink = gs + self.pinned_len if settled else gs
            rows = visible_rows(local_end, self.attention_window_size, sink, pinned_row, self.pinned_len, ls, recent,
                                self.window_mode)
            return rows, gs, shift, (gs, self.pinned_position, self.pinned_len) if settled else None
        sink = max(gs, self.sink_tokens)
        return visible_rows(local_end, self.attention_window_size, sink, chunk_start=ls,
                            recent_window_tokens=recent, window_mode=self.window_mode), sink, shift, None

    def update(
        self, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int, cache_head_start: int | None = None,
        recent_window_tokens: int | None = None, debug_name: str | None = None,
    ) -> PackedKVView:
        """Write a chunk and return the visible window as the storage + a row mask (no dense copy).

        The contract (arguments, indices, errors) is :meth:`update_and_get_attention_kv`'s; use this with
        :func:`kvops.packed.packed_attention` (``packed_attention(q, view.k, view.v)``) to attend without
        materializing the window densely.

        Returns:
            :class:`PackedKVView`: ``k``/``v`` are :class:`PackedSegments`: the cache's whole storage (every dense
            and packed slot, heads ``[h0, h0 + H_in)``; the same list on every call) and ``row_counts`` int32 ``[sum
            of the segments' rows]``, 1 for the visible rows and 0 elsewhere, computed by the tensor arithmetic of
            :meth:`update_and_get_attention_kv` -- so under ``torch.compile`` a stream compiles the same few graphs
            whatever the window's length (tests/packed/test_packed_compile.py), and ``kvops::packed_attention`` reads only
            the 16-row tiles that hold a visible row. Attention over it equals attention over
            :meth:`update_and_get_attention_kv`'s rows (the same rows, in storage order; tests/packed/test_packed_cache.py).
        """
        h0, h1, cur, g, local_end, ls = self._write(key, value, current_chunk_start, cache_head_start,
                                                   recent_window_tokens, debug_name)
        rows, sink, shift, pin = self._window(local_end, ls, g, recent_window_tokens)
        ks, vs, counts = window_counts(self, rows, lambda r: row_positions(r, sink, shift, pin), cur, h0, h1,
                                       h1 - h0 != self.num_kv_heads)
        return PackedKVView(PackedSegments(ks, counts), PackedSegments(vs, counts), ls, local_end, local_end, g)

    def _raise_non_sequential(self, s: int, g: int, cur_start: int, name: str) -> None:
        cur = None if cur_start < 0 else cur_start
        rewrite = "" if cur is None else (
            f", or current_chunk_start={cur} to rewrite the current chunk (a denoising step)")
        raise NotImplementedError(
            f"{name}: non-sequential write current_start={s} global_end={g} cur={cur}. The packed cache takes "
            f"chunks in order: pass current_chunk_start={g} to append the next chunk{rewrite}."
        )

    def update_and_get_attention_kv(
        self, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int, cache_head_start: int | None = None,
        recent_window_tokens: int | None = None, debug_name: str | None = None,
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
            debug_name: the cache's name in this call's error messages (sglang's argument of the same name; default:
                the constructor's ``name``).

        Returns:
            :class:`CausalKVView`: ``k``/``v`` ``[B, V, H_in, D]`` in the cache dtype (a new tensor: the visible rows
            gathered from the dense ring, the dequantized pool slots, the sink and the pinned copy) and the dense
            cache's indices.

        Raises (before anything is written):
            ValueError: ``"recent_window_tokens must be non-negative or None"``;
                ``"{name}: cache_head_start required for head slice"``; an append that is not ``chunk_tokens``
                long; dtype/device/batch/head_dim mismatches and head slices outside the cache (as
                ``kvops.cache_write``).
            NotImplementedError: ``"{name}: current-chunk rewrite size changed"``;
                ``"{name}: non-sequential write current_start={s} global_end={G} cur={cur_start}. ..."`` (then the
                ``current_chunk_start`` values that are accepted).
        """
        h0, h1, cur, g, local_end, ls = self._write(key, value, current_chunk_start, cache_head_start,
                                                   recent_window_tokens, debug_name)
        rows, sink, shift, pin = self._window(local_end, ls, g, recent_window_tokens)
        k, v = gather_window(self, rows, lambda r: row_positions(r, sink, shift, pin), cur, h0, h1,
                             h1 - h0 != self.num_kv_heads)
        return CausalKVView(k, v, ls, local_end, local_end, g)
