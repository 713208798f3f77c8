"""Validator for ``kvops::paged_cache_write`` (docs/semantics.md §3), and the ``kv_layout`` rule of both paged ops.

Caches are ``[P, block_size, H_kv, D]`` (``kv_layout="NHD"``) or ``[P, H_kv, block_size, D]`` (``"HND"``, FlashInfer's
name; ``D_v`` for values). An HND cache is validated and written as its NHD view ``cache.transpose(1, 2)`` (no copy:
every kernel takes strides). Writers carry ``[N', H_in, D]`` and ``slot_mapping``
``[N]`` with ``N' >= N``. Only metadata is checked here: slot *values* (negative = skip, ``< P * block_size``) are
content: they are checked per the value-check mode by ``kvops/_checks/values.py`` (docs/semantics.md §7).
"""

from __future__ import annotations

import torch

from .overlap import check_caches_disjoint
from .common import (
    as_int,
    FP8_DTYPE,
    check_fp8_scales,
    check_head_slice,
    head_slice_fix,
    check_kv_pair,
    index_fix,
    require_dim_match,
    require_ndim,
    require_same_device,
    require_same_dtype,
    require_writable,
)

OP = "kvops.paged_cache_write"
CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
TOKENS_LAYOUT = "[num_tokens, num_heads, head_dim]"
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_LAYOUTS = {  # kv_layout -> (cache layout, the dims K and V must agree in)
    "NHD": (CACHE_LAYOUT, "[num_blocks, block_size, num_kv_heads]"),
    "HND": ("[num_blocks, num_kv_heads, block_size, head_dim]", "[num_blocks, num_kv_heads, block_size]"),
}


def as_nhd(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as ``[P, block_size, H_kv, D]`` views (``transpose(1, 2)`` of HND caches; never a copy)."""
    if kv_layout == "HND":
        return k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache, v_cache


def check_paged_caches(
    op: str, k_cache: torch.Tensor, v_cache: torch.Tensor | None, kv_layout: str = "NHD"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_layout`` is "NHD" or "HND"; K and V paged caches: both present, 4-D in that layout, same dtype, device,
    blocks, block_size and heads. Returns the caches as NHD views (see :func:`as_nhd`)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(
            f"{op}: kv_layout must be \"NHD\" (caches [num_blocks, block_size, num_kv_heads, head_dim]) or \"HND\" "
            f"(caches [num_blocks, num_kv_heads, block_size, head_dim]), got {kv_layout!r}."
        )
    layout, agree = KV_LAYOUTS[kv_layout]
    check_kv_pair(op, k_cache, v_cache, layout, agree)
    k_cache, v_cache = as_nhd(k_cache, v_cache, kv_layout)
    check_nonzero_dims(op, k_cache, v_cache, layout)
    return k_cache, v_cache


def check_nonzero_dims(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> None:
    """NHD views of paged caches: ``block_size``, ``num_kv_heads`` and both head dims must be >= 1 (a zero-size one
    addresses nothing: ``slot // block_size`` and the GQA ratio divide by it)."""
    for name, cache, dim, what in (("k_cache", k_cache, 1, "block_size"), ("k_cache", k_cache, 2, "num_kv_heads"),
                                   ("k_cache", k_cache, 3, "head_dim"), ("v_cache", v_cache, 3, "head_dim")):
        if cache.shape[dim] == 0:
            raise ValueError(
                f"{op}: {name} has {what} = 0 (shape {tuple(cache.shape)} read as {layout}); a paged cache needs "
                f"{what} >= 1. Allocate the cache with at least one "
                + {"block_size": "row per block", "num_kv_heads": "KV head", "head_dim": "element per head"}[what]
                + "."
            )


def layout_hint(cache: torch.Tensor, kv_layout: str, heads: str, fits, nhd_only: str = "") -> str:
    """When the NHD view ``cache``'s ``num_kv_heads`` does not ``fit`` the input's heads (``heads``, e.g. "8 input
    heads") but its ``block_size`` dim does, a sentence saying the cache may be in the other layout and how to pass
    it; else ``""``. ``nhd_only``: the name of an op without ``kv_layout`` (it takes NHD caches only): the sentence
    then says so and how to get an NHD view. Shapes cannot tell the layouts apart when ``H_kv == block_size``: no hint.
    """
    if fits(cache.shape[2]) or not fits(cache.shape[1]):
        return ""
    other = "HND" if kv_layout == "NHD" else "NHD"
    shape = tuple(cache.shape) if kv_layout == "NHD" else tuple(cache.transpose(1, 2).shape)
    fix = (
        f"{nhd_only} takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use "
        f"kvops.paged_cache_write / kvops.paged_attention with kv_layout=\"HND\"." if nhd_only
        else f"pass kv_layout=\"{other}\"."
    )
    return (
        f" The cache of shape {shape} read as kv_layout=\"{kv_layout}\" has {as_int(cache.shape[2])} heads, but its "
        f"dim of size {as_int(cache.shape[1])} fits the {heads}: it may be an {other} cache "
        f"{KV_LAYOUTS[other][0]}; if so, {fix}"
    )


def check_paged_cache_write(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    cache_head_start: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    op: str = OP,
    nhd_only: bool = False,
) -> int:
    """Validate a paged write of ``N = slot_mapping.shape[0]`` tokens; returns the first cache head written.

    Raises ``ValueError`` for: a ``kv_layout`` other than "NHD"/"HND"; a missing ``v_cache`` (``"v_cache must be provided"``) or ``value``; ranks; a
    ``slot_mapping`` that is not 1-D int32/int64 on the caches' device; ``key`` shorter than ``slot_mapping``
    (``N' < N``); key/value dtype, device, token-count, head and head_dim mismatches; a head slice outside the cache;
    an fp8 cache without ``k_scale``/``v_scale``; scales for a non-fp8 cache; scales that are not fp32 ``[1]`` or
    ``[H_kv]``; a cache with a stride-0 dim (an expanded view cannot be written in place). ``nhd_only``: ``op`` has no
    ``kv_layout`` argument (the layout hint says so, see :func:`layout_hint`).
    """
    k_cache, v_cache = check_paged_caches(op, k_cache, v_cache, kv_layout)
    require_writable(op, "k_cache", k_cache)
    require_writable(op, "v_cache", v_cache)
    check_caches_disjoint(op, [("k_cache", k_cache), ("v_cache", v_cache)])
    if value is None:
        raise ValueError(f"{op}: value must be provided (got value=None with a v_cache); pass value [N, H_in, D_v].")
    require_ndim(op, "key", key, 3, TOKENS_LAYOUT)
    require_ndim(op, "value", value, 3, TOKENS_LAYOUT)
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"{op}: key shape {tuple(key.shape)} and value shape {tuple(value.shape)} must agree in "
            f"[num_tokens, num_heads]."
        )

    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape "
            f"{tuple(slot_mapping.shape)} and dtype {slot_mapping.dtype}. "
            + index_fix("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), "[num_tokens]")
        )
    require_same_device(op, "slot_mapping", slot_mapping, "k_cache", k_cache)
    if key.shape[0] < slot_mapping.shape[0]:
        raise ValueError(
            f"{op}: key has {as_int(key.shape[0])} tokens but slot_mapping has {as_int(slot_mapping.shape[0])}; "
            f"key and value need at least one row per slot (extra rows are ignored). Pad key/value or trim "
            f"slot_mapping."
        )

    fp8 = k_cache.dtype == FP8_DTYPE
    for name, t, cache_name, cache in (("key", key, "k_cache", k_cache), ("value", value, "v_cache", v_cache)):
        if fp8:
            if t.dtype not in SOURCE_DTYPES:
                raise ValueError(
                    f"{op}: {name} dtype {t.dtype} cannot be quantized into a {FP8_DTYPE} {cache_name}; pass "
                    f"{name} as float32, bfloat16 or float16."
                )
        else:
            require_same_dtype(op, name, t, cache_name, cache)
        require_same_device(op, name, t, cache_name, cache)
        require_dim_match(op, "head_dim", name, t, 2, cache_name, cache, 3)
    in_heads = key.shape[1]
    if cache_head_start is None and in_heads != k_cache.shape[2]:
        hint = layout_hint(k_cache, kv_layout, f"{as_int(in_heads)} input heads", lambda h: h == in_heads,
                           op if nhd_only else "")
        if hint:
            fix = head_slice_fix(k_cache.shape[2], in_heads) if in_heads < k_cache.shape[2] else ""
            raise ValueError(
                f"{op} requires cache_head_start when cache heads ({as_int(k_cache.shape[2])}) differ from input "
                f"heads ({as_int(in_heads)}).{fix}{hint}"
            )
    h0 = check_head_slice(op, k_cache.shape[2], in_heads, cache_head_start)

    check_fp8_scales(op, k_cache, k_scale, v_scale)
    return h0
