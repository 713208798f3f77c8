"""``CausalKVCache``: one transformer block's K/V for block-causal streaming (docs/semantics.md §1).

Bookkeeping is plain Python ints; every tensor write and move goes through ``kvops.cache_write`` / ``kvops.cache_roll``.
"""

from __future__ import annotations

import torch

from .._checks.contiguous import check_cache_write, check_caches
from .._deprecation import renamed_method
from ..ops.contiguous import cache_roll, cache_write
from ._alloc import allocate
from ._clamp import smax
from ._placement import CausalKVView, _Cursors, eviction_moves, eviction_moves_with_pin, place_rows, raise_write_range
from ._validate import check_update_args, check_window_mode
from ._window import visible_rows

__all__ = ["CausalKVCache", "CausalKVView"]


class CausalKVCache:
    """Streaming K/V cache of one attention layer for block-causal generation, as in docs/semantics.md §1.

    Used by causal video diffusion (Self-Forcing, CausVid, LingBot-world, LongLive) and streaming LLMs with attention
    sinks; the behaviour follows sglang's ``CausalSelfAttentionKVCache`` (and LongLive-2's pinned "shot" sink).

    State:
        k, v: ``[B, S, H_cache, D]`` / ``[B, S, H_cache, D_v]`` (any strides; K and V may be views of one
            ``[B, S, 2, H_cache, D]`` allocation, see :meth:`allocate`). Rows are tokens; ``S`` is the capacity.
        global_end (``G``): tokens generated so far (the global end of the cached window).
        local_end (``L``): rows in use; row ``i >= sink`` holds the token at global position ``G - L + i``.
        sink_tokens (``K``), global_sink_tokens, attention_window_size (``W``, default ``S``), allow_growth.
        A pinned ("shot") chunk set by :meth:`pin_current_chunk`. Without a pin the effective sink is
        ``E = max(global_sink_tokens, K)`` rows; with a pin it is ``global_sink_tokens + pinned_len`` once the pinned
        rows sit right after the global sink, else ``global_sink_tokens`` (the pinned rows are then kept and shown
        separately, and move down with the rows after the sink on eviction).

    Cursors are Python ints: nothing reads a tensor to decide where to write, so there is no host sync, and under
    ``torch.compile`` the eviction branches and the write-range errors are decided at trace time.

    Recommended usage under ``torch.compile`` (measured on torch 2.13, see tests/streaming/test_causal_compile.py)::

        caches = [CausalKVCache.allocate(B, S, H_kv, D, dtype=torch.bfloat16, device="cuda", sink_tokens=K)
                  for _ in range(num_layers)]

        class Model(torch.nn.Module):            # holds weights only, never the caches
            def forward(self, x, caches, current_chunk_start: int):
                for block, cache in zip(self.blocks, caches):
                    x = block(x, cache, current_chunk_start)   # calls cache.update_and_get_attention_kv(...)
                return x

        model = torch.compile(model, fullgraph=True)
        for chunk in range(num_chunks):
            s = chunk * tokens_per_chunk
            for step in denoising_steps:        # append on the first step, rewrites after
                x = model(x_noisy, caches, s)
            model(x_clean, caches, s)           # context pass (a rewrite)

    Pass the caches (a list, or any plain object holding them) as an **argument** of the compiled function, and
    build them outside it. Dynamo then treats their int cursors (and ``current_chunk_start``) as inputs: after one
    recompile they become dynamic ``SymInt``s. (A cache can also be built and used inside a compiled or exported
    function, e.g. an exported step that wraps given buffers; its cursors are then trace-time constants of that
    graph.) The bookkeeping is branch-free (``kvops.cache._placement``: clamps built from ``abs`` and ``//``), so
    appends, rewrites and evictions run the same graph; the loop compiles a small fixed set of graphs during the
    first chunks and none after (measured on torch 2.13, tests/streaming/test_causal_compile.py):

    - 3 for a plain or sink stream: the first call (all static), the first rewrite (``current_chunk_start`` still a
      static 0), then one dynamic graph for everything else;
    - +1 when the window first starts past the sink (``W < S`` or ``recent_window_tokens``: the view becomes a cat);
    - +3 with a pinned chunk (the pin appears, the eviction that moves it next to the global sink, the settled pin);
    - +1 per growth (the buffers change shape); +1 when head-sliced writers create their cursors on the first call;
    - +1 with Inductor, which guards on whether the eviction move has zero rows.

    The same holds with torch's default configuration in a later process on warm on-disk caches (FX graph cache,
    AOTAutograd cache, one ``TORCHINDUCTOR_CACHE_DIR``): it compiles no more graphs than the first (tested in
    tests/export/test_warm_cache.py). The cursor clamps hold no ``Max``/``Min`` terms because torch 2.13 re-evaluates the
    guards stored with a cached graph as Python code, where ``max``/``min`` compare their arguments and specialize
    the graph (kvops/cache/_clamp.py); with ``sym_max``/``sym_min`` clamps a warm sink stream compiled 8 graphs instead
    of 3, and a pinned stream hit ``FailOnRecompileLimitHit``.

    Do **not** store the caches as attributes of an ``nn.Module``: Dynamo treats int attributes reached through a
    module as constants, so the advancing cursors recompile every call until the recompile limit, a hard
    ``FailOnRecompileLimitHit`` under ``fullgraph=True``. (The cache is a plain object, not a module, for the same
    reason.) Errors raised by the cache (below) are raised while tracing: with ``fullgraph=True`` Dynamo reports them
    as ``torch._dynamo.exc.Unsupported`` ("Observed exception") whose text carries the original exception, e.g.
    ``RuntimeError('Invalid CausalKVCache write range: ...')``; without ``fullgraph`` the original exception
    propagates.

    Head slices: a writer carrying ``H_in < H_cache`` heads (tensor/Ulysses parallelism) passes ``cache_head_start``;
    its write, eviction move and visible K/V are restricted to heads ``[h0, h0 + H_in)`` and other heads are never
    touched. Each head slice keeps its own cursors, so several writers can fill one cache in lockstep (each calling
    with the same ``current_chunk_start``); slices must be disjoint or identical. The ``global_end``/``local_end``
    properties read the common cursors (an error while the slices disagree).

    Args:
        k, v: the cache buffers, ``[B, S, H_cache, D]`` and ``[B, S, H_cache, D_v]``, same dtype/device/B/S/H_cache.
        sink_tokens: ``K``, rows at the start never evicted (attention sinks); also the pinned chunk's max length.
        global_sink_tokens: rows kept in front of a pinned chunk (default 0).
        attention_window_size: ``W``, the whole visible budget in rows, sink and pinned rows included (default
            ``S``; ``0`` means ``S`` too, as sglang's caches); as sglang's windowed cache with sinks (docs/semantics.md §1.6).
        window_mode: what the view is once ``W`` rows no longer hold every row in use (docs/porting.md "Window with
            a sink"). ``"sink"`` (default): the sink rows (and an unsettled pinned chunk), then the newest rows, ``W``
            in all (LongLive-2, sglang's QVG packed cache). ``"tail"``: the newest ``W`` rows ``[L' - W, L')`` only,
            the sink rows dropping out of view (sglang's dense ``CausalSelfAttentionKVCache``, Self-Forcing's and
            CausVid's ``max_attention_size``); sink rows are never evicted in either mode. Example: ``S = 16``,
            ``K = 4``, ``W = 8``, chunks of 4 tokens ``1..20``: after the chunk at 16, ``"tail"`` shows tokens 13-20
            and ``"sink"`` tokens 1-4 and 17-20. ``recent_window_tokens`` is the same in both modes.
        allow_growth: grow the buffers (to ``max(L + a, 2 S)`` rows, copying rows ``[0, L)``; new rows are zero)
            instead of evicting.
        name: used in error messages (default ``"CausalKVCache"``).

    Raises:
        ValueError: invalid buffers (ranks, dtypes, devices, shapes as ``kvops.cache_write``), negative sink sizes,
            sink sizes not smaller than ``S``, a negative ``attention_window_size``.
    """

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sink_tokens: int = 0,
        global_sink_tokens: int = 0,
        attention_window_size: int | None = None,
        allow_growth: bool = False,
        window_mode: str = "sink",
        name: str = "CausalKVCache",
    ) -> None:
        check_caches(name, k, v)
        check_window_mode(name, window_mode)
        if sink_tokens < 0 or global_sink_tokens < 0:
            raise ValueError(
                f"{name}: sink_tokens ({sink_tokens}) and global_sink_tokens ({global_sink_tokens}) must be >= 0."
            )
        if max(sink_tokens, global_sink_tokens) >= k.shape[1]:
            raise ValueError(
                f"{name}: sink_tokens ({sink_tokens}) and global_sink_tokens ({global_sink_tokens}) must be smaller "
                f"than the cache size ({k.shape[1]} rows), leaving room for the chunks after the sink."
            )
        if attention_window_size == 0:  # sglang's caches: 0 (their default) means the cache size
            attention_window_size = None
        if attention_window_size is not None and attention_window_size < 1:
            raise ValueError(
                f"{name}: attention_window_size must be >= 1 (or None or 0 for the cache size, as sglang's caches), "
                f"got {attention_window_size}."
            )
        self.k = k
        self.v = v
        self.name = name
        self.sink_tokens = sink_tokens
        self.global_sink_tokens = global_sink_tokens
        self.attention_window_size = k.shape[1] if attention_window_size is None else attention_window_size
        self.allow_growth = allow_growth
        self.window_mode = window_mode
        # Growth keeps K and V in one allocation when they share one.
        self._fused_kv = k.shape[3] == v.shape[3] and _share_storage(k, v)
        # Cursors per head slice; the full-head entry exists from the start (its ints are then seen by Dynamo on the
        # first call, which saves a recompile) and is dropped when head-sliced writers start instead.
        self._cursors: dict[tuple[int, int], _Cursors] = {(0, k.shape[2]): _Cursors()}

    @classmethod
    def allocate(
        cls,
        batch_size: int,
        cache_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fused_kv: bool = False,
        **kwargs,
    ) -> CausalKVCache:
        """Allocate the buffers (uninitialized) and build a cache.

        ``k`` is ``[B, S, H_kv, D]`` and ``v`` ``[B, S, H_kv, D_v]`` (``D_v = head_dim_v or head_dim``) in ``dtype``
        (default: torch's default dtype) on ``device``. With ``fused_kv=True`` both are views of one
        ``[B, S, 2, H_kv, D]`` allocation (requires ``D_v == D``). ``kwargs`` go to the constructor. Buffers of more
        than ``2**47`` bytes raise ``ValueError`` naming the sizes and the byte count (kvops/cache/_alloc.py).
        """
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        sizes = dict(batch_size=batch_size, cache_size=cache_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     head_dim_v=head_dim_v)
        owner = f"{cls.__name__}.allocate"
        if fused_kv:
            if head_dim_v != head_dim:
                raise ValueError(f"fused_kv needs head_dim_v == head_dim, got {head_dim_v} and {head_dim}.")
            (kv,) = allocate(owner, sizes, [(batch_size, cache_size, 2, num_kv_heads, head_dim)], dtype, device,
                             torch.empty)
            return cls(kv[:, :, 0], kv[:, :, 1], **kwargs)
        k, v = allocate(owner, sizes, [(batch_size, cache_size, num_kv_heads, head_dim),
                                       (batch_size, cache_size, num_kv_heads, head_dim_v)], dtype, device, torch.empty)
        return cls(k, v, **kwargs)

    # --- cursors ------------------------------------------------------------------------------------------------
    @property
    def cache_size(self) -> int:
        """``S``, the buffers' capacity in rows."""
        return self.k.shape[1]

    def _common(self, field: str) -> int:
        values = {getattr(c, field) for c in self._cursors.values()}  # never empty: one entry per head slice
        if len(values) > 1:
            raise RuntimeError(
                f"{self.name}: head slices {sorted(self._cursors)} are at different {field} values {sorted(values)} "
                f"(a lockstep step is half done); read {field} after every writer of the step has written."
            )
        return values.pop()

    @property
    def global_end(self) -> int:
        """``G``: tokens generated so far (0 after :meth:`reset`)."""
        return self._common("global_end")

    @property
    def local_end(self) -> int:
        """``L``: cache rows in use."""
        return self._common("local_end")

    @property
    def pinned_start(self) -> int:
        """First row of the pinned chunk, or -1 without a pin."""
        return self._common("pinned_start")

    @property
    def pinned_len(self) -> int:
        """Rows of the pinned chunk (0 without a pin)."""
        return self._common("pinned_len")

    def reset(self) -> None:
        """Forget every cursor and the pin (a new stream starts at position 0); the buffers are not touched.

        The cursor objects are zeroed in place, so a compiled stream loop reuses its graphs for the next stream.
        """
        for c in self._cursors.values():
            c.global_end, c.local_end, c.pinned_start, c.pinned_len, c.ring_offset = 0, 0, -1, 0, 0

    reset_indices = renamed_method("reset_indices", "reset")

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        """True when ``K == 0`` and ``S == W == num_new_tokens``: the chunk alone is the visible window, so the
        caller may attend to it directly and skip the cache."""
        return (
            self.sink_tokens == 0
            and self.cache_size == num_new_tokens
            and self.attention_window_size == num_new_tokens
        )

    def pin_current_chunk(self, num_tokens: int) -> None:
        """Pin the chunk just written (the last ``num_tokens`` rows in use) as a "shot" sink of ``min(K, n)`` rows.

        Rows ``[L - n, L - n + min(K, n))`` are kept from then on: they move down with the rows after the global sink
        on eviction until they sit right after it, and then belong to the effective sink. With ``K == 0`` or
        ``num_tokens <= 0`` the pin is cleared instead. Applies to every head slice (each slice's own rows).

        Raises:
            ValueError: when ``L - n`` is negative or inside the global sink ``[0, global_sink_tokens)`` (the chunk
                was not appended after the global sink).
        """
        if self.sink_tokens <= 0 or num_tokens <= 0:
            for c in self._cursors.values():
                c.pinned_start, c.pinned_len = -1, 0
            return
        for c in self._cursors.values():
            start = c.local_end - num_tokens
            if start < self.global_sink_tokens or start < 0:
                raise ValueError(
                    f"{self.name}.pin_current_chunk({num_tokens}): the chunk would start at row {start} "
                    f"(local_end={c.local_end} minus {num_tokens}), which is before row 0 or inside the global sink "
                    f"[0, {self.global_sink_tokens}). Pin a chunk right after appending it past the global sink."
                )
        for c in self._cursors.values():
            c.pinned_start, c.pinned_len = c.local_end - num_tokens, min(self.sink_tokens, num_tokens)

    def _effective_sink(self, c: _Cursors) -> int:
        if c.pinned_len > 0:
            if c.pinned_start == self.global_sink_tokens:
                return self.global_sink_tokens + c.pinned_len
            return self.global_sink_tokens
        return max(self.global_sink_tokens, self.sink_tokens)

    def _find_slice_cursors(self, h0: int, h1: int) -> tuple[_Cursors, list | None]:
        """The cursors of head slice ``[h0, h1)`` and, for a slice seen for the first time, the slices they replace
        (overlapping slices that never held tokens; ``None`` for a known slice), without changing anything: the caller
        registers new cursors once the update is validated. Raises when the slice overlaps a slice holding tokens."""
        c = self._cursors.get((h0, h1))
        if c is not None:
            return c, None
        stale = []
        for (a, b), other in self._cursors.items():
            if not (a < h1 and h0 < b):
                continue
            if other.global_end == 0 and other.local_end == 0 and other.pinned_len == 0:
                stale.append((a, b))  # never written: another slicing of the heads takes over
            else:
                raise ValueError(
                    f"{self.name}: head slice [{h0}, {h1}) overlaps head slice [{a}, {b}), which holds tokens "
                    f"(global_end={other.global_end}). Writers must use disjoint head slices (or the same one); "
                    f"call reset() before streaming with another slicing of the heads."
                )
        return _Cursors(), stale

    # --- the update ---------------------------------------------------------------------------------------------
    def update_and_get_attention_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str | None = None,
    ) -> CausalKVView:
        """Write a chunk of K/V at its global position and return the rows the chunk attends to (docs/semantics.md §1).

        Args:
            key: ``[B, n, H_in, D]``, value: ``[B, n, H_in, D_v]`` (cache dtype/device/B/D).
            current_chunk_start: ``s``, global position of the chunk's first token (an int; a SymInt under compile).
            cache_head_start: ``h0`` when ``H_in != H_cache``: only heads ``[h0, h0 + H_in)`` are written, moved
                and returned.
            recent_window_tokens: ``r`` (optional): return the sink rows and only the ``r`` rows before the chunk
                plus the rows from the chunk to ``L'``, instead of the ``W``-row budget.
            debug_name: the cache's name in this call's error messages (sglang's argument of the same name; default:
                the constructor's ``name``).

        With ``e = s + n``:

        - rewrite (``e <= G``; later denoising steps, the clean context pass): rows ``[s - (G - L), … + n)``;
          cursors unchanged.
        - append (``e > G``, ``a = e - G`` new tokens): with ``allow_growth`` and ``L + a > S`` the buffers first
          grow to ``max(L + a, 2 S)`` rows (``W`` grows too if it equalled ``S``). If still ``L + a > S``,
          ``ev = L + a - S`` rows after the effective sink ``E`` are evicted (rows ``[E + ev, L)`` move down to
          ``E``, overlap-safe, via ``kvops.cache_roll``) and the chunk is written at rows ``[S - n, S)``; else at
          ``[L + a - n, L + a)``. Then ``G = e`` and ``L`` = the written end. An unsettled pinned chunk is never
          evicted: rows between the sink and the pin go first, then the pin moves right after the global sink and
          rows after it are evicted.
        - visible rows (docs/semantics.md §1.6, :func:`kvops.cache._window.visible_rows`), with ``E'`` the effective sink
          after the update and ``a = L' - W``: all rows ``[0, L')`` while ``a <= 0``; else ``W`` is the whole
          budget: the sink rows ``[0, min(E', L'))``, an unsettled pinned chunk that starts before ``a`` (``p``
          rows), then the newest ``max(0, W - E' - p)`` rows (``[a, L')`` without sink or pin). With
          ``recent_window_tokens = r``: the sink rows, an unsettled pinned chunk and ``[max(E', ls - r), L')``.
          One contiguous range is returned as a view of the cache, several as a ``torch.cat`` in row order.

        Returns:
            :class:`CausalKVView` ``(k, v, local_start_index, local_end_index, visible_local_end,
            visible_global_end)``.

        Raises (before anything is written or moved):
            ValueError: ``"recent_window_tokens must be non-negative or None"``;
                ``"{name} requires cache_head_start when cache heads ({H_cache}) differ from input heads ({H_in})."``;
                a head slice outside ``[0, H_cache)`` or overlapping another slice's; rank, dtype, device, batch or
                head_dim mismatches (as ``kvops.cache_write``).
            RuntimeError: ``"Invalid {name} write range: local=[ls, le), global_end=G, prev_local_end=L,
                kv_cache_size=S, num_new_tokens=n, current_start=s, current_end=e"`` when the rows leave
                ``[0, S)`` (``S`` after a planned growth), e.g. rewriting a chunk that was already evicted or a
                chunk longer than the buffer. The same message with a reason appended in parentheses when a rewrite
                would land on the global sink after tokens were evicted (an evicted chunk), when an evicting append
                would land on the sink rows (``sink + n > S``), or when ``s > G`` (an append that would leave
                positions ``[G, s)`` unwritten).
        """
        h0, h1, c, placement = self._place(key, value, current_chunk_start, cache_head_start, recent_window_tokens,
                                     debug_name)
        g, l = c.global_end, c.local_end
        unsettled_pin = c.pinned_len > 0 and c.pinned_start != self.global_sink_tokens
        if placement.capacity != self.cache_size:
            self._grow(placement.capacity)
        if unsettled_pin:
            moves, pinned_start = eviction_moves_with_pin(
                placement, l, self.global_sink_tokens, c.pinned_start, c.pinned_len
            )
        else:
            moves, pinned_start = eviction_moves(placement, l, self._effective_sink(c)), c.pinned_start
        for src, dst, count in moves:
            if torch.compiler.is_compiling() or count > 0:  # count is 0 unless rows are evicted
                cache_roll(self.k, self.v, src, dst, count, h0, h1 - h0)
        head_start = None if cache_head_start is None else h0
        cache_write(key, value, self.k, self.v, placement.ls, head_start)
        added, evicted = placement.added, placement.evicted
        c.global_end, c.local_end, c.pinned_start = g + added, l + added - evicted, pinned_start

        k, v = self._visible(c, placement.ls, c.local_end, recent_window_tokens, h0, h1, head_start is not None)
        return CausalKVView(k, v, placement.ls, placement.le, c.local_end, c.global_end)

    def _place(self, key, value, current_chunk_start, cache_head_start, recent_window_tokens, debug_name=None):
        """Validate one update (nothing is written) and return ``(h0, h1, cursors, placement)``: the head slice, its
        cursors and the :class:`kvops.cache._placement.Placement` (the chunk's rows after the update, the tokens
        appended and rows evicted, the capacity after a growth). Shared with :class:`kvops.cache.ring.RingCausalKVCache`.
        """
        name = self.name if debug_name is None else debug_name
        check_update_args(name, key, value, self.k.shape[2], current_chunk_start, cache_head_start, recent_window_tokens)
        # Metadata contract of the write op, checked before anything moves (zero rows: the row range is ours).
        h0 = check_cache_write(key, value, self.k, self.v, 0, cache_head_start, op=name, check_rows=False)
        h1 = h0 + key.shape[2]
        c, stale = self._find_slice_cursors(h0, h1)
        # Branch-free (kvops.cache._placement): a rewrite, an append and an append that evicts run the same graph; only
        # the pin's state (none/unsettled/settled) and the shape of the visible window (a view or a cat) are Python
        # branches. Rows [0, protected) never follow position = G - L + row.
        protected = self.global_sink_tokens if c.pinned_len > 0 else self._effective_sink(c)
        s, g, l = current_chunk_start, c.global_end, c.local_end
        placement, ok = place_rows(key.shape[1], s, g, l, self.cache_size, self.allow_growth, protected)
        if not ok:
            raise_write_range(name, placement, s, g, l, protected)
        # Validated: only now may a new head slicing replace the cursors of slices that never held tokens.
        if stale is not None:
            for old in stale:
                del self._cursors[old]
            self._cursors[(h0, h1)] = c
        return h0, h1, c, placement

    def _grow(self, new_size: int) -> None:
        """Reallocate the buffers with ``new_size`` rows, copying the rows in use (all heads) through the write op."""
        k, v = self.k, self.v
        old_size = k.shape[1]
        rows = 0
        for c in self._cursors.values():
            rows = smax(rows, c.local_end)  # no Max term under torch.compile (kvops.cache._clamp)
        b, _, h, d = k.shape
        if self._fused_kv:
            kv = k.new_zeros(b, new_size, 2, h, d)
            new_k, new_v = kv[:, :, 0], kv[:, :, 1]
        else:
            new_k, new_v = k.new_zeros(b, new_size, h, d), v.new_zeros(b, new_size, h, v.shape[3])
        if rows > 0:
            cache_write(k[:, :rows], v[:, :rows], new_k, new_v, 0)
        self.k, self.v = new_k, new_v
        if self.attention_window_size == old_size:
            self.attention_window_size = new_size

    def _visible(self, c: _Cursors, ls: int, end: int, recent: int | None, h0: int, h1: int, sliced: bool):
        """The rows of :func:`visible_rows` (docs/semantics.md §1.6): a view of the cache when they are one range."""

        def rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t[:, a:b, h0:h1] if sliced else t[:, a:b]

        if recent is None and self.attention_window_size >= self.cache_size:
            ranges = [(0, end)]  # the window holds every row (L' <= S <= W): no clamp, no guard
        else:
            ranges = visible_rows(
                end, self.attention_window_size, self._effective_sink(c), c.pinned_start, c.pinned_len, ls, recent,
                self.window_mode,
            )
        if len(ranges) == 1:
            (a, b), = ranges
            return rows(self.k, a, b), rows(self.v, a, b)
        return (
            torch.cat([rows(self.k, a, b) for a, b in ranges], dim=1),
            torch.cat([rows(self.v, a, b) for a, b in ranges], dim=1),
        )


def _share_storage(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``k`` and ``v`` are views of one allocation (only decides the layout of grown buffers).

    Eager: the storages' data pointers. Inside ``torch.compile``/``torch.export`` (strict and non-strict) a storage
    has no data pointer, so views of one base tensor count (``kv.unbind(2)``, ``kv[:, :, 0]``); K/V made to share
    storage by other means (``as_strided`` on a storage, ``set_``) then grow as two allocations, which is the same
    cache with another layout.
    """
    if torch.compiler.is_compiling():
        return k._base is not None and k._base is v._base
    return k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
