"""The visible window of a streaming cache (docs/semantics.md §1.6): which cache rows a chunk attends to.

One pure function, shared by every cache with the §1 contract (``CausalKVCache``, the packed cache): it maps the
cursors after an update to the row ranges of the view. It reads no tensor, so under ``torch.compile`` its ints may be
``SymInt``s: the comparisons below are the only guards it adds (whether the window starts past row 0, whether a sink
or a pinned chunk is shown, whether ranges are empty or touch), and the clamps are those of
:mod:`kvops.cache._clamp` (no ``Max``/``Min`` terms under ``torch.compile``; plain ``max``/``min`` on Python ints).
"""

from __future__ import annotations

from ._clamp import relu, smax, smin

__all__ = ["visible_rows"]


def visible_rows(
    local_end: int,
    window: int,
    sink: int,
    pinned_start: int = -1,
    pinned_len: int = 0,
    chunk_start: int = 0,
    recent_window_tokens: int | None = None,
    window_mode: str = "sink",
) -> list[tuple[int, int]]:
    """Row ranges ``[(start, end), ...]`` of the visible window, in increasing row order, disjoint, non-empty and
    not touching (touching ranges are merged), so one range means the view is a plain slice of the cache; the single
    range ``(0, 0)`` when nothing is visible (``L' = 0``).

    Args:
        local_end: ``L'``, the rows in use after the update (rows ``[0, L')``).
        window: ``W``, the attention window: the whole visible budget in rows (sink and pinned rows included).
        sink: ``E``, the effective sink after the update (``K``, or with a pinned chunk ``global_sink_tokens +
            pinned_len`` once the pin sits right after the global sink, else ``global_sink_tokens``).
        pinned_start, pinned_len: the pinned chunk's first row and length (``pinned_len == 0``: no pin). Only a pin
            lying past the sink (``pinned_start >= sink``, a pin not yet next to the global sink) is shown on its own;
            a settled pin is part of ``sink``.
        chunk_start: ``ls``, the row the current chunk was written at (used with ``recent_window_tokens`` only).
        recent_window_tokens: ``r`` or ``None``.
        window_mode: ``"sink"`` (default) or ``"tail"``: what the view is once the ``W`` rows no longer hold every
            row in use (``r is None``; docs/porting.md "Window with a sink").

    Semantics (docs/semantics.md §1.6, as sglang's windowed cache with sinks and LongLive-2's ``_attention_view``):

    - ``r is None``, with ``a = L' - W``: if ``a <= 0``, all rows ``[0, L')``. Else the sink rows
      ``[0, min(E, L'))``; then the pinned chunk ``[pinned_start, min(pinned_start + pinned_len, L'))`` if it lies
      past the sink and starts before ``a`` (its ``p`` rows; ``p = 0`` otherwise); then the newest
      ``max(0, W - E - p)`` rows ``[max(E, L' - (W - E - p)), L')``. The view holds ``max(W, min(E, L') + p)`` rows
      at most, ``W`` whenever ``E + p <= W``. With ``E = 0`` and no such pin this is ``[a, L')``. A pin lying past
      the sink but at or after ``a`` is shown only as far as it is among the newest rows.
    - ``r >= 0``: the sink rows ``[0, min(E, L'))``, a pin lying past the sink, and ``[max(min(E, L'), ls - r), L')``
      (``r = 0``: sink + the current chunk); all rows when they meet.

    - ``window_mode="tail"`` and ``r is None``: the plain tail ``[max(0, L' - W), L')``, whatever the sink and a pin
      (sglang's dense ``CausalSelfAttentionKVCache``, Self-Forcing's ``max_attention_size``): sink rows are still
      never evicted, but they drop out of view once ``L' > W``.

    ``r < 0`` is the caller's error to raise (``"recent_window_tokens must be non-negative or None"``).
    """
    pin = pinned_len > 0 and pinned_start >= sink
    if recent_window_tokens is None:
        if (sink == 0 and not pin) or window_mode == "tail":  # one range without a guard on the window's start under torch.compile
            return [(relu(local_end - window), local_end)]
        start = local_end - window
        if start <= 0:
            return [(0, local_end)]
        # local_end > window here, so with sink <= window the sink is whole and, without a pin shown, the newest rows
        # are the last window - sink: no clamp (each one grows Inductor's sympy work, kvops.cache._clamp). The sink
        # and the window are ints of the configuration (a SymInt sink only with a settled pin: a linear guard).
        whole_sink = sink <= window
        sink_end = sink if whole_sink else smin(sink, local_end)
        ranges = [(0, sink_end)]
        shown = 0
        if pin and pinned_start < start:
            pin_end = smin(pinned_start + pinned_len, local_end)
            ranges.append((pinned_start, pin_end))
            shown = pin_end - pinned_start
        if whole_sink and len(ranges) == 1:  # no pin shown
            ranges.append((local_end - (window - sink), local_end))
        else:
            ranges.append((smax(sink, local_end - relu(window - sink - shown)), local_end))
        return _merge(ranges)
    if sink <= local_end:  # a guard, no clamp (false only while the first chunks fill the sink)
        sink_end = sink
        start = sink + relu(chunk_start - recent_window_tokens - sink)
    else:  # chunk_start - r <= chunk_start < local_end: nothing is shown after the (partial) sink
        sink_end = start = local_end
    ranges = [(0, sink_end)]
    if pin:
        pinned = (pinned_start, smin(pinned_start + pinned_len, local_end))
        ranges += [pinned, (start, local_end)] if pinned[0] < start else [(start, local_end), pinned]
    else:
        ranges.append((start, local_end))
    return _merge(ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop empty ranges and merge touching or overlapping ones (input sorted by start); ``[(0, 0)]`` if none."""
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], smax(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged or [(0, 0)]
