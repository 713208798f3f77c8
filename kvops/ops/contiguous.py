"""Contiguous-cache ops: ``kvops::cache_write`` and ``kvops::cache_roll``.

Schema: ``kvops/_library.py``. Validators: ``kvops/_checks/contiguous.py``. CPU kernels: ``kvops/cpu/
contiguous.py``. CUDA kernels: ``kvops/triton/contiguous.py``. Inductor lowerings: ``lowering/inductor_contiguous.py``.
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks import values
from .._checks.common import int64_error
from .._checks.contiguous import check_cache_roll, check_cache_write, check_roll_rows, check_write_rows
from ..cpu import contiguous as cpu
from ..triton import HAS_TRITON
from .paged_write import paged_cache_write

# One module global per op: every global a traced wrapper reads is a Dynamo guard evaluated on each call of the
# compiled function, one per link of an attribute chain such as ``torch.ops.kvops.cache_write``.
_cache_write = torch.ops.kvops.cache_write.default


def cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int | torch.Tensor,
    cache_head_start: int | None = None,
) -> None:
    """Write ``T`` new tokens into a contiguous KV cache at rows ``[start, start + T)``, in place.

    Args:
        key: ``[B, T, H_in, D]``, same dtype and device as ``k_cache``.
        value: ``[B, T, H_in, D_v]``, same dtype and device as ``v_cache``.
        k_cache: ``[B, S, H_cache, D]`` (any strides, e.g. a view of a ``[B, S, 2, H, D]`` allocation); mutated.
        v_cache: ``[B, S, H_cache, D_v]``; mutated.
        start: first cache row (token index within the cache, not a global position): an int or SymInt, or an
            int32/int64 tensor on the caches' device, as compiled generate loops keep positions (gpt-fast's
            ``input_pos``): ``[]`` or ``[1]`` holds the first row, ``[T]`` one row per token (token ``t`` goes to row
            ``start[t]``, as gpt-fast's ``k_cache[:, :, input_pos] = k_val``). A tensor is never read on the host: no
            sync, no graph break, one compiled graph for every position. Its rows are a value contract (below).
        cache_head_start: first cache head written when the writer carries a slice of the KV heads
            (``H_in != H_cache``, as in tensor/Ulysses parallelism); heads outside ``[h0, h0 + H_in)`` are untouched.

    Raises:
        ValueError: ``"v_cache must be provided"``; missing ``value``; rank, dtype, device, batch or head_dim
            mismatches (the message names both shapes or dtypes); ``"... requires cache_head_start when cache heads
            (H_cache) differ from input heads (H_in)."``; a head slice outside ``[0, H_cache)``.
        RuntimeError: ``"Invalid kvops.cache_write write range: local=[s, e), kv_cache_size=S, num_new_tokens=T..."``
            when ``[start, start + T)`` leaves ``[0, S)``. A tensor ``start``: ``ValueError`` for a dtype other than
            int32/int64, a shape other than ``[]``, ``[1]``, ``[T]`` or another device; ``RuntimeError`` when
            ``T > S`` with a first row; its rows outside ``[0, S)`` are a value contract (docs/semantics.md §7) checked
            before anything is written per the value-check mode, as the paged indices: ``"eager"`` (default; eager
            calls, the int form's message, or ``"... start[i] = r is outside [0, S) ..."`` for ``[T]`` rows),
            ``"async"`` (``torch._assert_async``, also in compiled/exported graphs; nothing is written), ``"off"``.
            Unchecked (``"off"``, or compiled code in ``"eager"`` mode), rows outside ``[0, S)`` are skipped and the
            others written: nothing outside the cache is touched.

    All errors are raised by the fake rule too, so they fire at trace time under ``torch.compile`` and
    ``torch.export``. Semantics: a row-range ``copy_`` (as ``k_cache[:, start:start+T, h0:h0+H_in] = key``), the
    cache update of FlashAttention's ``flash_attn_with_kvcache`` (non-paged form, one ``start`` for the batch) and of
    sglang's causal video-diffusion KV cache (docs/semantics.md §1); a cache with a stride-0 dim (an ``expand``ed view)
    cannot be written in place and raises ``ValueError``. ``key``/``value`` may alias the caches (e.g. rows of
    ``k_cache`` itself): they are read before anything is written, as in compiled code (the kernels copy such a
    source first; docs/semantics.md §1). Under ``torch.compile`` (torch 2.13) pass a ``.clone()`` of such a
    view on every call, the first included: torch does not recompile when the inputs' aliasing changes
    (pytorch/pytorch#139789).

    With a tensor ``start`` the write is ``kvops.paged_cache_write`` on the cache read as ``B`` blocks of ``S`` rows
    (a view; slots ``b * S + row``), so it keeps that op's kernels, Inductor lowering (the write fuses with its
    producer) and export path; its metadata checks are the ones above, run in Python before it (under
    ``torch.compile(fullgraph=True)`` they surface as an "Observed exception" carrying the same error).
    """
    if isinstance(start, torch.Tensor):
        _cache_write_rows(key, value, k_cache, v_cache, start, cache_head_start)
        return
    if type(start) is int and not -(2**63) <= start < 2**63:  # (torch's schema error gives no fix)
        raise int64_error("kvops.cache_write", {"start": start})
    _cache_write(key, value, k_cache, v_cache, start, cache_head_start)


def _cache_write_rows(key, value, k_cache, v_cache, start, cache_head_start) -> None:
    """``cache_write`` with a tensor ``start``: slots ``b * S + row`` into the cache read as ``[B, S]`` blocks."""
    check_cache_write(key, value, k_cache, v_cache, 0, cache_head_start, check_rows=False)
    check_write_rows(key, k_cache, start)
    batch, num_new, cache_len = key.shape[0], key.shape[1], k_cache.shape[1]
    device = k_cache.device
    if start.dim() == 1 and start.shape[0] == num_new and num_new != 1:
        rows = start.to(torch.int64)
    else:
        rows = start.reshape(()).to(torch.int64) + torch.arange(num_new, dtype=torch.int64, device=device)
    ok = values.check_write_rows(rows, cache_len, start.dim() == 0 or start.shape[0] == 1)
    inside = (rows >= 0) & (rows < cache_len)
    if ok is not None:  # async value checks: a failing call writes nothing
        inside = inside & ok
    slots = torch.arange(batch, dtype=torch.int64, device=device)[:, None] * cache_len + rows[None, :]
    slots = torch.where(inside[None, :], slots, -1).view(-1)
    paged_cache_write(key.reshape(batch * num_new, *key.shape[2:]), value.reshape(batch * num_new, *value.shape[2:]),
                      k_cache, v_cache, slots, cache_head_start)


def cache_roll(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: int | torch.Tensor,
    dst: int | torch.Tensor,
    num_tokens: int | torch.Tensor,
    cache_head_start: int | None = None,
    num_heads: int | None = None,
) -> None:
    """Move cache rows ``[src, src + n)`` to ``[dst, dst + n)`` in both caches, in place (the eviction move).

    Correct when the two ranges overlap (as ``memmove``); the eviction step of streaming caches with attention sinks
    (StreamingLLM's rolling KV cache, sglang's causal video-diffusion cache: rows after the sink move down). Rows outside ``[dst, dst + n)`` and heads outside
    ``[cache_head_start, cache_head_start + num_heads)`` are untouched; the source rows keep their values where they
    are not overwritten.

    Args:
        k_cache: ``[B, S, H_cache, D]``; mutated.
        v_cache: ``[B, S, H_cache, D_v]``; mutated.
        src, dst, num_tokens: rows: ints or SymInts, or int32/int64 ``[]``/``[1]`` tensors on the caches' device, as
            compiled streaming loops keep their cursors (``kvops.export.streaming_update``). A tensor is never read on
            the host: no sync, no graph break, one compiled graph for every position; the rows are then a value
            contract (below).
        cache_head_start: first head moved (default 0).
        num_heads: heads moved (default: all heads from ``cache_head_start``).

    Raises:
        ValueError: ``"v_cache must be provided"``, cache mismatches, a head slice outside the cache, a cache with a
            stride-0 dim. With a tensor position: a tensor of another dtype, shape or device, and ``k_cache is
            v_cache`` (allowed with int positions only).
        RuntimeError: ``"Invalid kvops.cache_roll range: ..."`` when either range leaves ``[0, S)`` or ``n < 0``.
            With a tensor position this is a value contract (docs/semantics.md §7), checked before anything moves per
            the value-check mode, as the paged indices: ``"eager"`` (default; eager calls, the int form's message
            word for word), ``"async"`` (``torch._assert_async``, also in compiled/exported graphs; nothing moves),
            ``"off"``. Unchecked, rows whose source or destination is outside ``[0, S)`` are not moved (nothing
            outside the cache is read or written) and ``n <= 0`` moves nothing.

    With a tensor position the move is a fixed-size masked gather: the rows of the window ``[dst, S)`` when ``dst``
    is an int (``[dst, dst + n)`` when ``num_tokens`` is one too; ``[0, S)`` for a tensor ``dst``) are gathered
    (``index_select``, each row from ``row - dst + src`` inside the move, else itself) into a temporary of
    ``B x rows x heads x (D + D_v)`` elements, then the moved rows alone are written back with
    ``kvops.paged_cache_write`` on the cache read as ``B`` blocks of ``S`` rows (slots ``b * S + row``, ``-1`` for the
    rows not moved), so the move keeps that op's kernels, Inductor lowering and export path. The cache itself is never
    copied; an eviction after a sink of ``K`` rows (``dst = K``) gathers ``S - K`` rows, about what the move itself
    copies once the cache is full, but also when nothing moves (``n = 0``).
    """
    bad = int64_error("kvops.cache_roll", {"src": src, "dst": dst, "num_tokens": num_tokens})
    if bad is not None:  # (torch's schema error gives no fix)
        raise bad
    if isinstance(src, torch.Tensor) or isinstance(dst, torch.Tensor) or isinstance(num_tokens, torch.Tensor):
        h0, h1 = check_cache_roll(k_cache, v_cache, 0, 0, 0, cache_head_start, num_heads)  # metadata; rows below
        check_roll_rows(k_cache, v_cache, src, dst, num_tokens)
        src, dst, num_tokens = (x.reshape(()).long() if isinstance(x, torch.Tensor) else x
                                for x in (src, dst, num_tokens))
        ok = values.check_roll_rows(src, dst, num_tokens, k_cache.shape[1])
        move_rows(k_cache, v_cache, src, dst, num_tokens, h0, h1, ok)
        return
    torch.ops.kvops.cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start, num_heads)


def move_rows(k_cache, v_cache, src, dst, num_tokens, h0: int, h1: int, ok=None) -> None:
    """The tensor form of ``cache_roll`` on validated metadata (``src``/``dst``/``num_tokens``: ints or 0-d int64
    tensors): rows ``[src, src + n)`` to ``[dst, dst + n)`` of heads ``[h0, h1)``, rows outside ``[0, S)`` skipped,
    nothing moved where ``ok`` (a 0-d bool tensor) is False. Also used by ``kvops.export.streaming_update``."""
    batch, cache_len = k_cache.shape[0], k_cache.shape[1]
    device = k_cache.device
    static_dst = type(dst) is int and 0 <= dst <= cache_len
    lo = dst if static_dst else 0
    hi = min(dst + num_tokens, cache_len) if static_dst and type(num_tokens) is int and num_tokens >= 0 else cache_len
    rows = torch.arange(lo, max(lo, hi), dtype=torch.int64, device=device)
    source = rows - dst + src
    moved = (rows >= dst) & (rows < dst + num_tokens) & (source >= 0) & (source < cache_len)
    if ok is not None:
        moved = moved & ok
    index = torch.where(moved, source, rows)
    slots = torch.arange(batch, dtype=torch.int64, device=device)[:, None] * cache_len + rows[None, :]
    slots = torch.where(moved[None, :], slots, -1).view(-1)
    heads = h1 - h0
    k_rows = k_cache[:, :, h0:h1].index_select(1, index)  # [B, rows, heads, D], the only copy
    v_rows = v_cache[:, :, h0:h1].index_select(1, index)
    paged_cache_write(k_rows.view(-1, heads, k_rows.shape[3]), v_rows.view(-1, heads, v_rows.shape[3]),
                      k_cache, v_cache, slots, h0)


# --- fake rules: the contract at trace time ---------------------------------------------------------------------
@torch.library.register_fake("kvops::cache_write")
def _cache_write_fake(key, value, k_cache, v_cache, start, cache_head_start=None):
    check_cache_write(key, value, k_cache, v_cache, start, cache_head_start)


@torch.library.register_fake("kvops::cache_roll")
def _cache_roll_fake(k_cache, v_cache, src, dst, num_tokens, cache_head_start=None, num_heads=None):
    check_cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start, num_heads)


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, kernels) -> None:
    @torch.library.impl("kvops::cache_write", device)
    def _write(key, value, k_cache, v_cache, start, cache_head_start=None):
        h0 = check_cache_write(key, value, k_cache, v_cache, start, cache_head_start)
        kernels.cache_write(key, value, k_cache, v_cache, start, h0)

    @torch.library.impl("kvops::cache_roll", device)
    def _roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start=None, num_heads=None):
        h0, h1 = check_cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start, num_heads)
        kernels.cache_roll(k_cache, v_cache, src, dst, num_tokens, h0, h1)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import contiguous as _triton_contiguous

    _register("CUDA", _triton_contiguous)
