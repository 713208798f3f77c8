"""CUDA kernels of the quantize/dequantize ops (Triton; tested on CPU tensors with ``TRITON_INTERPRET=1``).

One program per (batch, token, head) row of ``D`` values. Covered: int8 and int4 quantize and dequantize, int2
dequantize (centroid gather + every residual stage in one pass). The fp8 quantize (a per-head amax over all tokens)
and the int2 quantize (k-means) run as torch ops on the GPU (``kvops/cpu/packed.py``). The arithmetic follows
the reference exactly (IEEE division ``div_rn``, round-half-to-even, fp16-rounded scales, int8 zero points in
eighths of a step: ``x ≈ (code - zero / 8) · scale``), so the codes are equal; non-finite inputs too (scales from the
finite values, a NaN scale for the row or group that holds one: docs/semantics.md §2.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu import packed as reference
from .launch import Launch, capability_of, run

SCALE_MIN, SCALE_MAX = reference.SCALE_MIN, reference.SCALE_MAX


@triton.jit
def _rint(y):
    """Round half to even (as torch.round)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _fp16_scale(s, SMIN: tl.constexpr, SMAX: tl.constexpr):
    return tl.minimum(tl.maximum(s, SMIN), SMAX).to(tl.float16).to(tl.float32)


@triton.jit
def _finite_parts(x):
    """``(x for the scale, x for the codes, bad)`` of loaded values (the reference's ``_saturating``): non-finite
    values count as 0 for the scale and as ``±big`` / 0 for the codes; ``bad`` marks them (their scale becomes NaN)."""
    big = 3.4028234663852886e38
    bad = (x != x) | (tl.abs(x) == float("inf"))
    return tl.where(bad, 0.0, x), tl.where(x != x, 0.0, tl.minimum(tl.maximum(x, -big), big)), bad


@triton.jit
def _row(pid, T, H, sb, st, sh):
    b = pid // (T * H)
    t = (pid // H) % T
    h = pid % H
    return b * sb + t * st + h * sh


@triton.jit
def _int8_quant_kernel(x_ptr, c_ptr, s_ptr, T, H, D, xb, xt, xh, xd, cb, ct, ch, cd, sb, st, sh,
                       SMIN: tl.constexpr, SMAX: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x, xc, bad = _finite_parts(tl.load(x_ptr + _row(pid, T, H, xb, xt, xh) + d * xd, mask=mask,
                                       other=0.0).to(tl.float32))
    scale = _fp16_scale(tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0), SMIN, SMAX)
    q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(xc, scale)), -127.0), 127.0)
    tl.store(c_ptr + _row(pid, T, H, cb, ct, ch) + d * cd, q.to(tl.int8), mask=mask)
    scale = tl.where(tl.max(bad.to(tl.int32), 0) > 0, float("nan"), scale)  # a non-finite value: NaN row
    tl.store(s_ptr + _row(pid, T, H, sb, st, sh), scale.to(tl.float16))


@triton.jit
def _int8_dequant_kernel(c_ptr, s_ptr, o_ptr, T, H, D, cb, ct, ch, cd, sb, st, sh,
                         BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    c = tl.load(c_ptr + _row(pid, T, H, cb, ct, ch) + d * cd, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + _row(pid, T, H, sb, st, sh)).to(tl.float32)
    tl.store(o_ptr + pid * D + d, (c * s).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_quant_kernel(x_ptr, c_ptr, s_ptr, z_ptr, T, H, G, xb, xt, xh, xd, cb, ct, ch, cd, sb, st, sh, sg,
                       SMIN: tl.constexpr, SMAX: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr):
    """Row of G groups of 2*HALF values: even/odd elements loaded as two [BLOCK_G, HALF] tiles."""
    pid = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = (g < G) & (j < HALF)
    base = x_ptr + _row(pid, T, H, xb, xt, xh)
    even, even_c, even_bad = _finite_parts(tl.load(base + (g * 2 * HALF + 2 * j) * xd, mask=mask,
                                                   other=0.0).to(tl.float32))
    odd, odd_c, odd_bad = _finite_parts(tl.load(base + (g * 2 * HALF + 2 * j + 1) * xd, mask=mask,
                                                other=0.0).to(tl.float32))
    lo = tl.minimum(tl.min(tl.where(mask, even, float("inf")), 1), tl.min(tl.where(mask, odd, float("inf")), 1))
    hi = tl.maximum(tl.max(tl.where(mask, even, -float("inf")), 1), tl.max(tl.where(mask, odd, -float("inf")), 1))
    scale = _fp16_scale(tl.maximum(tl.math.div_rn(hi - lo, 15.0), tl.math.div_rn(tl.abs(lo), 15.875)), SMIN, SMAX)
    zero = tl.minimum(tl.maximum(_rint(tl.math.div_rn(-lo, scale) * 8.0), -128.0), 127.0)  # int8, units of scale / 8
    qe = tl.minimum(tl.maximum(_rint(tl.math.div_rn(even_c, scale[:, None]) + zero[:, None] / 8.0), 0.0), 15.0)
    qo = tl.minimum(tl.maximum(_rint(tl.math.div_rn(odd_c, scale[:, None]) + zero[:, None] / 8.0), 0.0), 15.0)
    bad = tl.max((even_bad | odd_bad).to(tl.int32), 1) > 0
    scale = tl.where(bad, float("nan"), scale)  # a group holding a non-finite value: NaN (dequantizes to NaN)
    byte = qe.to(tl.int32) | (qo.to(tl.int32) << 4)
    tl.store(c_ptr + _row(pid, T, H, cb, ct, ch) + (g * HALF + j) * cd, byte.to(tl.uint8), mask=mask)
    gs = tl.arange(0, BLOCK_G)
    srow = _row(pid, T, H, sb, st, sh) + gs * sg
    tl.store(s_ptr + srow, scale.to(tl.float16), mask=gs < G)
    tl.store(z_ptr + srow, zero.to(tl.int8), mask=gs < G)


@triton.jit
def _grouped_dequant(c_ptr, s_ptr, z_ptr, crow, srow, G, cd, sg, BITS: tl.constexpr, BLOCK_G: tl.constexpr,
                     PER_GROUP: tl.constexpr):
    """One row's codes of BITS bits, groups of PER_GROUP values: returns [BLOCK_G, PER_GROUP] fp32 values."""
    per_byte: tl.constexpr = 8 // BITS
    g = tl.arange(0, BLOCK_G)[:, None]
    i = tl.arange(0, PER_GROUP)[None, :]
    mask = (g < G) & (i < PER_GROUP)
    e = g * PER_GROUP + i  # element index along D
    byte = tl.load(c_ptr + crow + (e // per_byte) * cd, mask=mask, other=0).to(tl.int32)
    q = ((byte >> ((e % per_byte) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    s = tl.load(s_ptr + srow + tl.arange(0, BLOCK_G) * sg, mask=tl.arange(0, BLOCK_G) < G, other=0).to(tl.float32)
    z = tl.load(z_ptr + srow + tl.arange(0, BLOCK_G) * sg, mask=tl.arange(0, BLOCK_G) < G, other=0).to(tl.float32)
    return (q - z[:, None] / 8.0) * s[:, None], e, mask


@triton.jit
def _int4_dequant_kernel(c_ptr, s_ptr, z_ptr, o_ptr, T, H, G, cb, ct, ch, cd, sb, st, sh, sg,
                         BLOCK_G: tl.constexpr, PER_GROUP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    x, e, mask = _grouped_dequant(c_ptr, s_ptr, z_ptr, _row(pid, T, H, cb, ct, ch), _row(pid, T, H, sb, st, sh),
                                  G, cd, sg, 4, BLOCK_G, PER_GROUP)
    tl.store(o_ptr + pid * G * PER_GROUP + e, x.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int2_dequant_kernel(c_ptr, s_ptr, z_ptr, m_ptr, id_ptr, o_ptr, T, H, G, STAGES,
                         cb, ct, ch, cs, cd, sb, st, sh, ss, sg, mb, mh, mc, md, ib, it, ih,
                         BLOCK_G: tl.constexpr, PER_GROUP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // (T * H)
    h = pid % H
    cluster = tl.load(id_ptr + _row(pid, T, H, ib, it, ih)).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    i = tl.arange(0, PER_GROUP)[None, :]
    e = g * PER_GROUP + i
    mask = (g < G) & (i < PER_GROUP)
    x = tl.load(m_ptr + b * mb + h * mh + cluster * mc + e * md, mask=mask, other=0).to(tl.float32)
    crow = _row(pid, T, H, cb, ct, ch)
    srow = _row(pid, T, H, sb, st, sh)
    for s in range(STAGES):
        stage, _, _ = _grouped_dequant(c_ptr, s_ptr, z_ptr, crow + s * cs, srow + s * ss, G, cd, sg, 2, BLOCK_G,
                                       PER_GROUP)
        x = x + stage
    tl.store(o_ptr + pid * G * PER_GROUP + e, x.to(o_ptr.dtype.element_ty), mask=mask)


def quantize(x, codes, scales, zeros, centroids, cluster_ids, quant: str, kmeans_iters: int) -> None:
    launches = plan_quantize(x, codes, scales, zeros, quant, capability_of(x))
    if not launches:  # fp8 and int2 (and empty rows): torch ops
        reference.quantize(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters)
        return
    run(launches)


def plan_quantize(x, codes, scales, zeros, quant: str, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`quantize` (none where torch ops do the work: fp8, int2, no rows)."""
    b, t, h, d = x.shape
    rows = b * t * h
    if rows == 0 or quant not in ("int8", "int4"):
        return []
    if quant == "int8":
        return [Launch(_int8_quant_kernel, (rows,), (x, codes, scales, t, h, d, *x.stride(), *codes.stride(),
                                                      *scales.stride()),
                       dict(SMIN=SCALE_MIN, SMAX=SCALE_MAX, BLOCK_D=triton.next_power_of_2(d)))]
    groups = scales.shape[-1]
    return [Launch(_int4_quant_kernel, (rows,), (
        x, codes, scales, zeros, t, h, groups, *x.stride(), *codes.stride(),
        *scales.stride()[:3], scales.stride(3)),
        dict(SMIN=SCALE_MIN, SMAX=SCALE_MAX, BLOCK_G=triton.next_power_of_2(groups), HALF=d // groups // 2))]


def dequantize(codes, scales, zeros, centroids, cluster_ids, quant: str, dtype: torch.dtype) -> torch.Tensor:
    b, t, h = codes.shape[:3]
    d = codes.shape[-1] * {"int8": 1, "fp8": 1, "int4": 2, "int2": 4}[quant]
    out = torch.empty(b, t, h, d, dtype=dtype, device=codes.device)
    launches = plan_dequantize(codes, scales, zeros, centroids, cluster_ids, quant, out, capability_of(codes))
    if not launches:  # fp8, and non-power-of-2 groups: torch ops
        return reference.dequantize(codes, scales, zeros, centroids, cluster_ids, quant, dtype)
    run(launches)
    return out


def plan_dequantize(codes, scales, zeros, centroids, cluster_ids, quant: str, out, capability: tuple[int, int]):
    """The launch of :func:`dequantize` into ``out [B, T, H, D]`` (none where torch ops do the work)."""
    b, t, h = codes.shape[:3]
    d = out.shape[-1]
    group = d // scales.shape[-1] if quant in ("int4", "int2") else d
    if b * t * h == 0 or quant == "fp8" or group & (group - 1):
        return []
    rows = b * t * h
    if quant == "int8":
        return [Launch(_int8_dequant_kernel, (rows,), (codes, scales, out, t, h, d, *codes.stride(), *scales.stride()),
                       dict(BLOCK_D=triton.next_power_of_2(d)))]
    g = scales.shape[-1]
    if quant == "int4":
        return [Launch(_int4_dequant_kernel, (rows,), (codes, scales, zeros, out, t, h, g, *codes.stride(),
                                                        *scales.stride()),
                       dict(BLOCK_G=triton.next_power_of_2(g), PER_GROUP=group))]
    return [Launch(_int2_dequant_kernel, (rows,), (
        codes, scales, zeros, centroids, cluster_ids, out, t, h, g, codes.shape[3],
        *codes.stride(), *scales.stride(), *centroids.stride(), *cluster_ids.stride()),
        dict(BLOCK_G=triton.next_power_of_2(g), PER_GROUP=group))]
