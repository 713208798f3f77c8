"""A plain fp64 reference of ``kvops.paged_attention`` with every feature (docs/attention_features.md), one sequence
and one query at a time: what the kernels are tested against. Readable, slow, no tiling, no online softmax."""

from __future__ import annotations

import math

import torch

from kvops.reference.custom_mask import custom_mask_offsets, visible


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
            for h in range(h_q):
                hk = h // g
                qv = q[t, h].double() * scale
                scores, vals = [], []
                gap = max(0, pos - window_left - (start + sink_tokens)) if sink_tokens and window_left >= 0 else 0
                for j in keys:
                    blk, row = int(block_table[b, j // bs]), j % bs
                    kv = k_cache[blk, row, hk].double() * (1.0 if k_scale is None else float(k_scale.flatten()[hk % k_scale.numel()]))
                    vv = v_cache[blk, row, hk].double() * (1.0 if v_scale is None else float(v_scale.flatten()[hk % v_scale.numel()]))
                    qq = qv
                    if rope_theta is not None:
                        shift = gap if j < start + sink_tokens else 0
                        qq = rope_rotate(qv, pos - start - shift, rope_theta, rope_scale)
                        kv = rope_rotate(kv, j - start, rope_theta, rope_scale)
                    s = float(qq @ kv)
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        slope = float(alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h])
                        s -= slope * abs(pos - j)
                    scores.append(s)
                    vals.append(vv)
                terms = scores + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                den = sum(math.exp(x - m) for x in terms)
                lse[h, t] = m + math.log(den)
                if scores:
                    w = torch.tensor([math.exp(x - m) / den for x in scores], dtype=torch.float64)
                    out[t, h] = (w[:, None] * torch.stack(vals)).sum(0)
    return out, lse
