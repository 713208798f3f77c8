"""The oracle of ``kvops.paged_attention``: a plain fp64 reference with every feature (docs/semantics.md §4,
docs/attention_features.md), one sequence and one query at a time, what every kernel (native, composite
``kvops/cpu/paged_attention.py``, Triton) is tested against. Readable, slow, no tiling, no online softmax; tests only
(the runtime never imports it). A new feature of ``AttnFeatures`` (``kvops/_checks/features.py``) is one more keyword
argument of :func:`reference` and its meaning below."""

from __future__ import annotations

import math

import torch

from .custom_mask import custom_mask_offsets, visible


def rope_rotate(x: torch.Tensor, position: float, theta: float, scale: float) -> torch.Tensor:
    """fp64 ``x [..., D]`` rotated GPT-NeoX style (FlashInfer's ROPE_LLAMA) at ``position``."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    ang = position / scale * theta ** (-2.0 * i / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)


def reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, scale=None, causal=True, window_left=-1,
              softcap=0.0, sinks=None, k_scale=None, v_scale=None, alibi_slopes=None, window_right=-1,
              cache_leftpad=None, sink_tokens=0, rope_theta=None, rope_scale=1.0, custom_mask=None,
              packed_custom_mask=None):
    """``(out [T, H_q, D_v] fp64, lse [H_q, T] fp64)``; NHD caches. Rows a query cannot see are never gathered."""
    t_q, h_q, d = q.shape
    bs, h_kv, d_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    g = h_q // h_kv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(t_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((h_q, t_q), -math.inf, dtype=torch.float64)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    packed = packed_custom_mask is not None
    mask = (packed_custom_mask if packed else custom_mask)
    mask = None if mask is None else mask.tolist()
    offsets = custom_mask_offsets([cu[b + 1] - cu[b] for b in range(len(lens))], packed)
    rows = {}  # (b, j) -> key row j of sequence b as fp64 (K [H_kv, D], V [H_kv, D_v]), read once

    def key_row(b, j, start):
        """Row ``j`` of sequence ``b`` through the block table, dequantized (``cache * scale``, per KV head) and, with
        RoPE at read time, K turned by its position ``j - start``."""
        if (b, j) not in rows:
            blk, row = int(block_table[b, j // bs]), j % bs
            kv, vv = k_cache[blk, row].double(), v_cache[blk, row].double()
            heads = torch.arange(h_kv)
            if k_scale is not None:
                kv = kv * k_scale.double().flatten()[heads % k_scale.numel()][:, None]
            if v_scale is not None:
                vv = vv * v_scale.double().flatten()[heads % v_scale.numel()][:, None]
            if rope_theta is not None:
                kv = rope_rotate(kv, j - start, rope_theta, rope_scale)
            rows[b, j] = kv, vv
        return rows[b, j]

    for b in range(len(lens)):
        q_len, kv_len = cu[b + 1] - cu[b], lens[b]
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        for i in range(q_len):
            pos = kv_len - q_len + i
            keys = []
            # candidates: the sinks, then the window (rows no mask admits are skipped: lengths near 2^31 stay cheap)
            hi = kv_len if mask is not None or (causal is False and window_right < 0) else min(
                kv_len, pos + 1 + (0 if causal else window_right))
            lo = start if window_left < 0 else max(start, pos - window_left)
            sinks_end = min(start + sink_tokens, lo) if window_left >= 0 else start
            for j in [*range(start, sinks_end), *range(lo, hi)]:
                if not visible(j, pos, kv_len, q_len, causal, window_right, mask, packed, offsets[b], i):
                    continue
                in_window = window_left < 0 or j >= pos - window_left
                is_sink = j < start + sink_tokens
                if in_window or (is_sink and window_left >= 0):
                    keys.append(j)
            t = cu[b] + i
            k_rows = torch.stack([key_row(b, j, start)[0] for j in keys]) if keys else k_cache.new_zeros(
                0, h_kv, d, dtype=torch.float64)  # [n, H_kv, D]
            v_rows = torch.stack([key_row(b, j, start)[1] for j in keys]) if keys else v_cache.new_zeros(
                0, h_kv, d_v, dtype=torch.float64)  # [n, H_kv, D_v]
            is_sink = torch.tensor([j < start + sink_tokens for j in keys], dtype=torch.bool)
            distance = torch.tensor([abs(pos - j) for j in keys], dtype=torch.float64)
            for h in range(h_q):
                hk = h // g  # GQA: query head h reads KV head h // (H_q // H_kv)
                qv = q[t, h].double() * scale
                # RoPE at read time: the query turns at its position; for the sinks at its position less the gap
                # between the sinks and its window (the kept keys take contiguous positions, StreamingLLM)
                gap = max(0, pos - window_left - (start + sink_tokens)) if sink_tokens and window_left >= 0 else 0
                q_window = q_sink = qv
                if rope_theta is not None:
                    q_window = rope_rotate(qv, pos - start, rope_theta, rope_scale)
                    q_sink = rope_rotate(qv, pos - start - gap, rope_theta, rope_scale)
                scores = torch.where(is_sink, k_rows[:, hk] @ q_sink, k_rows[:, hk] @ q_window)  # [n]
                if softcap > 0:  # softcap first, then the ALiBi bias (masking was the choice of keys)
                    scores = softcap * torch.tanh(scores / softcap)
                if alibi_slopes is not None:
                    slope = float(alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h])
                    scores = scores - slope * distance
                # the sink logit joins the denominator and carries no value
                terms = torch.cat([scores, sinks[h:h + 1].double()]) if sinks is not None else scores
                if terms.numel() == 0:
                    continue  # no visible key, no sink: out 0, lse -inf
                m = terms.max()
                den = torch.exp(terms - m).sum()
                lse[h, t] = m + torch.log(den)
                w = torch.exp(scores - m) / den
                out[t, h] = (w[:, None] * v_rows[:, hk]).sum(0)
    return out, lse
