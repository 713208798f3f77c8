"""Triton kernel of (chunked) prefill for ``kvops::paged_attention``: ``_prefill_kernel``, one program per (query
tile, sequence, KV head), for any batch (e.g. chunked prefill mixed with decodes) and for every call with a custom
mask.

The KV-tile loop it runs is in ``paged_tiles.py``; the launch plan and the overview of the kernels are in
``kvops/triton/paged_attention.py``; split-KV decode is in ``paged_decode.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paged_tiles import _attend_tiles, _partner, _rope


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
