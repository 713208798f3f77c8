"""transformers ``Cache`` classes on kvops caches (imported by ``kvops.integrations.transformers``).

Layers follow transformers' ``CacheLayerMixin`` interface (``lazy_initialization``, ``update``, ``get_mask_sizes``,
``get_seq_length``, ``get_max_length``, ``reset``). Cursors are Python ints on the layer objects: the cache is passed
to the model as an argument (``past_key_values=``), so under ``torch.compile`` they become dynamic after one
recompile (a 20-step decode loop compiles 2 graphs), and every tensor op goes through kvops' ops (``cache_write``,
``paged_cache_write``), whose writes fuse with the K/V producers under Inductor.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..cache import PagedKVCache, RollingKVCache
from ..ops import cache_write, paged_cache_write


def check_room(cache: str, seen, num_tokens, max_cache_len: int) -> None:
    """``ValueError`` naming the positions, ``max_cache_len`` and the fix when ``num_tokens`` new tokens after
    ``seen`` do not fit (raised before anything is written)."""
    if seen + num_tokens > max_cache_len:
        raise ValueError(
            f"{cache}: writing {num_tokens} tokens at positions [{seen}, {seen + num_tokens}) exceeds max_cache_len="
            f"{max_cache_len}, the tokens each sequence holds (prompt + generated). Allocate the cache with "
            f"max_cache_len >= {seen + num_tokens} (the prompt length + max_new_tokens)."
        )


class KvopsStaticLayer(CacheLayerMixin):
    """Full-attention layer: contiguous NHD caches ``[B, max_cache_len, H_kv, D]`` written by ``kvops.cache_write``.

    ``update`` writes the ``T`` new tokens at rows ``[G, G + T)`` and returns ``[B, H_kv, max_cache_len, D]`` views
    (transposes of the NHD storage, no copy); rows ``>= G + T`` are unfilled and masked by :func:`kvops_mask`.
    Raises ``ValueError`` (naming the positions and ``max_cache_len``, before writing) when ``G + T > max_cache_len``.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        shape = (self.batch_size, self.max_cache_len, self.num_heads)
        self.k = torch.zeros(*shape, key_states.shape[-1], dtype=self.dtype, device=self.device)
        self.v = torch.zeros(*shape, value_states.shape[-1], dtype=self.dtype, device=self.device)
        self.keys, self.values = self.k.transpose(1, 2), self.v.transpose(1, 2)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_room("KvopsStaticCache", self.seen, key_states.shape[-2], self.max_cache_len)
        cache_write(key_states.transpose(1, 2), value_states.transpose(1, 2), self.k, self.v, self.seen)
        self.seen += key_states.shape[-2]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.seen = 0


class KvopsSlidingLayer(KvopsStaticLayer):
    """Sliding-window layer on :class:`kvops.cache.RollingKVCache` (capacity ``W = min(sliding_window, max_len)``).

    Decode (``T == 1``): one ``cache_write`` into the ring, then the window in position order (``W`` rows, offset a
    device tensor so compiled decode does not specialize on the fill point). A chunk (``T > 1``, prefill): returns the
    held tokens followed by the chunk (as transformers' sliding layers do, so every query of the chunk sees its own
    window), then keeps the last ``W`` tokens.
    """

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        super().__init__(max_cache_len=min(sliding_window, max_cache_len))

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

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self.ring.reset()


class KvopsStaticCache(Cache):
    """Static cache for ``generate()`` / ``torch.compile`` / ``torch.export`` on kvops contiguous caches.

    Full-attention layers are :class:`KvopsStaticLayer`, sliding-window layers (``config.layer_types`` or
    ``config.sliding_window``) :class:`KvopsSlidingLayer`. Use with ``attn_implementation="kvops"``.

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


class KvopsPagedLayer(KvopsStaticLayer):
    """One layer of :class:`KvopsPagedCache`: ``[P, block_size, H_kv, D]`` storage, written by
    ``kvops.paged_cache_write`` through the shared block table; ``update`` returns ``(kv, block_table)``: the joint
    storage ``[P, block_size, 2, H_kv, D]`` and the ``[B, max_blocks]`` int32 table, which only
    :func:`kvops_attention_forward` understands (any other attention function fails on the 5-D "key")."""

    is_sliding = False

    def __init__(self, parent: "KvopsPagedCache", layer_idx: int, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.parent, self.layer_idx = parent, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        pool = self.parent.allocate(key_states, value_states)
        self.k, self.v = pool.k_caches[self.layer_idx], pool.v_caches[self.layer_idx]
        self.block_table = self.parent.block_table
        # the joint [P, block_size, 2, H_kv, D] view: V sits at a fixed storage offset from K (pool allocated joint)
        p, bs, h, d = self.k.shape
        kv_stride = self.v.storage_offset() - self.k.storage_offset()
        self.keys = self.k.as_strided((p, bs, 2, h, d), (*self.k.stride()[:2], kv_stride, *self.k.stride()[2:]))
        self.values = self.block_table
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, t, _ = key_states.shape
        check_room("KvopsPagedCache", self.seen, t, self.max_cache_len)
        bs = self.k.shape[1]
        pos = torch.arange(t, device=self.device) + self.seen
        slots = self.block_table[:, pos // bs].long() * bs + pos % bs  # [B, T]
        paged_cache_write(key_states.transpose(1, 2).reshape(batch * t, *self.k.shape[2:]),
                          value_states.transpose(1, 2).reshape(batch * t, *self.v.shape[2:]),
                          self.k, self.v, slots.view(-1))
        self.seen += t
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0


class KvopsPagedCache(Cache):
    """Paged cache for ``generate()`` on :class:`kvops.cache.PagedKVCache` (block manager + ``[P, block_size, H_kv,
    D]`` storage per layer). Sliding-window layers keep every token; the window is applied by the attention.

    Blocks for ``max_cache_len`` tokens per sequence are reserved at the first forward (allocated round-robin over
    the batch, so a sequence's blocks are not contiguous), so the block table is fixed while generating and a compiled
    decode step never recompiles for allocation. K and V of a layer are views of one joint allocation (``D_v ==
    D``). Use with ``attn_implementation="kvops"``: ``model.generate(**inputs, past_key_values=cache)``.

    Args:
        config: the model config (number of layers). max_cache_len: tokens per sequence.
        block_size: tokens per block (default 16). num_blocks: ``P`` (default: just enough for the batch).
    """

    def __init__(self, config, max_cache_len: int, block_size: int = 16, num_blocks: int | None = None, **kwargs):
        num_layers = config.get_text_config(decoder=True).num_hidden_layers
        self.block_size, self.num_blocks, self.pool, self.block_table = block_size, num_blocks, None, None
        super().__init__(layers=[KvopsPagedLayer(self, i, max_cache_len) for i in range(num_layers)])

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PagedKVCache:
        """The shared :class:`PagedKVCache` and block table (created by the first layer initialized)."""
        if self.pool is None:
            batch, heads, _, d = key_states.shape
            per_seq = -(-self.layers[0].max_cache_len // self.block_size)
            self.pool = PagedKVCache(self.num_blocks or batch * per_seq, self.block_size, heads, d,
                                     num_layers=len(self.layers), dtype=key_states.dtype, device=key_states.device,
                                     joint=True)
            for b in range(batch):
                self.pool.add_sequence(b)
            for _ in range(per_seq):  # round-robin: block ids of a sequence interleave with the others'
                for b in range(batch):
                    self.pool.extend(b, self.block_size)
            self.block_table = torch.tensor([self.pool.block_ids(b) for b in range(batch)], dtype=torch.int32,
                                            device=key_states.device)
        return self.pool
