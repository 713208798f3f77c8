"""Validator of ``kvops::rotary_paged_cache_write`` (rotary embedding fused into the paged write).

Rotary semantics are FlashAttention's (``flash_attn_with_kvcache``'s ``rotary_cos``/``rotary_sin``): tables
``[seqlen_ro, rotary_dim / 2]``, the first ``rotary_dim <= head_dim`` dims rotated, GPT-NeoX pairs ``(i, i +
rotary_dim / 2)`` or, with ``rotary_interleaved``, GPT-J pairs ``(2i, 2i + 1)``.
"""

from __future__ import annotations

import torch

from .common import as_int, index_fix, require_same_device
from .paged_write import check_paged_cache_write

OP = "kvops.rotary_paged_cache_write"


def check_rotary(op: str, name: str, x: torch.Tensor, rotary_cos, rotary_sin, positions, num_tokens,
                 dim_name: str = "head_dim") -> int:
    """Tables and positions for rotating ``x [..., head_dim]`` at ``positions[:num_tokens]``; returns ``rotary_dim``.
    ``dim_name``: what the messages call ``x``'s last dim (MLA's ``k_pe``: ``rope_dim``).

    Raises ``ValueError``: tables not 2-D, of different shapes, or with ``rotary_dim`` 0 or ``> head_dim``; a table
    dtype other than ``x``'s; ``positions`` not a 1-D int32/int64 tensor with at least ``num_tokens`` entries;
    devices. Position *values* (``< seqlen_ro``) depend on tensor contents and are not checked here.
    """
    for t_name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.dim() != 2 or t.shape != rotary_cos.shape:
            raise ValueError(
                f"{op}: {t_name} must be 2-D (seqlen_ro, rotary_dim / 2), rotary_cos and rotary_sin of one shape; "
                f"got rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)}."
            )
        if t.dtype != x.dtype:
            raise ValueError(
                f"{op}: {t_name} must have the same dtype as {name} ({x.dtype}), got {t.dtype}. Cast the tables with "
                f".to({x.dtype})."
            )
        require_same_device(op, t_name, t, name, x)
    rotary_dim, head_dim = 2 * rotary_cos.shape[1], x.shape[-1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        fix = ("Pass tables with at least one column." if rotary_dim == 0 else
               f"Pass tables [seqlen_ro, rotary_dim / 2] with rotary_dim <= {as_int(head_dim)}; transformers' cos/sin "
               f"[seq, {dim_name}] repeat their halves: pass their first {dim_name} // 2 columns, "
               f"cos[:, :{as_int(head_dim // 2)}] and sin[:, :{as_int(head_dim // 2)}].")
        raise ValueError(
            f"{op}: rotary_dim must be <= headdim: rotary_cos {tuple(rotary_cos.shape)} gives rotary_dim "
            f"{as_int(rotary_dim)} but {name} has {dim_name} {as_int(head_dim)} (and rotary_dim must be > 0). {fix}"
        )
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: positions must be a 1-D int32 or int64 tensor [num_tokens] (the rotary position of each token), "
            f"got shape {tuple(positions.shape)} and dtype {positions.dtype}. "
            + index_fix("positions", positions, 1, (torch.int32, torch.int64), "[num_tokens]")
        )
    if positions.shape[0] < num_tokens:
        raise ValueError(
            f"{op}: positions has {as_int(positions.shape[0])} entries but slot_mapping has {as_int(num_tokens)} "
            f"tokens; pass one position per token."
        )
    require_same_device(op, "positions", positions, name, x)
    return rotary_dim


def check_rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
                                   rotary_interleaved, cache_head_start, k_scale, v_scale) -> int:
    """The paged write's contract (``kvops.paged_cache_write``, same messages under this op's name; NHD caches only:
    an HND-looking cache gets the NHD-only layout hint) plus the rotary tables and positions; returns the first cache
    head written."""
    h0 = check_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, op=OP,
                                 nhd_only=True)
    check_rotary(OP, "key", key, rotary_cos, rotary_sin, positions, slot_mapping.shape[0])
    return h0
