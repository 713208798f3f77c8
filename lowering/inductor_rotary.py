"""Inductor lowering for ``kvops::rotary_paged_cache_write``: the rotation is computed inside the cache-store loop.

The rotated key is an ``ir.Pointwise`` whose loader reads the key's producer (so e.g. ``k_proj`` epilogue -> RoPE ->
store is one loop), the rotary position of its token (``positions[i]``, an indirect index into the tables) and the
partner dim of its pair; it is handed to the paged write's scatter (``lowering/inductor_paged.py``: slot routing,
negative slots, fp8 quantization), so nothing is materialized between the producer and the cache.

Index arithmetic, for dim ``d`` of ``rotary_dim = 2 * half``: GPT-NeoX partner ``(d + half) mod rotary_dim``, table
column ``d mod half``, sign ``-`` for ``d mod rotary_dim < half``; GPT-J partner ``d + 1 - 2 (d mod 2)``, column
``(d mod rotary_dim) // 2``, sign ``-`` for even ``d``. Both stay in bounds for ``d >= rotary_dim`` (those dims are
passed through by a ``where``). Math in fp32, rounded once to the key's dtype, as the CPU and Triton kernels.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from .inductor_contiguous import bind_layout_symbols, buffer_names, unfused_copy
from .inductor_paged import batch_router, paged_scatter, saved_rows


def rotated(key, positions, cos, sin, interleaved: bool, n):
    """``ir.Pointwise [n, ..., D]``: rows ``[0, n)`` of ``key`` (``[N', H, D]``, or ``[N', D]`` as MLA's ``k_pe``)
    rotated at ``positions`` (FlashAttention semantics)."""
    load_x, load_p, load_c, load_s = (t.make_loader() for t in (key, positions, cos, sin))
    seqlen_ro, half = cos.get_size()
    rd = 2 * half
    dtype = key.get_dtype()

    def inner_fn(idx):
        i, mid, d = idx[0], list(idx[1:-1]), idx[-1]
        if interleaved:
            partner = ModularIndexing(d + 1 - 2 * ModularIndexing(d, 1, 2), 1, rd)
            j = FloorDiv(ModularIndexing(d, 1, rd), 2)
            first = ops.eq(ops.index_expr(ModularIndexing(d, 1, 2), torch.int64), ops.constant(0, torch.int64))
        else:
            partner = ModularIndexing(d + half, 1, rd)
            j = ModularIndexing(d, 1, half)
            first = ops.lt(ops.index_expr(ModularIndexing(d, 1, rd), torch.int64), ops.constant(half, torch.int64))
        p = ops.indirect_indexing(ops.to_dtype(load_p([i]), torch.int64), seqlen_ro, check=True, wrap_neg=False)
        x = ops.to_dtype(load_x([i, *mid, d]), torch.float32)
        y = ops.to_dtype(load_x([i, *mid, partner]), torch.float32)
        c = ops.to_dtype(load_c([p, j]), torch.float32)
        s = ops.to_dtype(load_s([p, j]), torch.float32)
        xc, ys = ops.mul(x, c), ops.mul(y, s)
        out = ops.where(first, ops.sub(xc, ys), ops.add(xc, ys))
        in_rot = ops.lt(ops.index_expr(d, torch.int64), ops.constant(rd, torch.int64))
        return ops.to_dtype(ops.where(in_rot, out, x), dtype)

    return ir.Pointwise(device=key.get_device(), dtype=dtype, inner_fn=inner_fn, ranges=[n, *key.get_size()[1:]])


def rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
                             rotary_interleaved=False, cache_head_start=None, k_scale=None, v_scale=None):
    """Lowering of ``kvops::rotary_paged_cache_write``."""
    h0 = cache_head_start or 0
    n = slot_mapping.get_size()[0]
    if V.graph.sizevars.statically_known_equals(n, 0):
        return
    k_cache.realize()
    v_cache.realize()
    bind_layout_symbols(k_cache, v_cache)
    written = buffer_names(k_cache, v_cache)
    key, value = (unfused_copy(x) if x.get_read_names() & written else x for x in (key, value))
    router = batch_router(slot_mapping, k_cache)
    key = rotated(key, positions, rotary_cos, rotary_sin, rotary_interleaved, n)
    caches = ((key, k_cache, k_scale), (value, v_cache, v_scale))
    saved = saved_rows(caches, router, h0, "NHD")  # before writing
    for (src, cache, scale), rows in zip(caches, saved):
        paged_scatter(src, cache, scale, slot_mapping, router, h0, "NHD", rows)


def register(register_lowering) -> None:
    """Register the lowering of ``kvops::rotary_paged_cache_write``."""
    register_lowering(torch.ops.kvops.rotary_paged_cache_write.default,
                      type_promotion_kind=None)(rotary_paged_cache_write)
