"""Value contracts: checks of tensor *contents* (slots, block ids, sequence lengths), docs/semantics.md §7.

The validators next to this module check metadata only, at trace time. What they cannot see (a slot past the cache,
a block id past ``P``, a ``seq_len`` past the block table) is checked here, in one of three modes:

* ``"eager"`` (default): eager calls read the index tensors (one host sync per call, as FlashAttention's
  ``TORCH_CHECK``\\ s do) and raise ``RuntimeError`` *before* anything is written. Nothing is emitted while tracing
  (``torch.compile``, ``torch.export``, fake-tensor tracing) or capturing a CUDA graph: that code runs unchecked.
* ``"async"``: the checks become graph ops with no host sync (``torch._assert_async``), in eager code and in compiled
  or exported graphs alike. A write additionally routes every slot of a failing batch to ``-1`` ("skip"), so nothing
  is written even if the assert runs after the write (e.g. CUDA's asynchronous device assert).
* ``"off"``: no checks; a violated contract is undefined behaviour of the kernel (docs/semantics.md §7).

The mode is a process default (``set_value_checks``, as ``torch.set_default_dtype``) that a ``value_checks`` block
overrides for the calling thread only, so threads never change each other's mode; Dynamo guards on it, so changing it
recompiles.

Layout: the modes and the helpers every check uses are in ``values_modes.py``; ``paged_attention``'s checks (and
ALiBi slopes, custom masks) in ``values_attention.py``; the other ops' checks here. Every name of those two modules
that the ops, caches and other validators use is importable from here (``from kvops._checks import values``).
"""

from __future__ import annotations

import torch

from .values_attention import (  # noqa: F401  (re-exported: the ops call values.check_*)
    _bad_blocks,
    check_alibi_slopes,
    check_custom_mask,
    check_paged_attention,
    native_checks_all,
)
from .values_modes import (  # noqa: F401  (re-exported: the ops and validators use values.*)
    MODES,
    _active,
    _assert,
    _index,
    _known,
    cache_geometry,
    get_value_checks,
    set_value_checks,
    value_checks,
)


# --- paged_cache_write ----------------------------------------------------------------------------------------
def raise_bad_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int, op: str) -> None:
    """Eager: ``RuntimeError`` naming the first slot ``>= num_blocks * block_size`` (one host sync if all are valid)."""
    capacity = num_blocks * block_size
    bad = slot_mapping >= capacity
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    raise RuntimeError(
        f"{op}: slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache: valid slots are [0, {capacity}) "
        f"({num_blocks} blocks x block_size {block_size}), or negative to skip a padding token. Nothing was written. "
        f"Pass block * block_size + row for a block of the cache (or -1 for padding)."
    )


def check_paged_write(slot_mapping: torch.Tensor, k_cache: torch.Tensor, kv_layout: str = "NHD",
                      op: str = "kvops.paged_cache_write") -> torch.Tensor:
    """Apply the slot contract (``slot < P * block_size``) in the current mode; returns the slots to write.

    eager: raises before writing; async: asserts and returns the slots with every slot ``-1`` when any is bad (the
    whole batch is skipped); off/tracing in eager mode: ``slot_mapping`` unchanged. The wrapper runs the op's
    metadata validator before re-raising a value error, so a metadata error that explains it (e.g. a cache in the
    other ``kv_layout``, which misreads ``block_size``) wins, as inside the op.
    """
    geometry = cache_geometry(k_cache, kv_layout)
    mode = _active(slot_mapping)
    if mode is None or geometry is None or not _index(slot_mapping, 1) or slot_mapping.device != k_cache.device:
        return slot_mapping  # checks off, or a metadata error that the op's validator reports
    num_blocks, block_size = geometry
    if mode == "eager":
        raise_bad_slots(slot_mapping, num_blocks, block_size, op)
    else:
        ok = (slot_mapping < num_blocks * block_size).all()
        _assert(ok, f"{op}: slot_mapping holds a slot >= num_blocks * block_size = {_known(num_blocks * block_size)} "
                    f"(outside the cache); nothing was written. Run with kvops.value_checks('eager') to see the slot.")
        slot_mapping = torch.where(ok, slot_mapping, -1)
    return slot_mapping


# --- flash_attn_with_kvcache ----------------------------------------------------------------------------------
def check_kvcache(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, k_cache: torch.Tensor,
                  num_new_tokens: int, op: str = "flash_attn_with_kvcache", mode: str | None = None,
                  cache_leftpad: torch.Tensor | None = None) -> torch.Tensor | None:
    """``0 <= cache_seqlens[b]``, ``cache_seqlens[b] + num_new_tokens <= max_blocks * block_size``, the block ids
    of the positions in use in ``[0, P)`` and ``0 <= cache_leftpad[b] <= cache_seqlens[b]`` (the new tokens are
    written at row ``cache_seqlens[b]``: a first key row past it would hide them), in the current mode. Returns the
    async ``ok`` flag (None otherwise), so the caller can skip the whole write when it is False. ``mode="eager"``
    forces the eager check (``check_kvcache_capacity``)."""
    if mode is None:
        mode = _active(cache_seqlens) if block_table is None else _active(cache_seqlens, block_table)
    if (mode is None or (block_table is not None and block_table.device != cache_seqlens.device)
            or cache_geometry(k_cache) is None):
        return None  # checks off, or a metadata error that the validator reports
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]  # FlashAttention's caches are NHD
    width = 1 if block_table is None else block_table.shape[1]
    capacity = width * block_size
    lens = cache_seqlens.long()
    bad_len = (lens < 0) | (lens + num_new_tokens > capacity)
    bad_block = None
    if block_table is not None:
        bad_block = _bad_blocks(block_table, lens + num_new_tokens, block_size, num_blocks)
    bad_pad = None
    if (isinstance(cache_leftpad, torch.Tensor) and cache_leftpad.shape == lens.shape
            and cache_leftpad.device == lens.device):
        bad_pad = (cache_leftpad < 0) | (cache_leftpad.long() > lens)
    if mode == "async":
        ok = ~bad_len.any() if bad_block is None else ~(bad_len.any() | bad_block.any())
        if bad_pad is not None:
            ok = ok & ~bad_pad.any()
        _assert(ok, f"{op}: cache_seqlens + {_known(num_new_tokens)} new tokens exceed the capacity addressable by "
                    f"block_table ({_known(capacity)} tokens), or block_table holds a block id outside [0, "
                    f"{_known(num_blocks)}), or cache_leftpad holds a row outside [0, cache_seqlens]; nothing was "
                    f"written. Run with kvops.value_checks('eager') for details.")
        return ok
    if bool(bad_len.any()):
        b = int(bad_len.nonzero()[0, 0])
        n = int(lens[b])
        if n < 0:
            raise RuntimeError(
                f"{op}: sequence {b} has cache_seqlens={n}; cache_seqlens counts the tokens already in sequence "
                f"{b}'s cache and must be >= 0. Pass 0 for an empty sequence."
            )
        raise RuntimeError(
            f"{op}: sequence {b} has cache_seqlens={n}; with {num_new_tokens} new tokens it needs positions "
            f"[0, {n + num_new_tokens}) but block_table addresses only {capacity} tokens ({width} blocks x block_size "
            f"{block_size}). Give block_table more blocks or write fewer tokens."
        )
    if bad_block is not None and bool(bad_block.any()):
        b, j = (int(x) for x in bad_block.nonzero()[0])
        raise RuntimeError(
            f"{op}: block_table[{b}, {j}] = {int(block_table[b, j])} is not a block of the cache: block ids must be "
            f"in [0, {num_blocks}) (P = {num_blocks} blocks) for the blocks sequence {b} uses."
        )
    if bad_pad is not None and bool(bad_pad.any()):
        b = int(bad_pad.nonzero()[0, 0])
        raise RuntimeError(
            f"{op}: cache_leftpad[{b}] = {int(cache_leftpad[b])} is outside [0, cache_seqlens[{b}] = {int(lens[b])}]: "
            f"it is the first key row of sequence {b}, and the new tokens are written at row cache_seqlens[{b}]. "
            f"Nothing was written. Pass 0 <= cache_leftpad <= cache_seqlens."
        )
    return None


def check_cache_batch_idx(cache_batch_idx: torch.Tensor, batch_size_cache: int,
                          op: str = "flash_attn_with_kvcache") -> torch.Tensor | None:
    """``0 <= cache_batch_idx[b] < batch_size_cache`` (the ``k_cache`` row sequence ``b`` uses), in the current mode,
    before anything is written. Returns the async ``ok`` flag (None otherwise)."""
    mode = _active(cache_batch_idx)
    if mode is None or not _index(cache_batch_idx, 1):
        return None
    bad = (cache_batch_idx < 0) | (cache_batch_idx >= batch_size_cache)
    if mode == "async":
        ok = ~bad.any()
        _assert(ok, f"{op}: cache_batch_idx holds a row outside [0, batch_size_cache = {_known(batch_size_cache)}) of "
                    f"k_cache; nothing was written. Run with kvops.value_checks('eager') to see it.")
        return ok
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise RuntimeError(
            f"{op}: cache_batch_idx[{b}] = {int(cache_batch_idx[b])} is outside [0, {batch_size_cache}), the rows of "
            f"k_cache [batch_size_cache, seqlen_cache, num_kv_heads, head_dim]. Nothing was written. Pass the k_cache "
            f"row of each sequence."
        )
    return None


# --- cache_write with tensor rows -------------------------------------------------------------------------------
def check_write_rows(rows: torch.Tensor, cache_len: int, from_start: bool,
                     op: str = "kvops.cache_write") -> torch.Tensor | None:
    """``0 <= rows[i] < cache_len`` for the rows a ``cache_write`` with a tensor ``start`` writes (``rows`` int64
    ``[T]``: ``start + arange(T)`` when ``from_start``, else the given rows), in the current mode, before anything is
    written. Returns the async ``ok`` flag (None otherwise). The eager message for a start is the int form's."""
    mode = _active(rows)
    if mode is None or rows.numel() == 0:
        return None
    bad = (rows < 0) | (rows >= cache_len)
    if mode == "async":
        ok = ~bad.any()
        _assert(ok, f"{op}: start names rows outside [0, kv_cache_size = {_known(cache_len)}) of the cache; nothing "
                    f"was written. Run with kvops.value_checks('eager') to see the rows.")
        return ok
    if not bool(bad.any()):
        return None
    num_new = rows.shape[0]
    if from_start:
        from .contiguous import write_range_message

        raise RuntimeError(write_range_message(op, int(rows[0]), num_new, cache_len))
    i = int(bad.nonzero()[0, 0])
    raise RuntimeError(
        f"{op}: start[{i}] = {int(rows[i])} is outside [0, {cache_len}), the rows of the cache (kv_cache_size="
        f"{cache_len}); nothing was written. Pass one row in [0, kv_cache_size) per new token."
    )


# --- cache_roll with tensor rows -------------------------------------------------------------------------------
def check_roll_rows(src, dst, num_tokens, cache_len: int, op: str = "kvops.cache_roll") -> torch.Tensor | None:
    """``num_tokens >= 0`` and ``[src, src + n)``, ``[dst, dst + n)`` inside ``[0, cache_len)`` for a ``cache_roll``
    whose positions include a tensor (ints or 0-d int64 tensors here), in the current mode, before anything moves.
    Returns the async ``ok`` flag (None otherwise). The eager message is the int form's, word for word."""
    tensors = [x for x in (src, dst, num_tokens) if isinstance(x, torch.Tensor)]
    mode = _active(*tensors)
    if mode is None:
        return None
    ok = (num_tokens >= 0) & (src >= 0) & (dst >= 0) & (src + num_tokens <= cache_len) & (dst + num_tokens <= cache_len)
    if mode == "async":
        _assert(ok, f"{op}: src, dst or num_tokens names rows outside [0, kv_cache_size = {_known(cache_len)}) of the "
                    f"cache (or num_tokens < 0); nothing was moved. Run with kvops.value_checks('eager') to see them.")
        return ok
    if not bool(ok):
        from .contiguous import roll_range_message

        raise RuntimeError(roll_range_message(op, int(src), int(dst), int(num_tokens), cache_len))
    return None


# --- PagedKVCache.step_at ---------------------------------------------------------------------------------------
def check_step_positions(pos: torch.Tensor, blocks: torch.Tensor, block_table: torch.Tensor, capacity: int,
                         num_blocks: int, op: str = "PagedKVCache.step_at") -> torch.Tensor | None:
    """``0 <= pos[b, t] < capacity`` and the block ``blocks[b, t]`` holding it in ``[0, num_blocks)``, in the current
    mode (``pos``/``blocks`` int64 ``[B, T]``). Returns the async ``ok`` flag (None otherwise)."""
    mode = _active(pos, block_table)
    if mode is None or pos.numel() == 0:
        return None
    bad_pos = (pos < 0) | (pos >= capacity)
    bad_block = ~bad_pos & ((blocks < 0) | (blocks >= num_blocks))
    if mode == "async":
        ok = ~(bad_pos.any() | bad_block.any())
        _assert(ok, f"{op}: positions hold a position outside [0, max_blocks * block_size = {_known(capacity)}), or "
                    f"block_table a block id outside [0, {_known(num_blocks)}) for one; nothing will be written. Run "
                    f"with kvops.value_checks('eager') to see it.")
        return ok
    if bool(bad_pos.any()):
        b, t = (int(x) for x in bad_pos.nonzero()[0])
        raise RuntimeError(
            f"{op}: positions[{b}, {t}] = {int(pos[b, t])} is outside [0, {capacity}), the positions block_table "
            f"addresses ({block_table.shape[1]} blocks x block_size {capacity // block_table.shape[1]}). Reserve more "
            f"blocks for sequence {b} (a wider block_table) or stop before its capacity."
        )
    if bool(bad_block.any()):
        b, t = (int(x) for x in bad_block.nonzero()[0])
        j = int(pos[b, t]) // (capacity // block_table.shape[1])
        raise RuntimeError(
            f"{op}: block_table[{b}, {j}] = {int(block_table[b, j])} is not a block of the cache (block ids are in "
            f"[0, {num_blocks})), and sequence {b} writes position {int(pos[b, t])} into it. Pass the block table of "
            f"sequences whose blocks are reserved (PagedKVCache.block_table(seq_ids))."
        )
    return None


# --- rotary positions -------------------------------------------------------------------------------------------
def check_rotary_positions(positions: torch.Tensor, num_tokens, rotary_cos: torch.Tensor, op: str,
                           name: str = "positions") -> None:
    """``0 <= positions[i] < seqlen_ro`` for the first ``num_tokens`` entries, in the current mode (a negative
    position would index the tables from the end, a larger one past them). eager: ``RuntimeError`` naming the entry,
    its value and the table length, before anything is written; async: ``torch._assert_async``; off: unchecked."""
    if not _index(positions, 1) or rotary_cos.dim() != 2 or positions.device != rotary_cos.device:
        return  # a metadata error that the op's validator reports
    mode = _active(positions)
    if mode is None:
        return
    seqlen_ro = rotary_cos.shape[0]
    used = positions[:num_tokens]
    bad = (used < 0) | (used >= seqlen_ro)
    if mode == "async":
        _assert(~bad.any(), f"{op}: {name} holds a position outside [0, seqlen_ro = {_known(seqlen_ro)}) (the rows "
                            f"of rotary_cos/rotary_sin). Run with kvops.value_checks('eager') to see it.")
        return
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RuntimeError(
            f"{op}: {name}[{i}] = {int(used[i])} is outside [0, {seqlen_ro}), the rows of rotary_cos/rotary_sin "
            f"(seqlen_ro = {seqlen_ro}); nothing was written. Pass positions in [0, seqlen_ro), or extend the tables."
        )
