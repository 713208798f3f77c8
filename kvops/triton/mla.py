"""Triton kernels for the MLA ops (DeepSeek's latent KV cache): ``kvops::mla_cache_write`` and
``kvops::mla_attention``.

Cache ``[P, block_size, kv_lora_rank + rope_dim]``: one latent row per token (no head axis), its first
``kv_lora_rank`` columns the compressed KV ``kv_c``, the last ``rope_dim`` the rotated key part ``k_pe``.

* ``_mla_write_kernel`` (as vLLM's ``concat_and_cache_mla``): one program per token ``i``; slot ``x =
  slot_mapping[i]`` stores ``kv_c[i]`` and ``k_pe[i]`` (rotated at ``positions[i]`` when the RoPE tables are given:
  FlashAttention's convention, as ``kvops/triton/rotary.py``: pairs ``(j, j + half)`` or, interleaved, ``(2j, 2j +
  1)``, fp32 math rounded once to ``k_pe``'s dtype) into block ``x // block_size``, row ``x % block_size``; a
  negative slot writes nothing. fp8 e4m3 caches store ``x / kv_scale`` (fp32 division, saturated to +-448, round to
  nearest even; ``kvops/triton/paged_write.py``'s encoder).
* ``_mla_attention_kernel`` (absorbed MLA, as FlashMLA's ``flash_mla_with_kvcache``): the ``H`` query heads all read
  the single latent head, so they are tiled like the query heads of one GQA group: a program owns ``BLOCK_T``
  query tokens x ``BLOCK_H`` heads of one sequence (rows of one ``tl.dot``) and reads each KV tile once for all of
  them. Scores are ``q[:, :rank] . kv[:rank] + q[:, rank:] . kv[rank:]`` (the 576 columns of DeepSeek's geometry as
  a 512-wide and a 64-wide tile of the same rows); values are the same ``[BLOCK_N, rank]`` tile, so the cache is
  read once per KV tile. Decode batches (``max_seqlen_q == 1``) split the KV range over a third grid axis when the
  batch alone would not fill the GPU; the splits' normalized partial outputs and LSEs are merged by
  ``kvops/triton/paged_decode.py``'s ``_decode_merge_kernel``.

Precision: bf16/fp16 operands go into ``tl.dot`` in their own dtype (exact products, fp32 accumulation), and so do
the softmax weights ``p`` (rounded to q's dtype, as FlashAttention and FlashMLA do): the 512-wide value tile then
costs 2 bytes per value in registers and shared memory, which is what keeps 16 heads x 512 columns spill-free.
fp8 caches are decoded from their bits to q's dtype exactly (e4m3 / 256 is an fp16 value, and a bf16 one) and
the per-tensor ``kv_scale`` (times 256) multiplies the scores and the output instead of every element. fp32
operands use IEEE products. The softmax (max, exp, sums), the accumulator and the LSE are fp32. On CPU tensors (the
Triton interpreter, tests) bf16 products are taken in fp32 (``_dot``'s "upcast": the interpreter's bf16 ``tl.dot``
is wrong), the same exact products. All offsets are int64; KV positions are int64 (``_lane`` offsets from a tile's
int64 start). Slots at or beyond ``seq_len`` and table entries past it are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.paged_write import unaliased
from .launch import Launch, capability_of, run
from .paged_attention import merge_splits
from .paged_decode import _decode_merge_kernel
from .paged_tiles import _lane
from .paged_write import _e4m3_bits

_TARGET_PROGRAMS = 256  # decode: split the KV range until about this many programs run (~2 per SM on H100/H200)


@triton.jit
def e4m3_to_f16_over_256(b):
    """float8_e4m3fn bit patterns (uint8) -> fp16 ``value / 256``, exactly, NaN kept (``S.1111.111``).

    The e4m3 bits shifted into fp16's exponent and mantissa fields (``S EEEE MMM`` -> ``S 0EEEE MMM0000000``) are an
    fp16 of exponent bias 15 instead of 7, subnormals included: the value times ``2^-8``. Three integer ops and a
    select per element (``e4m3_to_f32`` takes about fifteen, which made the 16 x 512 tiles spill).
    """
    h = b.to(tl.uint16)
    x = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return tl.where((h & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def _mla_write_kernel(
    kvc_ptr, kpe_ptr, cache_ptr, slot_ptr, scale_ptr, pos_ptr, cos_ptr, sin_ptr,
    rank, rope_dim, block_size,
    s_ct, s_cd, s_pt, s_pd, c_p, c_b, c_d, t_s, t_j, u_s, u_j,
    QUANT: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program ``i``: ``cache[slot // block_size, slot % block_size] = concat(kv_c[i], rope(k_pe[i]))``."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    ok = slot >= 0  # a negative slot (padding) masks out every element
    n_c = tl.where(ok, rank, 0)  # (a vector & scalar-bool mask trips the interpreter)
    n_p = tl.where(ok, rope_dim, 0)
    row = cache_ptr + (slot // block_size) * c_p + (slot % block_size) * c_b
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.load(kvc_ptr + i * s_ct + r * s_cd, mask=r < n_c, other=0.0)
    d = tl.arange(0, BLOCK_P).to(tl.int64)
    pmask = d < n_p
    pe_row = kpe_ptr + i * s_pt
    x = tl.load(pe_row + d * s_pd, mask=pmask, other=0.0)
    if ROTARY:
        rot = pmask & (d < 2 * HALF)
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            partner = d + 1 - 2 * (d % 2)
            j = d // 2
            first = d % 2 == 0
        else:  # pairs (j, j + HALF)
            first = d < HALF
            partner = tl.where(first, d + HALF, d - HALF)
            j = tl.where(first, d, d - HALF)
        pos = tl.load(pos_ptr + i).to(tl.int64)
        xf = x.to(tl.float32)
        y = tl.load(pe_row + partner * s_pd, mask=rot, other=0.0).to(tl.float32)
        cs = tl.load(cos_ptr + pos * t_s + j * t_j, mask=rot, other=1.0).to(tl.float32)
        sn = tl.load(sin_ptr + pos * u_s + j * u_j, mask=rot, other=0.0).to(tl.float32)
        x = tl.where(rot, tl.where(first, xf * cs - y * sn, xf * cs + y * sn), xf)
        x = x.to(kpe_ptr.dtype.element_ty)  # rounded once to k_pe's dtype, as rotary_paged_cache_write
    if QUANT:  # cache_ptr: the cache as uint8; one per-tensor scale
        scale = tl.load(scale_ptr)
        c = _e4m3_bits(tl.math.div_rn(c.to(tl.float32), scale)).to(tl.uint8)
        x = _e4m3_bits(tl.math.div_rn(x.to(tl.float32), scale)).to(tl.uint8)
    tl.store(row + r * c_d, c.to(cache_ptr.dtype.element_ty), mask=r < n_c)
    tl.store(row + (rank + d) * c_d, x.to(cache_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` (fp32). ``PREC`` "tf32"/"ieee": ``tl.dot``'s ``input_precision`` (16-bit operands multiply
    exactly either way); "upcast" (CPU tensors only: the Triton interpreter, whose bf16 ``tl.dot`` returns garbage in
    Triton 3.9) multiplies the operands converted to fp32 with IEEE products: the same exact products."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc, input_precision=PREC)


@triton.jit
def _mla_attention_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, kv_scale_ptr, out_ptr, lse_ptr,
    s_qt, s_qh, s_qd, s_kp, s_kb, s_kd, s_bt, s_ot, s_oh, s_od, s_lh,
    num_heads, block_size, capacity, rank, rope_dim, scale, num_splits, tokens_per_split,
    CAUSAL: tl.constexpr, IS_FP8: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program ``(tile, b, head block [x split])``: rows are (query token, head) pairs of sequence ``b``; an online
    softmax over KV tiles read through ``block_table``. ``SPLIT``: out/lse are the decode partials ``[B, H, S,
    rank]`` / ``[B, H, S]`` of KV range ``[split * tokens_per_split, ...)``, normalized (merged afterwards)."""
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    hb = tl.program_id(2)
    split = hb * 0
    if SPLIT:
        split = hb % num_splits
        hb = hb // num_splits
    kv_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_H
    offs_m = tl.arange(0, BLOCK_M)
    t_loc = tile * BLOCK_T + offs_m // BLOCK_H  # query index within the sequence
    heads = hb * BLOCK_H + offs_m % BLOCK_H
    row_ok = (t_loc < q_len) & (heads < num_heads)
    tok = q_start + t_loc.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + tok[:, None] * s_qt + heads[:, None].to(tl.int64) * s_qh
    q_c = tl.load(q_row + offs_r[None, :] * s_qd, mask=row_ok[:, None] & (offs_r[None, :] < rank), other=0.0)
    q_pe = tl.load(q_row + (rank + offs_p)[None, :] * s_qd, mask=row_ok[:, None] & (offs_p[None, :] < rope_dim),
                   other=0.0)
    qk_scale = scale
    if IS_FP8:  # per-tensor scale: on the scores and the output, not on every element
        kv_scale = tl.load(kv_scale_ptr) * 256.0  # the tiles hold e4m3 values / 256 (e4m3_to_f16_over_256)
        qk_scale = scale * kv_scale
    pos = kv_len - q_len + t_loc  # int64 positions

    kv_lim = tl.minimum(kv_len, capacity)
    lo = kv_lim * 0
    hi = kv_lim
    if CAUSAL:  # the tile's last query sees positions <= its own
        hi = tl.minimum(hi, kv_len - q_len + tl.minimum(tile * BLOCK_T + BLOCK_T, q_len))
    if SPLIT:
        lo = split * tokens_per_split
        hi = tl.minimum(hi, lo + tokens_per_split)
    hi = tl.where(tile * BLOCK_T < q_len, hi, lo)  # programs past this sequence's queries do no work
    bt_row = bt_ptr + b * s_bt
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        in_seq = offs_n < _lane(hi, n0, BLOCK_N)
        blk0 = n0 // block_size
        rel = (n0 - blk0 * block_size).to(tl.int32) + offs_n  # < block_size + BLOCK_N
        blk = tl.load(bt_row + blk0 + rel // block_size, mask=in_seq, other=0).to(tl.int64)
        kv_row = kv_ptr + blk[:, None] * s_kp + (rel % block_size)[:, None].to(tl.int64) * s_kb
        c_mask = in_seq[:, None] & (offs_r[None, :] < rank)
        p_mask = in_seq[:, None] & (offs_p[None, :] < rope_dim)
        if IS_FP8:  # kv_ptr: the cache as uint8; e4m3 / 256 -> fp16 -> q's dtype is exact (x 256: in kv_scale)
            kv = e4m3_to_f16_over_256(tl.load(kv_row + offs_r[None, :] * s_kd, mask=c_mask, other=0)).to(q_c.dtype)
            pe = e4m3_to_f16_over_256(tl.load(kv_row + (rank + offs_p)[None, :] * s_kd, mask=p_mask,
                                              other=0)).to(q_c.dtype)
        else:
            kv = tl.load(kv_row + offs_r[None, :] * s_kd, mask=c_mask, other=0.0)
            pe = tl.load(kv_row + (rank + offs_p)[None, :] * s_kd, mask=p_mask, other=0.0)
        s = _dot(q_pe, tl.trans(pe), _dot(q_c, tl.trans(kv), None, PREC), PREC) * qk_scale
        vis = (offs_n < _lane(hi, n0, BLOCK_N))[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= _lane(pos, n0, BLOCK_N)[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(kv.dtype), kv, acc * alpha[:, None], PREC)
        m_i = m_new

    has = (l_i > 0) | (l_i != l_i)  # NaN: a visible key's NaN score (exp(NaN) joined l): the row is NaN, as SDPA
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    inv = 1.0 / tl.where(has, l_i, 1.0)
    if IS_FP8:
        inv = inv * kv_scale
    o = tl.where(has[:, None], acc * inv[:, None], 0.0)
    o_mask = row_ok[:, None] & (offs_r[None, :] < rank)
    if SPLIT:  # partials [B, H, num_splits, rank] and [B, H, num_splits] (the merge's layout)
        prow = (b * num_heads + heads) * num_splits + split
        tl.store(lse_ptr + prow, lse, mask=heads < num_heads)
        tl.store(out_ptr + prow[:, None] * rank + offs_r[None, :], o,
                 mask=(heads < num_heads)[:, None] & (offs_r[None, :] < rank))
    else:
        tl.store(out_ptr + tok[:, None] * s_ot + heads[:, None].to(tl.int64) * s_oh + offs_r[None, :] * s_od,
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + heads.to(tl.int64) * s_lh + tok, lse, mask=row_ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# --- write ------------------------------------------------------------------------------------------------------
def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, positions=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved: bool = False) -> None:
    """Launcher (arguments already validated). Slots ``>= P * block_size`` and positions outside the tables are
    not checked on the device (as vLLM): value contracts of the op. ``kv_c``/``k_pe`` overlapping the cache are
    copied first (read before anything is written, docs/semantics.md §3)."""
    n = slot_mapping.shape[0]
    kv_c, k_pe = unaliased(kv_c[:n], kv_cache, kv_cache), unaliased(k_pe[:n], kv_cache, kv_cache)
    run(plan_mla_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                       rotary_interleaved, capability_of(kv_cache)))


def plan_mla_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                   rotary_interleaved: bool, capability: tuple[int, int]) -> list[Launch]:
    """The launch of :func:`mla_cache_write` (none for an empty ``slot_mapping``)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return []
    rank, rope_dim = int(kv_c.shape[-1]), int(k_pe.shape[-1])
    slots = slot_mapping.contiguous()  # metadata: read at slot_ptr + i
    quant = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8) if quant else kv_cache  # fp8: store encoded bytes (same strides)
    rotary = rotary_cos is not None
    pos = positions.contiguous() if rotary else slots  # placeholders when not rotating
    cos, sin = (rotary_cos, rotary_sin) if rotary else (kv_c, kv_c)
    t_strides = (*rotary_cos.stride(), *rotary_sin.stride()) if rotary else (0, 0, 0, 0)
    block_r, block_p = triton.next_power_of_2(rank), triton.next_power_of_2(max(rope_dim, 1))
    return [Launch(_mla_write_kernel, (n,), (
        kv_c, k_pe, cache, slots, kv_scale if quant else slots, pos, cos, sin,
        rank, rope_dim, kv_cache.shape[1], *kv_c.stride(), *k_pe.stride(), *cache.stride(), *t_strides),
        dict(QUANT=quant, ROTARY=rotary, INTERLEAVED=bool(rotary_interleaved),
             HALF=int(rotary_cos.shape[1]) if rotary else 1, BLOCK_R=block_r, BLOCK_P=block_p),
        num_warps=4 if block_r + block_p > 256 else 1)]


# --- attention --------------------------------------------------------------------------------------------------
def tile_config(decode: bool, block_r: int, operands: str, capability: tuple[int, int]) -> dict:
    """``block_n`` (KV tokens per tile), ``block_m`` (rows: query tokens x heads), ``num_warps``, ``num_stages``.

    ``operands``: "16bit" (bf16/fp16 q; fp8 caches decode to it) or "fp32" (IEEE products on CUDA cores, both
    operands in registers). Chosen so that DeepSeek's geometry (rank 512, rope 64, 128 heads, block_size 16 and 64)
    compiles without spills and within 99 KB of shared memory (sm_86/sm_89) for sm_80..sm_100, as checked by
    ``python benchmarks/gpu_check.py --aot`` (docs/gpu.md). The accumulator ``[block_m, rank]`` is fp32 in registers:
    16 rows x 512 over 8 warps is 32 registers a thread.
    """
    if operands == "fp32":
        return dict(block_n=16, block_m=16, num_warps=8, num_stages=1)
    return dict(block_n=32 if block_r <= 256 else 16, block_m=16, num_warps=8 if block_r >= 256 else 4,
                num_stages=2)


def mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int, kv_lora_rank: int,
                  scale: float, causal: bool, kv_scale=None, *, num_splits: int | None = None,
                  block_n: int | None = None, block_m: int | None = None):
    """Launch the kernels on validated arguments (``scale`` resolved to a float); returns ``(out, lse)``.

    ``out [T_q, H, kv_lora_rank]`` in q's dtype, ``lse [H, T_q]`` fp32 (natural log). A query with no visible key
    gets ``out = 0`` and ``lse = -inf``, as ``kvops.paged_attention``; rows past ``cu_seqlens_q[-1]`` too.
    ``num_splits`` (decode only; default: a heuristic filling about ``_TARGET_PROGRAMS`` programs), ``block_n`` and
    ``block_m`` override :func:`tile_config` (tests).
    """
    launches, out, lse = plan_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q,
                                            kv_lora_rank, scale, causal, kv_scale, capability_of(q),
                                            num_splits=num_splits, block_n=block_n, block_m=block_m)
    run(launches)
    return out, lse


def plan_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int, kv_lora_rank: int,
                       scale: float, causal: bool, kv_scale, capability: tuple[int, int], *,
                       num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None):
    """The launches of :func:`mla_attention` for a device of compute ``capability`` (also run on ``meta`` tensors
    by the ahead-of-time check), with the allocated ``out`` and ``lse``."""
    num_tokens, num_heads, width = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    rank = int(kv_lora_rank)
    rope_dim = width - rank
    batch, max_blocks, block_size = block_table.shape[0], block_table.shape[1], int(kv_cache.shape[1])
    out = torch.zeros((num_tokens, num_heads, rank), dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or batch == 0:
        return [], out, lse
    capacity = max_blocks * block_size
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    block_table, seq_lens, cu_seqlens_q = block_table.contiguous(), seq_lens.contiguous(), cu_seqlens_q.contiguous()
    cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache  # decoded from its bits: same strides, no copy
    operands = "fp32" if q.dtype == torch.float32 else "16bit"
    block_r, block_p = _pow2(rank), _pow2(rope_dim)
    decode = max_seqlen_q == 1
    cfg = tile_config(decode, block_r, operands, capability)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_m = cfg["block_m"] if block_m is None else block_m
    block_h = min(triton.next_power_of_2(num_heads), block_m)
    block_t = max(block_m // block_h, 1)
    if decode:  # one query per sequence: every row a head
        block_h, block_t = max(block_m, 16), 1
    head_blocks = triton.cdiv(num_heads, block_h)
    if decode and num_splits is None:
        num_splits = max(1, min(triton.cdiv(capacity, block_n), triton.cdiv(_TARGET_PROGRAMS, batch * head_blocks)))
    split = decode and num_splits > 1
    tokens_per_split = capacity
    if split:  # whole KV tiles per split; grid sizes are concrete ints
        tokens_per_split = int(triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n)
        num_splits = int(triton.cdiv(capacity, tokens_per_split))
        split = num_splits > 1
    if not split:
        num_splits = 1
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], wrap=True)
    interpreted_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    prec = "ieee" if operands == "fp32" else "upcast" if interpreted_bf16 else "tf32"
    constexprs = dict(CAUSAL=bool(causal), IS_FP8=is_fp8, SPLIT=split, PREC=prec,
                      BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=block_p)
    sc = kv_scale if is_fp8 else seq_lens  # placeholder when not fp8
    grid = (triton.cdiv(max_seqlen_q, block_t), batch, head_blocks * num_splits)
    if not split:
        launch = Launch(_mla_attention_kernel, grid, (
            q, cache, block_table, seq_lens, cu_seqlens_q, sc, out, lse,
            *q.stride(), *cache.stride(), block_table.stride(0), *out.stride(), lse.stride(0),
            num_heads, block_size, capacity, rank, rope_dim, scale, num_splits, tokens_per_split), constexprs, **opts)
        return [launch], out, lse
    part_o = torch.empty((batch, num_heads, num_splits, rank), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    launch = Launch(_mla_attention_kernel, grid, (
        q, cache, block_table, seq_lens, cu_seqlens_q, sc, part_o, part_lse,
        *q.stride(), *cache.stride(), block_table.stride(0), *out.stride(), lse.stride(0),
        num_heads, block_size, capacity, rank, rope_dim, scale, num_splits, tokens_per_split), constexprs, **opts)
    merge = Launch(_decode_merge_kernel, (batch, num_heads), (
        part_o, part_lse, part_lse, cu_seqlens_q, out, lse, *out.stride(), lse.stride(0), num_splits, rank),
        dict(HAS_SINKS=False, BLOCK_S=merge_splits(num_splits, block_r), BLOCK_DV=block_r), wrap=True)
    return [launch, merge], out, lse
