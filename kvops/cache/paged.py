"""``PagedKVCache``: per-layer paged K/V caches and a block manager for a batch of sequences (vLLM-style).

Bookkeeping (block lists, lengths, reference counts) is plain Python ints and runs eagerly, outside compiled regions
(host-side planning: :meth:`PagedKVCache.prepare` raises a clear error when called while compiling or exporting); the
tensors a step needs are built by :meth:`PagedKVCache.prepare` and passed to the compiled step, and every cache write
goes through ``kvops.paged_cache_write`` (reads through ``kvops.paged_attention``). docs/semantics.md §3-4.

This module holds the caches (the constructor) and the tensor work (``write``, ``attention``); the block manager
(sequences, blocks, forks, ``prepare``, ``block_table``, ``step_at``), ``PagedStep`` and ``OutOfBlocksError`` are in
``_paged_blocks.py``, the base class of ``PagedKVCache``.
"""

from __future__ import annotations

from typing import Hashable

import torch

from ..ops.paged_attention import paged_attention
from ..ops.paged_write import paged_cache_write
from ._alloc import allocate
from ._paged_blocks import OutOfBlocksError  # noqa: F401  (re-exported: kvops.cache.paged.OutOfBlocksError)
from ._paged_blocks import BlockManager, PagedStep, _Seq


class PagedKVCache(BlockManager):
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
