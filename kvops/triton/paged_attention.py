"""Triton kernels for ``kvops::paged_attention`` (docs/semantics.md §4): split-KV decode + merge, and (chunked)
prefill.

* ``_decode_split_kernel`` (batches with ``max_seqlen_q == 1``): one program per (sequence, KV head, KV split). The
  ``G = H_q // H_kv`` query heads that share a KV head are packed into the rows of one program, so each K/V tile is
  read once per KV head. Each split writes a normalized partial output and its LSE; ``_decode_merge_kernel`` combines
  the splits (and the attention sink) per (sequence, query head).
* ``_prefill_kernel`` (any batch, e.g. chunked prefill mixed with decodes): one program per (query tile, sequence, KV
  head); rows are (query token, group head) pairs; an online softmax runs over KV tiles read through ``block_table``
  between the causal/window bounds of the tile. The grid uses ``max_seqlen_q`` (as FlashAttention's varlen API), so no
  host sync is needed; programs past a sequence's ``q_len`` do no work.

All offsets into q, the caches and the outputs are int64, and so are KV positions (``seq_lens`` reach 2^31 - 1; a
tile's lanes are int32 offsets from its int64 first position). Loads of bf16/fp16/fp8 are converted to fp32 before any
arithmetic; ``tl.dot`` runs with ``input_precision="ieee"`` for fp32 inputs and ``"tf32"`` otherwise. Slots at or
beyond ``seq_len`` are never loaded (masked loads), and unused block-table entries are never read, so NaN garbage there
cannot reach the output. Tested on CPU tensors with ``TRITON_INTERPRET=1`` by calling ``paged_attention`` here.

The launchers call the kernels through ``torch.library.wrap_triton`` so that, inside the ``triton_op`` of
``kvops/ops/paged_attention.py``, ``torch.compile`` on CUDA sees the Triton kernels themselves.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._checks.features import NO_FEATURES, AttnFeatures, resolve
from ..custom_mask import mask_indptr
from .launch import Launch, capability_of, run

_TARGET_PROGRAMS = 256  # decode: aim for about this many (sequence, KV head, split) programs (~2 per SM on H100/H200)
_MERGE_VALUES = 4096  # decode merge: partial-output values per step (32 fp32 registers a thread at 4 warps)


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # saturates to +-1 without inf/inf


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn bit patterns (uint8) -> fp32, exactly (as ``t.view(torch.float8_e4m3fn).float()``).

    Decoded with integer ops: 4 exponent bits (bias 7), 3 mantissa bits, subnormals for exponent 0, NaN for
    ``S.1111.111``; no infinities in e4m3fn.
    """
    bits = b.to(tl.int32)
    exp = (bits >> 3) & 0xF
    mant = (bits & 0x7).to(tl.float32)
    pow2 = ((tl.maximum(exp, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 10) = 2^(exp - 7) / 8
    x = tl.where(exp == 0, mant * 0.001953125, (mant + 8.0) * pow2)  # subnormal: mant * 2^-9
    x = tl.where((exp == 15) & (mant == 7.0), float("nan"), x)
    return tl.where((bits & 0x80) != 0, -x, x)


@triton.jit
def _load_kv(cache_ptr, bt_row_ptr, n0, offs_n, in_seq, block_size, s_p, s_b, s_h, s_d, kv_head, offs_d, dim,
             scale_ptr, IS_FP8: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_D]`` tile of logical positions ``n0 + offs_n`` of one KV head (0 where ``~in_seq``).

    ``n0`` is an int64 position (lengths reach 2^31 - 1: int32 positions wrapped); the block index and row
    of each lane come from one int64 division of ``n0`` and int32 arithmetic on the lanes' small offsets.
    ``scale_ptr`` (fp8 caches) points to a contiguous ``[H_kv]`` float32 scale (the launcher expands a ``[1]`` one).
    """
    blk0 = n0 // block_size
    rel = (n0 - blk0 * block_size).to(tl.int32) + offs_n  # < block_size + BLOCK_N
    blk = tl.load(bt_row_ptr + blk0 + rel // block_size, mask=in_seq, other=0).to(tl.int64)
    off = blk[:, None] * s_p + (rel % block_size)[:, None] * s_b + kv_head * s_h + offs_d[None, :] * s_d
    mask = in_seq[:, None] & (offs_d[None, :] < dim)
    if IS_FP8:  # cache_ptr is the cache viewed as uint8: decode e4m3 bits (no fp8 hardware needed, pre-sm89 too)
        x = e4m3_to_f32(tl.load(cache_ptr + off, mask=mask, other=0)) * tl.load(scale_ptr + kv_head)
    else:
        x = tl.load(cache_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _lane(x, n0, BLOCK_N: tl.constexpr):
    """int64 position(s) ``x`` as an int32 lane offset from ``n0``, clamped into ``[-1, BLOCK_N]`` (every lane
    compare keeps its result)."""
    return tl.minimum(tl.maximum(x - n0, -1), BLOCK_N).to(tl.int32)


@triton.jit
def _scores(q, k, n0, offs_n, pos, kv_len, window_left, softcap, slope, window_right,
            CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PREC: tl.constexpr,
            HAS_ALIBI: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False, BLOCK_N: tl.constexpr = 16,
            mask_ptr=None, mask_row=None, first_new=0, q_len=0, mask_lim=0, HAS_MASK: tl.constexpr = False,
            MASK_PACKED: tl.constexpr = False):
    """``softcap(q @ k^T)`` (``- slope * |pos - j|`` with ALiBi) with invisible keys at ``-inf`` (softcap first,
    then the bias, then masking, as docs/semantics.md §4 and docs/attention_features.md). Keys are positions
    ``n0 + offs_n`` (``n0``, ``pos``, ``kv_len``: int64); the masks compare int32 lane offsets."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if HAS_ALIBI:
        s -= slope[:, None] * tl.abs((pos - n0).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :])
    vis = (offs_n < _lane(kv_len, n0, BLOCK_N))[None, :]
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= _lane(pos, n0, BLOCK_N)[:, None])
    if HAS_RIGHT:
        vis = vis & (offs_n[None, :] <= _lane(pos + window_right, n0, BLOCK_N)[:, None])
    if HAS_WINDOW:
        vis = vis & (offs_n[None, :] >= _lane(pos - window_left, n0, BLOCK_N)[:, None])
    if HAS_MASK:
        vis = vis & _mask_bits(mask_ptr, mask_row, n0 - first_new + offs_n, q_len, mask_lim, MASK_PACKED)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _mask_bits(mask_ptr, mask_row, key, q_len, mask_lim, MASK_PACKED: tl.constexpr):
    """``[rows, BLOCK_N]`` visibility of keys ``key`` (int64 offsets from the sequence's first new key) under a
    custom mask (docs/tree-mask.md): keys before the new rows (``key < 0``) are visible, new key ``c`` is element
    (with ``MASK_PACKED``: little-endian bit) ``mask_row + c`` of the mask. Reads stay in ``[0, mask_lim)`` (the
    mask's elements or bits), so a mask of the wrong length never reads out of bounds."""
    idx = mask_row[:, None] + key[None, :]
    ok = ((key >= 0) & (key < q_len))[None, :] & (idx < mask_lim) & (idx >= 0)
    if MASK_PACKED:
        byte = tl.load(mask_ptr + (idx >> 3), mask=ok, other=0).to(tl.int32)
        bit = (byte >> (idx & 7).to(tl.int32)) & 1
    else:
        bit = tl.load(mask_ptr + idx, mask=ok, other=0).to(tl.int32)
    return (key < 0)[None, :] | (bit != 0)


@triton.jit
def _rope(x, x_partner, position, offs_d, head_dim, rope_coef, rope_inv_scale):
    """``x [R, BLOCK_D]`` turned GPT-NeoX style (pairs ``(e, e + D/2)``; ``x_partner`` holds each column's pair)
    by ``position [R]`` (fp32 angles ``position / rope_scale * theta ** (-2i / D)``, as FlashInfer's ROPE_LLAMA;
    ``rope_coef = -2 log2(theta) / D``)."""
    half = head_dim // 2
    i = tl.where(offs_d < half, offs_d, offs_d - half).to(tl.float32)
    ang = position.to(tl.float32)[:, None] * (tl.exp2(i * rope_coef) * rope_inv_scale)[None, :]
    sin, cos = _sincos(ang)
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    return x * cos + sign * x_partner * sin


@triton.jit
def _sincos(x):
    """``(sin(x), cos(x))`` of fp32 ``x`` to about 1e-7, in FMAs only: Cody-Waite reduction by pi/2 (three-part
    constant, exact with ``fma`` far beyond the 128K-token angles RoPE produces) and Cephes' single-precision
    polynomials on [-pi/4, pi/4]. ``tl.sin``/``tl.cos`` inline libdevice's Payne-Hanek path for huge arguments (a
    local-memory array and ~100 registers per call site), which made every RoPE kernel spill."""
    j = tl.floor(x * 0.6366197723675814 + 0.5)
    r = tl.fma(j, -1.5703125, x)
    r = tl.fma(j, -4.837512969970703125e-4, r)
    r = tl.fma(j, -7.549789954891882e-8, r)
    r2 = r * r
    s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    quad = j.to(tl.int32) & 3
    sin = tl.where((quad & 1) == 0, s, c)
    cos = tl.where((quad & 1) == 0, c, s)
    sin = tl.where((quad & 2) == 0, sin, -sin)
    cos = tl.where(((quad + 1) & 2) == 0, cos, -cos)
    return sin, cos


@triton.jit
def _partner(offs_d, head_dim):
    """The column each column pairs with under RoPE (padding columns keep their own index: masked)."""
    half = head_dim // 2
    return tl.where(offs_d < half, offs_d + half, tl.where(offs_d < head_dim, offs_d - half, offs_d))


@triton.jit
def _online_update(s, v, m_i, l_i, acc, PREC: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_tiles(
    m_i, l_i, acc, q, lo, hi, lim, pos, start, slope, window_left, window_right, softcap,
    k_ptr, v_ptr, bt_row, block_size, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, kv_head,
    offs_d, part_d, offs_dv, head_dim, head_dim_v, k_scale_ptr, v_scale_ptr, rope_coef, rope_inv_scale,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_ROPE: tl.constexpr, IS_FP8: tl.constexpr, PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, mask_ptr=None, mask_row=None, first_new=0, q_len=0, mask_lim=0,
    HAS_MASK: tl.constexpr = False, MASK_PACKED: tl.constexpr = False,
):
    """The KV-tile loop of every kernel: keys ``[lo, hi)`` (int64 positions; ``lim``: one past the last readable row)
    of one KV head, ``BLOCK_N`` at a time, read through the block table (``_load_kv``), turned by RoPE at read time
    (positions counted from ``start``), scored (``_scores``; with ``HAS_MASK`` the custom mask among the new keys,
    ``_mask_bits``) and folded into the online softmax ``(m_i, l_i, acc)``, which it returns."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        in_seq = offs_n < _lane(lim, n0, BLOCK_N)
        k = _load_kv(k_ptr, bt_row, n0, offs_n, in_seq, block_size, s_kp, s_kb, s_kh, s_kd, kv_head, offs_d,
                     head_dim, k_scale_ptr, IS_FP8)
        if HAS_ROPE:
            k_pair = _load_kv(k_ptr, bt_row, n0, offs_n, in_seq, block_size, s_kp, s_kb, s_kh, s_kd, kv_head, part_d,
                              head_dim, k_scale_ptr, IS_FP8)
            k = _rope(k, k_pair, n0 - start + offs_n, offs_d, head_dim, rope_coef, rope_inv_scale)
        v = _load_kv(v_ptr, bt_row, n0, offs_n, in_seq, block_size, s_vp, s_vb, s_vh, s_vd, kv_head, offs_dv,
                     head_dim_v, v_scale_ptr, IS_FP8)
        s = _scores(q, k, n0, offs_n, pos, lim, window_left, softcap, slope, window_right, CAUSAL, HAS_WINDOW,
                    HAS_SOFTCAP, PREC, HAS_ALIBI, HAS_RIGHT, BLOCK_N, mask_ptr, mask_row, first_new, q_len,
                    mask_lim, HAS_MASK, MASK_PACKED)
        m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, PREC)
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, k_scale_ptr, v_scale_ptr, part_o_ptr, part_lse_ptr,
    s_qt, s_qh, s_qd, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, s_bt,
    num_splits, block_size, capacity, group, head_dim, head_dim_v, tokens_per_split,
    scale, softcap, window_left,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IS_FP8: tl.constexpr,
    PREC: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    alibi_ptr=None, s_ab=0, leftpad_ptr=None, sink_tokens=0, rope_coef=0.0, rope_inv_scale=1.0,
    HAS_ALIBI: tl.constexpr = False, HAS_LEFTPAD: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False,
    HAS_ROPE: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    kv_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int64), capacity)  # int64 positions (lengths reach 2^31 - 1)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    heads = kv_head * group + offs_g
    q_mask = (offs_g < group) & (offs_g * 0 + q_len > 0)  # (vector & scalar-bool masks trip the interpreter)
    q_off = q_ptr + q_start * s_qt + heads[:, None] * s_qh
    q_msk = q_mask[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_off + offs_d[None, :] * s_qd, mask=q_msk, other=0.0).to(tl.float32) * scale
    pos = tl.full([BLOCK_G], 0, tl.int64) + (kv_len - 1)  # the single query sits at the last position (causal no-op)
    start = kv_len * 0
    if HAS_LEFTPAD:
        start = tl.maximum(tl.load(leftpad_ptr + b).to(tl.int64), 0)
    slope = tl.zeros([BLOCK_G], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b * s_ab + heads, mask=offs_g < group, other=0.0)

    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, kv_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, kv_len - 1 - window_left)
    if HAS_LEFTPAD:
        lo = tl.maximum(lo, start)
    bt_row = bt_ptr + b * s_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    part_d = _partner(offs_d, head_dim)  # (RoPE's column pairs; unused without it)
    if HAS_ROPE:
        q_pair = tl.load(q_off + part_d[None, :] * s_qd, mask=q_msk & (part_d[None, :] < head_dim),
                         other=0.0).to(tl.float32) * scale
    if HAS_SINK_TOKENS:  # StreamingLLM: split 0 also reads the sink rows [start, start + sink_tokens)
        sink_end = start + sink_tokens
        lo = tl.maximum(lo, sink_end)
        s_hi = tl.where((split == 0) & (q_len > 0), tl.minimum(sink_end, kv_len), start)
        q_s = q
        if HAS_ROPE:  # the kept keys take contiguous positions: the query turns at pos - gap for the sinks
            gap = tl.maximum(kv_len - 1 - window_left - sink_end, 0)
            q_s = _rope(q, q_pair, pos - start - gap, offs_d, head_dim, rope_coef, rope_inv_scale)
        m_i, l_i, acc = _attend_tiles(
            m_i, l_i, acc, q_s, start, s_hi, s_hi, pos, start, slope, window_left, 0, softcap,
            k_ptr, v_ptr, bt_row, block_size, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, kv_head,
            offs_d, part_d, offs_dv, head_dim, head_dim_v, k_scale_ptr, v_scale_ptr, rope_coef, rope_inv_scale,
            False, False, False, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, IS_FP8, PREC, BLOCK_N)
    if HAS_ROPE:
        q = _rope(q, q_pair, pos - start, offs_d, head_dim, rope_coef, rope_inv_scale)
    hi = tl.where(q_len > 0, hi, lo)
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, lo, hi, hi, pos, start, slope, window_left, 0, softcap,
        k_ptr, v_ptr, bt_row, block_size, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, kv_head,
        offs_d, part_d, offs_dv, head_dim, head_dim_v, k_scale_ptr, v_scale_ptr, rope_coef, rope_inv_scale,
        False, HAS_WINDOW, False, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, IS_FP8, PREC, BLOCK_N)

    has = (l_i > 0) | (l_i != l_i)  # NaN: a visible key's NaN score (exp(NaN) joined l): the row is NaN, as SDPA
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    row = (b * group * tl.num_programs(1) + heads) * num_splits + split  # part_* are [B, H_q, num_splits, (D_v)]
    g_ok = offs_g < group
    tl.store(part_lse_ptr + row, lse, mask=g_ok)
    tl.store(part_o_ptr + row[:, None] * head_dim_v + offs_dv[None, :], o,
             mask=g_ok[:, None] & (offs_dv[None, :] < head_dim_v))


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, cu_q_ptr, out_ptr, lse_ptr,
    s_ot, s_oh, s_od, s_lh, num_splits, head_dim_v,
    HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (sequence, query head): ``softmax``-weighted sum of the splits' partial outputs (and the
    sink's weight in the denominator), read ``BLOCK_S`` splits at a time with an online max/rescale, so the
    registers hold one ``[BLOCK_S, BLOCK_DV]`` tile whatever ``num_splits`` is (128K contexts: hundreds of
    splits; loading them all at once spilled up to 6 KB per thread on sm_80)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    base = (b * tl.num_programs(1) + head) * num_splits
    # the running max starts at the sink (weight exp(sink - m)), so one chunk computes what a single pass would
    m = tl.full([], float("-inf"), tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head).to(tl.float32)
    den = tl.exp(m - tl.where(m == float("-inf"), 0.0, m))  # 1 with a finite sink, else 0
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        split = s0 + offs_s
        row = base + split
        lse_s = tl.load(part_lse_ptr + row, mask=split < num_splits, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        o_s = tl.load(part_o_ptr + row[:, None] * head_dim_v + offs_dv[None, :],
                      mask=(split[:, None] < num_splits) & (offs_dv[None, :] < head_dim_v), other=0.0)
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    has = (den > 0) | (den != den)  # a NaN split (tl.max may drop the NaN; exp(NaN) joins den): NaN out, as SDPA
    o = acc / tl.where(has, den, 1.0)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, den, 1.0)), float("-inf"))
    tl.store(out_ptr + q_start * s_ot + head * s_oh + offs_dv * s_od, o.to(out_ptr.dtype.element_ty),
             mask=(offs_dv < head_dim_v) & (offs_dv * 0 + q_len > 0))
    tl.store(lse_ptr + head * s_lh + q_start, lse, mask=q_len > 0)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, lse_ptr,
    s_qt, s_qh, s_qd, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, s_bt, s_ot, s_oh, s_od, s_lh,
    block_size, capacity, group, head_dim, head_dim_v,
    scale, softcap, window_left,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    IS_FP8: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    alibi_ptr=None, s_ab=0, leftpad_ptr=None, sink_tokens=0, rope_coef=0.0, rope_inv_scale=1.0, window_right=-1,
    HAS_ALIBI: tl.constexpr = False, HAS_LEFTPAD: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False,
    HAS_ROPE: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    mask_ptr=None, mask_off_ptr=None, mask_lim=0, HAS_MASK: tl.constexpr = False, MASK_PACKED: tl.constexpr = False,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2).to(tl.int64)
    kv_len = tl.load(seq_lens_ptr + b).to(tl.int64)  # int64 positions (lengths reach 2^31 - 1)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    t_loc = tile * BLOCK_T + offs_m // BLOCK_G  # query index within the sequence
    g = offs_m % BLOCK_G
    row_ok = (t_loc < q_len) & (g < group)
    heads = kv_head * group + g
    tok = q_start + t_loc.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_off = q_ptr + tok[:, None] * s_qt + heads[:, None] * s_qh
    q_msk = row_ok[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_off + offs_d[None, :] * s_qd, mask=q_msk, other=0.0).to(tl.float32) * scale
    pos = kv_len - q_len + t_loc
    start = kv_len * 0
    if HAS_LEFTPAD:
        start = tl.maximum(tl.load(leftpad_ptr + b).to(tl.int64), 0)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b * s_ab + heads, mask=g < group, other=0.0)
    first_new = kv_len - q_len  # custom mask: the first new key; row i of the block starts at mask_off[b] + i * q_len
    mask_row = t_loc.to(tl.int64)
    if HAS_MASK:
        mask_row = tl.load(mask_off_ptr + b) + t_loc.to(tl.int64) * q_len

    first = kv_len - q_len + tile * BLOCK_T  # position of the tile's first query
    last = kv_len - q_len + tl.minimum(tile * BLOCK_T + BLOCK_T, q_len) - 1
    kv_lim = tl.minimum(kv_len, capacity)
    lo = kv_lim * 0
    hi = kv_lim
    if CAUSAL:
        hi = tl.minimum(hi, last + 1)
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(last + window_right + 1, 0))
    if HAS_WINDOW:
        lo = tl.maximum(first - window_left, 0)
    if HAS_LEFTPAD:
        lo = tl.maximum(lo, start)
    live = tile * BLOCK_T < q_len  # programs past this sequence's queries do no work
    bt_row = bt_ptr + b * s_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    part_d = _partner(offs_d, head_dim)  # (RoPE's column pairs; unused without it)
    if HAS_ROPE:
        q_pair = tl.load(q_off + part_d[None, :] * s_qd, mask=q_msk & (part_d[None, :] < head_dim),
                         other=0.0).to(tl.float32) * scale
    if HAS_SINK_TOKENS:  # StreamingLLM: the sink rows [start, start + sink_tokens) in a loop of their own
        sink_end = start + sink_tokens
        lo = tl.maximum(lo, sink_end)
        s_hi = tl.where(live, tl.minimum(sink_end, hi), start)
        q_s = q
        if HAS_ROPE:  # the kept keys take contiguous positions: each query turns at pos - gap for the sinks
            gap = tl.maximum(pos - window_left - sink_end, 0)
            q_s = _rope(q, q_pair, pos - start - gap, offs_d, head_dim, rope_coef, rope_inv_scale)
        m_i, l_i, acc = _attend_tiles(
            m_i, l_i, acc, q_s, start, s_hi, s_hi, pos, start, slope, window_left, window_right, softcap,
            k_ptr, v_ptr, bt_row, block_size, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, kv_head,
            offs_d, part_d, offs_dv, head_dim, head_dim_v, k_scale_ptr, v_scale_ptr, rope_coef, rope_inv_scale,
            CAUSAL, False, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, IS_FP8, PREC, BLOCK_N,
            mask_ptr, mask_row, first_new, q_len, mask_lim, HAS_MASK, MASK_PACKED)
    if HAS_ROPE:
        q = _rope(q, q_pair, pos - start, offs_d, head_dim, rope_coef, rope_inv_scale)
    hi = tl.where(live, hi, lo)
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, lo, hi, kv_lim, pos, start, slope, window_left, window_right, softcap,
        k_ptr, v_ptr, bt_row, block_size, s_kp, s_kb, s_kh, s_kd, s_vp, s_vb, s_vh, s_vd, kv_head,
        offs_d, part_d, offs_dv, head_dim, head_dim_v, k_scale_ptr, v_scale_ptr, rope_coef, rope_inv_scale,
        CAUSAL, HAS_WINDOW, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, IS_FP8, PREC, BLOCK_N,
        mask_ptr, mask_row, first_new, q_len, mask_lim, HAS_MASK, MASK_PACKED)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=g < group, other=0.0)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    has = (l_i > 0) | (l_i != l_i)  # NaN: a visible key's NaN score (exp(NaN) joined l): the row is NaN, as SDPA
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + tok[:, None] * s_ot + heads[:, None] * s_oh + offs_dv[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v))
    tl.store(lse_ptr + heads * s_lh + tok, lse, mask=row_ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    features: AttnFeatures = NO_FEATURES,
    *,
    force_prefill: bool = False,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels on validated arguments (see ``kvops.paged_attention``); returns ``(out, lse)``.

    ``features``: the validator's record of the attention features (``kvops/_checks/features.py``).
    ``out [T_q, H_q, D_v]`` in q's dtype, ``lse [H_q, T_q]`` fp32 (natural log, sinks included). Batches with
    ``max_seqlen_q == 1`` use split-KV decode + merge (``num_splits`` defaults to a heuristic filling about
    ``_TARGET_PROGRAMS`` programs); others, or ``force_prefill=True``, use the prefill kernel. ``block_n`` (KV tile,
    tokens) and ``block_m`` (prefill rows: query tokens x padded group heads) default to :func:`tile_config`'s choice
    for the device. Rows of ``out`` that belong to no sequence (``cu_seqlens_q[-1] < T_q``, e.g. a padded CUDA-graph
    batch) are 0 with LSE ``-inf``.
    """
    launches, out, lse = plan_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left, softcap,
        sinks, k_scale, v_scale, capability_of(q), features, force_prefill=force_prefill, num_splits=num_splits,
        block_n=block_n, block_m=block_m,
    )
    run(launches)
    return out, lse


def merge_splits(num_splits: int, block_dv: int) -> int:
    """``BLOCK_S``: splits ``_decode_merge_kernel`` reads per step, at most ``_MERGE_VALUES // block_dv`` (the
    partial outputs of all of them are live in registers at once)."""
    return min(_pow2(num_splits, 1), max(1, _MERGE_VALUES // block_dv))


def tile_config(kind: str, block_d: int, block_dv: int, operands: str, capability: tuple[int, int],
                rope: bool = False, group: int = 1, mask: bool = False) -> dict:
    """``block_n`` (KV tokens per tile), ``block_m`` (prefill rows), ``num_warps`` and ``num_stages`` of one kernel.

    ``kind`` is "decode" or "prefill", ``block_d``/``block_dv`` the padded head dims, ``operands`` what ``tl.dot``
    multiplies: "fp32" (fp32 inputs, IEEE products on CUDA cores), "fp8" (e4m3 bits decoded in registers, TF32) or
    "16bit" (bf16/fp16 converted to fp32, TF32). Every tile is converted to fp32 before the dot, so K/V tiles cost 4
    bytes per value in registers and shared memory whatever the cache dtype. Chosen so that no (kernel, head_dim,
    flag) combination spills registers or needs more than 99 KB of shared memory (sm_86/sm_89, the smallest block
    budget of the targets), as checked by ``python benchmarks/gpu_check.py --aot``; two pipeline stages (the K/V
    loads are gathers through ``block_table``, so deeper pipelining only costs shared memory). Prefill tiles: fp32
    16 rows x 16 tokens over 8 warps (32 x 16 at width 256 for GQA ``group`` 3-8 without RoPE: 16 rows of 2
    tokens x 8 heads were held to 64 registers by ptxas for sm_80 and spilled 4 B, 4 x 4 on sm_100; 32 rows
    spilled for 1 head or with RoPE on sm_90); padded width 256 16 x 32 over 8 warps (16-bit on sm_90 and sm_100: 16 x
    16, as ptxas for them held 16 x 32 at 80 registers over 8 warps, sm_90's at 128 over 4, and spilled 4-12 B); 16-bit at width 128 32 x 32 over 8
    warps (64 x 32 over 4 warps took 255 registers with causal + window + softcap + sinks and spilled 20-32 B on
    sm_80; over 8 warps ptxas for sm_100 capped it at 128 registers and spilled 4-8 B), 64 x 32 over 4 warps at
    width 64; fp8 32 x 32 over 4 warps. Decode: 16 rows over 4 warps (8 for fp32, but 4 with RoPE at width 64:
    GQA 4:1 spilled 436 B on sm_86 over 4 at width 128, 4 B at 255 registers on sm_90 at width 64, where 8 warps
    take 40-57, ALiBi at width 256 G=8 16 B at 128 registers on sm_86/sm_89; with RoPE at width 64 8 warps spilled
    12 B on sm_100; 8 for fp8 up to width 128 on sm_90 and sm_100, where ptxas held 4 warps at 80 registers
    at width 64 (both) and 128 at width 128 (sm_90) and spilled 8-28 B; 8 for bf16/fp16 at width 128 on sm_100:
    96 registers and 4-8 B spills over 4; one stage for bf16/fp16 at width 64 on sm_100, where two were held at 72
    registers and spilled 20 B; 16-bit prefill at width 64 over 8 warps on sm_100: over 4, 96 registers and 4 B
    with every flag). With ``rope`` (RoPE at
    read time) one stage: K and its rotation partner are turned in registers before the dot, and pipelining both
    loads through shared memory kept two K tiles and their copies live (fp32 D=256 prefill: 304 B spills at two
    stages, none at one); at padded head dims >= 128 also 8 warps and smaller tiles (decode: at most 32 KV tokens;
    prefill with 16-bit or fp8 operands: 16 rows x 32 tokens, 16 x 16 for fp8 at 256), which the sink-token loop
    with its second turned query needs (up to 900 B spills on sm_80 before); fp8 decode on sm_100 16-token tiles
    (16 warps at 256). With a custom ``mask`` (docs/tree-mask.md) prefill runs over at least 8 warps: each tile's
    int64 mask indices over 4 warps took fp8 at width 128 (GQA 7:1) to 255 registers and 8 B spills on sm_90; at
    padded width 256 16-token tiles (Triton 3.6 for sm_90: bf16 16 x 32 with RoPE and every flag, 156 B spills).
    """
    width = max(block_d, block_dv)
    cfg = _tiles(kind, width, operands)
    if kind == "prefill" and operands == "fp32" and width >= 256 and 2 < group <= 8 and not rope:
        cfg["block_m"] = 32
    if kind == "prefill" and operands == "16bit" and width >= 256 and capability >= (9, 0):
        # ptxas for sm_90 and sm_100 held 32 tokens at 80 registers (8 warps; 128 over 4): 4-12 B spills
        cfg["block_n"] = 16
    if kind == "decode" and operands == "fp8" and width <= 128 and capability >= (9, 0):
        # over 4 warps ptxas for sm_90 and sm_100 held 80 registers (D=64, 28 B spills), for sm_90 128 (D=80, 8 B)
        cfg["num_warps"] = 8
    if kind == "decode" and operands == "16bit" and width == 128 and capability >= (10, 0):
        cfg["num_warps"] = 8  # over 4 ptxas-blackwell held 96 registers: 4-8 B spills
    if kind == "prefill" and operands == "16bit" and width == 64 and capability >= (10, 0):
        cfg["num_warps"] = 8  # over 4 ptxas-blackwell held 96 registers with every flag: 4 B spills
    if kind == "decode" and operands == "16bit" and width == 64 and capability >= (10, 0):
        # two stages: ptxas-blackwell, under Triton's --regAllocOptLevel=2, held 72 registers and spilled 20 B
        cfg["num_stages"] = 1
    if rope:
        cfg["num_stages"] = 1
        if width >= 128 and kind == "decode":
            cfg.update(block_n=min(cfg["block_n"], 32), num_warps=8)
            if operands == "fp8" and capability >= (10, 0):  # ptxas-blackwell: 8 B spills at 255 registers
                cfg.update(block_n=16, num_warps=16 if width >= 256 else 8)
        elif kind == "decode" and operands == "fp32":  # width 64: over 8 warps 128 registers, 12 B spills (sm_100)
            cfg["num_warps"] = 4
        elif width >= 128 and operands != "fp32":
            cfg.update(block_n=16 if operands == "fp8" and width >= 256 else 32, block_m=16, num_warps=8)
    if mask and kind == "prefill":
        cfg["num_warps"] = max(cfg["num_warps"], 8)
        if width >= 256:  # Triton 3.6's ptxas for sm_90: bf16 with RoPE, every flag and a packed mask, 16 x 32 over
            cfg["block_n"] = 16  # 8 warps, took 255 registers and spilled 156 B
    return cfg


def _tiles(kind: str, width: int, operands: str) -> dict:
    if kind == "decode":  # 16 rows (the padded query heads of one KV head)
        if operands == "fp8":  # the e4m3 decode keeps the integer bits and the fp32 values live
            block_n = 32 if width <= 128 else 16
        else:
            block_n = 64 if width <= 64 or (width <= 128 and operands == "16bit") else 32 if width <= 128 else 16
        # fp32 over 8 warps: over 4, GQA 4:1 without flags took 255 registers and spilled 436 B at width 128
        # (sm_86), 4 B at width 64 (sm_90); ALiBi at width 256 with GQA 8:1 128 registers and 16 B (sm_86/sm_89)
        return dict(block_n=block_n, block_m=16, num_warps=8 if operands == "fp32" else 4, num_stages=2)
    if operands == "fp32":  # IEEE products on CUDA cores hold both operands in registers
        return dict(block_n=16, block_m=16, num_warps=8, num_stages=2)
    if width >= 256:
        return dict(block_n=32, block_m=16, num_warps=8, num_stages=2)
    if operands == "16bit" and width >= 128:  # 64 rows over 4 warps: 255 registers, spills with every flag
        return dict(block_n=32, block_m=32, num_warps=8, num_stages=2)
    block_m = 64 if operands == "16bit" else 32
    return dict(block_n=32, block_m=block_m, num_warps=4, num_stages=2)


def plan_paged_attention(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int, scale: float, causal: bool,
    window_left: int, softcap: float, sinks, k_scale, v_scale, capability: tuple[int, int],
    features: AttnFeatures = NO_FEATURES, *, force_prefill: bool = False, num_splits: int | None = None,
    block_n: int | None = None, block_m: int | None = None,
) -> tuple[list[Launch], torch.Tensor, torch.Tensor]:
    """The launches of :func:`paged_attention` for a device of compute ``capability`` (also run on ``meta`` tensors
    by the ahead-of-time check), with the allocated ``out`` and ``lse``."""
    window_left, features = resolve(window_left, features)  # (no overflow; the validator's record is resolved)
    num_tokens, batch, max_blocks = q.shape[0], block_table.shape[0], block_table.shape[1]
    # sizes that define the kernels specialize under tracing (constexpr tile sizes derive from them)
    num_heads, d = int(q.shape[1]), int(q.shape[2])
    block_size, num_kv_heads, d_v = int(v_cache.shape[1]), int(v_cache.shape[2]), int(v_cache.shape[3])
    group = num_heads // num_kv_heads
    # rows past cu_seqlens_q[-1] belong to no sequence and are never stored by the kernels: 0 and LSE -inf
    out = torch.zeros((num_tokens, num_heads, d_v), dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or batch == 0:
        return [], out, lse
    capacity = max_blocks * block_size
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    # The kernels index the small metadata tensors as contiguous: make them so (never the caches, which keep their
    # strides); fp8 scales become contiguous [H_kv] so K and V may use different scale shapes.
    block_table, seq_lens, cu_seqlens_q = block_table.contiguous(), seq_lens.contiguous(), cu_seqlens_q.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    k_sc = k_scale.expand(num_kv_heads).contiguous() if is_fp8 else seq_lens  # placeholders when not fp8
    v_sc = v_scale.expand(num_kv_heads).contiguous() if is_fp8 else seq_lens
    if is_fp8:  # the kernels decode e4m3 from bytes: same strides, a view, no copy
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    block_g = _pow2(group)
    block_d, block_dv = _pow2(d), _pow2(d_v)
    decode = max_seqlen_q == 1 and not force_prefill and features.mask() is None  # a mask: the prefill kernel
    causal = causal and features.mask() is None  # a custom mask replaces the causal bound (docs/tree-mask.md)
    operands = "fp8" if is_fp8 else "fp32" if q.dtype == torch.float32 else "16bit"
    cfg = tile_config("decode" if decode else "prefill", block_d, block_dv, operands, capability,
                      rope=features.rope_theta is not None, group=group, mask=features.mask() is not None)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_m = cfg["block_m"] if block_m is None else block_m
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], wrap=True)
    common = dict(
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, IS_FP8=is_fp8, PREC=prec,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
    )
    feats = _feature_args(features, window_left, causal, not decode, num_heads, d, cu_seqlens_q)
    if decode:
        if num_splits is None:
            fill = triton.cdiv(_TARGET_PROGRAMS, batch * num_kv_heads)
            num_splits = max(1, min(triton.cdiv(capacity, block_n), fill))
        # grid sizes: concrete ints (under dynamic shapes this guards on their values, not on every batch size)
        tokens_per_split = int(triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n)
        num_splits = int(max(1, triton.cdiv(capacity, tokens_per_split)))
        part_o = torch.empty((batch, num_heads, num_splits, d_v), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        split = Launch(_decode_split_kernel, (batch, num_kv_heads, num_splits), (
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_sc, v_sc, part_o, part_lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
            num_splits, block_size, capacity, group, d, d_v, tokens_per_split,
            scale, softcap, window_left), {**common, **feats}, **opts)
        merge = Launch(_decode_merge_kernel, (batch, num_heads), (
            part_o, part_lse, sinks if sinks is not None else part_lse, cu_seqlens_q, out, lse,
            *out.stride(), lse.stride(0), num_splits, d_v),
            dict(HAS_SINKS=sinks is not None, BLOCK_S=merge_splits(num_splits, block_dv), BLOCK_DV=block_dv),
            wrap=True)
        return [split, merge], out, lse
    block_g = triton.next_power_of_2(group)  # prefill rows are (token, head) pairs: only BLOCK_T * BLOCK_G >= 16
    block_t = max(block_m // block_g, triton.cdiv(16, block_g), 1)
    common["BLOCK_G"] = block_g
    prefill = Launch(_prefill_kernel, (triton.cdiv(max_seqlen_q, block_t), batch, num_kv_heads), (
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_sc, v_sc,
        sinks if sinks is not None else q, out, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(), lse.stride(0),
        block_size, capacity, group, d, d_v, scale, softcap, window_left),
        dict(CAUSAL=causal, HAS_SINKS=sinks is not None, BLOCK_T=block_t, **common, **feats), **opts)
    return [prefill], out, lse


def _feature_args(features: AttnFeatures, window_left: int, causal: bool, prefill: bool, num_heads: int,
                  head_dim: int, cu_seqlens_q: torch.Tensor) -> dict:
    """The kernels' arguments and constexpr flags of the attention features (docs/attention_features.md), passed by
    name and only for features in use, so calls without them launch (and compile ahead of time) as before. A right
    window is an argument of the prefill kernel only (a decode query sits at the last position) and only without
    ``causal`` (whose bound, 0, wins). A custom mask (docs/tree-mask.md; calls with one run the prefill kernel)
    goes as bytes (a bool mask viewed as uint8, no copy) with each sequence's first element / bit (``mask_indptr``
    of ``cu_seqlens_q``: torch ops, no host sync)."""
    args = {}
    if prefill and not causal and features.window_right >= 0:
        args.update(window_right=features.window_right, HAS_RIGHT=True)
    if features.alibi_slopes is not None:
        alibi = features.alibi_slopes.contiguous()
        args.update(alibi_ptr=alibi, s_ab=num_heads if alibi.dim() == 2 else 0, HAS_ALIBI=True)
    if features.cache_leftpad is not None:
        args.update(leftpad_ptr=features.cache_leftpad.contiguous(), HAS_LEFTPAD=True)
    if features.sink_tokens > 0 and window_left >= 0:
        args.update(sink_tokens=features.sink_tokens, HAS_SINK_TOKENS=True)
    if features.rope_theta is not None:
        args.update(rope_coef=-2.0 * math.log2(features.rope_theta) / head_dim,
                    rope_inv_scale=1.0 / features.rope_scale, HAS_ROPE=True)
    mask = features.mask()
    if mask is not None:
        packed = features.packed_custom_mask is not None
        bits = 8 if packed else 1  # the kernel counts bits of a packed mask
        args.update(mask_ptr=mask.view(torch.uint8), mask_off_ptr=mask_indptr(cu_seqlens_q, packed)[:-1] * bits,
                    mask_lim=mask.shape[0] * bits, HAS_MASK=True, MASK_PACKED=packed)
    return args
