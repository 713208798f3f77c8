"""Inductor lowering for ``kvops::paged_cache_write`` (caches ``[P, block_size, H_kv, D]``, docs/semantics.md §3).

Like the contiguous write (``lowering/inductor_contiguous.py``): an ``ir.Scatter`` over tokens ``[N, H_in, D]`` whose
values come from the producer's loader (RoPE, norm, and for ``float8_e4m3fn`` caches the quantization
``clamp(x / scale, ±448)``), stored into the mutated cache through indirect indices ``slot // block_size``,
``slot % block_size``. ``N`` is ``slot_mapping``'s length; key rows ``>= N`` are never read.

**Negative slots (skip) without a masked store.** Inductor's C++ backend has no masked store (``ops.masked`` bodies
may not store; see also the comment in Inductor's ``_unsafe_masked_index_put_accumulate`` lowering), and every
iteration of a ``Scatter`` stores. So a skipped token is routed to an equivalent store:

- if some token in ``[0, N)`` has a slot, let ``j`` be the first one; a skipped token stores token ``j``'s value
  into token ``j``'s slot: the same bytes at the same address as token ``j``'s own store (the write is a duplicate,
  not a dummy row; its only "race" is with an identical write);
- if no token has a slot (e.g. an all-padding batch), each skipped token stores the current value of cache row
  (block 0, row 0) of its head back into that row. This is the one case where the cache is stored to without a token
  being written; it is invisible unless another stream writes that row concurrently with this op.

**Vectorized over the head dim.** The choice between the two is one select per element, done in the compute dtype
(fp32 for fp8 caches, which have no select) so that Inductor's C++ backend vectorizes the store loop over
``H_in * D`` (it vectorizes no 16-bit integer type, so a select on bf16/fp16 bit patterns would make the whole kernel
scalar). The routing (``slot``, first slotted token, selects) depends on the token only: it is computed once per token into a
small ``[N, 2]`` route table (``RouteTable``, a loop of its own in the same kernel), so the store loop loads two
integers and bounds-checks the slot per vector, as Inductor's own ``index_put_`` loads and checks its slot.
Stored bits equal eager's for float32 and fp8 caches; for bf16/fp16 the fp32 round trip is exact for every value
except NaN, which is stored as the canonical NaN (a bf16/fp16 NaN payload in a key without a producer, or in row
(block 0, row 0) of an all-padding batch, comes back as a NaN with another payload).

**A slot ``>= P * block_size`` skips the whole batch.** The reduction that finds the first slotted token also flags
a slot past the cache; such a batch is routed as an all-padding one, so compiled code never writes part of a batch
and never stores outside the cache (Inductor's indirect-index bounds check, which on CPU was seen to abort the process
with ``std::terminate``, cannot fire). Compiled code gets a clean error as well with ``kvops.value_checks("async")``
(docs/semantics.md §7); eager calls are checked by default. Nothing else is checked: the fake rule ran the op's
validator at trace time.
"""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from kvops._checks.common import FP8_MAX

from .inductor_contiguous import bind_layout_symbols, buffer_names, scatter_into, unfused_copy


def first_slotted_token(slot_mapping, n, capacity):
    """0-d int64: the first ``i < n`` with ``slot_mapping[i] >= 0``, ``n`` when there is none, and ``-1`` when some
    slot is ``>= capacity`` (``P * block_size``): then the whole batch is skipped (see :class:`Router`)."""
    load = slot_mapping.make_loader()

    def inner_fn(_, ridx):
        i = ops.index_expr(ridx[0], torch.int64)
        slot = ops.to_dtype(load(ridx), torch.int64)
        has_slot = ops.ge(slot, ops.constant(0, torch.int64))
        outside = ops.ge(slot, ops.index_expr(capacity, torch.int64))
        return ops.where(outside, ops.constant(-1, torch.int64), ops.where(has_slot, i, ops.index_expr(n, torch.int64)))

    first = ir.Reduction.create(
        device=slot_mapping.get_device(),
        dst_dtype=torch.int64,
        src_dtype=torch.int64,
        inner_fn=inner_fn,
        ranges=[],
        reduction_ranges=[n],
        reduction_type="min",
    )
    first.realize()
    return first


class Router:
    """Per token ``i``: the token whose value is stored (``src``) and the slot it goes to (``dst``), as ops values.

    A batch with a slot ``>= P * block_size`` (``first == -1``) is routed as an all-padding batch: nothing is written,
    never a partial batch and never a store outside the cache (the slot bounds check cannot fire)."""

    def __init__(self, slot_mapping, first, n):
        self.load_slot, self.load_first, self.n = slot_mapping.make_loader(), first.make_loader(), n

    def route(self, i):
        zero = ops.constant(0, torch.int64)
        slot = ops.to_dtype(self.load_slot([i]), torch.int64)
        first = self.load_first([])
        valid_batch = ops.ge(first, zero)  # no slot past the cache
        has_slot = ops.logical_and(ops.ge(slot, zero), valid_batch)
        any_slot = ops.logical_and(ops.lt(first, ops.index_expr(self.n, torch.int64)), valid_batch)
        first = ops.where(any_slot, first, zero)  # 0 when no token has a slot (then nothing below reads it)
        first_index = ops.indirect_indexing(first, self.n, check=False, wrap_neg=False)
        first_slot = ops.to_dtype(self.load_slot([first_index]), torch.int64)
        src = ops.where(has_slot, ops.index_expr(i, torch.int64), first)
        dst = ops.where(has_slot, slot, ops.where(any_slot, first_slot, zero))
        return any_slot, src, dst


class RouteTable:
    """The routing of every token computed once, in a realized ``[N, 2]`` int64 buffer ``(src, dst)``: the store loop
    then loads two integers per token (as Inductor's ``index_put_`` loads one slot), not the whole routing chain."""

    def __init__(self, router, slot_mapping):
        self.load_first, self.n = router.load_first, router.n

        def inner_fn(idx):
            i, k = idx
            _, src, dst = router.route(i)
            return ops.where(ops.eq(ops.index_expr(k, torch.int64), ops.constant(0, torch.int64)), src, dst)

        table = ir.Pointwise.create(device=slot_mapping.get_device(), dtype=torch.int64, inner_fn=inner_fn,
                                    ranges=[router.n, 2])
        table.realize()
        self.load = table.make_loader()

    def route(self, i):
        first = self.load_first([])
        any_slot = ops.logical_and(ops.lt(first, ops.index_expr(self.n, torch.int64)),
                                   ops.ge(first, ops.constant(0, torch.int64)))
        return any_slot, self.load([i, 0]), self.load([i, 1])


def route_table(slot_mapping, k_cache, kv_layout="NHD") -> RouteTable:
    """The routing of a paged write's tokens (:class:`Router`, realized as a :class:`RouteTable`); a batch with a slot
    ``>= P * block_size`` is skipped whole. Shared by every paged-write lowering."""
    n = slot_mapping.get_size()[0]
    capacity = k_cache.get_size()[0] * k_cache.get_size()[2 if kv_layout == "HND" else 1]
    return RouteTable(Router(slot_mapping, first_slotted_token(slot_mapping, n, capacity), n), slot_mapping)


def paged_scatter(src, cache, scale, slot_mapping, router, h0, kv_layout) -> None:
    """``cache[dst // block_size, dst % block_size, h0 + h, d] = q(src[src_token, h, d])`` for every token (NHD
    indices; an HND cache ``[P, H_kv, block_size, D]`` is indexed with heads and rows swapped)."""
    hnd = kv_layout == "HND"
    num_blocks, block_size = cache.get_size()[0], cache.get_size()[2 if hnd else 1]
    dtype = cache.get_dtype()
    load_src = src.make_loader()
    load_old = cache.make_loader()
    load_scale = scale.make_loader() if scale is not None else None
    per_head_scale = scale is not None and scale.get_size()[0] != 1
    num_src_rows, src_dtype = src.get_size()[0], src.get_dtype()

    def value_fn(idx):
        i, h, d = idx
        any_slot, token, _ = router.route(i)
        x = load_src([ops.indirect_indexing(token, num_src_rows, check=False, wrap_neg=False), h, d])
        if load_scale is not None:  # fp8: x / scale in fp32, saturated to ±448, round to nearest even
            if src_dtype != torch.float32 and inductor_config.emulate_precision_casts:
                # round the producer's result to the key's dtype first, as eager does; by default Inductor keeps a
                # bf16/fp16 producer's result in fp32 (as it does for its own fused ``x.float() / scale``)
                x = ops.to_dtype(x, src_dtype, use_compute_types=False)
            s = load_scale([h0 + h] if per_head_scale else [0])
            x = ops.truediv(ops.to_dtype(x, torch.float32), s)
            x = ops.maximum(x, ops.constant(-FP8_MAX, torch.float32))
            x = ops.minimum(x, ops.constant(FP8_MAX, torch.float32))
        old_index = [0, h0 + h, 0, d] if hnd else [0, 0, h0 + h, d]
        if load_scale is not None:  # fp8 has no select: select in fp32 (exact: fp32 holds every e4m3 value and NaN)
            old = ops.masked(ops.logical_not(any_slot), lambda: ops.to_dtype(load_old(old_index), torch.float32), 0.0)
            return ops.to_dtype(ops.where(any_slot, x, old), dtype)
        # a select in the compute dtype (module docstring); the old row is read only when no token has a slot
        old = ops.masked(ops.logical_not(any_slot), lambda: load_old(old_index), 0.0)
        return ops.where(any_slot, ops.to_dtype(x, dtype), old)

    def index_fn(idx):
        i, h, d = idx
        _, _, dst = router.route(i)
        slot = ops.indirect_indexing(dst, num_blocks * block_size, check=True, wrap_neg=False)
        block, row = FloorDiv(slot, block_size), ModularIndexing(slot, 1, block_size)
        return [block, h0 + h, row, d] if hnd else [block, row, h0 + h, d]

    scatter_into(cache, ir.Pointwise(device=cache.get_device(), dtype=dtype, inner_fn=value_fn,
                                     ranges=[slot_mapping.get_size()[0], *src.get_size()[1:]]), index_fn)


def paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None, v_scale=None,
                      kv_layout="NHD"):
    """Lowering of ``kvops::paged_cache_write``."""
    h0 = cache_head_start or 0
    n = slot_mapping.get_size()[0]
    if V.graph.sizevars.statically_known_equals(n, 0):  # no tokens (a symbolic n is >= 2: Dynamo specializes 0/1)
        return
    k_cache.realize()
    v_cache.realize()
    bind_layout_symbols(k_cache, v_cache)
    written = buffer_names(k_cache, v_cache)
    # values computed from the caches themselves are copied out before either cache is written
    sources = [unfused_copy(x) if x.get_read_names() & written else x for x in (key, value)]
    router = route_table(slot_mapping, k_cache, kv_layout)
    for src, cache, scale in zip(sources, (k_cache, v_cache), (k_scale, v_scale)):
        paged_scatter(src, cache, scale, slot_mapping, router, h0, kv_layout)


def register(register_lowering) -> None:
    """Register the lowering of ``kvops::paged_cache_write``."""
    register_lowering(torch.ops.kvops.paged_cache_write.default, type_promotion_kind=None)(paged_cache_write)
