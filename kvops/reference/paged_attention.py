"""CPU kernel for ``kvops::paged_attention`` (docs/semantics.md §4): vectorized torch, fp32 accumulation.

Layout of the computation. Queries are gathered from the packed ``[T_q, H_q, D]`` into a padded
``[B, H_kv, max_seqlen_q * G, D]`` (``G = H_q // H_kv``, rows ordered (query, group head)), so each (sequence, KV head)
pair is one GEMM and GQA never repeats K/V. K/V are gathered through ``block_table`` one *tile* of positions at a
time into ``[B, N, H_kv, D]`` (one ``index_select`` of whole token rows on the ``[P * block_size, H_kv, D]`` view of
the cache when its block and row dims merge, else a (block, row) gather; the cache is never copied) and folded in
with an online softmax (running max ``m``, sum ``l``, accumulator ``acc``). Memory is bounded by the tile, not the
context: tiles are sized so that one tile's fp32 scores and gathered K/V stay under ``_TILE_BUDGET`` elements. A decode
batch (``max_seqlen_q == 1``, e.g. batch 8 x context 1000) is one tile. The padding costs ``B * max_seqlen_q`` query
rows and the gathers cover the table's capacity (``max_blocks * block_size``) for every sequence: a batch mixing one
long prefill (or one long context) with many short sequences pays for both (callers may split such batches). The
GEMMs loop over the ``H_kv`` KV heads (strided operands, no copies), never over tokens.

Garbage safety without multiplying by masks: positions at or beyond ``seq_len`` (and unused table entries) are
*redirected* to the sequence's position 0 before the gather, so NaN/inf stored in unused slots or unreferenced blocks is
never even read; their scores are set to ``-inf`` with ``torch.where``. A sequence with ``seq_len == 0`` has no
position 0: what its rows gather is never used, because a row with no visible key is set to exactly 0 by ``where``.
A NaN score of a *visible* key (NaN in q or K, or a NaN ALiBi slope) makes the row NaN (output and LSE), as SDPA.

Every loop bound comes from tensor metadata (``max_blocks * block_size`` is the context capacity) and no tensor is read
on the host, so the function traces under ``torch.compile(fullgraph=True)`` and ``make_fx`` without host syncs.
"""

from __future__ import annotations

import torch

from .._checks.features import NO_FEATURES, AttnFeatures, resolve
from ..custom_mask import dense_custom_mask

_TILE_BUDGET = 1 << 22  # fp32 elements of one tile's scores plus its gathered K and V (16 MiB)


def _tiles(batch, rows: int, num_kv_heads: int, d: int, d_v: int, block_size: int, max_blocks):
    """``[(first_block, num_blocks), ...]`` covering the table with tiles that fit ``_TILE_BUDGET``.

    When the whole table fits (decode), there is one tile and ``max_blocks`` stays symbolic under tracing (only the
    inequality is guarded); otherwise the tile loop specializes on the table width.
    """
    fit = _TILE_BUDGET // (batch * block_size * num_kv_heads * (rows + d + d_v))
    if max_blocks <= fit:
        return [(0, max_blocks)]
    nb = max(1, int(fit))
    return [(b0, min(nb, max_blocks - b0)) for b0 in range(0, int(max_blocks), nb)]


def _gather_tokens(cache, blocks, rows, scale):
    """fp32 ``[B, N, H_kv, D]`` of slots ``(blocks, rows)`` (``[B, N]`` each), dequantized for fp8 caches."""
    p, block_size = cache.shape[0], cache.shape[1]
    if p == 1 or block_size == 1 or cache.stride(0) == block_size * cache.stride(1):  # (P, block_size) merge: a view
        flat = cache.view(p * block_size, *cache.shape[2:])
        x = flat.index_select(0, (blocks * block_size + rows).flatten()).view(*blocks.shape, *cache.shape[2:])
    else:  # e.g. K/V interleaved per block ([P, 2, block_size, H_kv, D] allocation)
        x = cache[blocks, rows]
    x = x.to(torch.float32)
    if scale is not None:
        x = x * scale.view(1, 1, -1, 1)
    return x


def _per_kv_head_matmul(a, b, num_kv_heads: int):
    """``a [B, H_kv, R, K] @ b[:, :, h] [B, K, C]`` for every KV head ``h`` -> ``[B, H_kv, R, C]``.

    ``b`` is ``[B, K, H_kv, C]`` (the gathered token-major layout); its per-head slices are strided matrices that the
    GEMM reads in place, so K/V are never transposed into a head-major copy.
    """
    return torch.stack([torch.matmul(a[:, h], b[:, :, h]) for h in range(num_kv_heads)], dim=1)


def rope_frequencies(head_dim: int, theta: float, scale: float, device) -> torch.Tensor:
    """fp64 ``[head_dim / 2]`` rotation frequencies of Llama RoPE (FlashInfer's ``ROPE_LLAMA``): ``theta ** (-2i / D)
    / scale`` (``scale`` interpolates positions linearly: position ``p`` turns as ``p / scale``)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return theta ** (-2.0 * i / head_dim) / scale


def rotate_half(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` fp32 rotated GPT-NeoX style (pairs ``(j, j + D/2)``) by ``positions`` (broadcast against
    ``x[..., 0]``); angles in fp64, so a reference at large positions is not limited by fp32 angles."""
    ang = positions.to(torch.float64)[..., None] * freqs
    cos, sin = torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _heads_major(x, batch, m_q, num_kv_heads, group, d):
    """``[B, M, H_q, D]`` -> ``[B, H_kv, M * G, D]`` (rows ordered (query, group head))."""
    x = x.view(batch, m_q, num_kv_heads, group, d).permute(0, 2, 1, 3, 4)
    return x.reshape(batch, num_kv_heads, m_q * group, d)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention on validated arguments (see ``kvops.paged_attention``); returns ``(out, lse)``.

    ``out [T_q, H_q, D_v]`` in q's dtype, ``lse [H_q, T_q]`` fp32 (natural log, sinks included; ``-inf`` for a query
    with no visible key and no sink). The features of docs/attention_features.md (ALiBi, a right window, a per-sequence
    first row ``cache_leftpad``, StreamingLLM sink tokens, RoPE at read time) are masks, biases and rotations of the
    same tiles; ``features`` is the validator's record of them (``kvops/_checks/features.py``).
    """
    window_left, features = resolve(window_left, features)  # (no overflow; the validator's record is resolved)
    alibi_slopes, window_right, cache_leftpad, sink_tokens, rope_theta, rope_scale = features[:6]
    num_tokens, batch, max_blocks = q.shape[0], block_table.shape[0], block_table.shape[1]
    # sizes that define the computation (heads, head_dim, block_size) specialize under tracing; token counts, batch and
    # table width stay symbolic
    num_heads, d = int(q.shape[1]), int(q.shape[2])
    block_size, num_kv_heads, d_v = int(v_cache.shape[1]), int(v_cache.shape[2]), int(v_cache.shape[3])
    group = num_heads // num_kv_heads
    device = q.device
    if num_tokens == 0 or batch == 0:
        return (q.new_zeros(num_tokens, num_heads, d_v),
                torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=device))
    m_q = max_seqlen_q
    rows = m_q * group

    # padded queries: row (b, i) <- packed token cu_seqlens_q[b] + i (clamped; rows i >= q_len are never stored back)
    starts = cu_seqlens_q[:-1].long()
    q_lens = cu_seqlens_q[1:].long() - starts
    qi = torch.arange(m_q, device=device)
    src = (starts[:, None] + qi).clamp(0, num_tokens - 1)  # [B, M]
    qp = q[src].to(torch.float32) * scale  # [B, M, H_q, D]
    kv_len = seq_lens.long()
    pos = (kv_len - q_lens)[:, None] + qi  # [B, M] row of query i of sequence b
    start = torch.zeros_like(kv_len) if cache_leftpad is None else cache_leftpad.long().clamp_min(0)  # first key row
    sink_end = start + sink_tokens
    rope = rope_theta is not None
    # StreamingLLM with RoPE at read time: the kept keys take contiguous positions, so a sink key is seen from a
    # query shifted down by the gap between the sinks and the query's window (window keys keep true distances)
    gap = (pos - window_left - sink_end[:, None]).clamp_min(0) if sink_tokens > 0 and window_left >= 0 else None
    q_sink = None
    if rope:
        freqs = rope_frequencies(d, rope_theta, rope_scale, device)
        q_pos = pos - start[:, None]
        if gap is not None:
            q_sink = _heads_major(rotate_half(qp, (q_pos - gap)[:, :, None], freqs), batch, m_q, num_kv_heads, group, d)
        qp = rotate_half(qp, q_pos[:, :, None], freqs)
    qp = _heads_major(qp, batch, m_q, num_kv_heads, group, d)
    slopes = None
    if alibi_slopes is not None:  # [B, H_kv, 1, G, 1]: bias -slope * |pos - j| (FlashAttention's ALiBi)
        slopes = alibi_slopes.expand(batch, num_heads).reshape(batch, num_kv_heads, 1, group, 1)
    right = 0 if causal else window_right  # keys j <= pos + right are visible (-1: no right bound)
    new_keys = None
    if features.mask() is not None:  # docs/tree-mask.md: the mask replaces the causal rule among the new keys
        new_keys = dense_custom_mask(features.custom_mask, features.packed_custom_mask, cu_seqlens_q, m_q)  # [B, M, M]
        right = -1
    first_pos = (kv_len - q_lens)[:, None]  # the earliest query's row: keys before its window are never read

    m = torch.full((batch, num_kv_heads, rows), float("-inf"), dtype=torch.float32, device=device)
    l = torch.zeros((batch, num_kv_heads, rows), dtype=torch.float32, device=device)
    acc = torch.zeros((batch, num_kv_heads, rows, d_v), dtype=torch.float32, device=device)
    for b0, nbt in _tiles(batch, rows, num_kv_heads, d, d_v, block_size, max_blocks):
        n = nbt * block_size
        kpos = b0 * block_size + torch.arange(n, device=device)  # [N] logical positions of this tile
        in_seq = (kpos < kv_len[:, None]) & (kpos >= start[:, None])  # [B, N]
        read = in_seq  # rows some query can see (others, e.g. evicted blocks between sinks and window: never read)
        if window_left >= 0:
            read = read & ((kpos >= first_pos - window_left) | (kpos < sink_end[:, None]))
        # unread rows are redirected to the sequence's last row (a written key): garbage is never even gathered
        last = (kv_len - 1).clamp_min(0)
        last_block = block_table.gather(1, (last // block_size)[:, None]).long().clamp_min(0)  # [B, 1]
        blocks = torch.where(read, block_table[:, kpos // block_size].long(), last_block)  # [B, N]
        rows_in_block = torch.where(read, kpos % block_size, (last % block_size)[:, None])
        k = _gather_tokens(k_cache, blocks, rows_in_block, k_scale)  # [B, N, H_kv, D]
        v = _gather_tokens(v_cache, blocks, rows_in_block, v_scale)  # [B, N, H_kv, D_v]
        if rope:
            k = rotate_half(k, (kpos - start[:, None])[:, :, None], freqs)

        s = _per_kv_head_matmul(qp, k.transpose(1, 3), num_kv_heads)  # [B, H_kv, M*G, N]
        if q_sink is not None:  # sink keys are scored against the shifted query
            s_sink = _per_kv_head_matmul(q_sink, k.transpose(1, 3), num_kv_heads)
            s = torch.where(kpos < sink_end[:, None, None, None], s_sink, s)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        s = s.view(batch, num_kv_heads, m_q, group, n)
        if slopes is not None:
            s = s - slopes * (pos[:, :, None] - kpos).abs()[:, None, :, None, :]
        visible = read[:, None, :]  # [B, M, N]
        if right >= 0:
            visible = visible & (kpos <= pos[:, :, None] + right)
        if window_left >= 0:
            visible = visible & ((kpos >= pos[:, :, None] - window_left) | (kpos < sink_end[:, None, None]))
        if new_keys is not None:  # key c = j - (seq_len - q_len) >= 0 is new: its mask element decides
            c = kpos - (kv_len - q_lens)[:, None]  # [B, N]
            bit = new_keys.gather(2, c.clamp(0, m_q - 1)[:, None, :].expand(batch, m_q, n))
            visible = visible & ((c < 0)[:, None, :] | bit)
        s = torch.where(visible[:, None, :, None, :], s, float("-inf"))
        s = s.view(batch, num_kv_heads, rows, n)

        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # all-masked rows: avoid -inf - -inf
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + _per_kv_head_matmul(p, v, num_kv_heads)  # [B, H_kv, M*G, D_v]
        m = m_new

    # a visible key's NaN score (NaN in q or K, a NaN ALiBi slope) makes l NaN (exp(NaN) joins every sum after it):
    # such a row is NaN, as SDPA's, never the 0 / -inf of a row with no visible key (docs/semantics.md §4)
    has_keys = (l > 0) | torch.isnan(l)
    if sinks is not None:  # exp(sink_h) joins each head's denominator (gpt-oss); it carries no value
        sink = sinks.view(1, num_kv_heads, 1, group).expand(batch, num_kv_heads, m_q, group).reshape(m.shape)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        l = l * alpha + torch.exp(sink - m_new)
        acc = acc * alpha[..., None]
        m = m_new
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    o = torch.where(has_keys[..., None], acc / torch.where(has_keys, l, 1.0)[..., None], 0.0)
    lse_ok = (l > 0) | torch.isnan(l)
    row_lse = torch.where(lse_ok, m_safe + torch.log(torch.where(lse_ok, l, 1.0)), float("-inf"))

    # unpad: packed token t of sequence b(t) is row i = t - cu_seqlens_q[b(t)]
    t = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(cu_seqlens_q, t.to(cu_seqlens_q.dtype), right=True).long() - 1
    seq = seq.clamp(0, batch - 1)
    i = (t - starts[seq]).clamp(0, m_q - 1)
    o = o.view(batch, num_kv_heads, m_q, group, d_v).permute(0, 2, 1, 3, 4).reshape(batch, m_q, num_heads, d_v)
    row_lse = row_lse.view(batch, num_kv_heads, m_q, group).permute(0, 2, 1, 3).reshape(batch, m_q, num_heads)
    owned = t < cu_seqlens_q[-1]  # rows [cu_seqlens_q[-1], T_q) belong to no sequence: 0 (LSE -inf), never garbage
    out = torch.where(owned[:, None, None], o[seq, i], 0.0).to(q.dtype)
    return out, torch.where(owned[:, None], row_lse[seq, i], float("-inf")).t().contiguous()
