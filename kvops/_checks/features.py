"""The optional attention features of ``kvops::paged_attention`` (docs/attention_features.md) as one record.

The validator (``kvops/_checks/paged_attention.py``) checks them and resolves them (:func:`resolve`) into an
:class:`AttnFeatures`, which every backend takes as it is: the composite CPU kernel, the native op (its schema lists
the record's fields in order after ``v_scale``: ``*features``), the Triton launcher (which turns it into kernel
arguments and constexpr flags in one place, ``_feature_args``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .common import as_int, index_fix, require_finite, require_same_device, resolve_bounds


class AttnFeatures(NamedTuple):
    """ALiBi, a right window, per-sequence left padding, StreamingLLM sink tokens, RoPE at read time
    (docs/attention_features.md) and a custom mask among the new keys (docs/tree-mask.md); the defaults are "off".
    Field order is the order of these arguments in the op schemas (``kvops/_library.py``), so ``*features`` is how a
    call passes them on.

    Adding a feature touches, and only touches:

    1. the validator: ``check_features`` below (its errors) and, for a bound that may be "unbounded", :func:`resolve`;
    2. this record: one field with its "off" default (and :meth:`used`);
    3. the oracle: ``kvops/reference/attention.py`` (the readable fp64 reference every test compares against);
    4. each kernel: the composite CPU kernel (``kvops/cpu/paged_attention.py``: ``paged_attention``), the native
       kernel (``kvops/native/paged_attention.cpp``: ``paged_attention_native``), and the Triton kernels
       (``kvops/triton/paged_attention.py``: ``_feature_args`` for the launch; ``_decode_split_kernel`` in
       ``paged_decode.py`` / ``_prefill_kernel`` in ``paged_prefill.py`` and, for what a KV tile does,
       ``_attend_tiles`` / ``_scores`` in ``paged_tiles.py``).

    The op's public signature (``kvops.paged_attention``, the ``triton_op`` and its schema in ``kvops/_library.py``,
    the native op's schema there) lists the fields as arguments: a new field is one more argument there, passed on
    as ``*features`` without further edits.
    """

    alibi_slopes: Optional[torch.Tensor] = None  # float32 [H_q] or [B, H_q]
    window_right: int = -1  # -1: no right bound (ignored under causal)
    cache_leftpad: Optional[torch.Tensor] = None  # int32 [B]: first KV row of each sequence
    sink_tokens: int = 0  # StreamingLLM sinks kept beside window_left
    rope_theta: Optional[float] = None  # RoPE at read time; None: off
    rope_scale: float = 1.0
    custom_mask: Optional[torch.Tensor] = None  # bool [sum_b q_len_b ** 2] among the new keys (docs/tree-mask.md)
    packed_custom_mask: Optional[torch.Tensor] = None  # uint8: the same mask as little-endian bits, per-sequence bytes

    def used(self) -> bool:
        """Whether any feature differs from its default ("off")."""
        return (self.alibi_slopes is not None or self.cache_leftpad is not None or self.rope_theta is not None
                or self.window_right != -1 or self.sink_tokens != 0 or self.rope_scale != 1.0
                or self.mask() is not None)

    def mask(self) -> Optional[torch.Tensor]:
        """The custom mask in whichever form was given (None: none); :attr:`packed_custom_mask` says which."""
        return self.packed_custom_mask if self.packed_custom_mask is not None else self.custom_mask


NO_FEATURES = AttnFeatures()


def resolve(window_left: int, features: AttnFeatures) -> tuple[int, AttnFeatures]:
    """``(window_left, features)`` as the kernels take them: windows / sink counts beyond every int32 position are
    "none" (``resolve_bounds``), so no backend computes with ``sys.maxsize``. Idempotent."""
    window_left, window_right, sink_tokens = resolve_bounds(window_left, features.window_right, features.sink_tokens)
    if window_right != features.window_right or sink_tokens != features.sink_tokens:
        features = features._replace(window_right=window_right, sink_tokens=sink_tokens)
    return window_left, features


def check_features(op: str, q: torch.Tensor, batch, features: AttnFeatures, max_seqlen_q=None) -> None:
    """The attention features of docs/attention_features.md (``ValueError`` naming the argument, value and fix):
    ``alibi_slopes`` float32 ``[H_q]`` or ``[B, H_q]`` on q's device; ``window_right >= -1``; ``cache_leftpad``
    int32 ``[B]`` on q's device; ``sink_tokens >= 0``; finite ``rope_theta > 0`` and ``rope_scale > 0`` with an
    even ``head_dim``; a custom mask's form (:func:`check_custom_mask`). (The contents of ``alibi_slopes``, NaN or
    infinite slopes, and the mask's exact length are value contracts: ``kvops/_checks/values_attention.py``.)"""
    alibi_slopes, window_right, cache_leftpad, sink_tokens, rope_theta, rope_scale = features[:6]
    num_heads = q.shape[1]
    if alibi_slopes is not None:
        shape = tuple(alibi_slopes.shape)
        if alibi_slopes.dtype != torch.float32 or shape not in ((num_heads,), (batch, num_heads)):
            raise ValueError(
                f"{op}: alibi_slopes must be a float32 tensor of shape [{as_int(num_heads)}] or "
                f"[{as_int(batch)}, {as_int(num_heads)}] (one slope per query head, optionally per sequence), got "
                f"shape {shape} and dtype {alibi_slopes.dtype}."
            )
        require_same_device(op, "alibi_slopes", alibi_slopes, "q", q)
    if window_right < -1:
        raise ValueError(f"{op}: window_right must be -1 (no right bound) or >= 0, got {as_int(window_right)}.")
    if cache_leftpad is not None:
        if cache_leftpad.dtype != torch.int32 or tuple(cache_leftpad.shape) != (batch,):
            raise ValueError(
                f"{op}: cache_leftpad must be an int32 tensor of shape [{as_int(batch)}] (the first KV row of each "
                f"sequence), got shape {tuple(cache_leftpad.shape)} and dtype {cache_leftpad.dtype}. "
                + index_fix("cache_leftpad", cache_leftpad, 1, (torch.int32,),
                            f"[{as_int(batch)}] (one row per sequence)")
            )
        require_same_device(op, "cache_leftpad", cache_leftpad, "q", q)
    if sink_tokens < 0:
        raise ValueError(f"{op}: sink_tokens must be >= 0 (0: none), got {as_int(sink_tokens)}.")
    if rope_theta is not None:
        if not rope_theta > 0 or not rope_scale > 0:
            raise ValueError(
                f"{op}: RoPE at read time needs rope_theta > 0 and rope_scale > 0, got rope_theta={rope_theta} and "
                f"rope_scale={rope_scale} (FlashInfer's defaults: 1e4 and 1)."
            )
        for name, x in (("rope_theta", rope_theta), ("rope_scale", rope_scale)):
            require_finite(op, name, x, "RoPE at read time turns position p by p / rope_scale * rope_theta ** "
                           "(-2i / head_dim)", "Pass a finite value (FlashInfer's defaults: 1e4 and 1).")
        if q.shape[2] % 2:
            raise ValueError(
                f"{op}: RoPE at read time rotates pairs (j, j + head_dim / 2) and needs an even head_dim, got "
                f"{as_int(q.shape[2])}."
            )
    if features.mask() is not None:
        check_custom_mask(op, q, batch, features, max_seqlen_q)


def check_custom_mask(op: str, q: torch.Tensor, batch, features: AttnFeatures, max_seqlen_q=None) -> None:
    """``custom_mask`` 1-D bool / ``packed_custom_mask`` 1-D uint8 on q's device, not both, no ``window_right``
    beside it, and (given ``max_seqlen_q``) no longer than any batch of these queries can need: ``sum_b q_len_b ** 2
    <= max_seqlen_q * T_q`` elements, ``sum_b ceil(q_len_b ** 2 / 8) <= (max_seqlen_q * T_q + 7 * B) / 8`` bytes
    (docs/tree-mask.md)."""
    custom, packed = features.custom_mask, features.packed_custom_mask
    if custom is not None and packed is not None:
        raise ValueError(
            f"{op}: pass custom_mask (bool) or packed_custom_mask (its bits as uint8), not both (FlashInfer silently "
            f"ignores custom_mask then)."
        )
    if custom is not None and (custom.dtype != torch.bool or custom.dim() != 1):
        fix = ("For FlashInfer's packed bits pass packed_custom_mask." if custom.dtype == torch.uint8 and
               custom.dim() == 1 else "Flatten each sequence's block and concatenate them in batch order: "
               "torch.cat([block.flatten() for block in blocks])." if custom.dim() != 1 else
               "Pass mask.to(torch.bool) (True = visible).")
        raise ValueError(
            f"{op}: custom_mask must be a 1-D bool tensor [sum_b q_len_b ** 2] (each sequence's q_len x q_len block "
            f"of its new keys, row-major, concatenated in batch order), got shape {tuple(custom.shape)} and dtype "
            f"{custom.dtype}. {fix}"
        )
    if packed is not None and (packed.dtype != torch.uint8 or packed.dim() != 1):
        raise ValueError(
            f"{op}: packed_custom_mask must be a 1-D uint8 tensor [sum_b ceil(q_len_b ** 2 / 8)] (each sequence's "
            f"mask block as little-endian bits, padded to whole bytes), got shape {tuple(packed.shape)} and dtype "
            f"{packed.dtype}. Pack a bool mask with kvops.custom_mask.segment_packbits(mask, "
            f"mask_indptr(cu_seqlens_q), bitorder='little'), or pass it as custom_mask."
        )
    name = "custom_mask" if custom is not None else "packed_custom_mask"
    mask = features.mask()
    require_same_device(op, name, mask, "q", q)
    if features.window_right != -1:
        raise ValueError(
            f"{op}: window_right={as_int(features.window_right)} cannot be combined with {name}: it bounds the keys "
            f"to the right of a query (causal=False), and with a mask every such key is a new key, which the mask "
            f"decides. Drop window_right (or put the bound into the mask)."
        )
    if max_seqlen_q is None:
        return
    num_tokens, n = q.shape[0], mask.shape[0]
    bound = max_seqlen_q * num_tokens
    if custom is not None and n > bound:
        raise ValueError(
            f"{op}: custom_mask has {as_int(n)} elements, more than any batch of these queries needs: sum_b "
            f"q_len_b ** 2 <= max_seqlen_q * T_q = {as_int(max_seqlen_q)} * {as_int(num_tokens)} = {as_int(bound)}. "
            f"The mask covers each sequence's new keys only; FlashInfer's q_len x kv_len form also covers the cached "
            f"keys: keep its last q_len columns."
        )
    if packed is not None and 8 * n > bound + 7 * batch:
        raise ValueError(
            f"{op}: packed_custom_mask has {as_int(n)} bytes, more than any batch of these queries needs: sum_b "
            f"ceil(q_len_b ** 2 / 8) <= (max_seqlen_q * T_q + 7 * B) / 8 = ({as_int(max_seqlen_q)} * "
            f"{as_int(num_tokens)} + 7 * {as_int(batch)}) / 8, at most {as_int((bound + 7 * batch) // 8)}. The "
            f"mask covers each sequence's new keys only; "
            f"FlashInfer's q_len x kv_len form also covers the cached keys: keep its last q_len columns."
        )
