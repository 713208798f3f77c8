"""Inductor lowerings for ``kvops::cache_write`` and ``kvops::cache_roll`` (contiguous caches ``[B, S, H_cache, D]``).

A write is lowered the way Inductor lowers its own ``index_put_``: an ``ir.Scatter`` whose values come from the
producer's loader (so RoPE / norm / projection epilogues are computed inside the store loop, never materialized) and
whose output is the mutated cache (``ir.MutationLayoutSHOULDREMOVE``). The store index is expressed in the cache
view's own coordinates, and the mutation layout indexes through that view, so head slices, SymInt row starts and
strided caches (K and V as two views of one ``[B, S, 2, H, D]`` allocation) are written in place.

How the op reaches Inductor: functionalization wraps the mutable op in ``auto_functionalized_v2``; Inductor's
reinplacing pass drops the clones of caches that may be written in place (graph inputs, module buffers), and
``decompose_auto_functionalized`` turns the node back into ``torch.ops.kvops.cache_write.default`` called on the
caches (or ``as_strided`` views of their common base). That call is what these lowerings replace.

Nothing is checked here: the fake rule already ran the op's validator at trace time, with the same arguments.
"""

from __future__ import annotations

import sympy
from torch._inductor import ir
from torch._inductor.virtualized import V


def buffer_names(*nodes) -> set[str]:
    """Names of the buffers behind ``nodes`` (a view's name is its underlying buffer's)."""
    return {n.get_name() for n in nodes}


def bind_layout_symbols(*nodes) -> None:
    """Make sure the generated wrapper defines every size symbol of ``nodes``' layouts (sizes, strides, offset).

    K/V caches that are views of one allocation reach Inductor as ``as_strided(base, sizes, strides, offset)`` whose
    sizes are SymInt *graph inputs* (AOTAutograd's synthetic base). Inductor binds such an input under the symbol it
    was created with (``_get_placeholder_expr``: ``s59 = arg2_1``), while every expression it generates uses the
    shape environment's replacement (``s59 -> s20``, from the validator's ``k_cache.shape == v_cache.shape``): the
    kernel call then names ``s20``, which the wrapper never defines (``NameError`` after a recompile with new cache
    geometry). The wrapper does emit aliases ``old = canonical`` for replaced symbols once the canonical one is
    bound, so binding such an input under its canonical symbol defines both names.
    """
    sizevars = V.graph.sizevars
    needed = set()
    for node in nodes:
        layout = node.get_layout()
        for expr in (*layout.size, *layout.stride, layout.offset):
            needed |= sizevars.simplify(sympy.sympify(expr)).free_symbols
    bound = set()
    for value in V.graph.graph_inputs.values():
        if isinstance(value, sympy.Expr):
            bound |= value.free_symbols
        elif isinstance(value, ir.TensorBox):
            for expr in (*value.get_size(), *value.get_stride()):
                bound |= sympy.sympify(expr).free_symbols
    missing = needed - bound
    if not missing:
        return
    for name, value in V.graph.graph_inputs.items():
        if isinstance(value, sympy.Symbol) and sizevars.simplify(value) in missing:
            canonical = sizevars.simplify(value)
            V.graph.graph_inputs[name] = canonical
            missing.discard(canonical)


def scatter_into(cache, src, index_fn) -> None:
    """Store ``src`` (any IR value of the iteration shape) into ``cache`` in place: ``cache[index_fn(i)] = src[i]``.

    ``cache`` may be a view; ``index_fn`` maps an iteration index of ``src`` to an index in the view's coordinates.
    The values are computed by ``src``'s loader inside the store loop, which is what lets the producer fuse.
    """
    layout = ir.MutationLayoutSHOULDREMOVE(cache)  # marks the buffer mutated; earlier readers get realized first
    scatter = ir.Scatter(
        device=cache.get_device(),
        dtype=cache.get_dtype(),
        inner_fn=src.make_loader(),
        ranges=list(src.get_size()),
        output_indexer=index_fn,
        scatter_mode=None,
    )
    buffer = ir.ComputedBuffer(name=None, layout=layout, data=scatter)
    buffer.name = V.graph.register_buffer(buffer)
    V.graph.register_operation(buffer)


def rows_and_heads(row0, head0):
    """Index map ``[b, t, h, d] -> [b, row0 + t, head0 + h, d]`` (``row0`` may be a SymInt expression)."""

    def index_fn(idx):
        b, t, h, d = idx
        return [b, row0 + t, head0 + h, d]

    return index_fn


def unfused_copy(x):
    """A copy of ``x`` in a fresh buffer whose kernel the scheduler never fuses with another (``no_fuse_buffer_names``).

    Used for values read from the cache that is about to be written (roll; a key computed from cache rows). Fusing
    the copy into the store loop would be unsafe, and Inductor does not always see it: its in-place fusion check
    (``Scheduler.fusable_weak_dep``) compares the copy's read against the buffer's original name, while the read
    carries the name of the buffer's latest mutation; once the cache was mutated earlier in the graph (even by this
    op's K store when K and V share a base) it fuses the copy into the store loop, which then reads rows it has
    already overwritten. (An extern ``aten.clone`` would also do, but its fake-tensor input adds guards on symbolic
    row counts, i.e. recompiles.)
    """
    copy = ir.ExternKernel.copy_input(x)
    V.graph.no_fuse_buffer_names.add(copy.get_name())
    return copy


def cache_write(key, value, k_cache, v_cache, start, cache_head_start=None):
    """Lowering of ``kvops::cache_write``: rows ``[start, start + T)``, heads ``[h0, h0 + H_in)`` of both caches."""
    h0 = cache_head_start or 0
    k_cache.realize()
    v_cache.realize()
    bind_layout_symbols(k_cache, v_cache)
    written = buffer_names(k_cache, v_cache)
    # values computed from the caches themselves are copied out before either cache is written
    sources = [unfused_copy(x) if x.get_read_names() & written else x for x in (key, value)]
    for src, cache in zip(sources, (k_cache, v_cache)):
        scatter_into(cache, src, rows_and_heads(start, h0))


def cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start=None, num_heads=None):
    """Lowering of ``kvops::cache_roll``: rows ``[src, src + n)`` to ``[dst, dst + n)`` within a head slice.

    Overlap-safe by construction: the moved rows of both caches are first copied into temporary buffers (see
    ``unfused_copy``), then scattered into place (both stores in one kernel).
    """
    h0 = cache_head_start or 0
    moved = []
    for cache in (k_cache, v_cache):
        cache.realize()
        bind_layout_symbols(cache)
        batch, _, cache_heads, head_dim = cache.get_size()
        heads = num_heads if num_heads is not None else cache_heads - h0
        rows = ir.Pointwise(  # the view cache[:, src:src+n, h0:h0+heads], as a loader
            device=cache.get_device(),
            dtype=cache.get_dtype(),
            inner_fn=lambda idx, read=cache.make_loader(): read(rows_and_heads(src, h0)(idx)),
            ranges=[batch, num_tokens, heads, head_dim],
        )
        moved.append(unfused_copy(rows))
    for cache, rows in zip((k_cache, v_cache), moved):
        scatter_into(cache, rows, rows_and_heads(dst, h0))
