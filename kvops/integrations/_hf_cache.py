"""transformers ``Cache`` classes on kvops caches (imported by ``kvops.integrations.transformers``).

Layers follow transformers' ``CacheLayerMixin`` interface (``lazy_initialization``, ``update``, ``get_mask_sizes``,
``get_seq_length``, ``get_max_length``, ``reset``, ``reorder_cache``, ``crop``). The full-attention cursor is a 0-d
int64 *tensor* on the cache's device, ``cumulative_length``, as in transformers' ``StaticLayer``: traced writes go
through ``kvops.paged_cache_write`` with slots computed on the device from it (eager writes copy the checked rows
directly), so ``torch.compile`` never guards on a position
(one graph for a whole ``generate()`` decode), and an exported decode step reads the position from a buffer the caller
sets (``kvops.integrations.transformers.ExportableDecodeStep``). Bounds are checked eagerly (a named ``ValueError``
before anything is written); in a compiled or exported step a position past ``max_cache_len`` maps to a slot outside
the cache, which the write refuses (nothing is written) instead of landing in another sequence's rows.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..cache import PagedKVCache, RollingKVCache
from ..ops import paged_cache_write
from ._hf_checks import (_crop_count, beam_indices, check_depth, check_room, check_states,
                         remember_mask_sizes_caller)


class KvopsStaticLayer(CacheLayerMixin):
    """Full-attention layer: contiguous NHD caches ``[B, max_cache_len, H_kv, D]``, written at rows ``[G, G + T)``,
    ``G = cumulative_length`` (0-d int64 tensor): traced, by ``kvops.paged_cache_write`` (the cache read as ``B``
    blocks of ``max_cache_len`` rows; slot ``b * max_cache_len + p``); eager, by a copy into those rows once the bounds
    check passed. Raises ``ValueError`` before writing for states of another shape, dtype or device than the
    storage (:func:`check_states`).

    ``update`` returns ``[B, H_kv, max_cache_len, D]`` views (transposes of the NHD storage, no copy); rows ``>= G +
    T`` are unfilled and masked by :func:`kvops_mask`. Raises ``ValueError`` (naming the positions and
    ``max_cache_len``, before writing) when ``G + T > max_cache_len`` (checked eagerly; see the module docstring for
    compiled code). ``crop(-n)`` moves the cursor back ``n`` tokens (assisted decoding); ``reorder_cache`` permutes the
    batch in place (beam search), keeping the storage's address.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False
    cache_name = "KvopsStaticCache"

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.cumulative_length = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        shape = (self.batch_size, self.max_cache_len, self.num_heads)
        self.head_dim, self.head_dim_v = key_states.shape[-1], value_states.shape[-1]
        self.k = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(*shape, self.head_dim_v, dtype=self.dtype, device=self.device)
        self.keys, self.values = self.k.transpose(1, 2), self.v.transpose(1, 2)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._row0 = torch.arange(self.batch_size, device=self.device)[:, None] * self.max_cache_len  # [B, 1]
        if not torch.compiler.is_compiling():  # fixed addresses (CUDA graphs), as transformers' StaticLayer
            for t in (self.k, self.v, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _positions(self, num_tokens: int) -> torch.Tensor:
        """Positions ``[G, G + T)`` as an int64 device tensor (traced code: no guard on ``G``)."""
        return torch.arange(num_tokens, device=self.device) + self.cumulative_length

    def _eager_start(self, num_tokens: int) -> int | None:
        """Eager calls: ``G`` as a Python int after the bounds check (slots then take one op from it); traced: None."""
        if torch.compiler.is_compiling():
            return None
        g = int(self.cumulative_length)
        check_room(self.cache_name, g, num_tokens, self.max_cache_len)
        return g

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_states(self, key_states, value_states)
        t = key_states.shape[-2]
        g = self._eager_start(t)
        if g is not None:  # eager, in bounds (checked): rows [g, g + t), the rows paged_cache_write would write,
            self.keys.narrow(2, g, t).copy_(key_states)  # without its per-call cost (a tiny model's decode layer
            self.values.narrow(2, g, t).copy_(value_states)  # is ~100 us)
            self.cumulative_length.add_(t)
            return self.keys, self.values
        pos = self._positions(t)
        inside = (pos >= 0) & (pos < self.max_cache_len)  # else a slot outside the cache: the write refuses it
        slots = torch.where(inside, self._row0 + pos, self.batch_size * self.max_cache_len)
        paged_cache_write(key_states.transpose(1, 2).reshape(-1, *self.k.shape[2:]),
                          value_states.transpose(1, 2).reshape(-1, *self.v.shape[2:]), self.k, self.v,
                          slots.view(-1))
        self.cumulative_length.add_(t)
        # traced: views taken here, so they are views of the ``k``/``v`` buffers (a stored view would be lifted as a
        # constant of its own, which AOTInductor copies: the package would attend K/V frozen at export time)
        return self.k.transpose(1, 2), self.v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        """Tokens held, ``G``: the 0-d int64 tensor (as transformers' StaticLayer), 0 before the first write."""
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a cursor move; their rows are overwritten later)."""
        if self.is_initialized and tokens_to_remove:
            self.cumulative_length.sub_(_crop_count(self.cache_name, tokens_to_remove, int(self.cumulative_length)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``i`` becomes old sequence ``beam_idx[i]`` (in place, same storage). ``beam_idx``:
        ``[B]`` int64/int32 tensor (any device) or list of ints, each in ``[0, B)``; else ``TypeError`` /
        ``ValueError`` before anything moves (:func:`~kvops.integrations._hf_checks.beam_indices`)."""
        if self.is_initialized:
            self._reorder(beam_indices(self.cache_name, beam_idx, self.batch_size))

    def _reorder(self, parents: list[int]) -> None:
        idx = torch.tensor(parents, dtype=torch.int64, device=self.device)
        self.k.copy_(self.k.index_select(0, idx))
        self.v.copy_(self.v.index_select(0, idx))


class KvopsSlidingLayer(KvopsStaticLayer):
    """Sliding-window layer on :class:`kvops.cache.RollingKVCache` (capacity ``W = min(sliding_window, max_len)``).

    Decode (``T == 1``): one ``cache_write`` into the ring, then the window in position order (``W`` rows, offset a
    device tensor so compiled decode does not specialize on the fill point). A chunk (``T > 1``, prefill): returns the
    held tokens followed by the chunk (as transformers' sliding layers do, so every query of the chunk sees its own
    window), then keeps the last ``W`` tokens. Its cursor is a Python int (``seen``), as transformers'
    ``StaticSlidingWindowLayer``'s. ``crop`` works while nothing has been evicted (``G <= W``) and raises
    ``ValueError`` after (evicted tokens cannot be restored).
    """

    is_sliding = True
    is_croppable = False

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        super().__init__(max_cache_len=min(sliding_window, max_cache_len))
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.ring = RollingKVCache(self.k, self.v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key, value = key_states.transpose(1, 2), value_states.transpose(1, 2)
        held = self.ring.length
        if key.shape[1] == 1:
            self.ring.write(key, value)
            k, v, _ = self.ring.window()
        else:
            k, v, _ = self.ring.window()
            k, v = torch.cat([k[:, :held], key], 1), torch.cat([v[:, :held], value], 1)
            self.ring.write(key, value)
        self.seen = self.ring.global_end
        return k.transpose(1, 2), v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int):
        w, g = self.max_cache_len, self.seen
        if query_length == 1:  # the window after the write, offset as a device tensor (no guard on the fill point)
            device = self.device if self.is_initialized else "cpu"
            return w, torch.zeros((), dtype=torch.int64, device=device).add(g + 1 - w).clamp_min(0)
        held = min(g, w)
        return held + query_length, g - held

    def get_seq_length(self) -> int:
        return self.seen

    def reset(self) -> None:
        self.seen = 0
        if self.is_initialized:
            self.ring.reset()

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized or not tokens_to_remove:
            return
        n = _crop_count(self.cache_name, tokens_to_remove, self.seen)
        if self.seen > self.max_cache_len:
            raise ValueError(
                f"{self.cache_name}.crop({tokens_to_remove}): a sliding-window layer (window {self.max_cache_len}) "
                f"holding {self.seen} tokens has evicted the tokens a rollback needs; assisted / prompt-lookup "
                f"decoding past the window needs transformers' DynamicCache (past recording)."
            )
        self.ring.global_end = self.seen = self.seen - n


class _KvopsCache(Cache):
    """What both kvops caches add to transformers' ``Cache``: a model with more layers than the cache is refused,
    by ``kvops_mask`` before any layer writes (it sees the model's config right after ``get_mask_sizes``), else at
    the first layer the cache lacks (:func:`~kvops.integrations._hf_checks.check_depth`)."""

    def get_mask_sizes(self, query_length: int, layer_idx: int):
        sizes = super().get_mask_sizes(query_length, layer_idx)
        remember_mask_sizes_caller(self, sizes)
        return sizes

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_depth(self, 0, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KvopsStaticCache(_KvopsCache):
    """Static cache for ``generate()`` / ``torch.compile`` / ``torch.export`` on kvops contiguous caches.

    Full-attention layers are :class:`KvopsStaticLayer`, sliding-window layers (``config.layer_types`` or
    ``config.sliding_window``) :class:`KvopsSlidingLayer`. Use with ``attn_implementation="kvops"``. Supports greedy
    and sampled decoding, beam search (``reorder_cache``) and assisted / prompt-lookup decoding (``crop``; sliding
    layers only until their window fills).

    Args:
        config: the model config (layer types, sliding windows).
        max_cache_len: tokens per sequence (prompt + generated).
    """

    def __init__(self, config, max_cache_len: int, **kwargs):
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = [
            (KvopsSlidingLayer if kind in ("sliding_attention", "chunked_attention") else KvopsStaticLayer)(
                max_cache_len=max_cache_len, **kw)
            for kind, kw in zip(layer_types, layer_kwargs)
        ]
        super().__init__(layers=layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]`` in every layer; ``beam_idx`` is checked once
        (:meth:`KvopsStaticLayer.reorder_cache`) before any layer moves."""
        ready = [layer for layer in self.layers if layer.is_initialized]
        if ready:
            parents = beam_indices(self.layers[0].cache_name, beam_idx, ready[0].batch_size)
            for layer in ready:
                layer._reorder(parents)


class KvopsPagedLayer(KvopsStaticLayer):
    """One layer of :class:`KvopsPagedCache`: ``[P, block_size, H_kv, D]`` storage, written by
    ``kvops.paged_cache_write`` through the shared block table; ``update`` returns ``(kv, block_table)``: the joint
    storage ``[P, block_size, 2, H_kv, D]`` and the ``[B, max_blocks]`` int32 table, which only
    :func:`kvops_attention_forward` understands (any other attention function fails on the 5-D "key")."""

    is_sliding = False
    cache_name = "KvopsPagedCache"

    def __init__(self, parent: "KvopsPagedCache", layer_idx: int, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.parent, self.layer_idx = parent, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.head_dim, self.head_dim_v = key_states.shape[-1], value_states.shape[-1]
        pool = self.parent.allocate(key_states, value_states)
        self.k, self.v = pool.k_caches[self.layer_idx], pool.v_caches[self.layer_idx]
        self.block_table = self.parent.block_table
        self.kv = pool.kv_caches[self.layer_idx]  # the joint [P, block_size, 2, H_kv, D] allocation (k = kv[:, :, 0])
        self.keys, self.values = self.kv, self.block_table
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_states(self, key_states, value_states)
        batch, _, t, _ = key_states.shape
        kv = self.kv  # K and V as views of the joint buffer, taken here (see KvopsStaticLayer.update)
        bs, num_slots = kv.shape[1], kv.shape[0] * kv.shape[1]
        g = self._eager_start(t)
        if g is not None and t == 1:  # in bounds (checked): the block and row from the Python-int position
            slots = self.block_table[:, g // bs].long() * bs + g % bs
        else:
            pos = self._positions(t)
            col = (pos // bs).clamp_max(self.block_table.shape[1] - 1)
            slots = self.block_table[:, col].long() * bs + pos % bs  # [B, T]
            slots = torch.where((pos >= 0) & (pos < self.max_cache_len), slots, num_slots)
        paged_cache_write(key_states.transpose(1, 2).reshape(batch * t, *kv.shape[3:]),
                          value_states.transpose(1, 2).reshape(batch * t, *kv.shape[3:]),
                          kv[:, :, 0], kv[:, :, 1], slots.view(-1))
        self.cumulative_length.add_(t)
        return kv, self.block_table

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # the cache reorders the shared block table once
        raise NotImplementedError("KvopsPagedCache.reorder_cache reorders the shared block table of all layers")


class KvopsPagedCache(_KvopsCache):
    """Paged cache for ``generate()`` on :class:`kvops.cache.PagedKVCache` (block manager + ``[P, block_size, H_kv,
    D]`` storage per layer). Sliding-window layers keep every token; the window is applied by the attention.

    Blocks for ``max_cache_len`` tokens per sequence are reserved at the first forward (allocated round-robin over
    the batch, so a sequence's blocks are not contiguous), so the block table is fixed while generating and a compiled
    decode step never recompiles for allocation. K and V of a layer are views of one joint allocation (``D_v ==
    D``). Use with ``attn_implementation="kvops"``: ``model.generate(**inputs, past_key_values=cache)``.

    Beam search (``reorder_cache``, as vLLM's block manager): the first child of a beam takes over its blocks, the
    others share its full blocks by reference count (``PagedKVCache.fork``) and get fresh blocks from the partly
    filled one on, into which that block's rows are copied (copy-on-write; one block per layer and extra child); the
    blocks of beams nobody continues are freed first, so the reserved pool always suffices. ``crop`` (assisted
    decoding) moves the cursor back; it raises ``ValueError`` when the rows it would re-open sit in shared blocks.

    Args:
        config: the model config (number of layers). max_cache_len: tokens per sequence.
        block_size: tokens per block (default 16). num_blocks: ``P`` (default: just enough for the batch).
    """

    def __init__(self, config, max_cache_len: int, block_size: int = 16, num_blocks: int | None = None, **kwargs):
        num_layers = config.get_text_config(decoder=True).num_hidden_layers
        self.block_size, self.num_blocks, self.pool, self.block_table = block_size, num_blocks, None, None
        self.rows: list[int] = []  # pool sequence id of each batch row
        self._next_id = 0
        super().__init__(layers=[KvopsPagedLayer(self, i, max_cache_len) for i in range(num_layers)])

    @property
    def _reserved(self) -> int:
        """Tokens reserved per sequence: ``max_cache_len`` rounded up to whole blocks."""
        return -(-self.layers[0].max_cache_len // self.block_size) * self.block_size

    def _new_row(self) -> int:
        self._next_id += 1
        self.pool.add_sequence(self._next_id)
        return self._next_id

    def _reserve_rows(self, batch: int) -> None:
        """Fresh sequences for ``batch`` rows, blocks reserved round-robin (ids of a row interleave with others')."""
        self.rows = [self._new_row() for _ in range(batch)]
        for _ in range(self._reserved // self.block_size):
            for seq in self.rows:
                self.pool.extend(seq, self.block_size)

    def _table(self) -> torch.Tensor:
        return torch.tensor([self.pool.block_ids(s) for s in self.rows], dtype=torch.int32, device=self.pool.device)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PagedKVCache:
        """The shared :class:`PagedKVCache` and block table (created by the first layer initialized)."""
        if self.pool is None:
            batch, heads, _, d = key_states.shape
            self.pool = PagedKVCache(self.num_blocks or batch * self._reserved // self.block_size, self.block_size,
                                     heads, d, num_layers=len(self.layers), dtype=key_states.dtype,
                                     device=key_states.device, joint=True)
            self._reserve_rows(batch)
            self.block_table = self._table()
        return self.pool

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]`` (block sharing and copy-on-write, see above).

        ``beam_idx``: ``[B]`` int64/int32 tensor (any device) or list of ints, each in ``[0, B)``; else
        ``TypeError`` / ``ValueError`` before anything moves. Atomic: if an allocation fails (``OutOfBlocksError``,
        e.g. a ``num_blocks`` too small for the copies), the block manager, the rows and the block table are as
        before."""
        if self.pool is None:
            return
        parents = beam_indices("KvopsPagedCache", beam_idx, len(self.rows))  # host-side planning (eager)
        length, bs = int(self.layers[0].cumulative_length), self.block_size
        full = length // bs * bs  # tokens in full blocks: shared; the rest of the reserved range is per row
        children = defaultdict(list)
        for i, p in enumerate(parents):
            children[p].append(i)
        rows, next_id = list(self.rows), self._next_id
        with self.pool._atomic():  # a failing allocation restores the block manager
            try:
                copies = self._fork_beams(children, full, length)
            except BaseException:
                self.rows[:], self._next_id = rows, next_id
                raise
        if copies:
            src, dst = (torch.tensor(x, device=self.pool.device) for x in zip(*copies))
            for layer in self.layers:
                layer.keys.index_copy_(0, dst, layer.keys.index_select(0, src))
        self.block_table.copy_(self._table())

    def _fork_beams(self, children: dict, full: int, length: int) -> list[tuple[int, int]]:
        """The block manager's part of :meth:`reorder_cache`: new ``rows``; returns the (source, destination)
        blocks to copy (each extra child's partly filled block)."""
        bs = self.block_size
        new_rows: list[int | None] = [None] * len(self.rows)
        for p, kids in children.items():
            new_rows[kids[0]] = self.rows[p]  # the first child takes the beam's blocks over
        for p, seq in enumerate(self.rows):
            if p not in children:
                self.pool.free(seq)
        copies = []
        for p, kids in children.items():
            for i in kids[1:]:
                seq = self._next_id = self._next_id + 1
                self.pool.fork(self.rows[p], seq, full)
                self.pool.extend(seq, self._reserved - full)
                new_rows[i] = seq
                if length > full:  # the partly filled block: copied (copy-on-write)
                    copies.append((self.pool.block_ids(self.rows[p])[full // bs], self.pool.block_ids(seq)[full // bs]))
        self.rows[:] = new_rows
        return copies

    def crop(self, tokens_to_remove: int) -> None:
        """Move every layer's cursor back ``-tokens_to_remove`` tokens; ``ValueError`` if a re-opened row is shared."""
        if self.pool is not None and tokens_to_remove:
            length = int(self.layers[0].cumulative_length)
            first = (length - _crop_count("KvopsPagedCache", tokens_to_remove, length)) // self.block_size
            shared = [b for s in self.rows for b in self.pool.block_ids(s)[first:] if self.pool.ref_count(b) > 1]
            if shared:
                raise ValueError(
                    f"KvopsPagedCache.crop({tokens_to_remove}): blocks {shared} are shared between beams; rows in "
                    f"them cannot be rewritten. Crop before forking (beam search and assisted decoding do not mix)."
                )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Forget all tokens; rows get fresh reserved blocks (beams may have shared some)."""
        super().reset()
        if self.pool is not None:
            for seq in self.rows:
                self.pool.free(seq)
            self._reserve_rows(len(self.rows))
            self.block_table.copy_(self._table())
