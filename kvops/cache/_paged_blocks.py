"""The block manager of ``PagedKVCache`` (``paged.py``): ``BlockManager``, its base class, holds the sequences'
block lists, lengths and reference counts in Python ints (``add_sequence``, ``extend``, ``fork``, ``free``, the
StreamingLLM eviction) and builds each step's metadata (``prepare`` on the host, ``block_table``, ``step_at`` on the
device), as a ``PagedStep``; ``OutOfBlocksError`` is what an allocation raises when the free blocks do not suffice.

The caches, the constructor that sets the manager's state, and the tensor work (``write``, ``attention``) are in
``paged.py``; ``PagedMLACache`` (``mla.py``) reuses the manager through ``PagedKVCache``.
"""

from __future__ import annotations

import contextlib
import heapq
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import torch

from . import _device_step


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


class BlockManager:
    """Block manager and per-step metadata of :class:`~kvops.cache.PagedKVCache` (see its docstring). Its state is
    set by the constructor of the cache class: ``num_blocks``, ``block_size``, ``window_left``, ``sink_tokens``,
    ``device``, and the free heap ``_free``, reference counts ``_refs`` and sequences ``_seqs``."""

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


def _check_count(where: str, n, seq_id) -> None:
    """A token count: a non-negative Python int (1.5 or a tensor would raise bare ``TypeError``s deep inside)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{where}: num_tokens must be an int, got {type(n).__name__} {n!r} for sequence {seq_id!r}. Pass a "
            f"whole number of tokens (int(n))."
        )
    if n < 0:
        raise ValueError(f"PagedKVCache: num_tokens must be >= 0, got {n} for sequence {seq_id!r}.")
