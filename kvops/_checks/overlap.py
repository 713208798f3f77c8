"""Caches whose memory overlaps (docs/semantics.md §1.8, §3, §6): metadata only, no tensor contents.

A cache an op writes must not share a byte with another cache it writes, nor hold two elements at one address: what is
written would not read back (the later store wins). The documented joint layouts (K and V as views of one
``[P, block_size, 2, H_kv, D]``, ``[P, 2, block_size, H_kv, D]``, ``[P, 2, H_kv, block_size, D]`` or
``[B, S, 2, H, D]`` allocation, interleaved but disjoint) share a storage without sharing a byte, and are accepted.

Whether two strided views meet is decided exactly from sizes, strides and storage offsets (an integer search over
the index boxes, bounded: at most ``_BUDGET`` steps, beyond which the layout is accepted unproven). Symbolic shapes
or strides (dynamic shapes under ``torch.compile``) are not checked (no guards are added).
"""

from __future__ import annotations

import torch

_BUDGET = 20000


def _concrete(t: torch.Tensor) -> bool:
    return all(type(x) is int for x in (*t.shape, *t.stride(), t.storage_offset()))


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # a tensor subclass without a storage (functional wrappers): nothing to compare
        return None


def _dims(t: torch.Tensor, sign: int) -> list[tuple[int, int, int]]:
    """``(stride_bytes, lo, hi)`` per dim of size > 1; ``sign=-1`` negates the index range (the other side)."""
    item = t.element_size()
    out = []
    for n, s in zip(t.shape, t.stride()):
        if n > 1:
            out.append((s * item, 0, n - 1) if sign > 0 else (s * item, -(n - 1), 0))
    return out


def _solutions(dims: list[tuple[int, int, int]], target: int, skip_zero: bool) -> bool | None:
    """Whether integers ``x_d in [lo_d, hi_d]`` with ``sum(x_d * s_d) == target`` exist (with ``skip_zero``: other
    than all zeros); None when the search ran out of budget."""
    merged: dict[int, list[int]] = {}
    for s, lo, hi in dims:  # dims of one stride add up to one range
        r = merged.setdefault(s, [0, 0])
        r[0] += lo
        r[1] += hi
    dims = sorted(((s, lo, hi) for s, (lo, hi) in merged.items()), key=lambda d: -d[0])
    rest_lo = [0] * (len(dims) + 1)
    rest_hi = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        s, lo, hi = dims[i]
        rest_lo[i], rest_hi[i] = rest_lo[i + 1] + lo * s, rest_hi[i + 1] + hi * s
    budget = [_BUDGET]

    def search(i: int, remaining: int, nonzero: bool) -> bool | None:
        if i == len(dims):
            return remaining == 0 and (nonzero or not skip_zero)
        budget[0] -= 1
        if budget[0] < 0:
            return None
        s, lo, hi = dims[i]
        if s == 0:
            return search(i + 1, remaining, nonzero or (hi - lo) > 0)
        # remaining - x * s must stay within [rest_lo[i + 1], rest_hi[i + 1]]
        first = max(lo, -((rest_hi[i + 1] - remaining) // s))
        last = min(hi, (remaining - rest_lo[i + 1]) // s)
        unknown = False
        for x in range(first, last + 1):
            found = search(i + 1, remaining - x * s, nonzero or x != 0)
            if found:
                return True
            unknown |= found is None
        return None if unknown else False

    return search(0, target, False)


_self_memo: dict = {}


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share a byte (False when unknown or symbolic); memoized on the layout."""
    key = (t.shape, t.stride(), t.dtype)
    try:
        found = _self_memo.get(key)
    except TypeError:  # symbolic sizes (SymInts do not hash): not checked
        return False
    if found is None:
        if not _concrete(t) or t.numel() <= 1:
            return False
        if len(_self_memo) >= 256:
            _self_memo.clear()
        found = _self_memo[key] = _self_overlaps(t)
    return found


def _self_overlaps(t: torch.Tensor) -> bool:
    item = t.element_size()
    dims = _dims(t, 1)
    if len({s for s, _, _ in dims}) < len(dims):  # two dims of one stride: index (1, 0) meets (0, 1)
        return True
    # the standard sufficient condition first: each stride exceeds the span of the smaller ones
    span = item
    for s, _, hi in sorted(dims):
        if s < span:
            break
        span += hi * s
    else:
        return False
    # exact: some nonzero index difference x lands within an element: |sum(x_d * s_d)| < item (by symmetry,
    # targets 0 .. item - 1)
    signed = [(s, -hi, hi) for s, _, hi in dims]
    return any(_solutions(signed, y, skip_zero=True) for y in range(item))


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte (False when unknown, symbolic, or on different storages)."""
    key_a = _storage_key(a)
    if key_a is None or key_a != _storage_key(b) or a.device != b.device:
        return False
    if a.numel() == 0 or b.numel() == 0 or not (_concrete(a) and _concrete(b)):
        return False
    off_a, off_b = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    # bytes of an element: a's element occupies [x, x + item_a), b's [y, y + item_b); they meet iff
    # y - x in (-item_b, item_a), i.e. off_b - off_a + (b-side index) - (a-side index) + z == 0 for such z
    dims = _dims(a, 1) + _dims(b, -1)
    lo, hi = -(a.element_size() - 1), b.element_size() - 1
    dims.append((1, lo, hi))
    return bool(_solutions(dims, off_b - off_a, skip_zero=False))


def _span(t: torch.Tensor) -> tuple[int, int]:
    item = t.element_size()
    lo = t.storage_offset() * item
    return lo, lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * item + item


def check_caches_disjoint(op: str, caches: list[tuple[str, torch.Tensor]]) -> None:
    """``ValueError`` when a written cache holds two elements at one address, or two written caches share memory
    (the message names them); the documented joint K/V layouts are disjoint and pass. Pairs are compared only when
    they share a storage and their byte spans meet (layers of one allocation cost one sort). Not checked while
    ``torch.compile`` traces (Dynamo cannot trace storage identity, and Python validators of the composites and
    caches run under it; ``torch.export`` sets the same flag): eager calls check."""
    if torch.compiler.is_compiling():
        return
    if len(caches) == 2:  # the common case: one K and one V cache
        (name_a, a), (name_b, b) = caches
        for name, t in caches:
            if self_overlaps(t):
                _raise_self(op, name, t)
        key_a = _storage_key(a)
        if key_a is None or key_a != _storage_key(b):
            return
        try:
            memo_key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype,
                        b.storage_offset() * b.element_size() - a.storage_offset() * a.element_size())
            found = _pair_memo.get(memo_key)
        except TypeError:  # symbolic
            return
        if found is None:
            if len(_pair_memo) >= 256:
                _pair_memo.clear()
            found = _pair_memo[memo_key] = overlap(a, b)
        if found:
            _raise_overlap(op, name_a, a, name_b, b)
        return
    groups: dict = {}
    for name, t in caches:
        if self_overlaps(t):
            _raise_self(op, name, t)
        key = _storage_key(t)
        if key is not None and t.numel() > 0 and _concrete(t):
            groups.setdefault((key, t.device), []).append((name, t))
    for members in groups.values():
        if len(members) < 2:
            continue
        spans = sorted((_span(t), i) for i, (_, t) in enumerate(members))
        for x, ((lo_a, hi_a), i) in enumerate(spans):
            for (lo_b, _), j in spans[x + 1:]:
                if lo_b >= hi_a:
                    break
                (name_a, a), (name_b, b) = members[min(i, j)], members[max(i, j)]
                if overlap(a, b):
                    _raise_overlap(op, name_a, a, name_b, b)


_pair_memo: dict = {}


def _raise_self(op, name, t):
    raise ValueError(
        f"{op}: {name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} overlaps itself (two of its "
        f"elements share memory), so what is written would not read back. Allocate the cache with its own "
        f"storage (e.g. torch.zeros), or pass a view whose elements are distinct."
    )


def _raise_overlap(op, name_a, a, name_b, b):
    same = " (the same tensor)" if a is b else ""
    raise ValueError(
        f"{op}: {name_a} and {name_b} overlap in memory{same}: {name_a} shape {tuple(a.shape)} strides "
        f"{tuple(a.stride())} offset {a.storage_offset()}, {name_b} shape {tuple(b.shape)} strides "
        f"{tuple(b.stride())} offset {b.storage_offset()}; a write to one would overwrite the other. Pass caches "
        f"with disjoint memory (separate tensors, or the K and V halves of a joint allocation, e.g. kv[:, :, 0] and "
        f"kv[:, :, 1] of [num_blocks, block_size, 2, num_kv_heads, head_dim])."
    )
