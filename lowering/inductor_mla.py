"""Inductor lowering for ``kvops::mla_cache_write`` (MLA latent cache ``[P, block_size, kv_lora_rank + rope_dim]``).

The paged write's scatter model (``lowering/inductor_paged.py``) on one latent row per token: two ``ir.Scatter``
stores, ``kv_c [N, rank]`` into columns ``[0, rank)`` and ``k_pe [N, rope_dim]`` into ``[rank, W)``, whose values
come from the producers' loaders (the ``kv_a_proj`` split, ``kv_a_layernorm``, RoPE, and for ``float8_e4m3fn`` caches
the quantization ``clamp(x / kv_scale, ±448)``), stored through the indirect indices ``slot // block_size``,
``slot % block_size``. With the rotary tables, ``k_pe`` is rotated in the store loop
(``lowering/inductor_rotary.py``'s ``rotated``, fp32 math rounded once to ``k_pe``'s dtype). Nothing is
materialized between the producers and the cache; no extern call to kvops remains.

Negative slots and a batch with a slot ``>= P * block_size`` are routed as in ``inductor_paged.py`` (:class:`Router`):
a skipped token stores into row (block 0, row 0), which is saved before the stores (a ``[2, W]`` buffer: the row's
bits and the value of the first token whose slot is 0) and restored after them. The same caveat holds: two compiled
writes into one cache must not run concurrently (docs/semantics.md §7).
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
from .inductor_paged import batch_router
from .inductor_rotary import rotated


def stored(src, cache, kv_scale):
    """``value(token, col)``: column ``col`` of ``src``'s row ``token`` (an index, or an int64 ops value) as the cache
    stores it: cast to the cache dtype; for ``float8_e4m3fn`` ``clamp(x / kv_scale, ±448)`` in fp32 first."""
    dtype, src_dtype, rows = cache.get_dtype(), src.get_dtype(), src.get_size()[0]
    load_src = src.make_loader()
    load_scale = kv_scale.make_loader() if kv_scale is not None else None
    scale_index = [sympy.Integer(0)] * (len(kv_scale.get_size()) if kv_scale is not None else 0)  # [] or [1]

    def value(token, col):
        if not isinstance(token, sympy.Expr):
            token = ops.indirect_indexing(token, rows, check=False, wrap_neg=False)
        x = load_src([token, col])
        if load_scale is not None:  # as inductor_paged.cache_values
            if src_dtype != torch.float32 and inductor_config.emulate_precision_casts:
                x = ops.to_dtype(x, src_dtype, use_compute_types=False)
            x = ops.truediv(ops.to_dtype(x, torch.float32), load_scale(scale_index))
            x = ops.maximum(x, ops.constant(-FP8_MAX, torch.float32))
            x = ops.minimum(x, ops.constant(FP8_MAX, torch.float32))
        return ops.to_dtype(x, dtype)

    return value


def _pointwise(cache, ranges, fn):
    return ir.Pointwise(device=cache.get_device(), dtype=cache.get_dtype(), inner_fn=fn, ranges=list(ranges))


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, positions=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=False):
    """Lowering of ``kvops::mla_cache_write``."""
    n = slot_mapping.get_size()[0]
    if V.graph.sizevars.statically_known_equals(n, 0):  # no tokens
        return
    kv_cache.realize()
    bind_layout_symbols(kv_cache)
    written = buffer_names(kv_cache)
    # values computed from the cache itself are copied out before it is written
    kv_c, k_pe = (unfused_copy(x) if x.get_read_names() & written else x for x in (kv_c, k_pe))
    router = batch_router(slot_mapping, kv_cache)  # [P, block_size, W]: capacity P * block_size
    if rotary_cos is not None:
        k_pe = rotated(k_pe, positions, rotary_cos, rotary_sin, rotary_interleaved, n)
    rank = kv_c.get_size()[1]
    parts = [(kv_c, 0, stored(kv_c, kv_cache, kv_scale)), (k_pe, rank, stored(k_pe, kv_cache, kv_scale))]
    num_blocks, block_size, width = kv_cache.get_size()
    zero = sympy.Integer(0)

    def index(slot, col):  # in bounds by construction (the Router): no bounds check
        slot = ops.indirect_indexing(slot, num_blocks * block_size, check=False, wrap_neg=False)
        return [FloorDiv(slot, block_size), ModularIndexing(slot, 1, block_size), col]

    # before writing: saved[0] = row (0, 0)'s bits, saved[1] = the stored value of the first token whose slot is 0
    saved = empty_strided([2, width], None, dtype=kv_cache.get_dtype(), device=kv_cache.get_device())
    load_old = kv_cache.make_loader()
    scatter_into(saved, _pointwise(kv_cache, [width], lambda idx: load_old([zero, zero, idx[0]])),
                 lambda idx: [0, idx[0]])
    for src, col0, value in parts:
        scatter_into(saved, _pointwise(kv_cache, src.get_size()[1:], lambda idx, value=value:
                                       value(router.row0()[1], idx[0])),
                     lambda idx, col0=col0: [1, col0 + idx[0]])
    for src, col0, value in parts:
        scatter_into(kv_cache, _pointwise(kv_cache, [n, src.get_size()[1]], lambda idx, value=value:
                                          value(idx[0], idx[1])),
                     lambda idx, col0=col0: index(router.token(idx[0]), col0 + idx[1]))
    load_saved = saved.make_loader()

    def restored(idx):  # token w's value again when a token writes row (0, 0), else the row's own bits
        written_row0, _ = router.row0()
        half = ops.indirect_indexing(ops.to_dtype(written_row0, torch.int64), 2, check=False, wrap_neg=False)
        return load_saved([half, idx[0]])

    scatter_into(kv_cache, _pointwise(kv_cache, [width], restored), lambda idx: [zero, zero, idx[0]])


def register(register_lowering) -> None:
    """Register the lowering of ``kvops::mla_cache_write``."""
    register_lowering(torch.ops.kvops.mla_cache_write.default, type_promotion_kind=None)(mla_cache_write)
