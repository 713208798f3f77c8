"""Readable fp64 oracle of the packed (quantized) K/V formats and of attention over a packed window (docs/semantics.md
§2, layouts: ``kvops.packed.packed_layout``). Test-only: the runtime's kernels are ``kvops/cpu/packed.py`` (composite),
``kvops/native/packed_attention.cpp`` and ``kvops/triton/packed_*.py``; the tests compare them with this.

Written independently of those kernels: every bit field is unpacked by its own shift, every format's value formula is
spelled out, and all arithmetic is fp64.
"""

from __future__ import annotations

import torch

ZERO_STEPS = 8  # int4/int2 zero points are stored in units of scale / 8


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [..., n]`` -> int64 ``[..., n * 8 // bits]``: element ``i`` of each byte in its bits
    ``[i * bits, (i + 1) * bits)`` (the low bits first)."""
    fields = [(packed.to(torch.int64) >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)]
    return torch.stack(fields, -1).flatten(-2)


def affine(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``(code - zero / 8) * scale`` per group: ``codes [..., D]``, ``scales``/``zeros [..., G]`` (groups of
    ``D / G`` consecutive channels)."""
    groups = scales.shape[-1]
    c = codes.double().unflatten(-1, (groups, -1))
    return ((c - zeros.double()[..., None] / ZERO_STEPS) * scales.double()[..., None]).flatten(-2)


def dequantize(packed) -> torch.Tensor:
    """fp64 ``[B, T, H, D]`` of one packed segment (any object with the fields of ``kvops.packed.PackedKV``).

    int8: ``code * scale`` (one scale per token and head). fp8: ``code * scale`` (one scale per head of the segment).
    int4: the affine code of each group. int2: the token's centroid (``centroids[b, h, cluster_ids[b, t, h]]``) plus
    each residual stage's affine code."""
    quant, codes, scales = packed.quant, packed.codes, packed.scales
    if quant == "int8":
        return codes.double() * scales.double()[..., None]
    if quant == "fp8":
        return codes.double() * scales.double()[:, None, :, None]
    if quant == "int4":
        return affine(unpack(codes, 4), scales, packed.zeros)
    if quant == "int2":
        b, t, h = packed.cluster_ids.shape
        bi = torch.arange(b)[:, None, None]
        hi = torch.arange(h)[None, None, :]
        x = packed.centroids.double()[bi, hi, packed.cluster_ids.long()]
        for stage in range(codes.shape[3]):  # codes [B, T, H, stages, D / 4], scales/zeros [B, T, H, stages, G]
            x = x + affine(unpack(codes[:, :, :, stage], 2), scales[:, :, :, stage], packed.zeros[:, :, :, stage])
        return x
    raise ValueError(f"unknown packed format {quant!r}")


def window(segments, row_counts: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``[B, rows, H, D]``: the segments (dense tensors or packed ones) in order, each row repeated
    ``row_counts`` times when given (0: not in the window)."""
    dense = torch.cat([s.double() if isinstance(s, torch.Tensor) else dequantize(s) for s in segments], dim=1)
    if row_counts is not None:
        dense = dense[:, torch.arange(dense.shape[1]).repeat_interleave(row_counts.long())]
    return dense


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """fp64 softmax attention of ``q [B, T, H_q, D]`` to ``k [B, S, H_kv, D]``, ``v [B, S, H_kv, D_v]``, query head
    ``h`` reading KV head ``h // (H_q / H_kv)``, no mask: ``(out [B, T, H_q, D_v], lse [B, H_q, T])``."""
    group = q.shape[2] // k.shape[2]
    k, v = k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v), s.logsumexp(-1)


def packed_attention(q, k_segments, v_segments, scale: float | None = None, row_counts: torch.Tensor | None = None):
    """What ``kvops.packed.packed_attention(q, k_segments, v_segments, scale, row_counts)`` computes, in fp64."""
    return attention(q, window(k_segments, row_counts), window(v_segments, row_counts), scale)
