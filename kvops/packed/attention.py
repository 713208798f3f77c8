"""Attention over a packed visible window, segment by segment, merged by log-sum-exp.

:meth:`PackedCausalKVCache.update` returns the window as segments (dense views of the ring and sink rows, packed
pool slots). :func:`packed_attention` attends to each segment in turn -- a packed one is dequantized on the fly, one
chunk at a time, in fp32 -- and merges the partial results by their LSE, as FlashAttention merges KV splits. So no
dense copy of the whole window is ever made: the transient is one chunk, not ``V`` rows, and the bytes read per call
are the packed bytes. Under ``torch.compile`` Inductor decomposes ``kvops::dequantize_kv`` into elementwise ops
(``kvops/packed/_lowering.py``), which fuse with the scale and the score computation's inputs.
"""

from __future__ import annotations

import torch

from .ops import PackedKV, dequantize_kv


def _dense(segment) -> torch.Tensor:
    return dequantize_kv(segment, torch.float32) if isinstance(segment, PackedKV) else segment.float()


def packed_attention(
    q: torch.Tensor, k_segments: list, v_segments: list, *, scale: float | None = None, return_lse: bool = False,
):
    """Softmax attention of ``q`` to every row of the segments (no mask: a chunk sees its whole visible window).

    Args:
        q: ``[B, T, H_q, D]`` (fp32/bf16/fp16); ``H_q`` a multiple of the segments' ``H_kv`` (GQA: query head
            ``h`` reads KV head ``h // (H_q / H_kv)``).
        k_segments, v_segments: the window in token order, as returned by ``PackedCausalKVCache.update`` (``view.k``,
            ``view.v``): dense ``[B, n, H_kv, D]`` tensors or :class:`PackedKV` of ``n`` rows.
        scale: score scale (default ``D ** -0.5``).
        return_lse: also return the LSE ``[B, H_q, T]`` (fp32, natural log).

    Returns:
        ``out [B, T, H_q, D_v]`` in ``q.dtype`` (and the LSE). Equal, up to fp32 summation order, to softmax attention
        over the concatenated dequantized window.

    Raises:
        ValueError: no segments, or ``H_q`` not a multiple of ``H_kv``.
    """
    if not k_segments or len(k_segments) != len(v_segments):
        raise ValueError(
            f"packed_attention: need the same non-zero number of K and V segments, got {len(k_segments)} and "
            f"{len(v_segments)}."
        )
    b, t, hq, d = q.shape
    hkv = k_segments[0].codes.shape[2] if isinstance(k_segments[0], PackedKV) else k_segments[0].shape[2]
    if hq % hkv != 0:
        raise ValueError(f"packed_attention: query heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (GQA).")
    scale = d**-0.5 if scale is None else scale
    qf = q.float().view(b, t, hkv, hq // hkv, d) * scale
    out = lse = None
    for ks, vs in zip(k_segments, v_segments):
        k, v = _dense(ks), _dense(vs)  # [B, n, H_kv, D]: one segment (at most one chunk) at a time
        s = torch.einsum("bthgd,bshd->bhgts", qf, k)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        o = torch.einsum("bhgts,bshd->bhgtd", p, v) / l
        seg_lse = (m + torch.log(l)).squeeze(-1)  # [B, H_kv, G, T]
        if out is None:
            out, lse = o, seg_lse
        else:
            new = torch.logaddexp(lse, seg_lse)
            out = out * torch.exp(lse - new)[..., None] + o * torch.exp(seg_lse - new)[..., None]
            lse = new
    result = out.permute(0, 3, 1, 2, 4).reshape(b, t, hq, -1).to(q.dtype)
    return (result, lse.reshape(b, hq, t)) if return_lse else result
