"""Triton kernels of split-KV decode for ``kvops::paged_attention`` (batches with ``max_seqlen_q == 1``):
``_decode_split_kernel`` (one program per sequence, KV head and KV split; normalized partial output and LSE) and
``_decode_merge_kernel`` (one program per sequence and query head: combines the splits and the attention sink; also
used by ``mla.py``).

The KV-tile loop they run is in ``paged_tiles.py``; the launch plan (grid, splits, tiles) and the overview of the
kernels are in ``kvops/triton/paged_attention.py``; the prefill kernel is in ``paged_prefill.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paged_tiles import _attend_tiles, _partner, _rope


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
