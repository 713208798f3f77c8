"""Validators of the MLA latent-cache ops ``kvops::mla_cache_write`` and ``kvops::mla_attention`` (docs/mla.md).

The latent cache is ``[P, block_size, kv_lora_rank + rope_dim]``: one latent "head" per token holding the compressed
``kv_c`` (its first ``kv_lora_rank`` columns) and the rotary key part ``k_pe`` (the last ``rope_dim``), as vLLM's
``concat_and_cache_mla`` stores it. Only metadata and scalar arguments are checked here (never tensor contents): the
slot, position and ``block_table`` *values* are value contracts (``kvops/_checks/values.py``, docs/semantics.md §7).
"""

from __future__ import annotations

import torch

from .common import (FP8_DTYPE, as_int, check_varlen_metadata, index_fix, require_finite, require_ndim,
                     require_same_device, require_writable)
from .common import require_scale_tensor as common_require_scale_tensor
from .rotary import check_rotary

WRITE_OP = "kvops.mla_cache_write"
ATTN_OP = "kvops.mla_attention"
CACHE_LAYOUT = "[num_blocks, block_size, kv_lora_rank + rope_dim]"
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_latent_cache(op: str, kv_cache: torch.Tensor) -> None:
    """``kv_cache`` is 3-D ``[P, block_size, kv_lora_rank + rope_dim]`` with ``block_size`` and width ``>= 1``, of a
    float dtype kvops stores (fp32/bf16/fp16 or ``float8_e4m3fn``)."""
    require_ndim(op, "kv_cache", kv_cache, 3, CACHE_LAYOUT)
    for dim, what in ((1, "block_size"), (2, "kv_lora_rank + rope_dim")):
        if kv_cache.shape[dim] == 0:
            raise ValueError(
                f"{op}: kv_cache has {what} = 0 (shape {tuple(kv_cache.shape)} read as {CACHE_LAYOUT}); allocate "
                f"the latent cache with {what} >= 1."
            )
    if kv_cache.dtype not in SOURCE_DTYPES + (FP8_DTYPE,):
        raise ValueError(
            f"{op}: kv_cache dtype {kv_cache.dtype} is not supported; allocate it as float32, bfloat16, float16 or "
            f"{FP8_DTYPE} (with kv_scale)."
        )


def require_scale_tensor(op: str, kv_scale) -> None:
    """``kv_scale`` is None or a tensor (``common.require_scale_tensor``): the public wrappers check it before
    dispatch, ``PagedMLACache`` at construction."""
    common_require_scale_tensor(op, "kv_scale", kv_scale)


def check_kv_scale(op: str, kv_cache: torch.Tensor, kv_scale) -> None:
    """An fp8 cache needs ``kv_scale``, a float32 per-tensor scale (0-d or ``[1]``) on the cache's device; other
    caches take none."""
    require_scale_tensor(op, kv_scale)
    if kv_cache.dtype == FP8_DTYPE:
        if kv_scale is None:
            raise ValueError(
                f"{op}: a {FP8_DTYPE} kv_cache needs kv_scale (a float32 scalar tensor, vLLM's per-tensor scale: "
                f"the cache holds x / kv_scale). Pass kv_scale=torch.tensor(s, dtype=torch.float32)."
            )
        if kv_scale.dtype != torch.float32 or kv_scale.numel() != 1 or kv_scale.dim() > 1:
            raise ValueError(
                f"{op}: kv_scale must be a float32 scalar tensor (shape [] or [1], one scale per tensor), got shape "
                f"{tuple(kv_scale.shape)} and dtype {kv_scale.dtype}. Pass one scale, "
                f"torch.tensor(s, dtype=torch.float32) (the latent cache is one head: no per-head scales)."
            )
        require_same_device(op, "kv_scale", kv_scale, "kv_cache", kv_cache)
    elif kv_scale is not None:
        raise ValueError(
            f"{op}: kv_scale was given but kv_cache dtype is {kv_cache.dtype}; a scale applies only to a {FP8_DTYPE} "
            f"cache. Drop kv_scale or allocate the cache as {FP8_DTYPE}."
        )


def check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                          rotary_interleaved) -> None:
    """Validate a ``kvops::mla_cache_write`` call (``ValueError``, same message in eager, compile and export).

    ``kv_c [N', kv_lora_rank]`` and ``k_pe [N', rope_dim]`` (rows ``>= N = len(slot_mapping)`` ignored), one float
    dtype, the cache's (or any of fp32/bf16/fp16 for an fp8 cache); ``kv_lora_rank + rope_dim`` = the cache's width;
    ``slot_mapping`` 1-D int32/int64; the fp8 scale rule; ``positions``/``rotary_cos``/``rotary_sin`` all given or
    none, with ``rotary_dim <= rope_dim`` (``kvops/_checks/rotary.py``); devices; a cache that cannot be written in
    place (stride 0).
    """
    op = WRITE_OP
    check_latent_cache(op, kv_cache)
    require_writable(op, "kv_cache", kv_cache)
    require_ndim(op, "kv_c", kv_c, 2, "[num_tokens, kv_lora_rank]")
    require_ndim(op, "k_pe", k_pe, 2, "[num_tokens, rope_dim]")
    if kv_c.shape[1] == 0:
        raise ValueError(f"{op}: kv_c has kv_lora_rank = 0 (shape {tuple(kv_c.shape)}); pass kv_c [N, kv_lora_rank] "
                         f"with kv_lora_rank >= 1.")
    width = kv_cache.shape[2]
    if kv_c.shape[1] + k_pe.shape[1] != width:
        raise ValueError(
            f"{op}: kv_c has kv_lora_rank {as_int(kv_c.shape[1])} and k_pe has rope_dim {as_int(k_pe.shape[1])}, "
            f"together {as_int(kv_c.shape[1] + k_pe.shape[1])} columns, but kv_cache {tuple(kv_cache.shape)} holds "
            f"rows of {as_int(width)} (kv_lora_rank + rope_dim). Allocate the cache with width kv_lora_rank + "
            f"rope_dim, or pass the model's kv_c and k_pe."
        )
    if kv_c.dtype != k_pe.dtype:
        raise ValueError(f"{op}: k_pe dtype {k_pe.dtype} does not match kv_c dtype {kv_c.dtype}. Cast k_pe to "
                         f"{kv_c.dtype}.")
    if kv_cache.dtype == FP8_DTYPE:
        if kv_c.dtype not in SOURCE_DTYPES:
            raise ValueError(f"{op}: kv_c dtype {kv_c.dtype} cannot be quantized into a {FP8_DTYPE} kv_cache; pass "
                             f"kv_c and k_pe as float32, bfloat16 or float16.")
    elif kv_c.dtype != kv_cache.dtype:
        raise ValueError(f"{op}: kv_c dtype {kv_c.dtype} does not match kv_cache dtype {kv_cache.dtype}. Cast kv_c "
                         f"and k_pe to {kv_cache.dtype}.")
    require_same_device(op, "kv_c", kv_c, "kv_cache", kv_cache)
    require_same_device(op, "k_pe", k_pe, "kv_cache", kv_cache)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape "
            f"{tuple(slot_mapping.shape)} and dtype {slot_mapping.dtype}. "
            + index_fix("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), "[num_tokens]")
        )
    require_same_device(op, "slot_mapping", slot_mapping, "kv_cache", kv_cache)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[0] < num_tokens:
            raise ValueError(
                f"{op}: {name} has {as_int(t.shape[0])} tokens but slot_mapping has {as_int(num_tokens)}; kv_c and "
                f"k_pe need at least one row per slot (extra rows are ignored). Pad them or trim slot_mapping."
            )
    check_kv_scale(op, kv_cache, kv_scale)
    given = [name for name, t in (("positions", positions), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin))
             if t is not None]
    if given and len(given) != 3:
        raise ValueError(
            f"{op}: RoPE on k_pe needs positions, rotary_cos and rotary_sin together, got only {', '.join(given)}. "
            f"Pass all three (or none: k_pe is written as given)."
        )
    if given:
        check_rotary(op, "k_pe", k_pe, rotary_cos, rotary_sin, positions, num_tokens, "rope_dim")


def check_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank, scale, causal,
                        kv_scale) -> float:
    """Validate a ``kvops::mla_attention`` call; returns the softmax scale (``D ** -0.5`` when ``scale`` is None, with
    ``D = kv_lora_rank + rope_dim``).

    Raises ``ValueError`` (same message in eager, compile and export): ``q`` not 3-D ``[T_q, H, D]`` or not
    fp32/bf16/fp16; a latent cache that is not 3-D or has ``block_size``/width 0; ``q``'s ``D`` not the cache's width;
    ``kv_lora_rank`` outside ``[1, D]``; a non-fp8 cache whose dtype differs from q's; the fp8 scale rule; index
    tensors not int32 or of the wrong rank, or inconsistent in ``B``; devices; ``max_seqlen_q < 1`` with tokens;
    ``scale`` NaN or infinite.
    """
    op = ATTN_OP
    check_latent_cache(op, kv_cache)
    require_ndim(op, "q", q, 3, "[num_tokens, num_heads, kv_lora_rank + rope_dim]")
    require_same_device(op, "kv_cache", kv_cache, "q", q)
    if q.dtype not in SOURCE_DTYPES:
        raise ValueError(f"{op}: q dtype {q.dtype} is not supported; pass q as float32, bfloat16 or float16.")
    if kv_cache.dtype != FP8_DTYPE and kv_cache.dtype != q.dtype:
        raise ValueError(
            f"{op}: kv_cache dtype {kv_cache.dtype} does not match q dtype {q.dtype}. The cache must have q's dtype or "
            f"be {FP8_DTYPE} (with kv_scale); cast q or allocate the cache as {q.dtype}."
        )
    width = kv_cache.shape[2]
    if q.shape[2] != width:
        raise ValueError(
            f"{op}: q has head_dim {as_int(q.shape[2])} (shape {tuple(q.shape)}) but kv_cache {tuple(kv_cache.shape)} "
            f"holds latent rows of {as_int(width)} (kv_lora_rank + rope_dim). In the absorbed form q is "
            f"[T_q, H, kv_lora_rank + rope_dim]: the nope part multiplied by W_UK, then the rope part."
        )
    if not 1 <= kv_lora_rank <= width:
        raise ValueError(
            f"{op}: kv_lora_rank must be in [1, {as_int(width)}] (the latent columns read as values; the rest are "
            f"the rope part), got {kv_lora_rank}. Pass the model's kv_lora_rank (e.g. 512 for DeepSeek-V3)."
        )
    check_varlen_metadata(op, q, cu_seqlens_q, seq_lens, block_table, max_seqlen_q)
    require_finite(op, "scale", scale,
                   "the softmax scale on the scores q . row; None: (kv_lora_rank + rope_dim) ** -0.5",
                   "Pass a finite scale (DeepSeek: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5).")
    check_kv_scale(op, kv_cache, kv_scale)
    return float(width) ** -0.5 if scale is None else scale
