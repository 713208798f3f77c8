"""Triton kernels of ``kvops::merge_attention_states`` (two parts) and ``kvops::merge_attention_states_many`` (``N``
stacked parts): docs/semantics.md §12, as ``kvops/cpu/merge.py``.

One program per (query row ``t``, tile of ``BLOCK_H`` heads): it loads the parts' LSEs (fp32; ``+inf`` read as
``-inf``), computes ``m``, the weights and the merged LSE, then streams the parts' ``out`` rows ``[BLOCK_H,
BLOCK_D]`` (loaded in their dtype, ``.to(fp32)``), accumulates in fp32 and stores once in the parts' dtype. The
many-way kernel takes two passes over the ``N`` LSEs (max, then weights) and one over the outputs. Strides
everywhere (FlashInfer's ``[T, H]`` LSE passed as ``lse.t()`` is read in place); int64 offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, capability_of, run

_TILE = 4096  # elements of one [BLOCK_H, BLOCK_D] tile: at most 32 fp32 registers per thread over 4 warps


@triton.jit
def _load_lse(ptr, t, h, mask, s_h, s_t):
    x = tl.load(ptr + h * s_h + t * s_t, mask=mask, other=float("-inf"))
    return tl.where(x == float("inf"), float("-inf"), x)  # FlashAttention-2's empty part (vLLM's reading)


@triton.jit
def _merge_two_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr,
    H, D,
    a_t, a_h, a_d, la_h, la_t, b_t, b_h, b_d, lb_h, lb_t, o_t, o_h, o_d, l_h, l_t,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    hm = h < H
    la = _load_lse(la_ptr, t, h, hm, la_h, la_t)
    lb = _load_lse(lb_ptr, t, h, hm, lb_h, lb_t)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: weights 0, no NaN
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    s = wa + wb
    tl.store(lse_ptr + h * l_h + t * l_t, tl.log(s) + m, mask=hm)
    inv = tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0)
    ca = (wa * inv)[:, None]
    cb = (wb * inv)[:, None]
    mask = hm[:, None] & (d < D)[None, :]
    xa = tl.load(oa_ptr + t * a_t + h[:, None] * a_h + d[None, :] * a_d, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(ob_ptr + t * b_t + h[:, None] * b_h + d[None, :] * b_d, mask=mask, other=0.0).to(tl.float32)
    out = xa * ca + xb * cb
    tl.store(out_ptr + t * o_t + h[:, None] * o_h + d[None, :] * o_d, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_many_kernel(
    o_ptr, l_ptr, out_ptr, lse_ptr,
    N, H, D,
    s_n, s_t, s_h, s_d, ls_n, ls_h, ls_t, o_t, o_h, o_d, l_h, l_t,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    hm = h < H
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for i in range(N):
        m = tl.maximum(m, _load_lse(l_ptr + i * ls_n, t, h, hm, ls_h, ls_t))
    m = tl.where(m == float("-inf"), 0.0, m)  # every part empty: weights 0, no NaN
    s = tl.zeros((BLOCK_H,), tl.float32)
    for i in range(N):
        s += tl.exp(_load_lse(l_ptr + i * ls_n, t, h, hm, ls_h, ls_t) - m)
    tl.store(lse_ptr + h * l_h + t * l_t, tl.log(s) + m, mask=hm)
    inv = tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0)
    mask = hm[:, None] & (d < D)[None, :]
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for i in range(N):
        c = tl.exp(_load_lse(l_ptr + i * ls_n, t, h, hm, ls_h, ls_t) - m) * inv
        x = tl.load(o_ptr + i * s_n + t * s_t + h[:, None] * s_h + d[None, :] * s_d, mask=mask, other=0.0)
        acc += x.to(tl.float32) * c[:, None]
    tl.store(out_ptr + t * o_t + h[:, None] * o_h + d[None, :] * o_d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(h: int, d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(max(d, 1))
    return min(triton.next_power_of_2(max(h, 1)), max(1, _TILE // block_d)), block_d


def plan_merge_two(o_a, lse_a, o_b, lse_b, out, lse, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`merge_attention_states` (none for ``T == 0`` or ``H == 0``)."""
    t, h, d = o_a.shape
    if t == 0 or h == 0:
        return []
    block_h, block_d = _tiles(h, d)
    return [Launch(_merge_two_kernel, (t, triton.cdiv(h, block_h)), (
        o_a, lse_a, o_b, lse_b, out, lse, h, d, *o_a.stride(), *lse_a.stride(), *o_b.stride(), *lse_b.stride(),
        *out.stride(), *lse.stride()), dict(BLOCK_H=block_h, BLOCK_D=block_d))]


def plan_merge_many(outs, lses, out, lse, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`merge_attention_states_many` (none for ``T == 0`` or ``H == 0``)."""
    n, t, h, d = outs.shape
    if t == 0 or h == 0:
        return []
    block_h, block_d = _tiles(h, d)
    return [Launch(_merge_many_kernel, (t, triton.cdiv(h, block_h)), (
        outs, lses, out, lse, n, h, d, *outs.stride(), *lses.stride(), *out.stride(), *lse.stride()),
        dict(BLOCK_H=block_h, BLOCK_D=block_d))]


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Launcher with the CPU kernel's signature (arguments validated): ``(out [T, H, D_v], lse [H, T] float32)``."""
    t, h, _ = o_a.shape
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    lse = torch.empty((h, t), dtype=torch.float32, device=o_a.device)
    run(plan_merge_two(o_a, lse_a, o_b, lse_b, out, lse, capability_of(o_a)))
    return out, lse


def merge_attention_states_many(outs, lses):
    """Launcher with the CPU kernel's signature (arguments validated): ``(out [T, H, D_v], lse [H, T] float32)``."""
    n, t, h, d = outs.shape
    out = torch.empty((t, h, d), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((h, t), dtype=torch.float32, device=outs.device)
    run(plan_merge_many(outs, lses, out, lse, capability_of(outs)))
    return out, lse
