"""The cursor arithmetic of one streaming-cache update (docs/semantics.md §1): rows, evictions, moves, range checks.

Also the cursor state (``_Cursors``) and the update's result (``CausalKVView``). Pure functions of ints, shared by :class:`~kvops.cache.causal.CausalKVCache` and
:class:`~kvops.cache.ring.RingCausalKVCache`. Under ``torch.compile`` the ints are ``SymInt``s; the arithmetic is
branch-free (a rewrite, an append and an append that evicts run one graph) and its clamps are those of
:mod:`kvops.cache._clamp` (no ``Max``/``Min`` terms, which Inductor's on-disk FX graph cache would specialize when it
re-evaluates stored guards in a later process). Each clamp's argument is linear in the cursors (one level of clamps,
two for a pinned chunk's moves), which keeps Inductor's sympy work on the sizes and indices small.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._clamp import any_negative, positive, relu, smax


class CausalKVView(NamedTuple):
    """What :meth:`CausalKVCache.update_and_get_attention_kv` returns.

    ``k``/``v`` are the visible rows ``[B, V, H_in, D]`` / ``[B, V, H_in, D_v]`` in row order (a view of the cache
    when they are one contiguous row range, else a ``torch.cat`` of the ranges of
    :func:`kvops.cache._window.visible_rows`: sink rows, a pinned chunk, the newest rows; docs/semantics.md §1.6).
    The four ints are cache rows (``local_*``) and token positions (``*_global_*``): the chunk was written at rows
    ``[local_start_index, local_end_index)``; ``visible_local_end`` is the cache's local end after the update (``L'``)
    and ``visible_global_end`` its global end (``G'``).
    """

    k: torch.Tensor
    v: torch.Tensor
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int


class _Cursors:
    """Cursors of one head slice: ``global_end`` (G), ``local_end`` (L), the pinned chunk (rows) and the ring
    offset (used by :class:`kvops.cache.ring.RingCausalKVCache` only; always 0 here)."""

    __slots__ = ("global_end", "local_end", "pinned_start", "pinned_len", "ring_offset")

    def __init__(self) -> None:
        self.global_end = 0
        self.local_end = 0
        self.pinned_start = -1
        self.pinned_len = 0
        self.ring_offset = 0


class Placement(NamedTuple):
    """One update's rows: the chunk at rows ``[ls, le)`` after it; ``added`` tokens appended, ``evicted`` rows
    evicted (``max(0, over)``), ``capacity`` the rows after a planned growth; ``evicting`` is ``1`` when rows are
    evicted, else ``0`` (an int, so that it multiplies a move's row count without a branch)."""

    n: int
    ls: int
    le: int
    added: int
    evicted: int
    evicting: int
    over: int
    capacity: int


def place_rows(n, s, g, l, capacity, allow_growth, protected) -> tuple[Placement, bool]:
    """The rows of writing ``n`` tokens at global position ``s`` into a cache at ``G = g``, ``L = l`` with
    ``capacity`` rows (``L <= capacity``) and rows ``[0, protected)`` that never follow ``position = G - L + row``
    (the sink; the global sink when a chunk is pinned). Returns ``(placement, ok)``; ``ok`` is False when the write
    range is invalid (:func:`raise_write_range` says why)."""
    e = s + n
    added = relu(e - g)  # tokens appended (0 for a rewrite)
    if allow_growth and l + added > capacity:
        capacity = smax(l + added, 2 * capacity)
    # max(0, L + a - S) = max(0, L + e - G - S): for a rewrite L + e - G - S <= L - S <= 0, so no nested clamp.
    over = l + e - g - capacity
    evicted = relu(over)
    ls = l + s - g - evicted  # = s - (G - L) for a rewrite, L + a - n or S - n for an append
    le = ls + n
    # Each check is one comparison (any_negative: a single guard under torch.compile): rows inside [0, S) and no
    # gap after G; not a rewrite (e <= G) landing on the rows [0, protected) after tokens were evicted (G > L), i.e.
    # a rewrite of an evicted chunk; and an append that evicts lands after the protected rows.
    ok = not (
        any_negative(ls, capacity - le, g - s)
        or not any_negative(g - e, ls, protected - 1 - ls, g - l - 1)
        or not any_negative(evicted - 1, protected - 1 - ls)
    )
    return Placement(n, ls, le, added, evicted, positive(over), over, capacity), ok


def raise_write_range(name, placement: Placement, s, g, l, protected) -> None:
    """Raise the ``Invalid {name} write range`` error of an update :func:`place_rows` rejected (concrete values).

    The message starts with sglang's wording (``Invalid {name} write range: local=[ls, le), ...``) and ends with the
    reason and the fix in parentheses."""
    ls, le, g, l, capacity, s = (int(x) for x in (placement.ls, placement.le, g, l, placement.capacity, s))
    n, e = placement.n, s + placement.n
    oldest = g - l + protected if g > l else g - l  # oldest position a rewrite may address (rows past the sink)
    if s < 0:
        reason = (f"current_start is negative: token positions start at 0; pass current_start >= 0 "
                  f"(current_start={g} appends the next chunk)")
    elif s > g:
        reason = f"current_start is past global_end: positions [{g}, {s}) would never be written; pass current_start <= {g}"
    elif e > g and n > capacity and protected == 0:
        reason = (f"the chunk of {n} tokens is longer than the cache's {capacity} rows; use a larger cache, smaller "
                  f"chunks or allow_growth=True")
    elif e > g and n > capacity - protected:
        reason = (
            f"the chunk does not fit after the sink rows [0, {protected}): sink + num_new_tokens must be "
            f"<= kv_cache_size ({protected} + {n} > {capacity}); use a larger cache or smaller chunks"
        )
    elif g > l and s < oldest:
        held = (f"rows [0, {protected}) hold the sink, rows [{protected}, {l}) positions [{oldest}, {g})" if protected
                else f"rows [0, {l}) hold positions [{oldest}, {g})")
        reason = (
            f"the chunk starts before position {oldest}, the oldest one held after the sink: positions "
            f"[{protected}, {oldest}) were already evicted ({held}); rewrite only tokens still cached "
            f"(current_start >= {oldest}) or append at current_start={g}"
        )
    else:
        reason = (f"the rows fall outside [0, {capacity}); rewrite only tokens still cached (current_start >= "
                  f"{max(oldest, 0)}) or append at current_start={g}")
    raise RuntimeError(
        f"Invalid {name} write range: local=[{ls}, {le}), global_end={g}, prev_local_end={l}, "
        f"kv_cache_size={capacity}, num_new_tokens={n}, current_start={s}, current_end={e} ({reason})"
    )


def eviction_moves(placement: Placement, l, sink):
    """The row move ``(src, dst, count)`` of an eviction without an unsettled pin: rows ``[E + ev, L)`` move down to
    ``E`` (``count`` is 0 unless rows are evicted; ``src``/``dst`` are in range either way)."""
    return [(sink + placement.evicted, sink, (l - placement.evicted - sink) * placement.evicting)]


def eviction_moves_with_pin(placement: Placement, l, global_sink, pinned_start, pinned_len):
    """Eviction moves when a pinned chunk sits past the global sink, and the pin's new start.

    The rows between the global sink and the pin are evicted first (the pin moves down with the rows after it); once
    the pin sits right after the global sink, the remaining rows are evicted after the pin. The pin is never evicted.
    """
    pin_end = pinned_start + pinned_len
    gap = pinned_start - global_sink  # >= 1: rows between the global sink and an unsettled pin
    after = relu(placement.over - gap)  # evicted after the pin: max(0, evicted - gap), one level of clamps
    before = placement.evicted - after  # = min(evicted, gap), evicted between the global sink and the pin
    return [
        (global_sink + before, global_sink, (pin_end - global_sink - before) * placement.evicting),
        (pin_end + after, pin_end - before, relu(l - pin_end - after) * placement.evicting),
    ], pinned_start - before
