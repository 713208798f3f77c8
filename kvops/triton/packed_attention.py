"""CUDA kernel of ``kvops::packed_attention`` (Triton; tested on CPU tensors with ``TRITON_INTERPRET=1``).

One launch per segment (dense or packed), grid ``(row tiles, B · H_kv)``; row ``r`` of KV head ``h`` is query
``r // G``, query head ``h · G + r % G`` (GQA: K/V are read once per row tile, never repeated). Each launch loads the
online-softmax state (running max ``m``, sum ``l``, accumulator ``acc``; fp32 buffers) of its rows, walks the
segment in tiles of ``BLOCK_N`` tokens -- a packed tile is dequantized in registers from its codes, scales, zero
points (int8, eighths of a step), centroids and cluster ids (layouts: :func:`kvops.packed.packed_layout`), never
written back -- and stores the state; the state carried from launch to launch is the LSE merge of the segments. A
final torch step divides by ``l`` and forms the LSE. All math in fp32 (inputs are loaded and ``.to(tl.float32)`` first; ``tl.dot``
uses TF32 on GPUs that have it). fp8 e4m3 codes are decoded from their bits (exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks.packed import split_segments
from .launch import Launch, capability_of, run

_KIND = {None: 0, "int8": 1, "fp8": 2, "int4": 3, "int2": 4}


@triton.jit
def _fp8_e4m3(bits):
    """float8_e4m3fn bits (int32 in [0, 255]) -> fp32 (exact; ``S.1111.111`` is NaN: quantize_kv stores a NaN or
    ±inf input so, docs/semantics.md §2.0)."""
    sign = (bits >> 7) & 1
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = ((exp + 120) << 23) | (man << 20)  # (1 + man/8) · 2^(exp - 7): fp32 exponent exp - 7 + 127
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((exp == 15) & (man == 7), float("nan"), mag)
    return tl.where(sign == 1, -mag, mag)


@triton.jit
def _tile(c_ptr, s_ptr, z_ptr, m_ptr, id_ptr, cb, ct, ch, cs_, cd, sb, st_, sh, ss_, sg, zb, zt, zh, zs_, zg,
          mb, mh, mc, md, ib, it, ih, b, h, t, tmask, e, E, STAGES, KIND: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``t [BLOCK_N]`` x elements ``e [BLOCK_D]`` of one K or V segment of (batch b, KV head h), as fp32.
    Strides: codes ``c*`` = (b, t, h, stage, d), scales ``s*`` / zero points ``z*`` = (b, t, h, stage, group),
    centroids ``m*`` = (b, h, cluster, d), cluster ids ``i*`` = (b, t, h)."""
    mask = tmask[:, None] & (e[None, :] < E)
    tt = t[:, None].to(tl.int64)
    ee = e[None, :]
    crow = c_ptr + b * cb + tt * ct + h * ch
    if KIND == 0:
        x = tl.load(crow + ee * cd, mask=mask, other=0.0).to(tl.float32)
    elif KIND == 1:
        s = tl.load(s_ptr + b * sb + t.to(tl.int64) * st_ + h * sh, mask=tmask, other=0.0)
        x = tl.load(crow + ee * cd, mask=mask, other=0).to(tl.float32) * s.to(tl.float32)[:, None]
    elif KIND == 2:
        s = tl.load(s_ptr + b * sb + h * sh).to(tl.float32)
        bits = tl.load(crow + ee * cd, mask=mask, other=0).to(tl.int32) & 255
        x = _fp8_e4m3(bits) * s
    elif KIND == 3:
        byte = tl.load(crow + (ee // 2) * cd, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((ee % 2) * 4)) & 15).to(tl.float32)
        g = ee // GROUP
        s = tl.load(s_ptr + b * sb + tt * st_ + h * sh + g * sg, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + b * zb + tt * zt + h * zh + g * zg, mask=mask, other=0).to(tl.float32)
        x = (q - z * 0.125) * s
    else:
        cid = tl.load(id_ptr + b * ib + t.to(tl.int64) * it + h * ih, mask=tmask, other=0)
        x = tl.load(m_ptr + b * mb + h * mh + cid.to(tl.int64)[:, None] * mc + ee * md, mask=mask,
                    other=0.0).to(tl.float32)
        g = ee // GROUP
        for st in range(STAGES):
            byte = tl.load(crow + st * cs_ + (ee // 4) * cd, mask=mask, other=0).to(tl.int32)
            q = ((byte >> ((ee % 4) * 2)) & 3).to(tl.float32)
            s = tl.load(s_ptr + b * sb + tt * st_ + h * sh + st * ss_ + g * sg, mask=mask,
                        other=0.0).to(tl.float32)
            z = tl.load(z_ptr + b * zb + tt * zt + h * zh + st * zs_ + g * zg, mask=mask,
                        other=0).to(tl.float32)
            x += (q - z * 0.125) * s
    return x


@triton.jit
def _segment_kernel(
    q_ptr, kc, ks, kz, km, kid, vc, vs, vz, vm, vid, m_ptr, l_ptr, acc_ptr, w_ptr,
    qb, qt, qh, qd,
    kcb, kct, kch, kcs, kcd, ksb, kst, ksh, kss, ksg, kzb, kzt, kzh, kzs, kzg, kmb, kmh, kmc, kmd, kib, kit, kih,
    vcb, vct, vch, vcs, vcd, vsb, vst, vsh, vss, vsg, vzb, vzt, vzh, vzs, vzg, vmb, vmh, vmc, vmd, vib, vit, vih,
    N, G, HKV, R, D, DV, K_STAGES, V_STAGES, scale,
    KIND: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, HAS_COUNTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HKV, bh % HKV
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < R
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    i, hq = (r // G).to(tl.int64), (h * G + r % G).to(tl.int64)
    q = tl.load(q_ptr + b * qb + i[:, None] * qt + hq[:, None] * qh + d[None, :] * qd,
                mask=rmask[:, None] & (d[None, :] < D), other=0.0).to(tl.float32) * scale
    srow = bh * R + r
    m = tl.load(m_ptr + srow, mask=rmask, other=0.0)
    l = tl.load(l_ptr + srow, mask=rmask, other=0.0)
    acc_off = srow[:, None].to(tl.int64) * DV + dv[None, :]
    amask = rmask[:, None] & (dv[None, :] < DV)
    acc = tl.load(acc_ptr + acc_off, mask=amask, other=0.0)
    for n0 in range(0, N, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < N
        if HAS_COUNTS:  # row_counts of this segment's rows: 0 = not visible (masked, its V row never read)
            w = tl.load(w_ptr + t, mask=tmask, other=0).to(tl.float32)
            tmask = tmask & (w > 0)
        k = _tile(kc, ks, kz, km, kid, kcb, kct, kch, kcs, kcd, ksb, kst, ksh, kss, ksg, kzb, kzt, kzh, kzs, kzg,
                  kmb, kmh, kmc, kmd, kib, kit, kih, b, h, t, tmask, d, D, K_STAGES, KIND, K_GROUP)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(tmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile (and state) with no visible row yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        if HAS_COUNTS:
            p = p * w[None, :]
        l = l * alpha + tl.sum(p, 1)
        v = _tile(vc, vs, vz, vm, vid, vcb, vct, vch, vcs, vcd, vsb, vst, vsh, vss, vsg, vzb, vzt, vzh, vzs, vzg,
                  vmb, vmh, vmc, vmd, vib, vit, vih, b, h, t, tmask, dv, DV, V_STAGES, KIND, V_GROUP)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(m_ptr + srow, m, mask=rmask)
    tl.store(l_ptr + srow, l, mask=rmask)
    tl.store(acc_ptr + acc_off, acc, mask=amask)


def _layout(x: dict, quant):
    """(tensors, strides, stages, group) of one segment for ``_tile``: strides mapped to its fixed dim order."""
    c, s, z, m, ids = (x[k] for k in ("codes", "scales", "zeros", "centroids", "cluster_ids"))
    cst = list(c.stride())
    cs = cst if c.dim() == 5 else cst[:3] + [0, cst[3]]
    if quant in (None, "int8"):
        ss = [0] * 5 if s is None else list(s.stride()) + [0, 0]
    elif quant == "fp8":
        ss = [s.stride(0), 0, s.stride(1), 0, 0]
    elif quant == "int4":
        ss = list(s.stride()[:3]) + [0, s.stride(3)]
    else:
        ss = list(s.stride())
    zs = [0] * 5 if z is None else (list(z.stride()[:3]) + [0, z.stride(3)] if z.dim() == 4 else list(z.stride()))
    ms = [0] * 4 if m is None else list(m.stride())
    is_ = [0] * 3 if ids is None else list(ids.stride())
    d = c.shape[-1] * {None: 1, "int8": 1, "fp8": 1, "int4": 2, "int2": 4}[quant]
    group = d // s.shape[-1] if quant in ("int4", "int2") else 1
    stages = c.shape[3] if quant == "int2" else 1
    if quant == "fp8":  # decoded from the bits; no fp8 pointer reaches the kernel (sm_80/sm_86 have no e4m3 type)
        c = c.view(torch.uint8)
    ptrs = [c, *(t if t is not None else c for t in (s, z, m, ids))]  # placeholders for the unused pointers
    return ptrs, cs + ss + zs + ms + is_, stages, group


def packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale: float, row_counts=None):
    """``(out [B, T, H_q, D_v] q.dtype, lse [B, H_q, T] fp32)``; arguments as ``kvops::packed_attention``."""
    b, t, hq, d = q.shape
    segments = [(dict(codes=k, scales=None, zeros=None, centroids=None, cluster_ids=None),
                 dict(codes=v, scales=None, zeros=None, centroids=None, cluster_ids=None), None)
                for k, v in zip(k_dense, v_dense)]
    if quant is not None:
        segments += [(k, v, quant) for k, v in zip(split_segments(quant, k_packed), split_segments(quant, v_packed))]
    first_v = segments[0][1]["codes"]
    hkv = first_v.shape[2]
    d_v = first_v.shape[-1] * {None: 1, "int8": 1, "fp8": 1, "int4": 2, "int2": 4}[segments[0][2]]
    g = hq // hkv
    rows = t * g
    m = torch.full((b * hkv, rows), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros(b * hkv, rows, dtype=torch.float32, device=q.device)
    acc = torch.zeros(b * hkv, rows, d_v, dtype=torch.float32, device=q.device)
    counts = None if row_counts is None else row_counts.contiguous()
    run(plan_packed_attention(q, segments, hkv, m, l, acc, counts, scale, capability_of(q)))
    has = (l > 0) | torch.isnan(l)  # NaN: a visible row's NaN score (exp(NaN) joined l): NaN, as SDPA
    out = torch.where(has[..., None], acc / torch.where(has, l, 1.0)[..., None], 0.0)
    lse = torch.where(has, m + torch.log(torch.where(has, l, 1.0)), float("-inf"))
    out = out.view(b, hkv, t, g, d_v).permute(0, 2, 1, 3, 4).reshape(b, t, hq, d_v).to(q.dtype)
    return out, lse.view(b, hkv, t, g).permute(0, 1, 3, 2).reshape(b, hq, t)


def segment_config(block_d: int, block_dv: int, rows: int, quant, capability: tuple[int, int]) -> dict:
    """``block_m`` (rows: query tokens x group heads), ``block_n`` (tokens), ``num_warps``, ``num_stages`` of
    ``_segment_kernel`` for padded head dims and the packed format ``quant`` on a device of compute ``capability``. Chosen so that no format spills
    registers or needs more than 99 KB of shared memory (sm_86/sm_89), as ``python benchmarks/gpu_check.py --aot``
    checks."""
    width = max(block_d, block_dv)
    if width >= 256:
        block_m, num_warps = 16, 8
    elif width == 128:
        block_m, num_warps = 16, 4
    else:
        block_m, num_warps = 64, 4
    return dict(block_m=max(16, min(block_m, triton.next_power_of_2(rows))), block_n=16, num_warps=num_warps,
                num_stages=2)


def segment_launch(width: int, fmt, q_dtype: torch.dtype, cfg: dict) -> dict:
    """``block_n``, ``num_warps`` and ``num_stages`` of one segment's launch (the rows of :func:`segment_config` are
    shared by every segment, which update one state; tiles, warps and stages need not be): dense bf16/fp16 segments
    take 32-token tiles at padded width 128 (16: ptxas for sm_100 held them to 80 registers and spilled 20 B) and 4
    warps at 256 (8: 80 registers and 8 B spills on sm_80; fp32 keeps 8, 4 spilled on sm_100); int4 segments up to
    width 128 take 8 warps (4: 168 registers and 12 B spills on sm_80 at 128; at 64 with 16 rows ptxas for sm_90 held
    72 registers and spilled 32-44 B); fp8 and dense bf16/fp16 segments at width 64 take one pipeline stage (two:
    ptxas for sm_86/sm_89 held fp8 at 128 registers and spilled 8 B with bf16/fp16 queries, 16 B over 8 warps; ptxas-
    blackwell held dense fp16 with 16 rows and row counts at 64 registers and spilled 24 B)."""
    out = dict(block_n=cfg["block_n"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if width <= 64 and (fmt == "fp8" or (fmt is None and q_dtype != torch.float32)):
        out["num_stages"] = 1
    if fmt is None and q_dtype != torch.float32:
        if width == 128:
            out["block_n"] = 32
        elif width >= 256:
            out["num_warps"] = 4
    if fmt == "int4" and width <= 128:
        out["num_warps"] = 8
    return out


def plan_packed_attention(q, segments, hkv: int, m, l, acc, counts, scale: float,
                          capability: tuple[int, int]) -> list[Launch]:
    """One launch per non-empty segment of :func:`packed_attention`: ``segments`` are ``(k, v, quant)`` dicts of
    tensors, ``m``/``l [B·H_kv, R]`` and ``acc [B·H_kv, R, D_v]`` the fp32 online-softmax state, ``counts`` the
    ``row_counts`` (or None)."""
    b, t, hq, d = q.shape
    bh, rows, d_v = acc.shape
    g = hq // hkv
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    cfg = segment_config(block_d, block_dv, rows, next((fmt for _, _, fmt in segments if fmt), None), capability)
    block_m = cfg["block_m"]
    grid = (triton.cdiv(rows, block_m), bh)
    launches, row = [], 0
    for ks, vs, fmt in segments:
        n = ks["codes"].shape[1]
        row += n
        if n == 0 or rows == 0 or bh == 0:
            continue
        kp, kst, k_stages, k_group = _layout(ks, fmt)
        vp, vst, v_stages, v_group = _layout(vs, fmt)
        seg = segment_launch(max(block_d, block_dv), fmt, q.dtype, cfg)
        launches.append(Launch(_segment_kernel, grid, (
            q, *kp, *vp, m, l, acc, m if counts is None else counts[row - n :],
            *q.stride(), *kst, *vst, n, g, hkv, rows, d, d_v, k_stages, v_stages, scale),
            dict(KIND=_KIND[fmt], K_GROUP=k_group, V_GROUP=v_group, HAS_COUNTS=counts is not None,
                 BLOCK_M=block_m, BLOCK_N=seg["block_n"], BLOCK_D=block_d, BLOCK_DV=block_dv),
            num_warps=seg["num_warps"], num_stages=seg["num_stages"]))
    return launches
