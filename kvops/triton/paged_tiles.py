"""Triton device functions shared by the ``kvops::paged_attention`` kernels (``paged_decode.py``,
``paged_prefill.py``) and by ``mla.py``: the KV-tile loop ``_attend_tiles`` and what it is made of, i.e. reading a
tile through the block table (``_load_kv``, fp8 via ``e4m3_to_f32``), scores with softcap / ALiBi / causal, window
and custom-mask visibility (``_scores``, ``_lane``, ``_mask_bits``), RoPE at read time (``_rope``, ``_sincos``,
``_partner``) and the online-softmax step (``_online_update``).

The kernels' overview (int64 offsets and positions, fp32 arithmetic, masked loads) and the launcher are in
``kvops/triton/paged_attention.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
