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
"""

from __future__ import annotations

import threading

import torch

MODES = ("eager", "async", "off")
_mode = "eager"  # the process default (set_value_checks outside any value_checks block)
_local = threading.local()  # .stack: the modes of this thread's open value_checks blocks, innermost last
_blocks = False  # whether any value_checks block was ever opened (never reset): until then no thread has a stack, and
# get_value_checks skips the thread-local look-up (a miss raises and catches an AttributeError: ~0.5 us per eager call)


def get_value_checks() -> str:
    """The current value-check mode of the calling thread: that of its innermost open ``value_checks`` block, else the
    process default (``"eager"`` unless ``set_value_checks`` changed it)."""
    if not _blocks:
        return _mode
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else _mode


def set_value_checks(mode: str) -> None:
    """Set the value-check mode (docs/semantics.md §7): inside a ``value_checks`` block, that block's mode for the
    calling thread (the block's end restores the mode before it); outside any block, the process default, which every
    thread without a block of its own uses. Raises ``ValueError`` for an unknown mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kvops.set_value_checks: mode must be one of {MODES}, got {mode!r}.")
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1] = mode
    else:
        _mode = mode


class value_checks:
    """Context manager: ``with kvops.value_checks("async"): ...`` runs the block in ``mode`` and restores the mode.

    Modes: ``"eager"`` (default; host-sync checks in eager code, none while tracing), ``"async"`` (graph asserts,
    no host sync, also inside compiled/exported graphs), ``"off"``. The mode applies to the calling thread only
    (blocks of several threads may open and close in any order: each thread sees its own, and the process default is
    never changed by a block). Enter it *outside* a compiled function: the mode is read when the function is traced
    (and guarded on), not at every run.
    """

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"kvops.value_checks: mode must be one of {MODES}, got {mode!r}.")
        self.mode = mode

    def __enter__(self) -> "value_checks":
        global _blocks
        _blocks = True  # (before the stack exists: a thread reading the flag false has no block open)
        if getattr(_local, "stack", None) is None:
            _local.stack = []
        _local.stack.append(self.mode)
        return self

    def __exit__(self, *exc) -> None:
        _local.stack.pop()


def _active(*tensors: torch.Tensor) -> str | None:
    """The mode to apply to this call: ``"eager"`` only on real tensors outside tracing, ``"async"``, or None."""
    mode = get_value_checks()
    if mode == "off":
        return None
    if mode == "async":
        return "async"
    if torch.compiler.is_compiling() or any(type(t) not in _REAL or t.is_meta for t in tensors):  # tracing
        return None
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():  # CUDA-graph capture: no sync
        return None
    return "eager"


_REAL = (torch.Tensor, torch.nn.Parameter)
_INDEX = (torch.int32, torch.int64)


def cache_geometry(k_cache: torch.Tensor, kv_layout: str = "NHD") -> tuple[int, int] | None:
    """``(P, block_size)`` of a paged cache (``[P, block_size, H_kv, D]`` NHD or ``[P, H_kv, block_size, D]`` HND),
    or None when it is not 4-D or has a zero-size dim (the op's validator then raises its metadata error)."""
    if k_cache.dim() != 4 or any(n == 0 for n in k_cache.shape[1:]):
        return None
    return k_cache.shape[0], k_cache.shape[2 if kv_layout == "HND" else 1]


def _index(t, ndim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in _INDEX


def _known(x) -> str:
    """A bound for an assert message: its value when it is a plain int, else a placeholder (never guards a SymInt)."""
    return str(x) if type(x) is int else "?"


def _assert(ok: torch.Tensor, msg: str) -> None:
    torch._assert_async(ok, msg)


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
