"""Shared pieces of the compatibility suite (tests/compat/): seeded grid samples and a dense fp64 attention oracle.

``attend`` computes kvops' attention semantics (docs/semantics.md §4-5, docs/attention_features.md) on dense
``[B, S, H_kv, D]`` keys in fp64 with masks, vectorized so that the peers' sequence lengths (thousands of keys) stay
cheap. It is the same math as the per-query reference ``kvops/reference/attention.py`` (kvops' oracle), which
``tests/compat/test_oracle.py`` checks it against.
"""

from __future__ import annotations

import itertools
import math
import random

import torch


def sample(grid: dict, n: int, seed: int, keep=lambda case: True) -> list[dict]:
    """A seeded sample of ``n`` cases of the cartesian product of ``grid`` (name -> values) that ``keep`` accepts
    (the peer's own skips), in a stable order."""
    names = list(grid)
    cases = [dict(zip(names, values)) for values in itertools.product(*grid.values())]
    cases = [c for c in cases if keep(c)]
    return random.Random(seed).sample(cases, min(n, len(cases)))


def attend(q, k, v, lens, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None, leftpad=None,
           k_scale=None, v_scale=None):
    """``(out [B, S_q, H_q, D_v], lse [B, H_q, S_q])`` fp64 for ``q [B, S_q, H_q, D]`` over the first ``lens[b]`` rows
    of ``k``/``v [B, S, H_kv, D]`` (rows before ``leftpad[b]`` excluded): query ``i`` of sequence ``b`` sits at row
    ``lens[b] - S_q + i``; ``causal`` (right bound 0), else ``window = (left, right)`` (``-1``: unbounded); softcap
    ``tanh`` before masking; ALiBi ``- slope * |pos - j|``; fp8 scales dequantize ``k``/``v``. A query with no key
    gets 0 and LSE ``-inf``."""
    b, s_q, h_q, d = q.shape
    s, h_kv = k.shape[1], k.shape[2]
    kk, vv = k.double(), v.double()
    if k_scale is not None:
        kk = kk * k_scale.double().reshape(-1)[None, None, :, None]
        vv = vv * v_scale.double().reshape(-1)[None, None, :, None]
    kk = kk.repeat_interleave(h_q // h_kv, dim=2)
    vv = vv.repeat_interleave(h_q // h_kv, dim=2)
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    lens = torch.as_tensor(lens).long().view(b, 1, 1)
    pos = lens - s_q + torch.arange(s_q).view(1, s_q, 1)  # [B, S_q, 1]
    j = torch.arange(s).view(1, 1, s)
    if alibi is not None:
        slopes = alibi.double().reshape(-1, h_q) if alibi.dim() == 2 else alibi.double().view(1, h_q)
        scores = scores - slopes.view(-1, h_q, 1, 1) * (pos - j).abs().unsqueeze(1).double()
    start = torch.zeros(b, 1, 1, dtype=torch.long) if leftpad is None else torch.as_tensor(leftpad).long().view(b, 1, 1)
    visible = (j < lens) & (j >= start)
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        visible = visible & (j <= pos + right)
    if left >= 0:
        visible = visible & (j >= pos - left)
    scores = scores.masked_fill(~visible.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, S_q]
    weights = torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, torch.exp(scores - lse.unsqueeze(-1)))
    weights = torch.nan_to_num(weights)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, vv)
    return out, lse


def rotate(x, cos, sin, positions, interleaved):
    """fp64 rotary embedding of ``x [B, T, H, D]`` at ``positions [B, T]`` with tables ``[seqlen_ro, rotary_dim / 2]``
    (FlashAttention's: the first ``rotary_dim`` channels rotate, GPT-J pairs ``(2i, 2i + 1)`` when ``interleaved``,
    else GPT-NeoX halves ``(i, i + rotary_dim / 2)``)."""
    rd = cos.shape[1] * 2
    if rd == 0:
        return x.double()
    c, s = cos.double()[positions][:, :, None, :], sin.double()[positions][:, :, None, :]  # [B, T, 1, rd/2]
    xr, rest = x.double()[..., :rd], x.double()[..., rd:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([out, rest], dim=-1)
