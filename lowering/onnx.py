"""ONNX translations of the kvops ops, for ``torch.onnx.export(..., dynamo=True)`` (onnxscript, opset 18 ops).

Usage (see docs/deployment.md)::

    ep = kvops.export.functionalize(torch.export.export(model, args))     # writes -> functional kvops ops
    onnx_program = torch.onnx.export(ep, dynamo=True, custom_translation_table=kvops.onnx_translation_table())

Why the ``functionalize`` step: torch 2.13's exporter keeps a mutating custom op in place; ``run_decompositions()``
(which ``torch.onnx.export`` runs) wraps it in ``auto_functionalized_v2``, and torch 2.13's ONNX exporter cannot
translate that node for any op (it fails on the node's OpOverload argument before consulting the table).
``kvops.export.functionalize`` rewrites those nodes into the functional variants ``kvops::<op>_functional``; the
translations below are keyed on them (and on ``kvops::paged_attention``, which mutates nothing). Arguments are read by
name, so op arguments added later with a default keep working.

Mapping (values are ONNX graphs; nothing here runs at import of kvops):

- ``cache_write`` -> ``ScatterND`` of ``[B, T, H_in]`` (batch, row, head) indices (``Range`` + ``Expand``); head slices
  via the head coordinate. ``start`` may be a graph value (a SymInt of the exported program).
- ``cache_roll`` -> ``Slice`` of the source rows/heads + ``ScatterND`` at the destination (reads the old cache, so
  overlapping ranges are correct). With tensor positions (and ``cache_write`` with a tensor ``start``,
  ``kvops.export.streaming_update``) the op is a masked ``paged_cache_write`` of gathered rows, translated below.
- ``paged_cache_write`` -> ``ScatterND`` on the ``[P * block_size + 1, H_kv, D]`` flattened cache: negative slots
  (skip) are redirected explicitly to the extra last row, which is dropped afterwards (ONNX indices count from the
  end, so a negative slot would otherwise overwrite a real row). fp8 caches: ``Div`` by the scale, ``Clip(+-448)``,
  ``Cast`` to ``FLOAT8E4M3FN`` (round to nearest even, saturating), the scatter done on an exact fp32 copy.
- ``paged_attention`` -> ``Gather`` of each query's sequence metadata and K/V rows through ``block_table`` (positions
  past ``seq_len`` redirected to position 0, so NaN in unused slots is never read), then an explicit attention
  subgraph (``MatMul``, softcap ``Tanh``, ``Where`` mask for bottom-right causal + sliding window, sinks in the
  softmax denominator, ``Exp``/``ReduceSum``), GQA without repeating K/V (queries grouped per KV head), fp8 caches
  dequantized with their scales. Returns ``(out, lse)`` as the op. Memory is ``T_q x max_blocks x block_size x H_kv
  x D`` (every query gathers its sequence's table): an export/verification path, not a fast kernel.

- ``merge_attention_states(_many)`` -> elementwise ``Where``/``ReduceMax``/``Exp``/``ReduceSum``/``Log`` over the parts'
  LSEs and a weighted sum of the parts in fp32 (``Cast``, ``CastLike`` back), as ``kvops/cpu/merge.py``.

``kv_layout="HND"`` caches ``[P, H_kv, block_size, D]`` are transposed to NHD inside the graph (a copy per call in
the ONNX program; the written cache is transposed back). Not exported: symbolic ``window_left``/``softcap``/``scale`` (they must
be Python numbers when the program is exported). Slot values ``>= P * block_size`` and block ids outside ``[0, P)``
are value contracts (ONNX runtimes may raise or read garbage), as in the ops.
"""

from __future__ import annotations

import math

import torch

from kvops._extras import require

require("onnx", "kvops' ONNX translations (kvops.onnx_translation_table)", "onnx", "onnx_ir", "onnxscript")

import onnx_ir as ir  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

INT64, FLOAT, BOOL = ir.DataType.INT64, ir.DataType.FLOAT, ir.DataType.BOOL
FP8 = ir.DataType.FLOAT8E4M3FN
FP8_MAX = 448.0


# --- small graph helpers -----------------------------------------------------------------------------------------
def _scalar(x):
    """A 0-d int64 value from a Python int or an (int) graph value."""
    if isinstance(x, int):
        return op.Constant(value=ir.tensor(x, dtype=INT64))
    return op.Reshape(op.Cast(x, to=INT64), op.Constant(value_ints=[]))


def _vec(x):
    """A ``[1]`` int64 value from a Python int or a graph value."""
    if isinstance(x, int):
        return op.Constant(value_ints=[x])
    return op.Reshape(op.Cast(x, to=INT64), op.Constant(value_ints=[1]))


def _dim(x, i: int):
    """Size of dim ``i`` of ``x`` as a 0-d int64 value."""
    return op.Squeeze(op.Shape(x, start=i, end=i + 1), op.Constant(value_ints=[0]))


def _static(x, i: int, what: str) -> int:
    size = x.shape[i] if x.shape is not None else None
    if not isinstance(size, int):
        raise ValueError(f"kvops ONNX export: {what} must be a static size, got {size}.")
    return size


def _nhd(name: str, cache, kv_layout):
    """``(cache as NHD [P, block_size, H_kv, D], (block_size, H_kv, D))``; an HND cache ``[P, H_kv, block_size, D]``
    is transposed (the ONNX graph computes on a transposed copy and transposes the written cache back)."""
    if kv_layout not in (None, "NHD", "HND"):
        raise ValueError(f"kvops ONNX export: {name} got kv_layout={kv_layout!r}; expected 'NHD' or 'HND'.")
    hnd = kv_layout == "HND"
    dims = tuple(_static(cache, i, what) for i, what in ((1, "dim 1 of the cache"), (2, "dim 2 of the cache"),
                                                         (3, "head_dim")))
    if not hnd:
        return cache, dims
    return op.Transpose(cache, perm=[0, 2, 1, 3]), (dims[1], dims[0], dims[2])


def _range(start, count):
    """``[start, start + count)`` as an int64 vector (``start``/``count`` 0-d values or ints)."""
    start, count = _scalar(start), _scalar(count)
    return op.Range(start, op.Add(start, count), op.Constant(value=ir.tensor(1, dtype=INT64)))


# --- contiguous caches [B, S, H, D] ----------------------------------------------------------------------------
def _write_rows(x, cache, start, h0: int, h_in: int):
    """``cache[:, start:start+T, h0:h0+H_in] = x`` for ``x [B, T, H_in, D]``, as one ScatterND."""
    b, t = _dim(x, 0), _dim(x, 1)
    shape = op.Concat(op.Shape(x, start=0, end=3), op.Constant(value_ints=[1]), axis=0)  # [B, T, H_in, 1]
    ib = op.Expand(op.Reshape(_range(0, b), op.Constant(value_ints=[-1, 1, 1, 1])), shape)
    it = op.Expand(op.Reshape(_range(start, t), op.Constant(value_ints=[1, -1, 1, 1])), shape)
    ih = op.Expand(op.Reshape(_range(h0, h_in), op.Constant(value_ints=[1, 1, -1, 1])), shape)
    return op.ScatterND(cache, op.Concat(ib, it, ih, axis=-1), x)


def cache_write(key, value, k_cache, v_cache, start, cache_head_start=None, **_):
    """ONNX of ``kvops::cache_write_functional``: rows ``[start, start + T)``, heads ``[h0, h0 + H_in)``."""
    h0, h_in = cache_head_start or 0, _static(key, 2, "the number of heads written")
    return _write_rows(key, k_cache, start, h0, h_in), _write_rows(value, v_cache, start, h0, h_in)


def cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start=None, num_heads=None, **_):
    """ONNX of ``kvops::cache_roll_functional``: rows ``[src, src + n)`` -> ``[dst, dst + n)`` of heads
    ``[h0, h0 + num_heads)`` (overlap-safe: the moved rows are read from the input cache)."""
    h0 = cache_head_start or 0
    h1 = _static(k_cache, 2, "num_kv_heads") if num_heads is None else h0 + num_heads
    out = []
    for cache in (k_cache, v_cache):
        starts = op.Concat(_vec(src), op.Constant(value_ints=[h0]), axis=0)
        ends = op.Concat(_vec(op.Add(_scalar(src), _scalar(num_tokens))), op.Constant(value_ints=[h1]), axis=0)
        moved = op.Slice(cache, starts, ends, op.Constant(value_ints=[1, 2]))
        out.append(_write_rows(moved, cache, dst, h0, h1 - h0))
    return tuple(out)


# --- paged caches [P, block_size, H_kv, D] (NHD) ------------------------------------------------------------------
def _quantize_fp8(x, scale, h0: int, h_in: int):
    if _static(scale, 0, "the scale length") != 1:
        scale = op.Slice(scale, op.Constant(value_ints=[h0]), op.Constant(value_ints=[h0 + h_in]))
    q = op.Div(op.Cast(x, to=FLOAT), op.Reshape(scale, op.Constant(value_ints=[1, -1, 1])))
    low, high = (op.Constant(value=ir.tensor(v, dtype=FLOAT)) for v in (-FP8_MAX, FP8_MAX))
    return op.Cast(op.Clip(q, low, high), to=FP8)  # Cast saturates and rounds to nearest even


def _scatter_slots(x, cache, slots, h0: int, h_in: int, h: int, d: int, fp8: bool):
    """``cache[slot // bs, slot % bs, h0:h0+H_in] = x[i]`` (NHD ``cache``) for the slots ``>= 0``; ``slots`` int64
    ``[N]``."""
    if fp8:  # onnxruntime's CPU Reshape/ScatterND have no fp8 kernels: scatter on an exact fp32 copy
        cache, x = op.Cast(cache, to=FLOAT), op.Cast(x, to=FLOAT)
    flat = op.Reshape(cache, op.Constant(value_ints=[-1, h, d]))
    num_slots = _dim(flat, 0)
    padded = op.Concat(flat, op.Slice(flat, op.Constant(value_ints=[0]), op.Constant(value_ints=[1])), axis=0)
    slots = op.Where(op.Less(slots, op.Constant(value=ir.tensor(0, dtype=INT64))), num_slots, slots)  # skip -> row P*bs
    shape = op.Concat(op.Shape(x, start=0, end=2), op.Constant(value_ints=[1]), axis=0)  # [N, H_in, 1]
    i_slot = op.Expand(op.Reshape(slots, op.Constant(value_ints=[-1, 1, 1])), shape)
    i_head = op.Expand(op.Reshape(_range(h0, h_in), op.Constant(value_ints=[1, -1, 1])), shape)
    written = op.ScatterND(padded, op.Concat(i_slot, i_head, axis=-1), x)
    written = op.Slice(written, op.Constant(value_ints=[0]), _vec(num_slots))
    written = op.Reshape(written, op.Shape(cache))
    return op.Cast(written, to=FP8) if fp8 else written


def paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None, v_scale=None,
                      kv_layout=None, **_):
    """ONNX of ``kvops::paged_cache_write_functional`` (NHD or HND caches; negative slots skipped explicitly)."""
    if kv_layout not in (None, "NHD", "HND"):
        raise ValueError(f"kvops ONNX export: paged_cache_write got kv_layout={kv_layout!r}; expected 'NHD' or 'HND'.")
    h0 = cache_head_start or 0
    n = op.Shape(slot_mapping)
    slots = op.Cast(slot_mapping, to=INT64)
    out = []
    h_in = _static(key, 1, "the number of heads written")
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = op.Slice(x, op.Constant(value_ints=[0]), n)  # rows >= N of key/value are never read
        fp8 = cache.dtype == FP8
        if fp8:
            x = _quantize_fp8(x, scale, h0, h_in)
        nhd, (_, h, d) = _nhd("paged_cache_write", cache, kv_layout)
        written = _scatter_slots(x, nhd, slots, h0, h_in, h, d, fp8)
        out.append(op.Transpose(written, perm=[0, 2, 1, 3]) if kv_layout == "HND" else written)
    return tuple(out)


def _gather_kv(cache, slots, scale, h: int, d: int):
    """fp32 ``[T, N, H_kv, D]`` of flat slots ``[T, N]`` of an NHD ``cache``, dequantized for fp8 caches."""
    # fp32 first: onnxruntime's CPU Reshape/Gather have no fp8 kernels (a copy of the cache; exact)
    x = op.Gather(op.Reshape(op.Cast(cache, to=FLOAT), op.Constant(value_ints=[-1, h, d])), slots, axis=0)
    if scale is not None:
        x = op.Mul(x, op.Reshape(scale, op.Constant(value_ints=[1, 1, -1, 1])))
    return x


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale=None, causal=True,
                    window_left=-1, softcap=0.0, sinks=None, k_scale=None, v_scale=None, kv_layout=None,
                    alibi_slopes=None, window_right=-1, cache_leftpad=None, sink_tokens=0, rope_theta=None,
                    custom_mask=None, packed_custom_mask=None, **_):
    """ONNX of ``kvops::paged_attention``: returns ``(out [T_q, H_q, D_v], lse [H_q, T_q])`` as the op does.
    The attention features of docs/attention_features.md (ALiBi, a right window, cache_leftpad, sink tokens, RoPE at
    read time) and custom masks (docs/tree-mask.md) have no translation yet: exporting a call that uses one raises."""
    used = [name for name, x, default in (("alibi_slopes", alibi_slopes, None), ("window_right", window_right, -1),
                                          ("cache_leftpad", cache_leftpad, None), ("sink_tokens", sink_tokens, 0),
                                          ("rope_theta", rope_theta, None), ("custom_mask", custom_mask, None),
                                          ("packed_custom_mask", packed_custom_mask, None))
            if (x is not None if default is None else x != default)]
    if used:
        raise NotImplementedError(f"kvops ONNX export: paged_attention with {', '.join(used)} has no translation.")
    k_cache, (_, _, d_k) = _nhd("paged_attention", k_cache, kv_layout)
    v_cache, (block_size, num_kv_heads, d_v) = _nhd("paged_attention", v_cache, kv_layout)
    for name, x in (("window_left", window_left), ("softcap", softcap), ("scale", scale)):
        if x is not None and not isinstance(x, (int, float)):
            raise ValueError(f"kvops ONNX export: paged_attention's {name} must be a Python number, got {x!r}.")
    num_heads, d = _static(q, 1, "num_heads"), _static(q, 2, "head_dim")
    group = num_heads // num_kv_heads
    sm_scale = d ** -0.5 if scale is None else float(scale)
    i64 = lambda v: op.Constant(value=ir.tensor(v, dtype=INT64))  # noqa: E731
    f32 = lambda v: op.Constant(value=ir.tensor(v, dtype=FLOAT))  # noqa: E731
    neg_inf = f32(-math.inf)

    # each packed query's sequence b(t), position and table row
    t = _range(0, _dim(q, 0))  # [T]
    cu = op.Cast(cu_seqlens_q, to=INT64)
    starts = op.Slice(cu, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]))
    ends = op.Slice(cu, op.Constant(value_ints=[1]), op.Constant(value_ints=[2**62]))
    b = op.ReduceSum(op.Cast(op.GreaterOrEqual(op.Unsqueeze(t, i64([1])), op.Unsqueeze(ends, i64([0]))), to=INT64),
                     op.Constant(value_ints=[1]), keepdims=0)
    b = op.Min(b, op.Sub(_dim(block_table, 0), i64(1)))  # tokens past cu_seqlens_q[B] (padding) use the last row
    kv_len = op.Gather(op.Cast(seq_lens, to=INT64), b, axis=0)  # [T]
    start_t = op.Gather(starts, b, axis=0)
    q_len = op.Sub(op.Gather(ends, b, axis=0), start_t)
    pos = op.Add(op.Sub(kv_len, q_len), op.Sub(t, start_t))  # [T]
    table = op.Cast(op.Gather(block_table, b, axis=0), to=INT64)  # [T, max_blocks]

    # K/V rows through the table; positions past seq_len read position 0 of the sequence (never unused slots)
    kpos = _range(0, op.Mul(_dim(block_table, 1), i64(block_size)))  # [N]
    in_seq = op.Less(op.Unsqueeze(kpos, i64([0])), op.Unsqueeze(kv_len, i64([1])))  # [T, N]
    first = op.Where(op.Greater(kv_len, i64(0)), op.Squeeze(op.Slice(table, i64([0]), i64([1]), i64([1])), i64([1])),
                     i64(0))
    blocks = op.Where(in_seq, op.Gather(table, op.Div(kpos, i64(block_size)), axis=1), op.Unsqueeze(first, i64([1])))
    rows = op.Where(in_seq, op.Mod(kpos, i64(block_size)), i64(0))
    slots = op.Add(op.Mul(blocks, i64(block_size)), rows)  # [T, N]
    k = op.Transpose(_gather_kv(k_cache, slots, k_scale, num_kv_heads, d_k), perm=[0, 2, 3, 1])  # [T, H_kv, D, N]
    v = op.Transpose(_gather_kv(v_cache, slots, v_scale, num_kv_heads, d_v), perm=[0, 2, 1, 3])  # [T, H_kv, N, D_v]

    qg = op.Reshape(op.Mul(op.Cast(q, to=FLOAT), f32(sm_scale)), op.Constant(value_ints=[0, num_kv_heads, group, d]))
    s = op.MatMul(qg, k)  # [T, H_kv, G, N]
    if softcap and softcap > 0:
        s = op.Mul(op.Tanh(op.Div(s, f32(float(softcap)))), f32(float(softcap)))
    visible = in_seq
    kp, qp = op.Unsqueeze(kpos, i64([0])), op.Unsqueeze(pos, i64([1]))
    if causal:
        visible = op.And(visible, op.LessOrEqual(kp, qp))
    if window_left is not None and window_left >= 0:
        visible = op.And(visible, op.GreaterOrEqual(kp, op.Sub(qp, i64(int(window_left)))))
    s = op.Where(op.Unsqueeze(visible, i64([1, 2])), s, neg_inf)

    m = op.ReduceMax(s, op.Constant(value_ints=[-1]), keepdims=1)  # [T, H_kv, G, 1]
    sink = None
    if sinks is not None:  # exp(sink_h) joins head h's denominator and carries no value
        sink = op.Reshape(op.Cast(sinks, to=FLOAT), op.Constant(value_ints=[1, num_kv_heads, group, 1]))
        m = op.Max(m, sink)
    m_safe = op.Where(op.Equal(m, neg_inf), f32(0.0), m)
    p = op.Exp(op.Sub(s, m_safe))
    l = op.ReduceSum(p, op.Constant(value_ints=[-1]), keepdims=1)
    has_keys = op.Greater(l, f32(0.0))
    if sink is not None:
        l = op.Add(l, op.Exp(op.Sub(sink, m_safe)))
    acc = op.MatMul(p, v)  # [T, H_kv, G, D_v]
    o = op.Where(has_keys, op.Div(acc, op.Where(has_keys, l, f32(1.0))), f32(0.0))
    positive = op.Greater(l, f32(0.0))
    lse = op.Where(positive, op.Add(m_safe, op.Log(op.Where(positive, l, f32(1.0)))), neg_inf)
    out = op.Cast(op.Reshape(o, op.Constant(value_ints=[0, num_heads, d_v])), to=q.dtype)
    lse = op.Transpose(op.Reshape(lse, op.Constant(value_ints=[0, num_heads])), perm=[1, 0])
    return out, lse


def stream_positions(state, sink_tokens=None, kv_cache_size=None, **_):
    """``kvops::stream_positions`` (``streaming_update``'s position check) -> ``Identity``: ONNX has no assert. The
    step masks its moves and writes with the same checks, so a bad position writes nothing (no error)."""
    return op.Identity(state)


def _merge_weights(lses, axis: int):
    """``(c, lse)`` of docs/semantics.md §12 over ``axis`` of fp32 ``lses``: weights ``exp(lse_i - lse)`` (0 where
    every part is empty; ``+inf`` read as ``-inf``) and the merged LSE, as ``kvops/cpu/merge.py``."""
    inf = op.Constant(value=ir.tensor(math.inf, dtype=FLOAT))
    neg_inf = op.Neg(inf)
    zero = op.Constant(value=ir.tensor(0.0, dtype=FLOAT))
    lses = op.Where(op.Equal(lses, inf), neg_inf, lses)
    axes = op.Constant(value_ints=[axis])
    m = op.ReduceMax(lses, axes, keepdims=1)
    m = op.Where(op.Equal(m, neg_inf), zero, m)
    w = op.Exp(op.Sub(lses, m))
    s = op.ReduceSum(w, axes, keepdims=1)
    lse = op.Squeeze(op.Add(op.Log(s), m), axes)
    positive = op.Greater(s, zero)
    c = op.Where(positive, op.Div(w, op.Where(positive, s, op.Constant(value=ir.tensor(1.0, dtype=FLOAT)))), zero)
    return c, lse


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """ONNX of ``kvops::merge_attention_states``: ``(out [T, H, D_v]`` in the parts' dtype, ``lse [H, T])``; fp32
    math (``Cast``), weights transposed to ``[T, H, 1]``."""
    c, lse = _merge_weights(op.Concat(op.Unsqueeze(lse_a, op.Constant(value_ints=[0])),
                                      op.Unsqueeze(lse_b, op.Constant(value_ints=[0])), axis=0), 0)  # [2, H, T]
    c = op.Unsqueeze(op.Transpose(c, perm=[0, 2, 1]), op.Constant(value_ints=[3]))  # [2, T, H, 1]
    first, second = op.Split(c, num_outputs=2, axis=0)
    axis0 = op.Constant(value_ints=[0])
    out = op.Add(op.Mul(op.Cast(o_a, to=FLOAT), op.Squeeze(first, axis0)),
                 op.Mul(op.Cast(o_b, to=FLOAT), op.Squeeze(second, axis0)))
    return op.CastLike(out, o_a), lse


def merge_attention_states_many(outs, lses):
    """ONNX of ``kvops::merge_attention_states_many``: ``outs [N, T, H, D_v]``, ``lses [N, H, T]``."""
    c, lse = _merge_weights(lses, 0)
    c = op.Unsqueeze(op.Transpose(c, perm=[0, 2, 1]), op.Constant(value_ints=[3]))  # [N, T, H, 1]
    out = op.ReduceSum(op.Mul(op.Cast(outs, to=FLOAT), c), op.Constant(value_ints=[0]), keepdims=0)
    return op.CastLike(out, outs), lse


def onnx_translation_table() -> dict:
    """``{op overload: onnxscript translation}`` to pass as ``torch.onnx.export(custom_translation_table=...)``.

    Keys: ``kvops::cache_write_functional``, ``kvops::cache_roll_functional``, ``kvops::paged_cache_write_functional``
    (what ``kvops.export.functionalize`` turns the mutating writes into), ``kvops::paged_attention`` and the merges
    ``kvops::merge_attention_states(_many)``.
    """
    from kvops.export import functional  # noqa: F401  (defines the functional ops)

    ops = torch.ops.kvops
    return {
        ops.cache_write_functional.default: cache_write,
        ops.cache_roll_functional.default: cache_roll,
        ops.paged_cache_write_functional.default: paged_cache_write,
        ops.paged_attention.default: paged_attention,
        ops.stream_positions.default: stream_positions,
        ops.merge_attention_states.default: merge_attention_states,
        ops.merge_attention_states_many.default: merge_attention_states_many,
    }
