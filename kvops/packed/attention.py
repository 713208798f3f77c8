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


def _dense(segment, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_kv(segment, dtype) if isinstance(segment, PackedKV) else segment.to(dtype)


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention of ``q [B, H_kv, M, D]`` to one segment ``k``/``v [B, H_kv, n, D]``: (out fp32, LSE fp32 ``[B, H_kv,
    M]``). A fused flash kernel where torch has one that returns the LSE (CPU: any float dtype; CUDA: fp16/bf16),
    else plain fp32 math."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        return out.float(), lse
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        return out.float(), lse
    s = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhmn,bhnd->bhmd", torch.exp(s - lse[..., None]), v.float()), lse


def packed_attention(
    q: torch.Tensor, k_segments: list, v_segments: list, *, scale: float | None = None, return_lse: bool = False,
):
    """Softmax attention of ``q`` to every row of the segments (no mask: a chunk sees its whole visible window).

    Args:
        q: ``[B, T, H_q, D]`` (fp32/bf16/fp16); ``H_q`` a multiple of the segments' ``H_kv`` (GQA: query head
            ``h`` reads KV head ``h // (H_q / H_kv)``; the ``H_q / H_kv`` query heads of a KV head are attended as
            one block of queries, so K/V are never repeated).
        k_segments, v_segments: the window in token order, as returned by ``PackedCausalKVCache.update`` (``view.k``,
            ``view.v``): dense ``[B, n, H_kv, D]`` tensors or :class:`PackedKV` of ``n`` rows.
        scale: score scale (default ``D ** -0.5``).
        return_lse: also return the LSE ``[B, H_q, T]`` (fp32, natural log).

    Returns:
        ``out [B, T, H_q, D_v]`` in ``q.dtype`` (and the LSE). Equal, up to rounding, to softmax attention over the
        concatenated dequantized window. Each segment is attended with torch's fused flash kernel (CPU, CUDA
        fp16/bf16) in ``q.dtype`` after dequantizing it to ``q.dtype``; partial outputs are merged in fp32.

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
    group = hq // hkv
    qh = q.view(b, t, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * t, d)  # [B, H_kv, G*T, D]
    out = lse = None
    for ks, vs in zip(k_segments, v_segments):
        k, v = _dense(ks, q.dtype), _dense(vs, q.dtype)  # one segment (at most one chunk) at a time
        o, seg_lse = _partial(qh, k.transpose(1, 2), v.transpose(1, 2), scale)
        if out is None:
            out, lse = o, seg_lse
        else:
            new = torch.logaddexp(lse, seg_lse)
            out = out * torch.exp(lse - new)[..., None] + o * torch.exp(seg_lse - new)[..., None]
            lse = new
    result = out.view(b, hkv, group, t, -1).permute(0, 3, 1, 2, 4).reshape(b, t, hq, -1).to(q.dtype)
    return (result, lse.reshape(b, hq, t)) if return_lse else result
