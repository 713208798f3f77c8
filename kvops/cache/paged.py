"""``PagedKVCache``: per-layer paged K/V caches and a block manager for a batch of sequences (vLLM-style).

Bookkeeping (block lists, lengths, reference counts) is plain Python ints and runs eagerly, outside compiled regions
(host-side planning: :meth:`PagedKVCache.prepare` raises a clear error when called while compiling or exporting); the
tensors a step needs are built by :meth:`PagedKVCache.prepare` and passed to the compiled step, and every cache write
goes through ``kvops.paged_cache_write`` (reads through ``kvops.paged_attention``). docs/semantics.md §3-4.
"""

from __future__ import annotations

import contextlib
import heapq
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import torch

from ..ops.paged_attention import paged_attention
from ..ops.paged_write import paged_cache_write
from . import _device_step
from ._alloc import allocate


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the cache has; nothing was allocated."""


@dataclass(frozen=True)
class PagedStep:
    """Metadata of one forward step, as tensors for the ops (all on the cache's device).

    Attributes:
        block_table: ``[B', max_blocks]`` int32 physical block ids per sequence; entries past a sequence's blocks are 0
            (never read: attention reads only ``ceil(seq_len / block_size)`` blocks); blocks evicted by a StreamingLLM
            cache (``window_left``/``sink_tokens``) are ``-1`` (never read either).
        seq_lens: ``[B']`` int32 KV length of each sequence *after* this step's tokens.
        cu_seqlens_q: ``[B' + 1]`` int32 cumulative new-token counts; ``cu_seqlens_q[-1]`` equals the padded token
            count, so it matches ``q``'s rows.
        slot_mapping: ``[N_pad]`` int64 slot of each new token (``block * block_size + row``), ``-1`` for padding.
        positions: ``[N_pad]`` int64 position of each new token in its sequence (``seq_len_before + i`` for the
            ``i``-th new token), e.g. for RoPE; padding tokens (rows ``[N, N_pad)``) get position 0.
        max_seqlen_q: the largest per-row query length (a Python int).
        num_tokens: ``N``, the real new tokens (rows ``[N, N_pad)`` of ``q``/``key``/``value`` are padding).
        seq_ids: the sequences of rows ``[0, B)``; rows ``[B, B')`` are padding rows (``seq_len`` 0, their query rows
            see no key and yield zeros).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    max_seqlen_q: int
    num_tokens: int
    seq_ids: tuple


class _Seq:
    __slots__ = ("blocks", "length")

    def __init__(self, blocks: list[int], length: int) -> None:
        self.blocks = blocks
        self.length = length


class PagedKVCache:
    """Paged K/V caches ``[P, block_size, H_kv, D]`` (NHD) per layer, with a block manager for many sequences.

    Block manager: sequences are added with :meth:`add_sequence`, grown with :meth:`extend` or a whole batch at once
    with :meth:`prepare` (blocks are allocated as needed, lowest free id first, so freed blocks are reused), released
    with :meth:`free`. :meth:`fork` shares a prefix of *full* blocks read-only between sequences (reference counts);
    there is **no copy-on-write**: a shared block is always full, so no holder ever writes into it, and only
    block-aligned prefixes can be shared (the tail of a forked prefix is re-written by the child). Allocation is
    atomic: when the free blocks do not suffice, :class:`OutOfBlocksError` is raised and nothing changes.

    Per step, :meth:`prepare` returns a :class:`PagedStep` (``block_table``, ``seq_lens``, ``cu_seqlens_q``,
    ``slot_mapping``, ``positions``); with ``pad_tokens``/``pad_batch``/``max_blocks`` every tensor has a fixed
    shape, so a compiled decode step does not recompile as sequences grow. The slot mapping stays valid for every layer.

    Args:
        num_blocks: ``P``, physical blocks per layer.
        block_size: tokens per block.
        num_kv_heads: ``H_kv``. head_dim: ``D``. head_dim_v: ``D_v`` (default ``D``).
        num_layers: caches allocated (one ``k_caches[l]``/``v_caches[l]`` pair per layer).
        dtype, device: of the caches, as for torch's factory functions: ``None`` (default) means
            ``torch.get_default_dtype()`` and the default device (``torch.get_default_device()``), as
            ``CausalKVCache.allocate``. ``torch.float8_e4m3fn`` needs ``k_scale``/``v_scale``.
        joint: allocate K and V of a layer as views ``kv[:, :, 0]``/``kv[:, :, 1]`` of one
            ``[P, block_size, 2, H_kv, D]`` tensor (needs ``D_v == D``).
        k_scale, v_scale: float32 ``[1]`` or ``[H_kv]`` fp8 scales, passed to the write and attention ops.
        window_left, sink_tokens: StreamingLLM on the paged cache (docs/attention_features.md). With
            ``window_left >= 0`` a query at position ``pos`` sees the first ``sink_tokens`` tokens and positions
            ``[pos - window_left, pos]``; :meth:`attention` passes both to ``kvops.paged_attention``, and
            :meth:`prepare` frees, before each step, every block that lies wholly between the sinks and the window
            of the step's first query (``[ceil(sink_tokens / block_size) blocks, (seq_len - window_left) //
            block_size)``): its block-table entry becomes ``-1`` and is never read, so the blocks held per sequence
            stay bounded (``ceil(sink_tokens / bs) + ceil((window_left + new tokens) / bs) + 1``) as it grows.

    Raises:
        ValueError: non-positive sizes, ``joint`` with ``D_v != D``, caches needing more than ``2**47`` bytes (the
            message names the sizes and the byte count; an allocator failure below that re-raises its own type with
            the same facts first); from the methods: unknown or duplicate sequence
            ids, negative token counts, a non-block-aligned fork, padding targets smaller than the step.
        OutOfBlocksError: (a ``RuntimeError``) not enough free blocks; nothing is allocated.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        num_layers: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        joint: bool = False,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window_left: int = -1,
        sink_tokens: int = 0,
    ) -> None:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if window_left < -1 or sink_tokens < 0:
            raise ValueError(
                f"PagedKVCache: window_left must be -1 (no window) or >= 0 and sink_tokens >= 0, got "
                f"window_left={window_left} and sink_tokens={sink_tokens}."
            )
        self.window_left, self.sink_tokens = window_left, sink_tokens
        for name, x in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("head_dim_v", head_dim_v), ("num_layers", num_layers)):
            if x <= 0:
                raise ValueError(f"PagedKVCache: {name} must be positive, got {x}.")
        if joint and head_dim_v != head_dim:
            raise ValueError(
                f"PagedKVCache: joint=True views K and V of one [P, block_size, 2, H_kv, D] allocation and needs "
                f"head_dim_v == head_dim, got {head_dim_v} and {head_dim}. Pass joint=False."
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.kv_caches: list[torch.Tensor] = []  # joint: each layer's [P, block_size, 2, H_kv, D] allocation
        sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     head_dim_v=head_dim_v, num_layers=num_layers)
        shapes = ([(num_blocks, block_size, 2, num_kv_heads, head_dim)] if joint else
                  [(num_blocks, block_size, num_kv_heads, head_dim), (num_blocks, block_size, num_kv_heads, head_dim_v)])
        buffers = allocate("PagedKVCache", sizes, shapes * num_layers, dtype, device)  # sizes checked first
        for layer in range(num_layers):
            if joint:
                kv = buffers[layer]
                k, v = kv[:, :, 0], kv[:, :, 1]
                self.kv_caches.append(kv)
            else:
                k, v = buffers[2 * layer], buffers[2 * layer + 1]
            self.k_caches.append(k)
            self.v_caches.append(v)
        self.device = self.k_caches[0].device  # resolved like torch factories (None: the default device)
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest free block id first
        self._refs = [0] * num_blocks
        self._seqs: dict[Hashable, _Seq] = {}
        self._sliced = [0] * num_layers  # per layer: heads written by head-sliced writes, a bitmask (0: none)

    # --- block manager ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks (per layer) not held by any sequence."""
        return len(self._free)

    @property
    def seq_ids(self) -> list:
        """Ids of the live sequences, in the order they were added."""
        return list(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` in the cache (KV length). Raises ``ValueError`` for an unknown id."""
        return self._get(seq_id).length

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """Physical blocks of a sequence, in order (a copy)."""
        return list(self._get(seq_id).blocks)

    def ref_count(self, block: int) -> int:
        """How many sequences hold ``block`` (0: free)."""
        return self._refs[block]

    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"PagedKVCache: unknown sequence {seq_id!r}; add it with add_sequence first.") from None

    @contextlib.contextmanager
    def _atomic(self):
        """Block-manager transaction: if the block raises, the free pool, reference counts and sequences are
        restored (tensors are not: do tensor work after the block)."""
        saved = list(self._free), list(self._refs), {k: _Seq(list(s.blocks), s.length) for k, s in self._seqs.items()}
        try:
            yield
        except BaseException:  # in place: the containers may be referenced elsewhere
            self._free[:], self._refs[:] = saved[:2]
            self._seqs.clear()
            self._seqs.update(saved[2])
            raise

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence (no blocks until it is extended)."""
        if seq_id in self._seqs:
            raise ValueError(f"PagedKVCache: sequence {seq_id!r} already exists; free it first or use a new id.")
        self._seqs[seq_id] = _Seq([], 0)

    def _blocks_needed(self, seq: _Seq, num_tokens: int) -> int:
        return -(-(seq.length + num_tokens) // self.block_size) - len(seq.blocks)

    def _raise_out_of_blocks(self, needed: int, what: str) -> None:
        raise OutOfBlocksError(
            f"PagedKVCache: out of blocks: {what} needs {needed} new blocks of {self.block_size} tokens but only "
            f"{len(self._free)} of {self.num_blocks} are free; nothing was allocated. Free finished sequences or "
            f"allocate more blocks."
        )

    def _grow(self, seq: _Seq, num_tokens: int) -> list[int]:
        """Allocate blocks (already known to be available) and return the slots of the new tokens."""
        for _ in range(self._blocks_needed(seq, num_tokens)):
            block = heapq.heappop(self._free)
            self._refs[block] = 1
            seq.blocks.append(block)
        bs, start = self.block_size, seq.length
        seq.length += num_tokens
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    def extend(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow a sequence by ``num_tokens`` positions; returns their slots (``block * block_size + row``).

        Raises ``OutOfBlocksError`` (allocating nothing) when the free blocks do not suffice.
        """
        seq = self._get(seq_id)
        _check_count("PagedKVCache.extend", num_tokens, seq_id)
        needed = self._blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            self._raise_out_of_blocks(needed, f"extending sequence {seq_id!r} by {num_tokens} tokens")
        return self._grow(seq, num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its blocks return to the free pool when no other sequence shares them."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for block in seq.blocks:
            self._release(block)

    def _release(self, block: int) -> None:
        if block < 0:  # evicted already
            return
        self._refs[block] -= 1
        if self._refs[block] == 0:
            heapq.heappush(self._free, block)

    def _evictable(self, seq: _Seq) -> list[int]:
        """Indices into ``seq.blocks`` of the held blocks that no later query can see (StreamingLLM): wholly past
        the sinks and before the window of a query at position ``seq.length`` (the next new token)."""
        if self.window_left < 0:
            return []
        bs = self.block_size
        first = -(-self.sink_tokens // bs)  # the first block with no sink token
        end = max(0, seq.length - self.window_left) // bs  # blocks [.., end) end at or before the window's start
        return [i for i in range(first, min(end, len(seq.blocks))) if seq.blocks[i] >= 0]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int | None = None) -> int:
        """Start ``child_id`` sharing the parent's first ``num_tokens`` tokens (read-only, by reference count).

        ``num_tokens`` defaults to the parent's length rounded down to a whole block and must be a multiple of
        ``block_size`` (no copy-on-write: a partly filled block cannot be shared, the child re-writes that tail).
        Returns the number of shared tokens (the child's length).
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"PagedKVCache: sequence {child_id!r} already exists; fork into a new id.")
        bs = self.block_size
        if num_tokens is not None:
            _check_count("PagedKVCache.fork", num_tokens, child_id)
        n = parent.length // bs * bs if num_tokens is None else num_tokens
        if n < 0 or n > parent.length or n % bs:
            raise ValueError(
                f"PagedKVCache: fork of {parent_id!r} can share only whole blocks of its {parent.length} tokens "
                f"(block_size {bs}; no copy-on-write), got num_tokens={n}. Pass a multiple of {bs} up to "
                f"{parent.length // bs * bs}."
            )
        blocks = parent.blocks[: n // bs]
        self._check_fork_visible(parent, parent_id, n)
        for block in blocks:
            if block >= 0:  # (an evicted entry stays -1 in the child)
                self._refs[block] += 1
        self._seqs[child_id] = _Seq(list(blocks), n)
        return n

    def _check_fork_visible(self, parent: _Seq, parent_id: Hashable, n: int) -> None:
        """``ValueError`` when a StreamingLLM parent evicted (``-1``) a block among the first ``n // block_size``
        that the child's next query (position ``n``) would see: sink blocks, or blocks in its window."""
        seen = self._evicted_but_visible(parent.blocks, n)
        if not seen:
            return
        bs = self.block_size
        ok = [m for m in range(n, parent.length // bs * bs + 1, bs) if not self._evicted_but_visible(parent.blocks, m)]
        raise ValueError(
            f"PagedKVCache.fork: num_tokens={n} of {parent_id!r} includes blocks {seen} (token positions "
            f"[{seen[0] * bs}, {(seen[-1] + 1) * bs})) that the parent already evicted (StreamingLLM: window_left="
            f"{self.window_left}, sink_tokens={self.sink_tokens}), and the child's next query at position {n} would "
            f"read them. Nothing was forked; "
            + (f"pass num_tokens={ok[0]} or more (a multiple of block_size {bs})." if ok
               else "fork before the parent evicts them.")
        )

    def _evicted_but_visible(self, blocks: list[int], n: int) -> list[int]:
        """Indices of evicted entries among the first ``n // block_size`` of ``blocks`` that a query at position
        ``n`` sees."""
        hidden = set(self._evictable(_Seq([0] * (n // self.block_size), n)))
        return [i for i, b in enumerate(blocks[: n // self.block_size]) if b < 0 and i not in hidden]

    # --- per-step metadata --------------------------------------------------------------------------------------
    def prepare(
        self,
        new_tokens: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]],
        *,
        pad_tokens: int | None = None,
        pad_batch: int | None = None,
        max_blocks: int | None = None,
    ) -> PagedStep:
        """Extend every listed sequence by its new-token count and return the step's metadata tensors.

        Args:
            new_tokens: ``{seq_id: num_new_tokens}`` (or pairs) in batch order: prefill chunks and decode (1) mixed.
            pad_tokens: pad ``slot_mapping`` to this many tokens with ``-1`` (skipped by the write op); the padding
                query rows go to padding batch rows (``seq_len`` 0: they see no key and yield zeros).
            pad_batch: pad the batch to this many rows (``seq_len`` 0). Needed (``> B``) when ``pad_tokens`` adds
                tokens; defaults to ``B + 1`` then. Padding tokens are spread over the padding rows, so a decode
                step with ``pad_tokens == pad_batch`` keeps ``max_seqlen_q == 1``.
            max_blocks: width of ``block_table`` (default: the longest sequence's block count).

        Host-side planning, eager only: it allocates blocks in Python and builds the step's tensors from Python lists,
        so call it outside compiled regions and pass the :class:`PagedStep`'s tensors (``max_seqlen_q`` is an int)
        to the compiled step, as ``examples/llm_serving.py`` does. Called while compiling or exporting
        (``torch.compiler.is_compiling()``), it raises ``RuntimeError`` before changing anything: traced, the
        allocation would run once at trace time and its lists would be baked into the graph as constants.

        Atomic: every check (ids, counts, free blocks, ``max_blocks``, padding) runs before anything is allocated.
        Raises ``ValueError`` for unknown or repeated ids, negative counts and padding/width targets that are too
        small; ``OutOfBlocksError`` when the step needs more blocks than are free; ``RuntimeError`` when called
        while compiling.
        """
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "PagedKVCache.prepare is host-side planning (Python block manager) and runs eagerly only; it was "
                "called while compiling (torch.compile or torch.export). Call cache.prepare(...) outside the "
                "compiled function and pass the PagedStep's tensors (block_table, seq_lens, cu_seqlens_q, "
                "slot_mapping, positions) and max_seqlen_q to it as arguments, or, with blocks reserved up front, "
                "build the step inside it from a tensor of positions with cache.step_at(positions, block_table)."
            )
        items = list(new_tokens.items()) if isinstance(new_tokens, Mapping) else list(new_tokens)
        ids = [seq_id for seq_id, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedKVCache.prepare: a sequence appears twice in one step: {ids}.")
        seqs = [self._get(seq_id) for seq_id in ids]
        for seq_id, n in items:
            _check_count("PagedKVCache.prepare", n, seq_id)
        bs = self.block_size
        needed = sum(self._blocks_needed(seq, n) for seq, (_, n) in zip(seqs, items))
        evict = [self._evictable(seq) for seq in seqs]  # applied once every check passed
        reusable = sum(1 for seq, idx in zip(seqs, evict) for i in idx if self._refs[seq.blocks[i]] == 1)
        widths = [-(-(seq.length + n) // bs) for seq, (_, n) in zip(seqs, items)]
        widest = max(widths, default=0)
        width = widest if max_blocks is None else max_blocks
        if widest > width:
            raise ValueError(
                f"PagedKVCache.prepare: a sequence needs {max(widths)} blocks but max_blocks={max_blocks}; raise "
                f"max_blocks to at least {max(widths)}."
            )
        num_tokens = sum(n for _, n in items)
        pad_tokens = num_tokens if pad_tokens is None else pad_tokens
        if pad_tokens < num_tokens:
            raise ValueError(
                f"PagedKVCache.prepare: pad_tokens={pad_tokens} is less than the step's {num_tokens} tokens."
            )
        extra = pad_tokens - num_tokens
        batch = len(items)
        if pad_batch is None:
            pad_batch = batch + 1 if extra else batch
        if pad_batch < batch or (extra and pad_batch == batch):
            raise ValueError(
                f"PagedKVCache.prepare: pad_batch={pad_batch} must be >= the {batch} sequences of the step, and "
                f"larger when pad_tokens adds tokens (padding tokens need a padding row)."
            )
        if needed > len(self._free) + reusable:
            self._raise_out_of_blocks(needed, f"a step of {num_tokens} tokens over {batch} sequences")
        for seq, idx in zip(seqs, evict):
            for i in idx:
                self._release(seq.blocks[i])
                seq.blocks[i] = -1

        positions = [p for seq, (_, n) in zip(seqs, items) for p in range(seq.length, seq.length + n)] + [0] * extra
        slots = [s for seq, (_, n) in zip(seqs, items) for s in self._grow(seq, n)] + [-1] * extra
        q_lens = [n for _, n in items]
        pad_rows = pad_batch - batch
        if pad_rows:  # spread the padding tokens over the padding rows
            q_lens += [extra // pad_rows + (i < extra % pad_rows) for i in range(pad_rows)]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        table = [seq.blocks + [0] * (width - len(seq.blocks)) for seq in seqs] + [[0] * width] * pad_rows
        dev = self.device
        return PagedStep(
            block_table=torch.tensor(table, dtype=torch.int32, device=dev).view(pad_batch, width),
            seq_lens=torch.tensor([seq.length for seq in seqs] + [0] * pad_rows, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            max_seqlen_q=max(q_lens, default=0),
            num_tokens=num_tokens,
            seq_ids=tuple(ids),
        )

    def block_table(self, seq_ids: Iterable[Hashable], max_blocks: int | None = None) -> torch.Tensor:
        """The block table of ``seq_ids`` as they stand: int32 ``[B, max_blocks]`` on the cache's device, each row a
        sequence's blocks padded with 0 (never read); ``max_blocks`` defaults to the longest row. Host-side (eager):
        with :meth:`step_at`, reserve each sequence's blocks first (``extend(seq_id, max_tokens)``), then pass this
        table to the compiled step. Raises ``ValueError`` for an unknown id or a ``max_blocks`` smaller than a row."""
        rows = [self._get(seq_id).blocks for seq_id in seq_ids]
        width = max((len(r) for r in rows), default=0) if max_blocks is None else max_blocks
        if any(len(r) > width for r in rows):
            raise ValueError(
                f"PagedKVCache.block_table: a sequence holds {max(len(r) for r in rows)} blocks but "
                f"max_blocks={max_blocks}; pass max_blocks >= {max(len(r) for r in rows)}."
            )
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32,
                            device=self.device).view(len(rows), width)

    def step_at(self, positions: torch.Tensor, block_table: torch.Tensor) -> PagedStep:
        """The step's metadata computed on the device from a tensor of positions, inside a compiled step (compiled
        generate loops keep positions in a tensor, gpt-fast's ``input_pos``): no host sync, no recompile as the
        positions advance. The block manager is neither consulted nor changed (reserve blocks up front, e.g.
        :meth:`extend` then :meth:`block_table`; :meth:`prepare` plans on the host). Semantics, errors and value
        contract: ``kvops/cache/_device_step.py``.

        Args:
            positions: int32/int64 ``[T]`` (shared by every sequence, as gpt-fast's ``input_pos``) or ``[B, T]``,
                ``T >= 1``, the new tokens' consecutive positions, on the cache's device.
            block_table: int32 ``[B, max_blocks]`` on the cache's device.

        Returns:
            :class:`PagedStep`: ``block_table`` as given, ``seq_lens = positions[:, -1] + 1`` (int32), ``cu_seqlens_q
            = arange(B + 1) * T``, ``slot_mapping [B * T]`` int64, ``positions [B * T]`` int64, ``max_seqlen_q = T``,
            ``num_tokens = B * T``, ``seq_ids = ()``; for :meth:`write` and :meth:`attention`.
        """
        where = "PagedKVCache.step_at"
        _device_step.check_step_args(where, positions, block_table, self.device)
        table, seq_lens, cu, slots, pos, max_q, n = _device_step.step_at(where, positions, block_table,
                                                                        self.block_size, self.num_blocks)
        return PagedStep(block_table=table, seq_lens=seq_lens, cu_seqlens_q=cu, slot_mapping=slots, positions=pos,
                         max_seqlen_q=max_q, num_tokens=n, seq_ids=())

    # --- tensor work through the ops ----------------------------------------------------------------------------
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: PagedStep,
              cache_head_start: int | None = None) -> None:
        """Write the step's new ``key``/``value`` ``[N_pad, H_in, D]`` of ``layer`` via ``kvops.paged_cache_write``.

        Raises ``ValueError`` when ``H_in`` differs from the cache's ``num_kv_heads`` and no ``cache_head_start`` is
        given (naming ``num_kv_heads``: the caches are NHD by construction, so no layout hint), and every error of
        ``kvops.paged_cache_write``. Head-sliced writes (``cache_head_start``) are recorded per layer: until they
        have filled every KV head, :meth:`attention` on the layer raises.
        """
        self._check_layer("PagedKVCache.write", layer)
        if cache_head_start is None:
            _check_heads("PagedKVCache.write", "key", key, self.k_caches[layer].shape[2])
        paged_cache_write(key, value, self.k_caches[layer], self.v_caches[layer], step.slot_mapping,
                          cache_head_start, self.k_scale, self.v_scale)
        if cache_head_start is not None or self._sliced[layer]:  # after the op: a refused write marks nothing
            full = (1 << self.k_caches[layer].shape[2]) - 1
            h0 = 0 if cache_head_start is None else int(cache_head_start)
            self._sliced[layer] |= full & (((1 << key.shape[1]) - 1) << h0)

    def attention(self, layer: int, q: torch.Tensor, step: PagedStep, **kwargs):
        """``kvops.paged_attention`` of ``q [N_pad, H_q, D]`` over ``layer``'s cache with the step's metadata.

        ``kwargs``: ``scale``, ``causal`` (default True), ``window_left`` and ``sink_tokens`` (default: the cache's),
        ``softcap``, ``sinks``, ``return_lse``, and the other keyword arguments of ``kvops.paged_attention`` (e.g.
        ``rope_theta`` for RoPE at read time).
        Raises ``ValueError`` when ``H_q`` is not a multiple of the cache's ``num_kv_heads`` (GQA); when the layer's
        head-sliced writes (``write(..., cache_head_start=h0)``) left KV heads unwritten (e.g. a cache built with 4
        heads for a model with 2, written at heads ``[0, 2)``: attention would read the never-written heads); and
        every error of ``kvops.paged_attention``.
        """
        self._check_layer("PagedKVCache.attention", layer)
        _check_heads("PagedKVCache.attention", "q", q, self.k_caches[layer].shape[2])
        self._check_sliced_heads(layer, q)
        if self.window_left >= 0:
            kwargs.setdefault("window_left", self.window_left)
            kwargs.setdefault("sink_tokens", self.sink_tokens)
        return paged_attention(q, self.k_caches[layer], self.v_caches[layer], step.cu_seqlens_q, step.seq_lens,
                               step.block_table, max(step.max_seqlen_q, 1), k_scale=self.k_scale,
                               v_scale=self.v_scale, **kwargs)


    def _check_sliced_heads(self, layer: int, q: torch.Tensor) -> None:
        """Head-sliced writes (``write(..., cache_head_start=h0)``) of ``layer`` must have filled every KV head before
        attention reads them all: a cache built with more heads than the model has, written at the head slice the
        model's keys fit, reads never-written heads with no error otherwise (a Python-int bitmask per layer; the
        common path, writes without ``cache_head_start``, never sets it)."""
        written, num_kv_heads = self._sliced[layer], self.k_caches[layer].shape[2]
        if not written or written == (1 << num_kv_heads) - 1:
            return
        heads = [h for h in range(num_kv_heads) if written >> h & 1]
        spans = (f"[{heads[0]}, {heads[-1] + 1})" if heads[-1] - heads[0] + 1 == len(heads)
                 else "{" + ", ".join(map(str, heads)) + "}")
        raise ValueError(
            f"PagedKVCache.attention: layer {layer}'s cache has num_kv_heads={num_kv_heads}, but its writes filled "
            f"only heads {spans} (PagedKVCache.write with cache_head_start), so q's {q.shape[1]} heads would read heads "
            f"that were never written. If the model has {_kv_heads(len(heads))}, build PagedKVCache with "
            f"num_kv_heads={len(heads)} and write without cache_head_start; with head-sliced writers, write every "
            f"head slice before attention."
        )

    def _check_layer(self, where: str, layer) -> None:
        """``layer`` indexes the cache's layers: an int in ``[0, num_layers)`` (a negative index would silently
        address another layer; a float or tensor would raise a bare ``TypeError``)."""
        num_layers = len(self.k_caches)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(
                f"{where}: layer must be an int in [0, {num_layers}) (the cache holds num_layers={num_layers}), got "
                f"{type(layer).__name__} {layer!r}. Pass the layer's index, or build PagedKVCache with more layers."
            )


def _check_count(where: str, n, seq_id) -> None:
    """A token count: a non-negative Python int (1.5 or a tensor would raise bare ``TypeError``s deep inside)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{where}: num_tokens must be an int, got {type(n).__name__} {n!r} for sequence {seq_id!r}. Pass a "
            f"whole number of tokens (int(n))."
        )
    if n < 0:
        raise ValueError(f"PagedKVCache: num_tokens must be >= 0, got {n} for sequence {seq_id!r}.")


def _check_heads(where: str, name: str, x: torch.Tensor, num_kv_heads: int) -> None:
    """The head count of ``x [N, H, D]`` (``q``: a multiple of ``num_kv_heads``, GQA; ``key``: equal) in the cache's
    terms. A ``PagedKVCache`` allocates NHD caches itself, so the ops' "may be an HND cache" hint cannot apply (it
    would suggest a ``kv_layout`` that ``PagedKVCache`` does not take)."""
    heads = x.shape[1] if x.dim() == 3 else None
    if heads is None or (heads % num_kv_heads == 0 if name == "q" else heads == num_kv_heads):
        return
    if name == "q":
        need = (f"must be a multiple of the cache's num_kv_heads={num_kv_heads} (GQA). If the model has another KV "
                f"head count, build PagedKVCache with it (a divisor of {heads}); else pass q with a multiple of "
                f"{num_kv_heads} heads.")
    elif heads < num_kv_heads:  # the likely mistake is the cache's head count: that fix first
        need = (f"differ from the cache's num_kv_heads={num_kv_heads}. If the model has {_kv_heads(heads)}, build "
                f"PagedKVCache with num_kv_heads={heads}. A head slice is for several writers filling one cache "
                f"(tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= "
                f"{num_kv_heads - heads}), and have the other writers fill the other heads before attention.")
    else:
        need = (f"exceed the cache's num_kv_heads={num_kv_heads}. Pass {name} with {num_kv_heads} heads, or build "
                f"PagedKVCache with num_kv_heads={heads}.")
    raise ValueError(f"{where}: {name} of shape {tuple(x.shape)} has {heads} heads, which {need}")


def _kv_heads(n: int) -> str:
    return f"{n} KV head{'s' if n != 1 else ''}"
