"""Validator of ``kvops.flash_attn_with_kvcache`` (docs/semantics.md §5)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import as_int, gqa_fix, index_fix
from .forms import bool_arg, float_arg, int_arg, window_arg
from .paged_write import layout_hint
from .rotary import check_rotary

OP = "flash_attn_with_kvcache"


class FlashArgs(NamedTuple):
    """The scalar arguments of one ``flash_attn_with_kvcache`` call, resolved to the Python values the ops take."""

    cache_seqlens: object  # None, an int (or SymInt) or the int32 [B] tensor as given
    softmax_scale: object  # None or a float
    causal: bool
    window: tuple  # (left, right) as given (right is ignored when causal)
    softcap: object  # a float
    rotary_interleaved: bool
    return_softmax_lse: bool


def check_flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                  cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                  rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse) -> FlashArgs:
    """Shape/dtype/Python-value contract of ``kvops.flash_attn_with_kvcache`` (no tensor contents are read, except
    a tensor given where FlashAttention takes a Python value, in eager calls: kvops/_checks/forms.py).

    Returns the scalar arguments resolved to the values the ops take (:class:`FlashArgs`): every form
    FlashAttention's ``flash_attn_with_kvcache`` accepts (``window_size`` as a tuple, list or 2-element integer
    tensor; ``softmax_scale``/``softcap`` as ints, floats or one-element tensors; ``cache_seqlens`` as an int or an
    int32 ``[B]`` tensor; ...) is accepted with its meaning, anything else is a ``ValueError`` naming the argument,
    raised before anything is written.

    Caches are NHD only (as FlashAttention's): when a head count contradicts ``k_cache``'s ``num_kv_heads`` but fits
    its ``block_size`` dim, the error says the cache may be HND and how to get an NHD view
    (:func:`kvops._checks.paged_write.layout_hint`). An HND cache whose ``H_kv == block_size``, or whose misread
    head count still fits, cannot be told from an NHD one by its shape: it is read as NHD.

    ``flash_attn_with_kvcache`` is a composite of two ops (``paged_cache_write``, then ``paged_attention``), not an op
    itself, so Inductor still sees and fuses the write; this validator runs in Python before them. Under
    ``torch.compile(fullgraph=True)`` its errors are raised while Dynamo traces, as an "Observed exception" whose text
    carries the original type and message; eager and ``torch.export`` raise the original exception.
    """
    window = window_arg(OP, window_size)
    args = FlashArgs(
        cache_seqlens=cache_seqlens if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor)
        else int_arg(OP, "cache_seqlens", cache_seqlens, wanted="an int or an int32 tensor of shape [batch]"),
        softmax_scale=float_arg(OP, "softmax_scale", softmax_scale, optional=True),
        causal=bool_arg(OP, "causal", causal),
        window=window,
        softcap=float_arg(OP, "softcap", softcap),
        rotary_interleaved=bool_arg(OP, "rotary_interleaved", rotary_interleaved),
        return_softmax_lse=bool_arg(OP, "return_softmax_lse", return_softmax_lse),
    )
    int_arg(OP, "num_splits", num_splits)  # a scheduling hint kvops ignores; FlashAttention takes an int
    cache_seqlens = args.cache_seqlens
    if v_cache is None:
        raise ValueError(f"{OP}: v_cache must be provided (the V cache, with k_cache).")
    if k_cache is None:
        raise ValueError(
            f"{OP}: k_cache must be provided. (k_cache can only be None when only_qv=True, the MLA q-only path, "
            f"which kvops does not support.)"
        )
    if (k is None) != (v is None):
        raise ValueError(f"{OP}: k and v must be given together (got {'k' if k is not None else 'v'} only).")
    if q.dim() != 4:
        raise ValueError(f"{OP}: q must be 4-D [batch, seqlen_q, num_heads, head_dim], got shape {tuple(q.shape)}.")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{OP}: {name} must be 4-D: [num_blocks, block_size, num_kv_heads, head_dim] with block_table, or "
                f"[batch, seqlen_cache, num_kv_heads, head_dim] without; got shape {tuple(cache.shape)}."
            )
    batch, num_heads, num_kv_heads = q.shape[0], q.shape[2], k_cache.shape[2]
    rows = "block_size" if block_table is not None else "seqlen_cache"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        for dim, what in ((1, rows), (2, "num_kv_heads"), (3, "head_dim")):
            if cache.shape[dim] == 0:
                raise ValueError(
                    f"{OP}: {name} has {what} = 0 (shape {tuple(cache.shape)}, read as "
                    f"{'[num_blocks, block_size' if block_table is not None else '[batch, seqlen_cache'}, "
                    f"num_kv_heads, head_dim]); it must be >= 1. Allocate the cache with at least one "
                    + {"block_size": "row per block", "seqlen_cache": "row (token) per sequence",
                       "num_kv_heads": "KV head", "head_dim": "element per head"}[what] + "."
                )
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32
                                     or tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads))):
        raise ValueError(
            f"{OP}: alibi_slopes must be float32 of shape [{num_heads}] or [{batch}, {num_heads}] (nheads or "
            f"(batch_size, nheads)), got shape {tuple(alibi_slopes.shape)} and dtype {alibi_slopes.dtype}."
        )
    if cache_leftpad is not None and (cache_leftpad.dtype != torch.int32 or tuple(cache_leftpad.shape) != (batch,)):
        raise ValueError(
            f"{OP}: cache_leftpad must be an int32 tensor of shape [{batch}] (the row each sequence's cache starts "
            f"at), got shape {tuple(cache_leftpad.shape)} and dtype {cache_leftpad.dtype}. "
            + index_fix("cache_leftpad", cache_leftpad, 1, (torch.int32,), f"[{batch}] (one row per sequence)")
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{OP}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) (GQA); got q shape "
            f"{tuple(q.shape)} and k_cache shape {tuple(k_cache.shape)}."
            + (layout_hint(k_cache, "NHD", f"{num_heads} query heads", lambda h: num_heads % h == 0, OP)
               or " " + gqa_fix(num_heads, num_kv_heads, "allocate k_cache and v_cache"))
        )
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError(
                f"{OP}: block_table must be a 2-D int32 tensor [batch, max_blocks], got shape "
                f"{tuple(block_table.shape)} and dtype {block_table.dtype}. "
                + index_fix("block_table", block_table, 2, (torch.int32,), "[batch, max_blocks]")
            )
        if block_table.shape[0] != batch:
            raise ValueError(
                f"{OP}: block_table has {block_table.shape[0]} rows but q has batch {batch}; pass one block_table "
                f"row per sequence ([batch, max_blocks])."
            )
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError(
                f"{OP}: cache_batch_idx cannot be combined with block_table (FlashAttention: \"Paged KVcache does not "
                f"support cache_batch_idx\"). Select the sequences' block_table rows instead: "
                f"block_table[cache_batch_idx.long()]."
            )
        if (not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32
                or tuple(cache_batch_idx.shape) != (batch,)):
            got = (f"shape {tuple(cache_batch_idx.shape)} and dtype {cache_batch_idx.dtype}"
                   if isinstance(cache_batch_idx, torch.Tensor) else f"{type(cache_batch_idx).__name__}")
            raise ValueError(
                f"{OP}: cache_batch_idx must be an int32 tensor of shape [{batch}] (the k_cache row of each "
                f"sequence), got {got}. "
                + index_fix("cache_batch_idx", cache_batch_idx, 1, (torch.int32,), f"[{batch}] (one row per sequence)")
            )
    elif block_table is None and k_cache.shape[0] != batch:
        raise ValueError(
            f"{OP}: without block_table, k_cache is [batch, seqlen_cache, num_kv_heads, head_dim] and its batch "
            f"({k_cache.shape[0]}) must equal q's ({batch}); pass cache_batch_idx (int32 [{batch}]) to say which "
            f"k_cache row each sequence uses."
        )
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens), ("k_cache", k_cache),
                    ("cache_batch_idx", cache_batch_idx)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but q is on {q.device}. Move both to the same device.")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
            raise ValueError(
                f"{OP}: cache_seqlens must be an int or an int32 tensor of shape [{batch}], got shape "
                f"{tuple(cache_seqlens.shape)} and dtype {cache_seqlens.dtype}. "
                + index_fix("cache_seqlens", cache_seqlens, 1, (torch.int32,), f"[{batch}] (one length per sequence)")
            )
    elif cache_seqlens is not None and cache_seqlens < 0:
        raise ValueError(f"{OP}: cache_seqlens must be >= 0 (tokens already in the cache), got {cache_seqlens}.")
    capacity = (1 if block_table is None else block_table.shape[1]) * k_cache.shape[1]
    if k is None:
        if rotary_cos is not None or rotary_sin is not None:
            raise ValueError(
                f"{OP}: If rotary cos/sin are provided, new key / value to be appended to KV cache must also be "
                f"provided (pass k and v, or rotary_cos=None and rotary_sin=None)."
            )
        return args
    if cache_seqlens is None:
        raise ValueError(f"{OP}: k/v were given without cache_seqlens; pass cache_seqlens to say where they go.")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dim() != 4 or t.shape[0] != batch or t.shape[1] != k.shape[1] or t.shape[2:] != cache.shape[2:]:
            raise ValueError(
                f"{OP}: {name} must be [batch={batch}, seqlen_new, num_kv_heads={cache.shape[2]}, "
                f"head_dim={cache.shape[3]}] (k and v with the same seqlen_new), got shape {tuple(t.shape)}."
                + (_heads_fix(cache, name, t) if t.dim() == 4 else "")
            )
    s_new = k.shape[1]
    check_rotary_tables(q, k, rotary_cos, rotary_sin, capacity)
    start = cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else 0
    if start < 0 or start + s_new > capacity:
        where = f"at cache_seqlens={cache_seqlens} " if not isinstance(cache_seqlens, torch.Tensor) else ""
        raise ValueError(
            f"{OP}: writing {s_new} new token{'s' if s_new != 1 else ''} {where}exceeds the capacity addressable by "
            f"the cache: {capacity} tokens (max_blocks {capacity // k_cache.shape[1]} x block_size {k_cache.shape[1]}). Give "
            f"block_table more blocks or write fewer tokens."
        )
    return args


def _heads_fix(cache, name, t) -> str:
    """For new keys/values ``t`` whose head count differs from the cache's: the layout hint when the cache may be HND,
    else the likely fix, a cache allocated with the model's head count (FlashAttention writes all heads)."""
    if t.shape[2] == cache.shape[2]:
        return ""
    return (layout_hint(cache, "NHD", f"{t.shape[2]} heads of {name}", lambda h: h == t.shape[2], OP)
            or f" If the model has {t.shape[2]} KV head{'s' if t.shape[2] != 1 else ''}, allocate k_cache and v_cache "
               f"with {t.shape[2]} head{'s' if t.shape[2] != 1 else ''}.")


def check_rotary_tables(q, k, rotary_cos, rotary_sin, capacity) -> None:
    """FlashAttention's rotary contract: both tables or neither, ``[seqlen_ro, rotary_dim / 2]`` in q's dtype with
    ``seqlen_ro >=`` the cache capacity and ``rotary_dim <= head_dim`` (the write op's validator checks the rest)."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{OP}: rotary_cos and rotary_sin must be given together (got only "
                         f"{'rotary_cos' if rotary_cos is not None else 'rotary_sin'}).")
    if rotary_cos is None:
        return
    check_rotary(OP, "q", q, rotary_cos, rotary_sin, torch.zeros(0, dtype=torch.int32, device=q.device), 0)
    if rotary_cos.shape[0] < capacity:
        raise ValueError(
            f"{OP}: cos/sin seqlen must be at least the seqlen of KV cache: rotary_cos has {rotary_cos.shape[0]} "
            f"positions but the cache holds {capacity} (max_blocks x block_size); extend the tables."
        )


def check_mask_length(name: str, mask: torch.Tensor, batch, s_q) -> None:
    """The exact length of a custom mask in the batch form, where every sequence has ``S_q`` new rows
    (docs/tree-mask.md): ``B * S_q ** 2`` elements (``custom_mask``) or ``B * ceil(S_q ** 2 / 8)`` bytes
    (``packed_custom_mask``). A mask of the wrong form is left to ``kvops.paged_attention``'s validator."""
    packed = name == "packed_custom_mask"
    if mask.dim() != 1 or mask.dtype != (torch.uint8 if packed else torch.bool):
        return
    per = (s_q * s_q + 7) // 8 if packed else s_q * s_q
    if mask.shape[0] != batch * per:
        rule = "batch_size * ceil(seqlen_q ** 2 / 8) bytes" if packed else "batch_size * seqlen_q ** 2 elements"
        raise ValueError(
            f"{OP}: {name} has {as_int(mask.shape[0])} {'bytes' if packed else 'elements'}, expected {rule} = "
            f"{as_int(batch)} * {as_int(per)} = {as_int(batch * per)} (each sequence's seqlen_q x seqlen_q block of "
            f"its new keys, row-major, concatenated{'; bits padded to whole bytes per sequence' if packed else ''})."
        )
