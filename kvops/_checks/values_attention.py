"""Value contracts of ``paged_attention`` (docs/semantics.md §7): ``cu_seqlens_q``, ``seq_lens``, the block ids the
queries read (``check_paged_attention``; its eager CPU fast path through the native kernel's one-pass check,
``_native_valid`` / ``native_checks_all``), ALiBi slopes (``check_alibi_slopes``) and custom-mask lengths
(``check_custom_mask``).

The modes and shared helpers are in ``values_modes.py``; the other ops' value checks in ``values.py``, which
re-exports every public name here.
"""

from __future__ import annotations

import torch

from .values_modes import _active, _assert, _index, _known, cache_geometry, get_value_checks


# --- paged_attention ------------------------------------------------------------------------------------------
def _bad_blocks(block_table, lens, block_size, num_blocks, reads=None):
    """``[B, W]``: True where a used entry (the first ``ceil(lens[b] / block_size)`` of row ``b``) is outside
    ``[0, num_blocks)``; entries past a sequence's blocks are never read and may hold any value. ``reads``:
    ``(start, a, w)`` ``[B]`` each, the rows ``[start, a)`` and ``[w, lens)`` the queries can see (a window, sink
    tokens, ``cache_leftpad``: :func:`_read_rows`); entries of blocks outside them are never read either."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols < ((lens + block_size - 1) // block_size)[:, None]
    if reads is not None:
        start, a, w = (x[:, None] for x in reads)
        lo, hi = cols * block_size, (cols + 1) * block_size
        used = used & (((lo < a) & (hi > start)) | ((lo < lens[:, None]) & (hi > w)))
    return used & ((block_table < 0) | (block_table >= num_blocks))


def _read_rows(cu_seqlens_q, seq_lens, window_left, sink_tokens, cache_leftpad):
    """``(start, a, w)``: sequence ``b``'s queries read rows ``[start, a)`` (sink tokens) and ``[w, seq_len)``
    (the earliest query's window); None when they read every row ``[0, seq_len)`` (no window, no ``cache_leftpad``).
    The native kernel's ``Index::reads`` computes the same."""
    if window_left < 0 and cache_leftpad is None:
        return None
    lens = seq_lens.long()
    start = torch.zeros_like(lens) if cache_leftpad is None else cache_leftpad.long().clamp_min(0)
    if window_left < 0:
        return start, start, start
    first = lens - (cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long())
    w = torch.maximum(start, first - window_left)
    return start, torch.minimum(w, start + sink_tokens), w


def _reads_text(reads, b, lens) -> str:
    start, a, w = (int(x[b]) for x in reads)
    return f"reads rows [{start}, {a}) and [{w}, {lens[b]})"


def _attention_violations(q, num_blocks, block_size, cu_seqlens_q, seq_lens, block_table, max_seqlen_q,
                          reads=None, cache_leftpad=None):
    """Boolean tensors (each ``[B]`` or ``[B, W]`` or scalar) that are True where a contract is violated."""
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    lens = seq_lens.long()
    capacity = block_table.shape[1] * block_size
    return {
        "cu_start": cu[0] != 0,
        "cu_order": q_lens < 0,
        "cu_end": cu[-1] > q.shape[0],
        "q_len": q_lens > max_seqlen_q,
        "seq_len": (lens < 0) | (lens > capacity),
        "leftpad": (torch.zeros_like(lens, dtype=torch.bool) if cache_leftpad is None
                    else (cache_leftpad < 0) | (cache_leftpad.long() > lens)),
        "block": _bad_blocks(block_table, lens, block_size, num_blocks, reads),
    }


def _raise_attention(v, q, num_blocks, block_size, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, op,
                     reads=None, cache_leftpad=None):
    """Eager error path: the first violated contract, with its index, value, bound and fix."""
    cu, lens, table = cu_seqlens_q.tolist(), seq_lens.tolist(), block_table
    capacity = block_table.shape[1] * block_size
    if bool(v["cu_start"]) or bool(v["cu_order"].any()) or bool(v["cu_end"]):
        raise RuntimeError(
            f"{op}: cu_seqlens_q = {cu} must be non-decreasing from 0 to at most q's {q.shape[0]} rows (T_q); "
            f"sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]). Pass the cumulative query lengths."
        )
    if bool(v["q_len"].any()):
        b = int(v["q_len"].nonzero()[0, 0])
        longest = max(cu[i + 1] - cu[i] for i in range(len(lens)))
        raise RuntimeError(
            f"{op}: sequence {b} has q_len {cu[b + 1] - cu[b]} (cu_seqlens_q[{b + 1}] - cu_seqlens_q[{b}]) but "
            f"max_seqlen_q={max_seqlen_q}; pass max_seqlen_q >= {longest}, the longest query length in the batch."
        )
    if bool(v["seq_len"].any()):
        b = int(v["seq_len"].nonzero()[0, 0])
        raise RuntimeError(
            f"{op}: seq_lens[{b}] = {lens[b]} is outside [0, {capacity}], the capacity of block_table: "
            f"{block_table.shape[1]} blocks per sequence x block_size {block_size}. Give block_table more columns "
            f"(max_blocks >= ceil(seq_len / block_size)) or pass the sequence's real KV length."
        )
    if bool(v["leftpad"].any()):
        b = int(v["leftpad"].nonzero()[0, 0])
        pad = int(cache_leftpad[b])
        if pad < 0:
            raise RuntimeError(
                f"{op}: cache_leftpad[{b}] = {pad} is negative; it is the first KV row of sequence {b} "
                f"(0: no left padding)."
            )
        raise RuntimeError(
            f"{op}: cache_leftpad[{b}] = {pad} is past seq_lens[{b}] = {lens[b]}; it is the first KV row of sequence "
            f"{b} and must be in [0, seq_len] (sequence {b}'s keys are rows [cache_leftpad, seq_len))."
        )
    b, j = (int(x) for x in v["block"].nonzero()[0])
    if reads is not None:
        raise RuntimeError(
            f"{op}: block_table[{b}, {j}] = {int(table[b, j])} is not a block of the cache: block ids must be in "
            f"[0, {num_blocks}) (P = {num_blocks} blocks). Sequence {b} {_reads_text(reads, b, lens)}; entries of "
            f"blocks outside them are never read and may hold any value (e.g. -1)."
        )
    raise RuntimeError(
        f"{op}: block_table[{b}, {j}] = {int(table[b, j])} is not a block of the cache: block ids must be in "
        f"[0, {num_blocks}) (P = {num_blocks} blocks). Sequence {b} (seq_len {lens[b]}) uses its first "
        f"{-(-lens[b] // block_size)} entries; entries past those are never read and may hold any value (e.g. -1)."
    )


# kvops.native.available, set by kvops/ops/__init__.py: the native build is a layer above the validators (CONTRIBUTING.md,
# "Layers"), so this module asks it through the callable the ops layer hands down instead of importing it.
native_available = None


def _native_valid(q, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, num_blocks, block_size, window_left=-1,
                  sink_tokens=0, cache_leftpad=None) -> bool:
    """Eager CPU fast path: True when the native kernel's one-pass check (``kvops/native/paged_checks.h``, the
    same contracts as ``_attention_violations``) finds every contract held. False when one is violated (the torch
    path then finds it and raises) or the fast path does not apply (not CPU/int32, no native build)."""
    int32 = torch.int32
    if not (q.is_cpu and cu_seqlens_q.dtype == int32 and seq_lens.dtype == int32 and block_table.dtype == int32):
        return False
    if cache_leftpad is not None and (cache_leftpad.dtype != int32 or cache_leftpad.device != q.device):
        return False
    if native_available is None or not native_available():
        return False
    if cache_leftpad is not None and bool((cache_leftpad > seq_lens).any()):  # not in the native pass
        return False
    if window_left < 0 and sink_tokens == 0 and cache_leftpad is None:  # the call graphs had before the features
        return not torch.ops.kvops._paged_attention_values_bad.default(
            cu_seqlens_q, seq_lens, block_table, q.shape[0], max_seqlen_q, num_blocks, block_size)
    return not torch.ops.kvops._paged_attention_values_bad.default(
        cu_seqlens_q, seq_lens, block_table, q.shape[0], max_seqlen_q, num_blocks, block_size, window_left,
        sink_tokens, cache_leftpad)


def native_checks_all(q, cu_seqlens_q, max_seqlen_q, cache_leftpad=None) -> bool:
    """Whether the native kernel's own check (``kvops/native/paged_checks.h``: ``cu_seqlens_q``, ``seq_lens`` and
    the block ids it reads, in every mode, with this module's messages word for word) is the whole eager check of a
    ``paged_attention`` call on CPU whose metadata the op's validator passed. Not with ``cache_leftpad`` (its bound
    ``<= seq_len`` is not in the kernel's pass); else when every ``q_len <= max_seqlen_q``, the one contract the kernel
    leaves out: certain without reading ``cu_seqlens_q`` when ``T_q <= max_seqlen_q`` (a valid ``cu_seqlens_q`` bounds
    every ``q_len`` by ``T_q``), otherwise read here. False sends the call through :func:`check_paged_attention`,
    which reports the first violated contract (a broken ``cu_seqlens_q`` before a ``q_len``)."""
    if cache_leftpad is not None:
        return False
    if q.shape[0] <= max_seqlen_q:
        return True
    cu = cu_seqlens_q.tolist()
    return max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q


def check_paged_attention(q, k_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_layout: str = "NHD",
                          op: str = "kvops.paged_attention", *, window_left=-1, sink_tokens=0,
                          cache_leftpad=None, validated: bool = False) -> None:
    """Apply the value contracts of ``paged_attention`` in the current mode (docs/semantics.md §7).

    eager: one host sync; ``RuntimeError`` naming the argument, index, value, bound and fix. async: one
    ``torch._assert_async`` per contract. ``cu_seqlens_q[-1] < T_q`` is allowed (rows owned by no sequence are 0).
    With a window (``window_left >= 0``, ``sink_tokens``) or ``cache_leftpad``, only the block ids of the rows the
    queries can see must be valid (docs/attention_features.md); ``cache_leftpad`` must be in ``[0, seq_len]``.
    ``validated``: the op's validator passed these arguments, plain CPU tensors outside tracing (the eager CPU path
    of ``kvops.paged_attention``), so the guard against metadata it reports is skipped.
    """
    geometry = cache_geometry(k_cache, kv_layout)
    if validated:
        mode = get_value_checks()
        if mode == "off" or not isinstance(window_left, int) or not isinstance(sink_tokens, int):
            return
    else:
        mode = _active(q, cu_seqlens_q, seq_lens, block_table)
        if (mode is None or geometry is None or q.dim() != 3 or not _index(cu_seqlens_q, 1) or not _index(seq_lens, 1)
                or not _index(block_table, 2)
                or not block_table.shape[0] == seq_lens.shape[0] == cu_seqlens_q.shape[0] - 1
                or any(t.device != q.device for t in (k_cache, cu_seqlens_q, seq_lens, block_table))
                or (max_seqlen_q < 1 and q.shape[0] > 0)
                or (cache_leftpad is not None and (not _index(cache_leftpad, 1) or cache_leftpad.device != q.device
                                                   or cache_leftpad.shape[0] != seq_lens.shape[0]))
                or not isinstance(window_left, int) or not isinstance(sink_tokens, int)):
            return  # checks off, or a metadata error that the op's validator reports (or symbolic window bounds)
    num_blocks, block_size = geometry
    if mode == "eager" and _native_valid(q, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, num_blocks, block_size,
                                         window_left, sink_tokens, cache_leftpad):
        return
    reads = _read_rows(cu_seqlens_q, seq_lens, window_left, sink_tokens, cache_leftpad)
    v = _attention_violations(q, num_blocks, block_size, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, reads,
                              cache_leftpad)
    if mode == "eager":
        if bool(torch.stack([t.any() for t in v.values()]).any()):
            _raise_attention(v, q, num_blocks, block_size, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, op,
                             reads, cache_leftpad)
        return
    cap = _known(block_table.shape[1] * block_size)
    hint = "Run with kvops.value_checks('eager') to see the index and value."
    _assert(~(v["cu_start"] | v["cu_order"].any() | v["cu_end"]),
            f"{op}: cu_seqlens_q must be non-decreasing from 0 to at most T_q = {_known(q.shape[0])}. {hint}")
    _assert(~v["q_len"].any(), f"{op}: a sequence's q_len exceeds max_seqlen_q = {_known(max_seqlen_q)}. {hint}")
    _assert(~v["seq_len"].any(), f"{op}: seq_lens outside [0, {cap}], the capacity of block_table. {hint}")
    _assert(~v["leftpad"].any(), f"{op}: cache_leftpad holds a row outside [0, seq_len]. {hint}")
    _assert(~v["block"].any(),
            f"{op}: block_table holds a block id outside [0, P = {_known(num_blocks)}) in a used entry. {hint}")


def check_alibi_slopes(alibi_slopes, op: str = "kvops.paged_attention"):
    """Every ALiBi slope finite, in the current mode (a NaN or infinite slope makes every score of its head NaN or
    +-inf). eager: ``RuntimeError`` naming the first bad ``alibi_slopes[...]`` and its value, before
    anything runs; async: ``torch._assert_async``, returning its ``ok`` flag (so a writer can skip its write);
    off / tracing in eager mode: unchecked (the kernels then give NaN rows, never 0). Returns None except in async
    mode. Metadata errors (dtype, shape) are the validator's."""
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        return None
    mode = _active(alibi_slopes)
    if mode is None:
        return None
    bad = ~torch.isfinite(alibi_slopes)
    if mode == "async":
        ok = ~bad.any()
        _assert(ok, f"{op}: alibi_slopes holds a NaN or infinite slope. Run with kvops.value_checks('eager') to see "
                    f"it.")
        return ok
    if bool(bad.any()):
        at = ", ".join(str(int(i)) for i in bad.nonzero()[0])
        raise RuntimeError(
            f"{op}: alibi_slopes[{at}] = {float(alibi_slopes[tuple(bad.nonzero()[0])])} is not finite; ALiBi adds "
            f"-slope * |pos - j| to every score of its head, so every score would be NaN or infinite. Pass finite "
            f"slopes (e.g. 2 ** (-8 h / H_q), FlashAttention's and FlashInfer's)."
        )
    return None


# --- custom masks (docs/tree-mask.md) ------------------------------------------------------------------------------
def check_custom_mask(custom_mask, packed_custom_mask, cu_seqlens_q: torch.Tensor,
                      op: str = "kvops.paged_attention") -> None:
    """The mask's length against the query lengths in ``cu_seqlens_q``, in the current mode: ``sum_b q_len_b ** 2``
    elements (bool form) or ``sum_b ceil(q_len_b ** 2 / 8)`` bytes (packed form). eager: ``RuntimeError`` naming the
    length, the expected one and the query lengths (one host sync); async: ``torch._assert_async``; off: unchecked
    (the kernels never read outside the mask). Metadata errors (dtype, rank, device) are the validator's."""
    packed = packed_custom_mask is not None
    mask = packed_custom_mask if packed else custom_mask
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1 or not _index(cu_seqlens_q, 1):
        return
    mode = _active(mask, cu_seqlens_q)
    if mode is None:
        return
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    sizes = (q_lens * q_lens + 7) // 8 if packed else q_lens * q_lens
    expected = sizes.sum()
    name = "packed_custom_mask" if packed else "custom_mask"
    rule = "sum_b ceil(q_len_b ** 2 / 8) bytes" if packed else "sum_b q_len_b ** 2 elements"
    if mode == "async":
        _assert(expected == mask.shape[0], f"{op}: {name} must have {rule} for the query lengths of cu_seqlens_q. "
                                           f"Run with kvops.value_checks('eager') to see the lengths.")
        return
    if int(expected) != mask.shape[0]:
        lens = q_lens.tolist()
        shown = ", ".join(map(str, lens[:8])) + (", ..." if len(lens) > 8 else "")
        fix = ("Pack the mask with kvops.custom_mask.segment_packbits(mask, mask_indptr(cu_seqlens_q), "
               "bitorder='little'): each sequence's block padded to whole bytes." if packed else
               "Pass each sequence's q_len x q_len block of its new keys, flattened and concatenated "
               "(torch.cat([block.flatten() for block in blocks])); FlashInfer's q_len x kv_len form also covers "
               "the cached keys: keep its last q_len columns.")
        raise RuntimeError(
            f"{op}: {name} has {mask.shape[0]} {'bytes' if packed else 'elements'}, expected {int(expected)} "
            f"({rule}) for the query lengths [{shown}] of cu_seqlens_q. {fix}"
        )
