"""Kernels of ``kvops::quantize_kv`` / ``kvops::dequantize_kv`` in plain torch (fp32 math).

Registered for CPU, and for CUDA where a Triton kernel does not cover the format (the int2 k-means). Layouts:
:func:`kvops.packed.packed_layout`. Outputs of ``quantize`` are written in place into the given tensors (views of a
cache's packed pools), never reallocated.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SCALE_MIN = 2.0**-14  # smallest normal fp16: scales are stored in fp16 and must not flush to zero
SCALE_MAX = 65504.0


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale rounded to its stored fp16 value (and back to fp32), clamped to fp16's normal range."""
    return scale.clamp(SCALE_MIN, SCALE_MAX).to(torch.float16).float()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` integer codes in ``[0, 2**bits)`` -> ``[..., D * bits / 8]`` uint8, element ``i`` of each byte's
    group in bits ``[i * bits, (i + 1) * bits)``."""
    per = 8 // bits
    c = codes.to(torch.int32).unflatten(-1, (-1, per))
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.flatten(-2)


ZERO_MIN, ZERO_MAX = -128, 127  # zero points are stored as int8 ...
ZERO_STEPS = 8  # ... in units of scale / 8 (fixed point with 3 fractional bits)


def _affine(x: torch.Tensor, group: int, levels: int, x_codes: torch.Tensor | None = None):
    """Asymmetric min/max quantization of ``x [..., D]`` in groups of ``group`` along D with an 8-bit integer zero
    point (as GPTQ/AWQ store it, here in units of ``scale / 8``): ``x ≈ (code - zero / 8) · scale``. Returns (codes
    in ``[0, levels]``, scale rounded to its stored fp16 value, zero as an integer-valued fp32 in ``[-128, 127]``).

    ``scale = max((max - min) / levels, |min| / 15.875)`` (the second term keeps ``zero = round(-8 · min / scale)``
    inside int8; it binds only for a group whose values all lie on one side of zero, farther from it than the
    group's range), ``code = round(x / scale + zero / 8)``. Every value is within half a step of its code's value,
    and the group's minimum within 1/16 of a step (a zero in whole steps, as GPTQ's, would lose the near-exact
    minimum: with one outlier channel per group, as in K, that costs ~2x attention error at int4 g32)."""
    g = x.unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = _fp16_scale(torch.maximum((hi - lo) / levels, lo.abs() / (ZERO_MAX / ZERO_STEPS)))
    zero = torch.round(-lo / scale * ZERO_STEPS).clamp(ZERO_MIN, ZERO_MAX)
    gc = g if x_codes is None else x_codes.unflatten(-1, (-1, group))  # (saturated non-finite values)
    q = torch.round(gc / scale[..., None] + zero[..., None] / ZERO_STEPS).clamp(0, levels)
    return q.flatten(-2), scale, zero


def _ungroup(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    g = q.float().unflatten(-1, (scale.shape[-1], -1))
    return ((g - zero[..., None] / ZERO_STEPS) * scale[..., None]).flatten(-2)


def kmeans(x: torch.Tensor, num_clusters: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per row of ``x [N, T, D]`` (fp32): ``(centroids [N, C, D], ids [N, T])``.

    Deterministic: centroid ``i`` starts at token ``i * T // C``; ties go to the lowest cluster; an empty cluster
    keeps its centroid. ``iters`` update steps, then the ids of the final centroids.
    """
    n, t, d = x.shape
    init = (torch.arange(num_clusters, device=x.device) * t) // max(num_clusters, 1)
    cent = x[:, init.clamp(max=max(t - 1, 0))] if t > 0 else x.new_zeros(n, num_clusters, d)

    def assign(c):
        dist = (c * c).sum(-1)[:, None, :] - 2 * torch.bmm(x, c.transpose(1, 2))  # ||x||^2 is common to a row
        return dist.argmin(-1)

    for _ in range(iters):
        ids = assign(cent)
        sums = x.new_zeros(n, num_clusters, d).scatter_add_(1, ids[..., None].expand(n, t, d), x)
        counts = x.new_zeros(n, num_clusters).scatter_add_(1, ids, x.new_ones(n, t))
        cent = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], cent)
    return cent, assign(cent)


def _saturating(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-finite inputs (docs/semantics.md §2.0): ``(x for the scales, x for the codes, finite)``. Scales are
    computed from the finite values only (a non-finite value counts as 0), so an Inf or NaN never changes another
    value's code; the codes of non-finite values are those of ``±big`` / 0 (deterministic), and the caller then makes
    what holds them NaN (:func:`_poison`)."""
    finite = xf.isfinite()  # (no branch on it: no host sync where this runs on CUDA, the int2 k-means)
    big = torch.finfo(torch.float32).max
    return torch.where(finite, xf, 0.0), torch.nan_to_num(xf, nan=0.0, posinf=big, neginf=-big), finite


def _poison(scale: torch.Tensor, finite: torch.Tensor, groups: int) -> torch.Tensor:
    """``scale [..., groups]`` (or ``[...]`` for one group per row) NaN where its group of ``finite [..., D]`` holds
    a NaN or ±inf: it dequantizes to NaN, visible as attention over a dense cache holding the value is (before:
    before, the value was saturated or stored as 0, silently)."""
    bad = ~finite.unflatten(-1, (groups, -1)).all(-1)
    return torch.where(bad if scale.dim() == bad.dim() else bad.squeeze(-1), float("nan"), scale)


def quantize(x, codes, scales, zeros, centroids, cluster_ids, quant: str, kmeans_iters: int) -> None:
    """Quantize ``x [B, T, H, D]`` into the given output tensors (layouts: ``packed_layout``)."""
    xf, xc, finite = _saturating(x.float())
    if quant == "int8":
        scale = _fp16_scale(xf.abs().amax(-1) / 127.0)
        codes.copy_(torch.round(xc / scale[..., None]).clamp(-127, 127).to(torch.int8))
        scales.copy_(_poison(scale, finite, 1))
    elif quant == "fp8":
        b, t, h, _ = xf.shape
        amax = xf.abs().amax(dim=(1, 3)) if t > 0 else xf.new_zeros(b, h)  # [B, H]; no tokens: any scale
        scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        y = (xc / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        codes.copy_(torch.where(finite, y, float("nan")).to(torch.float8_e4m3fn))  # e4m3fn's NaN code: that value
        scales.copy_(scale)
    elif quant == "int4":
        q, scale, zero = _affine(xf, xf.shape[-1] // scales.shape[-1], 15, xc)
        codes.copy_(_pack(q, 4))
        scales.copy_(_poison(scale, finite, scales.shape[-1]))
        zeros.copy_(zero)
    else:  # int2: k-means per (batch, head), then progressive 2-bit residual stages (non-finite values as 0)
        b, t, h, d = xf.shape
        rows = xf.permute(0, 2, 1, 3).reshape(b * h, t, d)
        cent, ids = kmeans(rows, centroids.shape[2], kmeans_iters)
        cent = cent.to(torch.float16)
        centroids.copy_(cent.view(b, h, -1, d))
        cluster_ids.copy_(ids.view(b, h, t).transpose(1, 2))
        residual = xf - _gather_centroids(cent.view(b, h, -1, d).float(), ids.view(b, h, t).transpose(1, 2))
        group = d // scales.shape[-1]
        for s in range(codes.shape[3]):
            q, scale, zero = _affine(residual, group, 3)
            codes[:, :, :, s].copy_(_pack(q, 2))
            scales[:, :, :, s].copy_(_poison(scale, finite, scales.shape[-1]))
            zeros[:, :, :, s].copy_(zero)
            residual = residual - _ungroup(q, scale, zero)


def check_cluster_ids(cluster_ids: torch.Tensor, clusters: int, op: str) -> None:
    """int2 cluster ids index the centroids: ``RuntimeError`` naming the first id ``>= clusters`` (the native
    kernel's check and wording; a PackedKV is a public tuple). CPU tensors only (no device sync)."""
    if clusters >= 256 or type(cluster_ids) is not torch.Tensor or not cluster_ids.is_cpu or cluster_ids.numel() == 0:
        return  # (traced, e.g. Inductor's decomposition of dequantize_kv: compiled code has Inductor's index assert)
    bad = cluster_ids.to(torch.int64) >= clusters
    if bool(bad.any()):
        b, t, h = (int(i) for i in bad.nonzero()[0])
        raise RuntimeError(
            f"{op}: cluster_ids[{b}, {t}, {h}] = {int(cluster_ids[b, t, h])} is not a centroid of its segment: cluster "
            f"ids must be in [0, {clusters}) (centroids [B, H, {clusters}, D]). Pass the cluster_ids that "
            f"kvops.packed.quantize_kv wrote with those centroids."
        )


def _gather_centroids(cent: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cent [B, H, C, D]``, ``ids [B, T, H]`` -> ``[B, T, H, D]``: each token's centroid."""
    b, h, c, d = cent.shape
    flat = cent.reshape(b * h, c, d)
    idx = ids.transpose(1, 2).reshape(b * h, -1).long()
    out = torch.gather(flat, 1, idx[..., None].expand(-1, -1, d))
    return out.view(b, h, -1, d).transpose(1, 2)


def dequantize(codes, scales, zeros, centroids, cluster_ids, quant: str, dtype: torch.dtype,
               op: str = "kvops.dequantize_kv") -> torch.Tensor:
    """Dense ``[B, T, H, D]`` in ``dtype`` from a packed tensor (math in fp32); int2 cluster ids are checked."""
    if quant == "int2":
        check_cluster_ids(cluster_ids, centroids.shape[2], op)
    if quant == "int8":
        x = codes.float() * scales.float()[..., None]
    elif quant == "fp8":
        x = codes.float() * scales[:, None, :, None]
    elif quant == "int4":
        x = _ungroup(_unpack(codes, 4), scales.float(), zeros.float())
    else:
        x = _gather_centroids(centroids.float(), cluster_ids)
        for s in range(codes.shape[3]):
            x = x + _ungroup(_unpack(codes[:, :, :, s], 2), scales[:, :, :, s].float(), zeros[:, :, :, s].float())
    return x.to(dtype).contiguous()  # the fake rule promises a contiguous output


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention of ``q [B, H_kv, M, D]`` to one segment ``k``/``v [B, H_kv, n, D]`` (``n >= 1``): (out fp32, LSE fp32
    ``[B, H_kv, M]``). A fused flash kernel where torch has one that returns the LSE (CPU: any float dtype; CUDA:
    fp16/bf16; both need ``D_v == D``), else plain fp32 math."""
    flash = q.shape[-1] == v.shape[-1]
    # torch's flash kernels read rows as unit-stride (a last-dim stride of 2 gave wrong results on CPU): copy others
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if flash and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        return out.float(), lse
    if flash and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        return out.float(), lse
    s = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhmn,bhnd->bhmd", torch.exp(s - lse[..., None]), v.float()), lse


def packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale: float, row_counts=None):
    """Composite kernel of ``kvops::packed_attention`` (CPU without the native build, and the "dequantize + SDPA"
    baseline of ``benchmarks/packed_cache.py``): each segment in turn -- a packed one dequantized to ``q.dtype``, one
    segment (at most a chunk) at a time; with ``row_counts`` its rows repeated that often (0: dropped) -- attended
    with torch's flash SDPA, partial results merged by their LSE in fp32. ``(out [B, T, H_q, D_v] q.dtype, lse
    [B, H_q, T] fp32)``; no rows at all: zeros and ``-inf``."""
    from .._checks.packed import split_segments

    b, t, hq, d = q.shape
    segments = list(zip(k_dense, v_dense))
    if quant is not None:
        segments += list(zip(split_segments(quant, k_packed), split_segments(quant, v_packed)))
    first_v = segments[0][1]
    hkv = first_v.shape[2] if isinstance(first_v, torch.Tensor) else first_v["codes"].shape[2]
    d_v = first_v.shape[3] if isinstance(first_v, torch.Tensor) else None
    group = hq // hkv
    qh = q.reshape(b, t, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * t, d)  # [B, H_kv, G*T, D]
    out = lse = None
    row = 0
    for ks, vs in segments:
        n = ks.shape[1] if isinstance(ks, torch.Tensor) else ks["codes"].shape[1]
        counts = None if row_counts is None else row_counts[row : row + n]
        row += n
        op = "kvops.packed_attention"
        k = ks if isinstance(ks, torch.Tensor) else dequantize(*ks.values(), quant, q.dtype, op)
        v = vs if isinstance(vs, torch.Tensor) else dequantize(*vs.values(), quant, q.dtype, op)
        d_v = v.shape[3]
        if counts is not None:
            keep = torch.arange(n, device=k.device).repeat_interleave(counts.long())
            k, v = k.index_select(1, keep), v.index_select(1, keep)
        if k.shape[1] == 0:
            continue
        o, seg_lse = _partial(qh, k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2), scale)
        if out is None:
            out, lse = o, seg_lse
        else:
            new = torch.logaddexp(lse, seg_lse)
            out = out * torch.exp(lse - new)[..., None] + o * torch.exp(seg_lse - new)[..., None]
            lse = new
    if out is None:
        return q.new_zeros(b, t, hq, d_v), q.new_full((b, hq, t), float("-inf"), dtype=torch.float32)
    result = out.view(b, hkv, group, t, -1).permute(0, 3, 1, 2, 4).reshape(b, t, hq, -1).to(q.dtype)
    return result, lse.reshape(b, hq, t)
