"""Launcher and launch plan (grid, tiles, splits, feature arguments) of the Triton kernels for
``kvops::paged_attention`` (docs/semantics.md §4): split-KV decode + merge (``paged_decode.py``), and (chunked)
prefill (``paged_prefill.py``); the KV-tile loop the kernels share is in ``paged_tiles.py``.

* ``_decode_split_kernel`` (batches with ``max_seqlen_q == 1``): one program per (sequence, KV head, KV split). The
  ``G = H_q // H_kv`` query heads that share a KV head are packed into the rows of one program, so each K/V tile is
  read once per KV head. Each split writes a normalized partial output and its LSE; ``_decode_merge_kernel`` combines
  the splits (and the attention sink) per (sequence, query head).
* ``_prefill_kernel`` (any batch, e.g. chunked prefill mixed with decodes): one program per (query tile, sequence, KV
  head); rows are (query token, group head) pairs; an online softmax runs over KV tiles read through ``block_table``
  between the causal/window bounds of the tile. The grid uses ``max_seqlen_q`` (as FlashAttention's varlen API), so no
  host sync is needed; programs past a sequence's ``q_len`` do no work.

All offsets into q, the caches and the outputs are int64, and so are KV positions (``seq_lens`` reach 2^31 - 1; a
tile's lanes are int32 offsets from its int64 first position). Loads of bf16/fp16/fp8 are converted to fp32 before any
arithmetic; ``tl.dot`` runs with ``input_precision="ieee"`` for fp32 inputs and ``"tf32"`` otherwise. Slots at or
beyond ``seq_len`` are never loaded (masked loads), and unused block-table entries are never read, so NaN garbage there
cannot reach the output. Tested on CPU tensors with ``TRITON_INTERPRET=1`` by calling ``paged_attention`` here.

The launchers call the kernels through ``torch.library.wrap_triton`` so that, inside the ``triton_op`` of
``kvops/ops/paged_attention.py``, ``torch.compile`` on CUDA sees the Triton kernels themselves.
"""

from __future__ import annotations

import math

import torch
import triton

from .._checks.features import NO_FEATURES, AttnFeatures, resolve
from ..custom_mask import mask_indptr
from .launch import Launch, capability_of, run
from .paged_decode import _decode_merge_kernel, _decode_split_kernel
from .paged_prefill import _prefill_kernel

_TARGET_PROGRAMS = 256  # decode: aim for about this many (sequence, KV head, split) programs (~2 per SM on H100/H200)
_MERGE_VALUES = 4096  # decode merge: partial-output values per step (32 fp32 registers a thread at 4 warps)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    features: AttnFeatures = NO_FEATURES,
    *,
    force_prefill: bool = False,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels on validated arguments (see ``kvops.paged_attention``); returns ``(out, lse)``.

    ``features``: the validator's record of the attention features (``kvops/_checks/features.py``).
    ``out [T_q, H_q, D_v]`` in q's dtype, ``lse [H_q, T_q]`` fp32 (natural log, sinks included). Batches with
    ``max_seqlen_q == 1`` use split-KV decode + merge (``num_splits`` defaults to a heuristic filling about
    ``_TARGET_PROGRAMS`` programs); others, or ``force_prefill=True``, use the prefill kernel. ``block_n`` (KV tile,
    tokens) and ``block_m`` (prefill rows: query tokens x padded group heads) default to :func:`tile_config`'s choice
    for the device. Rows of ``out`` that belong to no sequence (``cu_seqlens_q[-1] < T_q``, e.g. a padded CUDA-graph
    batch) are 0 with LSE ``-inf``.
    """
    launches, out, lse = plan_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left, softcap,
        sinks, k_scale, v_scale, capability_of(q), features, force_prefill=force_prefill, num_splits=num_splits,
        block_n=block_n, block_m=block_m,
    )
    run(launches)
    return out, lse


def merge_splits(num_splits: int, block_dv: int) -> int:
    """``BLOCK_S``: splits ``_decode_merge_kernel`` reads per step, at most ``_MERGE_VALUES // block_dv`` (the
    partial outputs of all of them are live in registers at once)."""
    return min(_pow2(num_splits, 1), max(1, _MERGE_VALUES // block_dv))


def tile_config(kind: str, block_d: int, block_dv: int, operands: str, capability: tuple[int, int],
                rope: bool = False, group: int = 1, mask: bool = False) -> dict:
    """``block_n`` (KV tokens per tile), ``block_m`` (prefill rows), ``num_warps`` and ``num_stages`` of one kernel.

    ``kind`` is "decode" or "prefill", ``block_d``/``block_dv`` the padded head dims, ``operands`` what ``tl.dot``
    multiplies: "fp32" (fp32 inputs, IEEE products on CUDA cores), "fp8" (e4m3 bits decoded in registers, TF32) or
    "16bit" (bf16/fp16 converted to fp32, TF32). Every tile is converted to fp32 before the dot, so K/V tiles cost 4
    bytes per value in registers and shared memory whatever the cache dtype. Chosen so that no (kernel, head_dim,
    flag) combination spills registers or needs more than 99 KB of shared memory (sm_86/sm_89, the smallest block
    budget of the targets), as checked by ``python benchmarks/gpu_check.py --aot``; two pipeline stages (the K/V
    loads are gathers through ``block_table``, so deeper pipelining only costs shared memory). Prefill tiles: fp32
    16 rows x 16 tokens over 8 warps (32 x 16 at width 256 for GQA ``group`` 3-8 without RoPE: 16 rows of 2
    tokens x 8 heads were held to 64 registers by ptxas for sm_80 and spilled 4 B, 4 x 4 on sm_100; 32 rows
    spilled for 1 head or with RoPE on sm_90); padded width 256 16 x 32 over 8 warps (16-bit on sm_90 and sm_100: 16 x
    16, as ptxas for them held 16 x 32 at 80 registers over 8 warps, sm_90's at 128 over 4, and spilled 4-12 B); 16-bit at width 128 32 x 32 over 8
    warps (64 x 32 over 4 warps took 255 registers with causal + window + softcap + sinks and spilled 20-32 B on
    sm_80; over 8 warps ptxas for sm_100 capped it at 128 registers and spilled 4-8 B), 64 x 32 over 4 warps at
    width 64; fp8 32 x 32 over 4 warps. Decode: 16 rows over 4 warps (8 for fp32, but 4 with RoPE at width 64:
    GQA 4:1 spilled 436 B on sm_86 over 4 at width 128, 4 B at 255 registers on sm_90 at width 64, where 8 warps
    take 40-57, ALiBi at width 256 G=8 16 B at 128 registers on sm_86/sm_89; with RoPE at width 64 8 warps spilled
    12 B on sm_100; 8 for fp8 up to width 128 on sm_90 and sm_100, where ptxas held 4 warps at 80 registers
    at width 64 (both) and 128 at width 128 (sm_90) and spilled 8-28 B; 8 for bf16/fp16 at width 128 on sm_100:
    96 registers and 4-8 B spills over 4; one stage for bf16/fp16 at width 64 on sm_100, where two were held at 72
    registers and spilled 20 B; 16-bit prefill at width 64 over 8 warps on sm_100: over 4, 96 registers and 4 B
    with every flag). With ``rope`` (RoPE at
    read time) one stage: K and its rotation partner are turned in registers before the dot, and pipelining both
    loads through shared memory kept two K tiles and their copies live (fp32 D=256 prefill: 304 B spills at two
    stages, none at one); at padded head dims >= 128 also 8 warps and smaller tiles (decode: at most 32 KV tokens;
    prefill with 16-bit or fp8 operands: 16 rows x 32 tokens, 16 x 16 for fp8 at 256), which the sink-token loop
    with its second turned query needs (up to 900 B spills on sm_80 before); fp8 decode on sm_100 16-token tiles
    (16 warps at 256). With a custom ``mask`` (docs/tree-mask.md) prefill runs over at least 8 warps: each tile's
    int64 mask indices over 4 warps took fp8 at width 128 (GQA 7:1) to 255 registers and 8 B spills on sm_90; at
    padded width 256 16-token tiles (Triton 3.6 for sm_90: bf16 16 x 32 with RoPE and every flag, 156 B spills).
    """
    width = max(block_d, block_dv)
    cfg = _tiles(kind, width, operands)
    if kind == "prefill" and operands == "fp32" and width >= 256 and 2 < group <= 8 and not rope:
        cfg["block_m"] = 32
    if kind == "prefill" and operands == "16bit" and width >= 256 and capability >= (9, 0):
        # ptxas for sm_90 and sm_100 held 32 tokens at 80 registers (8 warps; 128 over 4): 4-12 B spills
        cfg["block_n"] = 16
    if kind == "decode" and operands == "fp8" and width <= 128 and capability >= (9, 0):
        # over 4 warps ptxas for sm_90 and sm_100 held 80 registers (D=64, 28 B spills), for sm_90 128 (D=80, 8 B)
        cfg["num_warps"] = 8
    if kind == "decode" and operands == "16bit" and width == 128 and capability >= (10, 0):
        cfg["num_warps"] = 8  # over 4 ptxas-blackwell held 96 registers: 4-8 B spills
    if kind == "prefill" and operands == "16bit" and width == 64 and capability >= (10, 0):
        cfg["num_warps"] = 8  # over 4 ptxas-blackwell held 96 registers with every flag: 4 B spills
    if kind == "decode" and operands == "16bit" and width == 64 and capability >= (10, 0):
        # two stages: ptxas-blackwell, under Triton's --regAllocOptLevel=2, held 72 registers and spilled 20 B
        cfg["num_stages"] = 1
    if rope:
        cfg["num_stages"] = 1
        if width >= 128 and kind == "decode":
            cfg.update(block_n=min(cfg["block_n"], 32), num_warps=8)
            if operands == "fp8" and capability >= (10, 0):  # ptxas-blackwell: 8 B spills at 255 registers
                cfg.update(block_n=16, num_warps=16 if width >= 256 else 8)
        elif kind == "decode" and operands == "fp32":  # width 64: over 8 warps 128 registers, 12 B spills (sm_100)
            cfg["num_warps"] = 4
        elif width >= 128 and operands != "fp32":
            cfg.update(block_n=16 if operands == "fp8" and width >= 256 else 32, block_m=16, num_warps=8)
    if mask and kind == "prefill":
        cfg["num_warps"] = max(cfg["num_warps"], 8)
        if width >= 256:  # Triton 3.6's ptxas for sm_90: bf16 with RoPE, every flag and a packed mask, 16 x 32 over
            cfg["block_n"] = 16  # 8 warps, took 255 registers and spilled 156 B
    return cfg


def _tiles(kind: str, width: int, operands: str) -> dict:
    if kind == "decode":  # 16 rows (the padded query heads of one KV head)
        if operands == "fp8":  # the e4m3 decode keeps the integer bits and the fp32 values live
            block_n = 32 if width <= 128 else 16
        else:
            block_n = 64 if width <= 64 or (width <= 128 and operands == "16bit") else 32 if width <= 128 else 16
        # fp32 over 8 warps: over 4, GQA 4:1 without flags took 255 registers and spilled 436 B at width 128
        # (sm_86), 4 B at width 64 (sm_90); ALiBi at width 256 with GQA 8:1 128 registers and 16 B (sm_86/sm_89)
        return dict(block_n=block_n, block_m=16, num_warps=8 if operands == "fp32" else 4, num_stages=2)
    if operands == "fp32":  # IEEE products on CUDA cores hold both operands in registers
        return dict(block_n=16, block_m=16, num_warps=8, num_stages=2)
    if width >= 256:
        return dict(block_n=32, block_m=16, num_warps=8, num_stages=2)
    if operands == "16bit" and width >= 128:  # 64 rows over 4 warps: 255 registers, spills with every flag
        return dict(block_n=32, block_m=32, num_warps=8, num_stages=2)
    block_m = 64 if operands == "16bit" else 32
    return dict(block_n=32, block_m=block_m, num_warps=4, num_stages=2)


def plan_paged_attention(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int, scale: float, causal: bool,
    window_left: int, softcap: float, sinks, k_scale, v_scale, capability: tuple[int, int],
    features: AttnFeatures = NO_FEATURES, *, force_prefill: bool = False, num_splits: int | None = None,
    block_n: int | None = None, block_m: int | None = None,
) -> tuple[list[Launch], torch.Tensor, torch.Tensor]:
    """The launches of :func:`paged_attention` for a device of compute ``capability`` (also run on ``meta`` tensors
    by the ahead-of-time check), with the allocated ``out`` and ``lse``."""
    window_left, features = resolve(window_left, features)  # (no overflow; the validator's record is resolved)
    num_tokens, batch, max_blocks = q.shape[0], block_table.shape[0], block_table.shape[1]
    # sizes that define the kernels specialize under tracing (constexpr tile sizes derive from them)
    num_heads, d = int(q.shape[1]), int(q.shape[2])
    block_size, num_kv_heads, d_v = int(v_cache.shape[1]), int(v_cache.shape[2]), int(v_cache.shape[3])
    group = num_heads // num_kv_heads
    # rows past cu_seqlens_q[-1] belong to no sequence and are never stored by the kernels: 0 and LSE -inf
    out = torch.zeros((num_tokens, num_heads, d_v), dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or batch == 0:
        return [], out, lse
    capacity = max_blocks * block_size
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    # The kernels index the small metadata tensors as contiguous: make them so (never the caches, which keep their
    # strides); fp8 scales become contiguous [H_kv] so K and V may use different scale shapes.
    block_table, seq_lens, cu_seqlens_q = block_table.contiguous(), seq_lens.contiguous(), cu_seqlens_q.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    k_sc = k_scale.expand(num_kv_heads).contiguous() if is_fp8 else seq_lens  # placeholders when not fp8
    v_sc = v_scale.expand(num_kv_heads).contiguous() if is_fp8 else seq_lens
    if is_fp8:  # the kernels decode e4m3 from bytes: same strides, a view, no copy
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    block_g = _pow2(group)
    block_d, block_dv = _pow2(d), _pow2(d_v)
    decode = max_seqlen_q == 1 and not force_prefill and features.mask() is None  # a mask: the prefill kernel
    causal = causal and features.mask() is None  # a custom mask replaces the causal bound (docs/tree-mask.md)
    operands = "fp8" if is_fp8 else "fp32" if q.dtype == torch.float32 else "16bit"
    cfg = tile_config("decode" if decode else "prefill", block_d, block_dv, operands, capability,
                      rope=features.rope_theta is not None, group=group, mask=features.mask() is not None)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_m = cfg["block_m"] if block_m is None else block_m
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], wrap=True)
    common = dict(
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, IS_FP8=is_fp8, PREC=prec,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
    )
    feats = _feature_args(features, window_left, causal, not decode, num_heads, d, cu_seqlens_q)
    if decode:
        if num_splits is None:
            fill = triton.cdiv(_TARGET_PROGRAMS, batch * num_kv_heads)
            num_splits = max(1, min(triton.cdiv(capacity, block_n), fill))
        # grid sizes: concrete ints (under dynamic shapes this guards on their values, not on every batch size)
        tokens_per_split = int(triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n)
        num_splits = int(max(1, triton.cdiv(capacity, tokens_per_split)))
        part_o = torch.empty((batch, num_heads, num_splits, d_v), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        split = Launch(_decode_split_kernel, (batch, num_kv_heads, num_splits), (
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_sc, v_sc, part_o, part_lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
            num_splits, block_size, capacity, group, d, d_v, tokens_per_split,
            scale, softcap, window_left), {**common, **feats}, **opts)
        merge = Launch(_decode_merge_kernel, (batch, num_heads), (
            part_o, part_lse, sinks if sinks is not None else part_lse, cu_seqlens_q, out, lse,
            *out.stride(), lse.stride(0), num_splits, d_v),
            dict(HAS_SINKS=sinks is not None, BLOCK_S=merge_splits(num_splits, block_dv), BLOCK_DV=block_dv),
            wrap=True)
        return [split, merge], out, lse
    block_g = triton.next_power_of_2(group)  # prefill rows are (token, head) pairs: only BLOCK_T * BLOCK_G >= 16
    block_t = max(block_m // block_g, triton.cdiv(16, block_g), 1)
    common["BLOCK_G"] = block_g
    prefill = Launch(_prefill_kernel, (triton.cdiv(max_seqlen_q, block_t), batch, num_kv_heads), (
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_sc, v_sc,
        sinks if sinks is not None else q, out, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(), lse.stride(0),
        block_size, capacity, group, d, d_v, scale, softcap, window_left),
        dict(CAUSAL=causal, HAS_SINKS=sinks is not None, BLOCK_T=block_t, **common, **feats), **opts)
    return [prefill], out, lse


def _feature_args(features: AttnFeatures, window_left: int, causal: bool, prefill: bool, num_heads: int,
                  head_dim: int, cu_seqlens_q: torch.Tensor) -> dict:
    """The kernels' arguments and constexpr flags of the attention features (docs/attention_features.md), passed by
    name and only for features in use, so calls without them launch (and compile ahead of time) as before. A right
    window is an argument of the prefill kernel only (a decode query sits at the last position) and only without
    ``causal`` (whose bound, 0, wins). A custom mask (docs/tree-mask.md; calls with one run the prefill kernel)
    goes as bytes (a bool mask viewed as uint8, no copy) with each sequence's first element / bit (``mask_indptr``
    of ``cu_seqlens_q``: torch ops, no host sync)."""
    args = {}
    if prefill and not causal and features.window_right >= 0:
        args.update(window_right=features.window_right, HAS_RIGHT=True)
    if features.alibi_slopes is not None:
        alibi = features.alibi_slopes.contiguous()
        args.update(alibi_ptr=alibi, s_ab=num_heads if alibi.dim() == 2 else 0, HAS_ALIBI=True)
    if features.cache_leftpad is not None:
        args.update(leftpad_ptr=features.cache_leftpad.contiguous(), HAS_LEFTPAD=True)
    if features.sink_tokens > 0 and window_left >= 0:
        args.update(sink_tokens=features.sink_tokens, HAS_SINK_TOKENS=True)
    if features.rope_theta is not None:
        args.update(rope_coef=-2.0 * math.log2(features.rope_theta) / head_dim,
                    rope_inv_scale=1.0 / features.rope_scale, HAS_ROPE=True)
    mask = features.mask()
    if mask is not None:
        packed = features.packed_custom_mask is not None
        bits = 8 if packed else 1  # the kernel counts bits of a packed mask
        args.update(mask_ptr=mask.view(torch.uint8), mask_off_ptr=mask_indptr(cu_seqlens_q, packed)[:-1] * bits,
                    mask_lim=mask.shape[0] * bits, HAS_MASK=True, MASK_PACKED=packed)
    return args
