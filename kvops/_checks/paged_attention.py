"""Validator for ``kvops::paged_attention`` (docs/semantics.md §4).

``q [T_q, H_q, D]`` packed (varlen); caches ``[P, block_size, H_kv, D]`` / ``[P, block_size, H_kv, D_v]`` (NHD), or
``[P, H_kv, block_size, D]`` with ``kv_layout="HND"`` (validated as the NHD view ``transpose(1, 2)``);
``cu_seqlens_q [B + 1]``, ``seq_lens [B]``, ``block_table [B, max_blocks]``, all int32. Only metadata and the scalar
arguments are checked. Value contracts that depend on tensor *contents* are checked per the value-check mode by
``kvops/_checks/values_attention.py`` (docs/semantics.md §7), not here: ``cu_seqlens_q`` non-decreasing from 0 to
``T_q``, every ``q_len <= max_seqlen_q``,
``seq_len <= max_blocks * block_size``, and table entries of the first ``ceil(seq_len / block_size)`` blocks
in ``[0, P)``.
"""

from __future__ import annotations

import torch

from .common import (FP8_DTYPE, UNBOUNDED, as_int, check_fp8_scales, check_varlen_metadata, gqa_fix, require_dim_match,
                     require_finite, require_ndim, require_same_device)
from .features import NO_FEATURES, AttnFeatures, check_features, resolve
from .paged_write import check_paged_caches, layout_hint

OP = "kvops.paged_attention"
Q_LAYOUT = "[num_tokens, num_heads, head_dim]"
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q,
    scale: float | None,
    causal: bool,
    window_left: int,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_layout: str = "NHD",
    features: AttnFeatures = NO_FEATURES,
    *,
    memo: bool = False,
    tensor_key: bytes | None = None,
) -> tuple[float, int, AttnFeatures]:
    """Validate a paged attention call; returns what the kernels take: the softmax scale (``D ** -0.5`` when
    ``scale`` is None), ``window_left`` and the :class:`~kvops._checks.features.AttnFeatures`, with windows and sink
    counts beyond every int32 position resolved to "none" (:func:`~kvops._checks.features.resolve`).

    Raises ``ValueError`` (same type and message in eager, under ``torch.compile`` and ``torch.export``) for: a
    ``kv_layout`` other than "NHD"/"HND" (an error on ``num_kv_heads`` says when the cache may be in the other layout);
    a missing
    ``v_cache`` (``"v_cache must be provided"``); ranks; K/V caches that disagree in dtype, device, ``P``,
    ``block_size`` or ``H_kv``; a q dtype other than fp32/bf16/fp16; a non-fp8 cache whose dtype differs from q's;
    ``head_dim`` of q vs ``k_cache``; ``H_q % H_kv != 0``; index tensors that are not int32 or have the wrong rank;
    ``block_table``/``seq_lens``/``cu_seqlens_q`` inconsistent in ``B``; devices; ``sinks`` not fp32 ``[H_q]``;
    an fp8 cache without ``k_scale``/``v_scale``, scales with a non-fp8 cache, scales not fp32 ``[1]``/``[H_kv]``;
    ``max_seqlen_q < 1`` while q has tokens; ``window_left < -1``; ``softcap < 0``; a ``scale`` or ``softcap``
    that is NaN or infinite; and the features of docs/attention_features.md (:func:`check_features`).

    ``memo=True`` (eager calls whose tensor arguments are all plain CPU tensors, ``type(t) is torch.Tensor``, nothing
    symbolic: the caller checked) remembers the :func:`signature` of calls that passed and skips the checks for the
    next call with the same one: they read nothing else, so the outcome is the same; a failing call is never
    remembered (it raises each time). ``tensor_key`` (with ``memo``): the tensor part of that signature as
    ``kvops.native.eager_key`` gives it for ``(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, sinks,
    k_scale, v_scale, *features' tensors)`` in this order (bytes naming each one's dtype and shape), computed in one
    native pass by ``_direct`` (kvops/ops/paged_attention.py); the scalar arguments complete it (:func:`scalars`).
    """
    head_scale = None  # head_dim ** -0.5, remembered with a passed signature
    if not memo:
        _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, window_left, softcap,
               sinks, k_scale, v_scale, kv_layout, features)
    else:
        if tensor_key is None:
            key = signature(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale,
                            window_left, softcap, sinks, k_scale, v_scale, kv_layout, features)
        else:  # (a tuple of another length than signature's: the two forms never meet)
            key = (tensor_key, max_seqlen_q, scale, type(scale), window_left, softcap, type(softcap), kv_layout,
                   None if features is NO_FEATURES else scalars(features))
        head_scale = _PASSED.get(key)
        if head_scale is None:
            _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, window_left, softcap,
                   sinks, k_scale, v_scale, kv_layout, features)
            if len(_PASSED) >= MEMO_SIZE:
                _PASSED.clear()
            head_scale = _PASSED[key] = float(q.shape[2]) ** -0.5
    if features is not NO_FEATURES or window_left >= UNBOUNDED:  # (else resolve changes nothing)
        window_left, features = resolve(window_left, features)
    if scale is not None:
        return scale, window_left, features
    return (float(q.shape[2]) ** -0.5 if head_scale is None else head_scale), window_left, features


MEMO_SIZE = 256  # signatures remembered (a serving loop has a handful: one per batch shape); then forgotten at once
_PASSED: dict = {}  # signature of a passed call -> head_dim ** -0.5 (the default scale)


def _meta(t):
    return None if t is None else (t.shape, t.dtype)


def signature(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, window_left, softcap,
              sinks, k_scale, v_scale, kv_layout, features) -> tuple:
    """What :func:`_check` reads of CPU tensors, as a hashable key: every tensor's shape and dtype (its device is the
    CPU; never its values or strides), and the scalar arguments (``causal`` is not among them: any value is valid),
    the floats with their types (``require_finite`` checks Python numbers only)."""
    return (q.shape, q.dtype, k_cache.shape, k_cache.dtype, _meta(v_cache), cu_seqlens_q.shape, cu_seqlens_q.dtype,
            seq_lens.shape, seq_lens.dtype, block_table.shape, block_table.dtype, max_seqlen_q, scale, type(scale),
            window_left, softcap, type(softcap), kv_layout, _meta(sinks), _meta(k_scale), _meta(v_scale),
            None if features is NO_FEATURES else (_meta(features.alibi_slopes), features.window_right,
                                                  _meta(features.cache_leftpad), features.sink_tokens,
                                                  features.rope_theta, type(features.rope_theta), features.rope_scale,
                                                  type(features.rope_scale), _meta(features.custom_mask),
                                                  _meta(features.packed_custom_mask)))


def scalars(features: AttnFeatures) -> tuple:
    """The scalar fields of ``features`` as :func:`signature` keys them (floats with their types)."""
    return (features.window_right, features.sink_tokens, features.rope_theta, type(features.rope_theta),
            features.rope_scale, type(features.rope_scale))


def _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, window_left, softcap,
           sinks, k_scale, v_scale, kv_layout, features) -> None:
    """The checks of :func:`check_paged_attention` (raises; returns nothing)."""
    k_cache, v_cache = check_paged_caches(OP, k_cache, v_cache, kv_layout)  # "v_cache must be provided" first
    require_ndim(OP, "q", q, 3, Q_LAYOUT)
    require_same_device(OP, "k_cache", k_cache, "q", q)
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"{OP}: q dtype {q.dtype} is not supported; pass q as float32, bfloat16 or float16.")
    fp8 = k_cache.dtype == FP8_DTYPE
    if not fp8 and k_cache.dtype != q.dtype:
        raise ValueError(
            f"{OP}: k_cache dtype {k_cache.dtype} does not match q dtype {q.dtype}. Caches must have q's dtype or be "
            f"{FP8_DTYPE} (with k_scale/v_scale); cast q or allocate the caches as {q.dtype}."
        )
    require_dim_match(OP, "head_dim", "q", q, 2, "k_cache", k_cache, 3)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        gqa = (f"num_heads ({as_int(num_heads)}) must be a multiple of num_kv_heads ({as_int(num_kv_heads)}) "
               f"(GQA: query head h reads KV head h // (num_heads // num_kv_heads))")
        hint = layout_hint(k_cache, kv_layout, f"{as_int(num_heads)} query heads", lambda h: num_heads % h == 0)
        if hint:  # the swapped layout explains the head count: say so first
            raise ValueError(f"{OP}:{hint} (Read as {kv_layout}, {gqa}.)")
        raise ValueError(f"{OP}: {gqa}. {gqa_fix(num_heads, num_kv_heads)}")

    check_varlen_metadata(OP, q, cu_seqlens_q, seq_lens, block_table, max_seqlen_q)
    if window_left < -1:
        raise ValueError(f"{OP}: window_left must be -1 (no window) or >= 0, got {as_int(window_left)}.")
    if softcap < 0:
        raise ValueError(f"{OP}: softcap must be >= 0 (0 disables it), got {softcap}.")
    require_finite(OP, "softcap", softcap, "scores become softcap * tanh(score / softcap); 0 disables it",
                   "Pass a finite softcap >= 0 (e.g. Gemma-2's 50.0), or 0.0 for none.")
    require_finite(OP, "scale", scale, "the softmax scale on q·k; None: head_dim ** -0.5",
                   "Pass a finite scale, or None for the default.")

    if sinks is not None:
        if sinks.dtype != torch.float32 or sinks.dim() != 1 or sinks.shape[0] != num_heads:
            raise ValueError(
                f"{OP}: sinks must be a float32 tensor of shape [{as_int(num_heads)}] (one logit per query head), got "
                f"shape {tuple(sinks.shape)} and dtype {sinks.dtype}."
            )
        require_same_device(OP, "sinks", sinks, "q", q)

    check_fp8_scales(OP, k_cache, k_scale, v_scale)
    check_features(OP, q, block_table.shape[0], features, max_seqlen_q)
