"""``RingCausalKVCache``: the streaming cache of docs/semantics.md §1 in a ring layout (docs/ring-cache.md).

Rows ``[0, E)`` hold the sink; rows ``[E, S)`` form a ring of ``R = S - E`` rows, so an evicting append overwrites
the evicted rows in place: it writes the new chunk only (one or two ``kvops.cache_write`` calls, two when the chunk
wraps past row ``S - 1``) and nothing moves (no ``kvops.cache_roll``). The cursors, errors and returned indices are
those of :class:`~kvops.cache.causal.CausalKVCache` (it shares its validation, ``CausalKVCache._place``): the
*logical* row ``E + j`` of the roll layout is stored at the *physical* row ``E + (offset + j) % R``, where ``offset``
advances by the evicted rows on every eviction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.contiguous import cache_write
from ._clamp import smin
from ._window import visible_rows
from .causal import CausalKVCache

__all__ = ["RingCausalKVCache", "RingKVView"]


class RingKVView(NamedTuple):
    """What :meth:`RingCausalKVCache.update_and_get_attention_kv` returns.

    ``k``/``v`` are the visible rows (the same tokens as :class:`~kvops.cache.causal.CausalKVView`'s, docs/semantics.md
    §1.6) ``[B, V, H_in, D]`` / ``[B, V, H_in, D_v]`` in **ring order** (increasing physical row): a view of the cache
    when the rows are one physical range (the steady state of a full cache with ``W = S``), else a ``torch.cat``.
    The four ints are the *logical* rows and positions of the roll layout, identical to ``CausalKVView``'s.
    ``segments`` describes the order: ``((length, global_start), ...)``, one per run of consecutive positions, in
    view order; :attr:`positions` expands it and :meth:`ordered` gathers K/V in position order.

    When ring order is enough: attention of every query to every visible key with no mask inside the window and no
    bias that depends on the key's index (softmax attention is invariant to permuting keys together with values),
    e.g. the block-causal video models (Wan/Self-Forcing/LingBot: the chunk attends to all visible rows unmasked);
    RoPE applied to K before the write is fine (it travels with the row). It does **not** hold for a causal or
    sliding mask inside the window, ALiBi or relative-position biases computed from the key's index in the view,
    or anything that slices the view by index (use :attr:`positions` to build such masks, or :meth:`ordered`).
    """

    k: torch.Tensor
    v: torch.Tensor
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int
    segments: tuple[tuple[int, int], ...]

    @property
    def positions(self) -> torch.Tensor:
        """``[V]`` int64 (on ``k``'s device): the global token position of each visible row, in view order."""
        return torch.cat([torch.arange(g, g + n, device=self.k.device) for n, g in self.segments])

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` in increasing position order (exactly ``CausalKVView``'s ``k``/``v``; a copy unless the view is
        already ordered, then ``k``/``v`` themselves)."""
        offsets, off = [], 0
        for n, _ in self.segments:
            offsets.append(off)
            off += n
        order = _argsort([g for _, g in self.segments])
        if order == list(range(len(order))):
            return self.k, self.v
        pick = [(offsets[i], self.segments[i][0]) for i in order]
        return (
            torch.cat([self.k.narrow(1, o, n) for o, n in pick], dim=1),
            torch.cat([self.v.narrow(1, o, n) for o, n in pick], dim=1),
        )


class RingCausalKVCache(CausalKVCache):
    """:class:`~kvops.cache.causal.CausalKVCache` with the rows after the sink stored as a ring (docs/ring-cache.md).

    Same constructor (buffers ``[B, S, H_cache, D]`` / ``[B, S, H_cache, D_v]``, any strides, joint K/V allowed),
    same :meth:`allocate`, same ``update_and_get_attention_kv(key, value, current_chunk_start, cache_head_start=None,
    recent_window_tokens=None)`` contract, cursors (``global_end``, ``local_end``), errors (the same validator and
    messages) and returned indices; head slices (``cache_head_start``), sinks (``sink_tokens``,
    ``global_sink_tokens``: without a pin ``E = max(global_sink_tokens, sink_tokens)``), ``attention_window_size``,
    ``window_mode`` (``"sink"`` or ``"tail"``) and ``recent_window_tokens`` are supported. The difference is the
    layout and the view's order:

    - rows ``[0, E)`` hold positions ``[0, E)`` as in the roll layout; the logical row ``E + j`` of the roll layout
      (position ``G - L + E + j``) is stored at physical row ``E + (offset + j) % (S - E)``. An evicting append of
      ``n`` tokens that evicts ``ev`` rows advances ``offset`` by ``ev`` and writes the ``n`` new rows (K+V bytes
      moved = the chunk's; the roll layout moves the ``S - E - n`` kept rows twice more); a rewrite writes the chunk's
      rows. Each write is at most two ``kvops.cache_write`` calls (the chunk wraps at row ``S``).
    - the returned :class:`RingKVView` holds the visible rows in ring order; see its docstring for when that order
      is enough for attention (no mask inside the window, no index-dependent bias) and for ``positions`` /
      ``ordered()`` (:meth:`ordered` here too).

    Not supported (a ``ValueError`` naming the option; use :class:`CausalKVCache` for them):
    ``allow_growth=True`` (at construction) and pinned chunks (:meth:`pin_current_chunk`).

    Under ``torch.compile(fullgraph=True)`` use it as ``CausalKVCache`` (caches passed as arguments). Whether the
    chunk wraps and whether the visible rows are one physical range are Python branches, so a stream compiles a few
    more graphs than the roll layout while the ring offset takes its first values, and none once every case was
    seen (measured on torch 2.13: ``examples/streaming_video.py`` 5 graphs vs 3 for the roll layout; a sink stream
    with a wrapping chunk 6 graphs, the last at chunk 5, bounded in tests/streaming/test_ring_cache.py).
    """

    def __init__(self, k, v, *, allow_growth: bool = False, name: str = "RingCausalKVCache", **kwargs) -> None:
        if allow_growth:
            raise ValueError(
                f"{name}: allow_growth=True is not supported by the ring layout (a grown ring would have to be "
                f"unrolled); use CausalKVCache for growing caches."
            )
        super().__init__(k, v, allow_growth=False, name=name, **kwargs)

    def pin_current_chunk(self, num_tokens: int) -> None:
        """Not supported by the ring layout: raises ``ValueError`` (use :class:`CausalKVCache` for pinned chunks)."""
        raise ValueError(
            f"{self.name}.pin_current_chunk({num_tokens}): pinned chunks are not supported by the ring layout; "
            f"use CausalKVCache for pinned (shot) sinks."
        )

    @staticmethod
    def ordered(view: RingKVView) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``view`` in position order (:meth:`RingKVView.ordered`)."""
        return view.ordered()

    def update_and_get_attention_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str | None = None,
    ) -> RingKVView:
        """Write a chunk at its global position and return the visible rows in ring order (docs/semantics.md §1).

        Arguments, cursor updates, returned indices and errors (raised before anything is written) are those of
        :meth:`CausalKVCache.update_and_get_attention_kv`; the chunk's logical rows ``[ls, le)`` are written at
        their physical ring rows, after the ring offset advanced by the evicted rows. Returns a :class:`RingKVView`.
        """
        h0, h1, c, placement = self._place(key, value, current_chunk_start, cache_head_start, recent_window_tokens,
                                     debug_name)
        ls, le, added, evicted = placement.ls, placement.le, placement.added, placement.evicted
        sink = self._effective_sink(c)
        ring = self.cache_size - sink
        offset = (c.ring_offset + evicted) % ring  # committed with the cursors, after the writes
        head_start = None if cache_head_start is None else h0
        done = 0
        for p, count in self._physical(offset, sink, ls, le):
            cache_write(key.narrow(1, done, count), value.narrow(1, done, count), self.k, self.v, p, head_start)
            done += count
        c.ring_offset, c.global_end, c.local_end = offset, c.global_end + added, c.local_end + added - evicted

        sliced = head_start is not None
        pieces = []  # (physical start, count, global start) in physical order
        first = c.global_end - c.local_end  # position of logical row 0 past the sink
        for a, b in visible_rows(c.local_end, self.attention_window_size, sink, -1, 0, ls, recent_window_tokens,
                                 self.window_mode):
            if b <= a:
                continue
            for p, count in self._physical(c.ring_offset, sink, a, b):
                pieces.append((p, count, (a if a < sink else first + a)))
                a += count
        pieces = [pieces[i] for i in _argsort([p for p, _, _ in pieces])]
        ranges = []  # merged physical ranges
        for p, count, _ in pieces:
            if ranges and ranges[-1][1] == p:
                ranges[-1][1] = p + count
            else:
                ranges.append([p, p + count])
        segments = []
        for _, count, g in pieces:
            if segments and segments[-1][1] + segments[-1][0] == g:
                segments[-1][0] += count
            else:
                segments.append([count, g])

        def rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t[:, a:b, h0:h1] if sliced else t[:, a:b]

        if not ranges:
            k, v = rows(self.k, 0, 0), rows(self.v, 0, 0)
        elif len(ranges) == 1:
            (a, b), = ranges
            k, v = rows(self.k, a, b), rows(self.v, a, b)
        else:
            k = torch.cat([rows(self.k, a, b) for a, b in ranges], dim=1)
            v = torch.cat([rows(self.v, a, b) for a, b in ranges], dim=1)
        return RingKVView(k, v, ls, le, c.local_end, c.global_end, tuple((n_, g) for n_, g in segments))

    def _physical(self, offset: int, sink: int, a: int, b: int) -> list[tuple[int, int]]:
        """The physical row runs ``[(start, count), ...]`` holding logical rows ``[a, b)`` at ring offset ``offset``,
        in logical order."""
        out = []
        if a < sink:
            end = smin(b, sink)
            out.append((a, end - a))
            a = end
        if a < b:
            size = self.cache_size
            p = sink + (offset + a - sink) % (size - sink)
            head = smin(b - a, size - p)
            out.append((p, head))
            if head < b - a:
                out.append((sink, b - a - head))
        return out


def _argsort(xs: list[int]) -> list[int]:
    """Indices that sort ``xs`` (distinct ints; a handful of them). An insertion sort by comparisons, because Dynamo
    cannot trace ``sorted`` over ``SymInt`` keys; each comparison is a guard under ``torch.compile``."""
    order: list[int] = []
    for i, x in enumerate(xs):
        j = len(order)
        while j > 0 and x < xs[order[j - 1]]:
            j -= 1
        order.insert(j, i)
    return order
