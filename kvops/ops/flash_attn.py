"""``flash_attn_with_kvcache``: FlashAttention's KV-cache entry point on kvops ops (docs/semantics.md §5).

Not an op of its own: it appends ``k``/``v`` with ``kvops::paged_cache_write`` and attends with
``kvops::paged_attention``; the metadata between them (slot mapping, sequence lengths) is computed on the device with
no host sync. Its own argument checks are plain Python on shapes, dtypes and Python ints, so they run at trace time
under ``torch.compile`` (Dynamo reports them as an "Observed exception" carrying the original error) and
``torch.export``.
"""

from __future__ import annotations

import torch

from .._checks import values
from .._checks.common import index_fix, kv_scale_tensors
from .._checks.flash_attn import OP, check_flash_attn_with_kvcache, check_mask_length
from .._checks.features import AttnFeatures
from .._checks.paged_attention import check_paged_attention
from .paged_attention import paged_attention
from .paged_write import paged_cache_write
from .rotary import apply_rotary, rotary_paged_cache_write


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
):
    """Append new K/V to a KV cache and attend, with FlashAttention 2's ``flash_attn_with_kvcache`` signature.

    For each sequence ``b``: ``k[b]``/``v[b]`` (``S_new`` tokens) are written at positions
    ``[cache_seqlens[b], cache_seqlens[b] + S_new)`` through ``kvops.paged_cache_write``, then ``q[b]`` attends to
    positions ``[0, cache_seqlens[b] + S_new)`` through ``kvops.paged_attention``.

    Argument forms (kvops/_checks/forms.py, docs/porting.md "FlashAttention's argument forms"): every form
    FlashAttention's pybind11 entry point converts is accepted with its meaning: ints (NumPy integers, one-element
    integer tensors) for ``window_size``'s bounds and ``num_splits``; ints, floats or one-element tensors for
    ``softmax_scale`` and ``softcap``; truth values for ``causal``, ``rotary_interleaved`` and
    ``return_softmax_lse``. A tensor given for such a Python value is read once in eager calls; while
    ``torch.compile``/``torch.export`` trace the call it is refused (``ValueError`` naming the form that compiles),
    since its value would be baked into the graph.

    Args:
        q: ``[B, S_q, H_q, D]`` float32/bfloat16/float16.
        k_cache: paged ``[P, block_size, H_kv, D]`` (NHD) when ``block_table`` is given, else contiguous-form
            ``[B, S, H_kv, D]`` (read as ``B`` blocks of ``block_size = S``, one per sequence: a view, no copy;
            ``[B_cache, S, H_kv, D]`` with ``cache_batch_idx``). Any
            strides; mutated in place when ``k`` is given. NHD only (as FlashAttention): for an HND cache
            ``[P, H_kv, block_size, D]`` pass its NHD view ``k_cache.transpose(1, 2)`` (no copy), or use
            ``kvops.paged_cache_write``/``kvops.paged_attention`` with ``kv_layout="HND"``. An HND cache with
            ``H_kv == block_size`` cannot be told from an NHD one by its shape and is read as NHD.
        v_cache: like ``k_cache`` with ``D_v``.
        k, v: optional ``[B, S_new, H_kv, D]`` / ``[B, S_new, H_kv, D_v]`` new tokens (together or not at all).
        cache_seqlens: int or ``[B]`` int32 tensor, tokens already in each sequence's cache (before ``k``). ``None``
            (only without ``k``): every sequence fills its capacity ``max_blocks * block_size``.
        cache_batch_idx: ``[B]`` int32, contiguous form only (as FlashAttention): sequence ``b`` uses row
            ``cache_batch_idx[b]`` of a ``[B_cache, S, H_kv, D]`` cache (its block table is ``cache_batch_idx.view(B,
            1)``); other rows are untouched. Value contract ``0 <= cache_batch_idx[b] < B_cache``, checked before
            anything is written. Repeated rows with ``k`` get the tokens of one of the sequences (as FlashAttention).
        block_table: ``[B, max_blocks]`` int32 physical block ids (entries past a sequence's blocks are never read).
        softmax_scale: default ``D ** -0.5``.
        causal: bottom-right aligned causal mask: query ``i`` sits at position ``seq_len - S_q + i``.
        window_size: ``(left, right)``, each ``-1`` (unbounded) or ``>= 0``: query at position ``pos`` sees keys
            ``[pos - left, pos + right]`` (bottom-right aligned, as FlashAttention's local attention); with
            ``causal=True`` ``right`` is ignored (0), as in FlashAttention (``flash_api.cpp``: ``if (is_causal)
            window_size_right = 0``). A tuple or list of two ints, or a 2-element integer tensor (FlashAttention's
            ``test_flash_attn_kvcache`` passes ``torch.randint(0, seqlen_k, (2,))``); anything else raises
            ``ValueError``.

        cache_leftpad: ``[B]`` int32, the row each sequence's cache starts at (FlashAttention's left padding):
            the keys are rows ``[cache_leftpad[b], cache_seqlens[b] + S_new)``, the new ``k``/``v`` are still
            written at row ``cache_seqlens[b]``, and the query's position is counted in rows (so causal, window
            and ALiBi distances are the same as FlashAttention's over the unpadded keys). Rotary tables are indexed
            by row, as FlashAttention does. Works with ``block_table`` too (FlashAttention 2 refuses that pair).
            Value contract: ``0 <= cache_leftpad[b] <= cache_seqlens[b]`` (a first key row past the row the new
            tokens go to would hide them), checked before anything is written.
        alibi_slopes: ``[H_q]`` or ``[B, H_q]`` float32: ALiBi, ``- slope * |pos - j|`` added to the score of key
            ``j`` (after softcap, before masking). The output is FlashAttention's; under ``causal`` FlashAttention's
            kernel adds ``slope * j`` instead, which differs by a per-query constant, so its ``softmax_lse`` differs
            by ``slope * pos`` from kvops' (kvops' LSE is the log-sum-exp of the scores as written here).
        softcap: ``> 0`` applies ``softcap * tanh(score / softcap)`` before masking.
        return_softmax_lse: also return the log-sum-exp ``[B, H_q, S_q]`` float32 (natural log; ``-inf`` for a query
            that sees no key).
        rotary_cos, rotary_sin: ``[seqlen_ro, rotary_dim / 2]`` in q's dtype (``rotary_dim <= D``, ``seqlen_ro >=``
            the capacity), only with ``k``: ``k`` is rotated at its cache positions ``cache_seqlens + i`` inside the
            write (``kvops.rotary_paged_cache_write``); ``q`` at ``cache_seqlens + i`` when ``causal`` or local
            (``window_size != (-1, -1)``), else every query at ``cache_seqlens`` (FlashAttention's semantics).
        rotary_interleaved: GPT-J pairs ``(2j, 2j + 1)`` (default, as FlashAttention) or GPT-NeoX pairs ``(j, j +
            rotary_dim / 2)``.
        num_splits: a scheduling hint (an int); ignored.
        custom_mask, packed_custom_mask: (kvops extension, keyword-only; docs/tree-mask.md) a mask among each
            sequence's ``S_q`` new rows, as ``kvops.paged_attention``'s: bool ``[B * S_q ** 2]`` or uint8
            ``[B * ceil(S_q ** 2 / 8)]`` (little-endian bits, each sequence's segment padded to whole bytes); the
            cached keys stay visible and the mask replaces the causal rule among the new keys (a draft tree
            verified in one call). The length is exact here (every sequence has ``S_q`` rows): ``ValueError``.
        k_scale, v_scale: (kvops extension, keyword-only) float32 ``[1]`` or ``[H_kv]`` scales for
            ``float8_e4m3fn`` caches (written as ``x / scale``, read as ``cache * scale``).

    Returns:
        ``out [B, S_q, H_q, D_v]`` in q's dtype, or ``(out, softmax_lse)``.

    Raises:
        ValueError: ``"v_cache must be provided"``; ``k_cache`` None (it can only be None for MLA's
            ``only_qv=True`` path, which kvops does not support); ``k`` without ``v`` or ``v`` without ``k``; ranks;
            ``block_table`` not 2-D int32 or its batch not ``B``; ``cache_seqlens`` not an int or a ``[B]`` int32
            tensor; ``k`` without ``cache_seqlens``; ``H_q % H_kv != 0``; ``k``/``v`` shapes that disagree with
            ``q`` (batch) or the cache (heads, head_dim); a contiguous-form cache whose batch is not ``B``; a write
            past the capacity ``max_blocks * block_size`` when it is known from shapes and Python ints
            (``S_new > capacity``, or ``cache_seqlens + S_new > capacity`` for an int ``cache_seqlens``). Errors of
            the ops (dtypes, devices, fp8 scales, ``window_left < -1``, ``softcap < 0``) propagate from their
            validators. When a head count (``H_q``, or ``k``'s) contradicts ``k_cache``'s ``num_kv_heads`` but fits
            its ``block_size`` dim, the message says the cache may be HND and how to pass an NHD view.
        ValueError (rotary): tables without ``k`` (``"If rotary cos/sin are provided, new key / value to be appended
            to KV cache must also be provided"``), only one table, ``"cos/sin seqlen must be at least the seqlen of KV
            cache"``, ``"rotary_dim must be <= headdim"``, a table dtype other than q's.
        ValueError (zero sizes): a cache with ``block_size`` (``seqlen_cache`` without ``block_table``),
            ``num_kv_heads`` or ``head_dim`` 0. Every check, the attention's included, runs before ``k``/``v`` are
            appended: a failing call changes no cache.
        ValueError (features): ``alibi_slopes`` not float32 ``[H_q]``/``[B, H_q]``; ``cache_leftpad`` not int32
            ``[B]``; ``window_size`` not a pair of ints in one of FlashAttention's forms (e.g. ``(2.5, 0)``), or a
            bound below -1; ``softmax_scale``/``softcap``/``num_splits`` not a number of the kind FlashAttention takes;
            ``cache_batch_idx`` not int32 ``[B]``, or given with ``block_table`` (FlashAttention refuses the pair); a
            tensor for a Python value while tracing (above). A ``cache_leftpad[b]`` outside ``[0, cache_seqlens[b]]``
            is a value contract (``RuntimeError``, below). All argument checks run before anything is written.
        RuntimeError: value contracts (docs/semantics.md §7), before anything is written: a ``cache_seqlens``
            value with ``cache_seqlens[b] + S_new`` past the capacity addressable by ``block_table``, or negative
            (``"flash_attn_with_kvcache: sequence b has cache_seqlens=n; ... block_table addresses only C tokens
            ..."``, as FlashAttention's ``RuntimeError`` matching ``"block_table"``), or a block id outside
            ``[0, P)`` among the blocks a sequence uses, or a ``cache_leftpad[b]`` outside ``[0,
            cache_seqlens[b]]``, or a ``cache_batch_idx[b]`` outside ``[0, B_cache)``. Checked per the value-check
            mode: ``"eager"`` (default; eager calls, one host sync), ``"async"`` (``torch._assert_async``, also in
            compiled/exported graphs; the write is skipped), ``"off"``. Unchecked (``"off"``, or compiled code in
            ``"eager"`` mode), positions past the capacity are neither written (slot -1) nor read (``seq_lens``
            clamped), so no other sequence's blocks are touched, but the result is meaningless; a used block id
            outside ``[0, P)`` then raises in the native CPU attention kernel (``"kvops.paged_attention:
            block_table[b, j] = id is not a block of the cache ..."``, docs/semantics.md §7).
    """
    args = check_flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                         window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                         return_softmax_lse)
    cache_seqlens, softmax_scale, softcap = args.cache_seqlens, args.softmax_scale, args.softcap
    k_scale, v_scale = kv_scale_tensors(OP, k_scale, v_scale)
    batch, s_q = q.shape[0], q.shape[1]
    device = q.device
    user_table = block_table
    if cache_batch_idx is not None:  # contiguous form, sequence b in k_cache row cache_batch_idx[b] (block of size S)
        block_table = cache_batch_idx.view(batch, 1)
    elif block_table is None:  # contiguous form: sequence b is block b of block_size S
        block_table = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
    block_size = k_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    s_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        base = torch.full((batch,), capacity, dtype=torch.int64, device=device)
    elif isinstance(cache_seqlens, torch.Tensor):
        base = cache_seqlens.to(torch.int64)
    else:
        base = torch.full((batch,), cache_seqlens, dtype=torch.int64, device=device)
    seq_lens = (base + s_new).clamp(0, capacity).to(torch.int32)
    cu_seqlens_q = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * s_q
    left, right = args.window[0], 0 if args.causal else args.window[1]
    features = {}  # only what is used: calls without the features keep the op's call of before them
    if alibi_slopes is not None:
        features["alibi_slopes"] = alibi_slopes
    if cache_leftpad is not None:
        features["cache_leftpad"] = cache_leftpad
    for name, mask in (("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask)):
        if mask is not None:
            features[name] = mask
            check_mask_length(name, mask, batch, s_q)
    if right > 0:
        features["window_right"] = right
    q_rows = q.reshape(batch * s_q, *q.shape[2:])
    # the attention's contract too, before anything is written (a failing call changes nothing)
    check_paged_attention(q_rows, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, s_q, softmax_scale,
                          right == 0, left, softcap, None, k_scale, v_scale, "NHD", AttnFeatures(**features))
    ok = values.check_kvcache(base, user_table, k_cache, s_new,  # value contract, docs/semantics.md §7
                              cache_leftpad=cache_leftpad)
    if alibi_slopes is not None:  # finite slopes (async: a failing call writes nothing either)
        alibi_ok = values.check_alibi_slopes(alibi_slopes, OP)
        ok = alibi_ok if ok is None else ok if alibi_ok is None else ok & alibi_ok
    if cache_batch_idx is not None:
        ok_idx = values.check_cache_batch_idx(cache_batch_idx, k_cache.shape[0], OP)
        ok = ok_idx if ok is None else (ok if ok_idx is None else ok & ok_idx)

    if k is not None and s_new > 0:
        pos = base[:, None] + torch.arange(s_new, dtype=torch.int64, device=device)[None, :]  # [B, S_new]
        inside = (pos >= 0) & (pos < capacity)
        blocks = block_table.gather(1, pos.clamp(0, capacity - 1) // block_size).to(torch.int64)
        if cache_batch_idx is not None:  # a row outside k_cache is never written, whatever the value-check mode
            inside = inside & (blocks >= 0) & (blocks < k_cache.shape[0])
        slots = torch.where(inside, blocks * block_size + pos % block_size, -1).view(-1)
        if ok is not None:  # async value checks: a failing batch writes nothing
            slots = torch.where(ok, slots, -1)
        k_rows, v_rows = k.reshape(batch * s_new, *k.shape[2:]), v.reshape(batch * s_new, *v.shape[2:])
        if rotary_cos is None:
            paged_cache_write(k_rows, v_rows, k_cache, v_cache, slots, None, k_scale, v_scale)
        else:  # k rotated at its cache positions inside the write (fused under Inductor)
            ro_pos = pos.clamp(0, rotary_cos.shape[0] - 1).view(-1)
            rotary_paged_cache_write(k_rows, v_rows, k_cache, v_cache, slots, ro_pos, rotary_cos, rotary_sin,
                                     args.rotary_interleaved, None, k_scale, v_scale)
    if rotary_cos is not None:  # q: at cache_seqlens + i when causal or local, else all at cache_seqlens (as FA)
        local = args.causal or args.window != (-1, -1)
        q_pos = base[:, None] + (torch.arange(s_q, dtype=torch.int64, device=device) if local else 0)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_pos.expand(batch, s_q).clamp(0, rotary_cos.shape[0] - 1),
                         args.rotary_interleaved)

    out, lse = paged_attention(
        q.reshape(batch * s_q, *q.shape[2:]), k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, s_q,
        scale=softmax_scale, causal=right == 0, window_left=left, softcap=softcap, k_scale=k_scale,
        v_scale=v_scale, return_lse=True, **features,
    )
    out = out.view(batch, s_q, *out.shape[1:])
    if not args.return_softmax_lse:
        return out
    return out, lse.view(lse.shape[0], batch, s_q).transpose(0, 1).contiguous()


def check_kvcache_capacity(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    block_table: torch.Tensor | None = None,
    num_new_tokens: int = 0,
) -> None:
    """Eager check of the value contract of :func:`flash_attn_with_kvcache`, whatever the value-check mode (it reads
    ``cache_seqlens`` and ``block_table``: a host sync on CUDA; do not call it inside compiled regions).

    The same check ``flash_attn_with_kvcache`` runs in the default ``"eager"`` value-check mode (docs/semantics.md
    §7): raises ``RuntimeError`` (naming ``block_table``) when a sequence has ``cache_seqlens[b] < 0`` or
    ``cache_seqlens[b] + num_new_tokens`` past the capacity ``max_blocks * block_size`` addressable by
    ``block_table``, or when a block id it uses is outside ``[0, P)``.
    """
    for name, t, dims, layout in (("cache_seqlens", cache_seqlens, (0, 1), "[batch]"),
                                  ("block_table", block_table, (2,), "[batch, max_blocks]")):
        if isinstance(t, torch.Tensor) and (t.dtype != torch.int32 or t.dim() not in dims):
            raise ValueError(
                f"kvops.check_kvcache_capacity: {name} must be an int32 tensor {layout}, got shape {tuple(t.shape)} "
                f"and dtype {t.dtype}. " + index_fix(name, t, dims[-1], (torch.int32,), layout)
            )
    batch = k_cache.shape[0] if block_table is None else block_table.shape[0]
    lens = torch.as_tensor(cache_seqlens, device=k_cache.device).expand(batch)
    values.check_kvcache(lens, block_table, k_cache, num_new_tokens, OP, mode="eager")
