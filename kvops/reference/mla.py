"""fp64 oracle of the MLA latent-cache ops (tests only; the runtime never imports it): docs/mla.md.

Written from the definitions, one token and one sequence at a time, with no shared code with ``kvops/cpu/mla.py``:
the write places ``[kv_c | rot(k_pe)]`` at its slot (vLLM's ``concat_and_cache_mla``); attention reads each
sequence's rows through ``block_table`` position by position and computes, per query head, ``softmax(scale * q ·
row_j)`` over the visible positions applied to ``row_j[:kv_lora_rank]`` (FlashMLA's absorbed form).
"""

from __future__ import annotations

import math

import torch


def rotate(x: torch.Tensor, cos_row: torch.Tensor, sin_row: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """fp64 ``x [D]`` with its first ``2 * len(cos_row)`` dims turned pair by pair (GPT-NeoX or GPT-J pairs)."""
    x = x.to(torch.float64).clone()
    half = cos_row.shape[0]
    for j in range(half):
        a_i, b_i = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        a, b = x[a_i].item(), x[b_i].item()
        c, s = float(cos_row[j]), float(sin_row[j])
        x[a_i], x[b_i] = a * c - b * s, b * c + a * s
    return x


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, positions=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=False) -> torch.Tensor:
    """A new cache (``kv_cache`` is not modified) with the tokens written. Rows are rounded to the source dtype
    after RoPE (as the kernels), then quantized for fp8 (``x / kv_scale`` in fp32, saturated)."""
    out = kv_cache.clone()
    block_size = kv_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        pe = k_pe[i]
        if positions is not None:
            p = int(positions[i])
            pe = rotate(pe, rotary_cos[p].to(torch.float64), rotary_sin[p].to(torch.float64),
                        rotary_interleaved).to(torch.float32).to(k_pe.dtype)
        row = torch.cat((kv_c[i], pe))
        if kv_scale is not None:
            row = (row.to(torch.float32) / kv_scale.to(torch.float32).reshape(())).clamp(-448.0, 448.0)
        out[slot // block_size, slot % block_size] = row.to(kv_cache.dtype)
    return out


def mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, kv_lora_rank, scale=None, causal=True,
                  kv_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``(out [T_q, H, kv_lora_rank], lse [H, T_q])``; no visible key: out 0, lse -inf."""
    t_q, num_heads, width = q.shape
    scale = width ** -0.5 if scale is None else scale
    out = torch.zeros(t_q, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((num_heads, t_q), -math.inf, dtype=torch.float64)
    block_size = kv_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = []
        for j in range(seq_len):
            row = kv_cache[int(block_table[b, j // block_size]), j % block_size].to(torch.float64)
            if kv_scale is not None:
                row = row * float(kv_scale)
            rows.append(row)
        q_len = cu[b + 1] - cu[b]
        for i in range(q_len):
            t = cu[b] + i
            visible = seq_len - q_len + i + 1 if causal else seq_len
            if visible <= 0:
                continue
            kv = torch.stack(rows[:visible])  # [S, W]
            s = q[t].to(torch.float64) @ kv.t() * scale  # [H, S]
            m = s.max(dim=-1, keepdim=True).values
            e = (s - m).exp()
            out[t] = (e @ kv[:, :kv_lora_rank]) / e.sum(-1, keepdim=True)
            lse[:, t] = m.squeeze(-1) + e.sum(-1).log()
    return out, lse
