"""Inductor lowering for ``kvops::paged_cache_write`` (caches ``[P, block_size, H_kv, D]``, docs/semantics.md §3).

Like the contiguous write (``lowering/inductor_contiguous.py``): an ``ir.Scatter`` over tokens ``[N, H_in, D]`` whose
values come from the producer's loader (RoPE, norm, and for ``float8_e4m3fn`` caches the quantization
``clamp(x / scale, ±448)``), stored into the mutated cache through indirect indices ``slot // block_size``,
``slot % block_size``. ``N`` is ``slot_mapping``'s length; key rows ``>= N`` are never read.

**Negative slots (skip) without a masked store.** Inductor's C++ backend has no masked store (``ops.masked`` bodies
may not store; see also the comment in Inductor's ``_unsafe_masked_index_put_accumulate`` lowering), and every
iteration of a ``Scatter`` stores. So a skipped token (a negative slot, or any token of a batch skipped whole, below)
stores its own value into slot 0, i.e. cache row (block 0, row 0) of its heads, and that row is **restored** at the end:

- one reduction over the slots (:func:`batch_code`) gives ``-1`` when a slot is past the cache, else the first token
  ``w`` whose slot is 0 (``N`` when none);
- before the write, heads ``[h0, h0 + H_in)`` of row (0, 0) are bit-copied into a small buffer, next to token ``w``'s
  stored value (:func:`saved_rows`; one ``[2, 2, H_in, D]`` buffer for K and V);
- after the token stores, one ``[H_in, D]`` store per cache writes token ``w``'s value into row (0, 0) again when a
  token writes that row (the duplicate of its own store), else the row's saved bytes back.

The final cache is exact (a bit copy: NaN payloads included); while the kernel runs, row (0, 0) may transiently hold a
skipped token's value (visible only to a reader running concurrently with this op). For the same reason two
compiled writes into one cache must not run concurrently (e.g. on two CUDA streams): each restores row (0, 0) from
its own copy, so one may undo the other's write of slot 0 (docs/semantics.md §7).

Why two scratch buffers and not none (measured by ``benchmarks/cache_write.py``, the §6 ratio's remaining gap at
small ``N``): the whole-batch skip needs one value computed from every slot before any store, and Inductor's CPU
code keeps a reduction's result in a buffer the wrapper allocates (about 0.35 us per buffer per call with its free);
a select between the producer's value and the cache's own bits would skip the restore, but Inductor computes a
bf16/fp16 select in fp32 (two conversions per element, NaN payloads lost) and does not vectorize a bit-cast select.

**Vectorized over the head dim, no select.** The store loop is Inductor's own ``index_put_`` loop: per token it
loads the slot, computes ``(src, dst)`` with a few scalar ops (as ``index_put_`` computes its wrapped index; the
C++ code evaluates them once per vector of the head dim, like ``index_put_``'s), and stores the producer's value,
vectorized over ``H_in * D``. The stored value is the producer's value itself (no select between it and the cache:
a bf16/fp16 select would be computed in fp32 and cost two conversions per element), so a plain copy stays a plain
vector copy.

**A slot ``>= P * block_size`` skips the whole batch.** The reduction that finds the first slotted token also flags
a slot past the cache; such a batch is routed as an all-padding one, so compiled code never leaves part of a batch
written and never stores outside the cache (every destination is in bounds by construction, so the stores carry no
bounds check; Inductor's, which on CPU was seen to abort the process with ``std::terminate``, cannot fire). Compiled
code gets a clean error as well with ``kvops.value_checks("async")`` (docs/semantics.md §7); eager calls are checked
by default. Nothing else is checked: the fake rule ran the op's validator at trace time.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import empty_strided
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from kvops._checks.common import FP8_MAX

from .inductor_contiguous import bind_layout_symbols, buffer_names, scatter_into, unfused_copy


def batch_code(slot_mapping, n, capacity):
    """0-d int64, one reduction over the slots: ``-1`` when some slot is ``>= capacity`` (``P * block_size``; the
    whole batch is then skipped), else the first token ``w`` whose slot is 0, or ``n`` when none is."""
    load = slot_mapping.make_loader()

    def inner_fn(_, ridx):
        slot = ops.to_dtype(load(ridx), torch.int64)
        outside = ops.ge(slot, ops.index_expr(capacity, torch.int64))
        to_row0 = ops.eq(slot, ops.constant(0, torch.int64))
        return ops.where(outside, ops.constant(-1, torch.int64),
                         ops.where(to_row0, ops.index_expr(ridx[0], torch.int64), ops.index_expr(n, torch.int64)))

    code = ir.Reduction.create(
        device=slot_mapping.get_device(),
        dst_dtype=torch.int64,
        src_dtype=torch.int64,
        inner_fn=inner_fn,
        ranges=[],
        reduction_ranges=[n],
        reduction_type="min",
    )
    code.realize()
    return code


class Router:
    """The routing of a paged write (module docstring), as ops values computed where they are used.

    ``token(i)``: the slot token ``i`` stores its own value into: its slot, or slot 0 (block 0, row 0) when it is
    skipped (a negative slot, or a batch with a slot ``>= P * block_size``). ``row0()``: ``(written, w)``: whether a
    token of a valid batch writes slot 0, and the first one that does (0 when none)."""

    def __init__(self, slot_mapping, code, n):
        self.load_slot, self.load_code, self.n = slot_mapping.make_loader(), code.make_loader(), n

    def token(self, i):
        zero = ops.constant(0, torch.int64)
        slot = ops.to_dtype(self.load_slot([i]), torch.int64)
        write = ops.logical_and(ops.ge(slot, zero), ops.ge(self.load_code([]), zero))  # a slot, in a valid batch
        return ops.where(write, slot, zero)

    def row0(self):
        zero = ops.constant(0, torch.int64)
        code = self.load_code([])
        written = ops.logical_and(ops.ge(code, zero), ops.lt(code, ops.index_expr(self.n, torch.int64)))
        return written, ops.where(written, code, zero)


def batch_router(slot_mapping, k_cache, kv_layout="NHD") -> Router:
    """The routing of a paged write's tokens (:class:`Router`); a batch with a slot ``>= P * block_size`` is skipped
    whole. Shared by every paged-write lowering."""
    n = slot_mapping.get_size()[0]
    capacity = k_cache.get_size()[0] * k_cache.get_size()[2 if kv_layout == "HND" else 1]
    return Router(slot_mapping, batch_code(slot_mapping, n, capacity), n)


def cache_values(src, cache, scale, h0):
    """``value(token, h, d)``: the value stored for input head ``h``, dim ``d`` of ``token`` (an index, or an int64
    ops value): ``src``'s, cast to the cache dtype; for ``float8_e4m3fn`` caches ``clamp(x / scale, ±448)`` in fp32."""
    dtype = cache.get_dtype()
    load_src = src.make_loader()
    load_scale = scale.make_loader() if scale is not None else None
    per_head_scale = scale is not None and scale.get_size()[0] != 1
    num_src_rows, src_dtype = src.get_size()[0], src.get_dtype()

    def value(token, h, d):
        if not isinstance(token, sympy.Expr):
            token = ops.indirect_indexing(token, num_src_rows, check=False, wrap_neg=False)
        x = load_src([token, h, d])
        if load_scale is not None:  # fp8: x / scale in fp32, saturated to ±448, round to nearest even
            if src_dtype != torch.float32 and inductor_config.emulate_precision_casts:
                # round the producer's result to the key's dtype first, as eager does; by default Inductor keeps a
                # bf16/fp16 producer's result in fp32 (as it does for its own fused ``x.float() / scale``)
                x = ops.to_dtype(x, src_dtype, use_compute_types=False)
            s = load_scale([h0 + h] if per_head_scale else [0])
            x = ops.truediv(ops.to_dtype(x, torch.float32), s)
            x = ops.maximum(x, ops.constant(-FP8_MAX, torch.float32))
            x = ops.minimum(x, ops.constant(FP8_MAX, torch.float32))
        return ops.to_dtype(x, dtype)

    return value


def cache_index(cache, h0, kv_layout):
    """``index(slot, h, d)``: the cache-view index of input head ``h``, dim ``d`` of slot ``slot`` (an int64 ops value
    in ``[0, P * block_size)``; NHD indices, an HND cache ``[P, H_kv, block_size, D]`` is indexed with heads and rows
    swapped)."""
    hnd = kv_layout == "HND"
    num_blocks, block_size = cache.get_size()[0], cache.get_size()[2 if hnd else 1]

    def index(slot, h, d):
        if not isinstance(slot, sympy.Expr):  # in bounds by construction (module docstring): no bounds check
            slot = ops.indirect_indexing(slot, num_blocks * block_size, check=False, wrap_neg=False)
        block, row = FloorDiv(slot, block_size), ModularIndexing(slot, 1, block_size)
        return [block, h0 + h, row, d] if hnd else [block, row, h0 + h, d]

    return index


def saved_rows(caches, router, h0, kv_layout):
    """Computed before the write, per ``(src, cache, scale)`` of ``caches``: ``(buffer, c)``, where ``buffer[c, 0]``
    holds heads ``[h0, h0 + H_in)`` of cache row (block 0, row 0) (a bit copy) and ``buffer[c, 1]`` the value of the
    first token ``w`` whose slot is 0. K and V share one uninitialized ``[2, 2, H_in, D]`` buffer (one allocation)
    when their head dims agree (the caches' dtypes always do)."""
    heads = caches[0][0].get_size()[1]
    dims = [src.get_size()[2] for src, _, _ in caches]
    shared = all(V.graph.sizevars.statically_known_equals(d, dims[0]) for d in dims)
    zero = sympy.Integer(0)
    out, buffer = [], None
    for c, (src, cache, scale) in enumerate(caches):
        if buffer is None or not shared:
            buffer = empty_strided([len(caches) if shared else 1, 2, heads, dims[c]], None, dtype=cache.get_dtype(),
                                   device=cache.get_device())  # no loop: every element is stored below
        slot = c if shared else 0
        load_old, index = cache.make_loader(), cache_index(cache, h0, kv_layout)
        value = cache_values(src, cache, scale, h0)

        def old_row(idx, load_old=load_old, index=index):
            return load_old(index(zero, idx[0], idx[1]))

        def token_w(idx, value=value):
            _, w = router.row0()
            return value(w, idx[0], idx[1])

        for half, fn in ((0, old_row), (1, token_w)):
            scatter_into(buffer, ir.Pointwise(device=cache.get_device(), dtype=cache.get_dtype(), inner_fn=fn,
                                              ranges=[heads, dims[c]]),
                         lambda idx, slot=slot, half=half: [slot, half, idx[0], idx[1]])
        out.append((buffer, slot))
    return out


def paged_scatter(src, cache, scale, slot_mapping, router, h0, kv_layout, saved) -> None:
    """``cache[dst // block_size, dst % block_size, h0 + h, d] = q(src[i, h, d])`` for every token ``i`` (``dst``:
    :meth:`Router.token`), then the restore store of row (block 0, row 0) from ``saved`` (:func:`saved_rows`): token
    ``w``'s value again when a token writes that row, else the row's own bytes."""
    value = cache_values(src, cache, scale, h0)
    index = cache_index(cache, h0, kv_layout)
    dtype = cache.get_dtype()
    scatter_into(cache, ir.Pointwise(device=cache.get_device(), dtype=dtype,
                                     inner_fn=lambda idx: value(idx[0], idx[1], idx[2]),
                                     ranges=[slot_mapping.get_size()[0], *src.get_size()[1:]]),
                 lambda idx: index(router.token(idx[0]), idx[1], idx[2]))
    buffer, slot = saved
    load_saved = buffer.make_loader()

    def restored(idx):
        written, _ = router.row0()
        half = ops.indirect_indexing(ops.to_dtype(written, torch.int64), 2, check=False, wrap_neg=False)
        return load_saved([slot, half, idx[0], idx[1]])

    zero = sympy.Integer(0)
    scatter_into(cache, ir.Pointwise(device=cache.get_device(), dtype=dtype, inner_fn=restored,
                                     ranges=list(src.get_size()[1:])), lambda idx: index(zero, idx[0], idx[1]))


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
    router = batch_router(slot_mapping, k_cache, kv_layout)
    caches = list(zip(sources, (k_cache, v_cache), (k_scale, v_scale)))
    saved = saved_rows(caches, router, h0, kv_layout)  # before writing
    for (src, cache, scale), rows in zip(caches, saved):
        paged_scatter(src, cache, scale, slot_mapping, router, h0, kv_layout, rows)


def register(register_lowering) -> None:
    """Register the lowering of ``kvops::paged_cache_write``."""
    register_lowering(torch.ops.kvops.paged_cache_write.default, type_promotion_kind=None)(paged_cache_write)
