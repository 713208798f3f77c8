"""Validator of ``kvops.integrations.flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (``plan`` and ``run``).

``plan`` is host work (as FlashInfer's): it reads ``indptr`` and ``last_page_len`` and checks their values here.
``run`` checks shapes and dtypes against the plan only (no tensor contents, no host sync); the rest is
``kvops.paged_attention``'s validator.
"""

from __future__ import annotations

import torch

from .common import index_fix, require_finite

PLAN = "BatchDecodeWithPagedKVCacheWrapper.plan"
RUN = "BatchDecodeWithPagedKVCacheWrapper.run"
MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
LAYOUTS = {"indptr": "[batch + 1]", "indices": "[nnz_pages]", "last_page_len": "[batch]"}
MAX_KV_LEN = 2**31 - 1  # kvops.paged_attention's seq_lens are int32


def check_plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
               window_left, logits_soft_cap, rope_scale, rope_theta, sm_scale=None) -> list[int]:
    """Check a ``plan`` call; returns the number of pages of each sequence (read from ``indptr`` on the host)."""
    if pos_encoding_mode not in MODES:
        raise ValueError(f"{PLAN}: pos_encoding_mode must be one of {MODES}, got {pos_encoding_mode!r}.")
    for name, t, ndim in (("indptr", indptr, 1), ("indices", indices, 1), ("last_page_len", last_page_len, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype != torch.int32:
            raise ValueError(
                f"{PLAN}: {name} must be a 1-D int32 tensor, got "
                f"{(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__}. "
                + index_fix(name, t, 1, (torch.int32,), LAYOUTS[name])
            )
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        if t.device.type == "meta" or t.device != indptr.device:
            raise ValueError(
                f"{PLAN}: {name} is on {t.device} (indptr on {indptr.device}); plan reads indptr and last_page_len on "
                f"the host and gathers indices next to them: pass the three on one real device (e.g. cpu)."
            )
    batch = indptr.shape[0] - 1
    if batch < 0 or last_page_len.shape[0] != batch:
        raise ValueError(
            f"{PLAN}: indptr must be [batch + 1] and last_page_len [batch], got {indptr.shape[0]} and "
            f"{last_page_len.shape[0]} entries."
        )
    for name, n in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("page_size", page_size)):
        if n < 1:
            raise ValueError(f"{PLAN}: {name} must be >= 1, got {n}.")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{PLAN}: num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) (GQA).")
    if window_left < -1:
        raise ValueError(f"{PLAN}: window_left must be -1 (no window) or >= 0, got {window_left}.")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"{PLAN}: logits_soft_cap must be None or >= 0 (0: off), got {logits_soft_cap}.")
    if pos_encoding_mode == "ROPE_LLAMA" and not (rope_scale > 0 and rope_theta > 0):
        raise ValueError(f"{PLAN}: rope_scale and rope_theta must be > 0, got {rope_scale} and {rope_theta}.")
    for name, x, what in (("logits_soft_cap", logits_soft_cap, "None or >= 0; 0/None: off"),
                          ("sm_scale", sm_scale, "None: head_dim ** -0.5"), ("rope_scale", rope_scale, "default 1"),
                          ("rope_theta", rope_theta, "default 1e4")):
        require_finite(PLAN, name, x, what, f"Pass a finite {name}.")
    ptr = indptr.tolist()  # host work, as FlashInfer's plan
    counts = [ptr[b + 1] - ptr[b] for b in range(batch)]
    if ptr[0] != 0 or min(counts, default=0) < 0 or ptr[-1] > indices.shape[0]:
        raise ValueError(
            f"{PLAN}: indptr = {ptr} must be non-decreasing from 0 to at most len(indices) = {indices.shape[0]} "
            f"(sequence b's pages are indices[indptr[b]:indptr[b + 1]])."
        )
    last = last_page_len.tolist()
    for b in range(batch):
        if counts[b] > 0 and not 1 <= last[b] <= page_size:
            raise ValueError(
                f"{PLAN}: last_page_len[{b}] = {last[b]} must be in [1, page_size = {page_size}] (the keys in "
                f"sequence {b}'s last page)."
            )
        kv_len = (counts[b] - 1) * page_size + last[b] if counts[b] > 0 else 0
        if kv_len > MAX_KV_LEN:  # kvops' seq_lens are int32: a longer sequence would wrap (to 3 keys)
            raise ValueError(
                f"{PLAN}: sequence {b} has {counts[b]} pages of page_size {page_size} (last_page_len {last[b]}), "
                f"kv_len = {kv_len} keys, more than the {MAX_KV_LEN} an int32 sequence length holds "
                f"(kvops.paged_attention's seq_lens). Split the sequence, or pass fewer pages."
            )
    return counts


def check_run(q, k_cache, v_cache, kv_layout, shape, dtypes, planned_window, window_left, out=None,
              lse=None, scales=()) -> None:
    """Shapes and dtypes of a ``run`` call against its plan (``ValueError``; metadata only), including the optional
    ``out`` ``[batch, num_qo_heads, head_dim_vo]`` (q's dtype) and ``lse`` ``[batch, num_qo_heads]`` (float32)
    buffers, checked before any attention runs; ``scales``: ``(name, value)`` of the float calibration scales
    (``q_scale``, ``k_scale``, ``v_scale``), each None or finite."""
    for name, x in scales:
        require_finite(RUN, name, x, "a calibration scale; None: 1", f"Pass a finite {name}, or None.")
    batch, h_q, h_kv, head_dim, page_size = shape
    q_dtype, kv_dtype = dtypes
    for name, buf, want, dtype in (("out", out, (batch, h_q, v_cache.shape[-1]), q.dtype),
                                   ("lse", lse, (batch, h_q), torch.float32)):
        if buf is not None and (tuple(buf.shape) != want or buf.dtype != dtype or buf.device != q.device):
            raise ValueError(f"{RUN}: {name} must be a {dtype} tensor of shape {list(want)} on {q.device}, got "
                             f"{list(buf.shape)} {buf.dtype} on {buf.device}; pass {name}=None to get a new one.")
    if tuple(q.shape) != (batch, h_q, head_dim):
        raise ValueError(f"{RUN}: q must be [batch, num_qo_heads, head_dim] = {[batch, h_q, head_dim]} as planned, "
                         f"got {list(q.shape)}.")
    if q.dtype != q_dtype or k_cache.dtype != kv_dtype or v_cache.dtype != kv_dtype:
        raise ValueError(f"{RUN}: planned q_data_type {q_dtype} and kv_data_type {kv_dtype}, got q {q.dtype}, "
                         f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype}; plan with these dtypes.")
    if k_cache.dim() == 4:
        rows, heads = (k_cache.shape[1], k_cache.shape[2]) if kv_layout == "NHD" else (k_cache.shape[2],
                                                                                        k_cache.shape[1])
        if rows != page_size or heads != h_kv:
            dims = "[P, page_size, H_kv, D]" if kv_layout == "NHD" else "[P, H_kv, page_size, D]"
            other = "HND" if kv_layout == "NHD" else "NHD"
            if rows == h_kv and heads == page_size:
                fix = f" It may be an {other} cache: construct the wrapper with kv_layout=\"{other}\"."
            elif rows == page_size:
                fix = (f" Allocate the cache with the planned num_kv_heads={h_kv} (the model's), or plan with "
                       f"num_kv_heads={heads}.")
            else:
                fix = f" Allocate the cache with the planned page_size={page_size}, or plan with page_size={rows}."
            raise ValueError(f"{RUN}: k_cache {list(k_cache.shape)} is not {kv_layout} {dims} with page_size "
                             f"{page_size} and {h_kv} KV heads as planned.{fix}")
    if window_left is not None and window_left != planned_window:
        raise ValueError(f"{RUN}: window_left={window_left} differs from the planned {planned_window}; pass None "
                         f"or plan with it.")
