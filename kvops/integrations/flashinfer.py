"""FlashInfer-shaped batch decode on ``kvops.paged_attention`` (docs/attention_features.md, "FlashInfer-shaped calls").

``BatchDecodeWithPagedKVCacheWrapper`` takes FlashInfer's ``plan``/``run`` calls: ``plan`` turns FlashInfer's page
table (``indptr``, ``indices``, ``last_page_len``) into kvops' ``block_table``/``seq_lens`` once (host work, as
FlashInfer's own ``plan``), and ``run`` is one ``kvops.paged_attention`` call (no host sync of its own; it can be
traced by ``torch.compile``). No FlashInfer install is needed; the semantics are FlashInfer's
(``flashinfer/decode.py``, ``include/flashinfer/attention/decode.cuh``), written here in kvops' words.
"""

from __future__ import annotations

import math

import torch

from .._checks.flashinfer import PLAN, RUN, check_plan, check_run
from .._checks.forms import python_float
from ..ops.paged_attention import paged_attention

LOG2E = 1.0 / math.log(2.0)


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """FlashInfer's ALiBi slopes ``[num_heads]`` float32 (``flashinfer.utils.get_alibi_slopes``): ``2 ** (-8 h / n)``
    for ``h = 1..n``, ``n`` the largest power of two ``<= num_heads``, then ``2 ** (-4 (2 h - 1) / n)`` for the rest."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * h / n) for h in range(1, 1 + 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)``: decode (one query per sequence)
    over a paged KV cache, run by ``kvops.paged_attention``.

    ``float_workspace_buffer`` (any tensor, or None) is not used: kvops needs no workspace. ``use_cuda_graph``,
    ``use_tensor_cores`` and ``backend`` are FlashInfer's scheduling choices; they do not change results and are
    accepted and ignored. ``kv_layout``: ``"NHD"`` (caches ``[P, page_size, H_kv, D]``) or ``"HND"``
    (``[P, H_kv, page_size, D]``).

    Semantics (FlashInfer's): sequence ``b`` has pages ``indices[indptr[b]:indptr[b + 1]]`` (in order) and
    ``kv_len = (pages - 1) * page_size + last_page_len[b]`` keys (0 with no page); its query sits at position
    ``kv_len - 1`` and sees every key (``window_left = W >= 0``: keys ``>= kv_len - 1 - W``). Scores are
    ``sm_scale * q·k`` (default ``D ** -0.5``), then ``logits_soft_cap * tanh(s / logits_soft_cap)`` when
    ``logits_soft_cap > 0``. ``pos_encoding_mode``: ``"NONE"``; ``"ROPE_LLAMA"``: the cache holds un-rotated keys and
    q (at ``kv_len - 1``) and key ``j`` (at its row ``j``) are rotated GPT-NeoX style by angle
    ``position / rope_scale * rope_theta ** (-2i / D)`` (defaults ``rope_scale = 1``, ``rope_theta = 1e4``) inside
    the kernel; ``"ALIBI"``: ``slope_h * (j - (kv_len - 1))`` is added (slopes of :func:`alibi_slopes`).
    """

    def __init__(self, float_workspace_buffer: torch.Tensor | None = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False, backend: str = "auto") -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"BatchDecodeWithPagedKVCacheWrapper: kv_layout must be 'NHD' or 'HND', got "
                             f"{kv_layout!r}.")
        self._kv_layout = kv_layout
        self._plan = None

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
             data_type: str | torch.dtype | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True) -> None:
        """Plan a decode batch (FlashInfer's ``plan``; keyword arguments after ``page_size``, as FlashInfer asks).

        Args:
            indptr: ``[B + 1]`` int32, sequence ``b``'s pages are ``indices[indptr[b]:indptr[b + 1]]``.
            indices: ``[nnz_pages]`` int32 page ids (rows of the caches' ``P`` dim).
            last_page_len: ``[B]`` int32, keys in each sequence's last page (``1 <= n <= page_size``).
            num_qo_heads, num_kv_heads, head_dim, page_size: the shapes ``run`` will see (GQA: query head ``h``
                reads KV head ``h // (num_qo_heads // num_kv_heads)``).
            pos_encoding_mode: ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"`` (class docstring).
            window_left: ``-1`` or ``>= 0``; logits_soft_cap: None or ``>= 0`` (0/None: off); sm_scale: None
                (``head_dim ** -0.5``); rope_scale/rope_theta: None (1 and 1e4), used with ``"ROPE_LLAMA"``.
            q_data_type, kv_data_type (default q's), data_type (FlashInfer's deprecated alias, which sets either
                one only where it is None, as FlashInfer's: ``plan(..., data_type=torch.float8_e4m3fn,
                q_data_type=torch.float16)`` plans fp16 queries over an fp8 cache): what ``run`` must receive (a name
                such as ``"float16"`` or a ``torch.dtype``). ``non_blocking``: ignored.

        Host work, once per batch (reads ``indptr``: a host sync, as FlashInfer's ``plan``); not for
        ``torch.compile`` regions. Builds ``block_table [B, max_pages]`` (``-1`` past a sequence's pages) and
        ``seq_lens [B]`` on ``indptr``'s device.

        Raises:
            ValueError: an unknown ``pos_encoding_mode``; index tensors not 1-D int32 or of inconsistent lengths;
                ``num_qo_heads % num_kv_heads != 0``; a size ``< 1``; ``window_left < -1``; ``logits_soft_cap <
                0``; ``rope_scale``/``rope_theta`` not ``> 0``; ``logits_soft_cap``, ``sm_scale``, ``rope_scale``
                or ``rope_theta`` NaN or infinite; a ``last_page_len`` outside ``[1, page_size]`` for a sequence
                with pages; ``indptr`` not non-decreasing from 0 to at most ``len(indices)``; a sequence of more
                than ``2**31 - 1`` keys (kvops' ``seq_lens`` are int32).
        """
        if data_type is not None:  # FlashInfer's deprecated alias: fills the dtypes not given explicitly
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dtype = _dtype(q_data_type)
        kv_dtype = q_dtype if kv_data_type is None else _dtype(kv_data_type)
        # NumPy scalars: floats
        logits_soft_cap, sm_scale, rope_scale, rope_theta = (python_float(PLAN, name, x) for name, x in (
            ("logits_soft_cap", logits_soft_cap), ("sm_scale", sm_scale), ("rope_scale", rope_scale),
            ("rope_theta", rope_theta)))
        rope_scale = 1.0 if rope_scale is None else rope_scale
        rope_theta = 1e4 if rope_theta is None else rope_theta
        counts = check_plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                            pos_encoding_mode, window_left, logits_soft_cap, rope_scale, rope_theta, sm_scale)
        device = indptr.device
        width = max(1, max(counts, default=0))
        n = torch.tensor(counts, dtype=torch.int64, device=device)
        cols = torch.arange(width, device=device)
        if indices.numel() > 0:
            at = (indptr[:-1].long()[:, None] + cols).clamp_max(indices.numel() - 1)
            table = torch.where(cols < n[:, None], indices.long()[at], -1)
        else:
            table = torch.full((len(counts), width), -1, dtype=torch.int64, device=device)
        seq_lens = torch.where(n > 0, (n - 1) * page_size + last_page_len.long(), 0)
        batch = len(counts)
        self._plan = dict(
            block_table=table.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
            shape=(batch, num_qo_heads, num_kv_heads, head_dim, page_size), dtypes=(q_dtype, kv_dtype),
            window_left=window_left, softcap=float(logits_soft_cap or 0.0), sm_scale=sm_scale,
            rope=(rope_theta, rope_scale) if pos_encoding_mode == "ROPE_LLAMA" else (None, 1.0),
            alibi=alibi_slopes(num_qo_heads, device) if pos_encoding_mode == "ALIBI" else None,
            one=torch.ones(1, dtype=torch.float32, device=device),
        )

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, *, q_scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, window_left: int | None = None):
        """Decode attention for the planned batch (FlashInfer's ``run``).

        Args:
            q: ``[B, H_q, D]`` in the planned ``q_data_type``.
            paged_kv_cache: a tuple ``(k_cache, v_cache)``, each ``[P, page_size, H_kv, D]`` (NHD) or
                ``[P, H_kv, page_size, D]`` (HND), or one tensor ``[P, 2, page_size, H_kv, D]`` (HND:
                ``[P, 2, H_kv, page_size, D]``) with K at ``[:, 0]`` and V at ``[:, 1]``; the planned
                ``kv_data_type`` (q's, or ``float8_e4m3fn``); any strides, never copied.
            q_scale, k_scale: floats multiplied into ``sm_scale``; v_scale: multiplies the output (FlashInfer's
                fp8 calibration scales; an fp8 cache is otherwise read as ``cache.float()``).
            out, lse: optional preallocated ``[B, H_q, D]`` (q's dtype) / ``[B, H_q]`` float32 outputs.
            return_lse: also return the LSE.
            window_left: None, or the planned value (as FlashInfer).

        Returns:
            ``out [B, H_q, D]`` in q's dtype, or ``(out, lse)`` with ``lse [B, H_q]`` float32 in **base 2**, as
            FlashInfer's (``log2(sum_j 2 ** (s_j * log2(e)))`` = kvops' natural-log LSE ``* log2(e)``; ``-inf`` for a
            sequence with no keys). ``flashinfer.merge_state`` expects this base-2 form.

        Raises:
            RuntimeError: ``run`` before ``plan``. ValueError: q or caches whose shapes, page size or dtypes differ
            from the plan; ``out``/``lse`` buffers of another shape, dtype or device; a ``window_left`` other than the planned one;
            a NaN or infinite ``q_scale``/``k_scale``/``v_scale``; and every error of
            ``kvops.paged_attention``. No host sync: the checks read shapes and dtypes only (kvops' own value
            checks follow its value-check mode, docs/semantics.md §7).
        """
        p = self._plan
        if p is None:
            raise RuntimeError("BatchDecodeWithPagedKVCacheWrapper.run: call plan() first.")
        if isinstance(paged_kv_cache, (tuple, list)):
            k_cache, v_cache = paged_kv_cache
        else:
            k_cache, v_cache = _split(paged_kv_cache)
        q_scale, k_scale, v_scale = (python_float(RUN, name, x) for name, x in (  # NumPy scalars: floats
            ("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)))
        check_run(q, k_cache, v_cache, self._kv_layout, p["shape"], p["dtypes"], p["window_left"], window_left, out,
                  lse, (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)))
        scale = q.shape[-1] ** -0.5 if p["sm_scale"] is None else p["sm_scale"]
        scale = scale * (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        theta, rope_scale = p["rope"]
        o, lse_nat = paged_attention(
            q, k_cache, v_cache, p["cu_seqlens_q"], p["seq_lens"], p["block_table"], 1, scale=scale, causal=True,
            window_left=p["window_left"], softcap=p["softcap"], k_scale=p["one"] if fp8 else None,
            v_scale=p["one"] if fp8 else None, return_lse=True, kv_layout=self._kv_layout,
            alibi_slopes=p["alibi"], rope_theta=theta, rope_scale=rope_scale,
        )
        if v_scale is not None:
            o = o * v_scale
        lse_2 = lse_nat.t() * LOG2E
        if out is not None:
            o = out.copy_(o)
        if lse is not None:
            lse_2 = lse.copy_(lse_2)
        return (o, lse_2) if return_lse else o

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, **kwargs):
        """``run(q, paged_kv_cache, return_lse=True, **kwargs)``: ``(out, lse)`` (FlashInfer's ``run_return_lse``, which
        its decode tests call)."""
        return self.run(q, paged_kv_cache, return_lse=True, **kwargs)


def _split(kv: torch.Tensor):
    """``[P, 2, ...]`` -> the K and V views ``kv[:, 0]``, ``kv[:, 1]`` (FlashInfer's single-tensor cache)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(
            "BatchDecodeWithPagedKVCacheWrapper.run: paged_kv_cache must be a (k_cache, v_cache) tuple or one "
            f"[num_pages, 2, ...] tensor (5-D), got {type(kv).__name__} of shape "
            f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else None}."
        )
    return kv[:, 0], kv[:, 1]


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    got = getattr(torch, str(d), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"BatchDecodeWithPagedKVCacheWrapper.plan: unknown data type {d!r}; pass a torch.dtype.")
    return got
