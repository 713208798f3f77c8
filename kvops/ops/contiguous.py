"""Contiguous-cache ops: ``kvops::cache_write`` and ``kvops::cache_roll``.

Schema: ``kvops/_library.py``. Validators: ``kvops/_checks/contiguous.py``. CPU kernels: ``kvops/reference/
contiguous.py``. CUDA kernels: ``kvops/triton/contiguous.py``. Inductor lowerings: ``lowering/inductor_contiguous.py``.
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks.common import int64_error
from .._checks.contiguous import check_cache_roll, check_cache_write
from ..reference import contiguous as cpu
from ..triton import HAS_TRITON

# One module global per op: every global a traced wrapper reads is a Dynamo guard evaluated on each call of the
# compiled function, one per link of an attribute chain such as ``torch.ops.kvops.cache_write``.
_cache_write = torch.ops.kvops.cache_write.default


def cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    cache_head_start: int | None = None,
) -> None:
    """Write ``T`` new tokens into a contiguous KV cache at rows ``[start, start + T)``, in place.

    Args:
        key: ``[B, T, H_in, D]``, same dtype and device as ``k_cache``.
        value: ``[B, T, H_in, D_v]``, same dtype and device as ``v_cache``.
        k_cache: ``[B, S, H_cache, D]`` (any strides, e.g. a view of a ``[B, S, 2, H, D]`` allocation); mutated.
        v_cache: ``[B, S, H_cache, D_v]``; mutated.
        start: first cache row (token index within the cache, not a global position); an int or SymInt.
        cache_head_start: first cache head written when the writer carries a slice of the KV heads
            (``H_in != H_cache``, as in tensor/Ulysses parallelism); heads outside ``[h0, h0 + H_in)`` are untouched.

    Raises:
        ValueError: ``"v_cache must be provided"``; missing ``value``; rank, dtype, device, batch or head_dim
            mismatches (the message names both shapes or dtypes); ``"... requires cache_head_start when cache heads
            (H_cache) differ from input heads (H_in)."``; a head slice outside ``[0, H_cache)``.
        RuntimeError: ``"Invalid kvops.cache_write write range: local=[s, e), kv_cache_size=S, num_new_tokens=T..."``
            when ``[start, start + T)`` leaves ``[0, S)``.

    All errors are raised by the fake rule too, so they fire at trace time under ``torch.compile`` and
    ``torch.export``. Semantics: a row-range ``copy_`` (as ``k_cache[:, start:start+T, h0:h0+H_in] = key``), the
    cache update of FlashAttention's ``flash_attn_with_kvcache`` (non-paged form, one ``start`` for the batch) and of
    sglang's causal video-diffusion KV cache (docs/semantics.md §1); a cache with a stride-0 dim (an ``expand``ed view)
    cannot be written in place and raises ``ValueError``. ``key``/``value`` may alias the caches (e.g. rows of
    ``k_cache`` itself): they are read before anything is written, as in compiled code (the kernels copy such a
    source first; docs/semantics.md §1). Under ``torch.compile`` (torch 2.13) pass a ``.clone()`` of such a
    view on every call, the first included: torch does not recompile when the inputs' aliasing changes
    (pytorch/pytorch#139789).
    """
    if type(start) is int and not -(2**63) <= start < 2**63:  # (torch's schema error gives no fix)
        raise int64_error("kvops.cache_write", {"start": start})
    _cache_write(key, value, k_cache, v_cache, start, cache_head_start)


def cache_roll(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: int,
    dst: int,
    num_tokens: int,
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
        src, dst, num_tokens: rows (ints or SymInts).
        cache_head_start: first head moved (default 0).
        num_heads: heads moved (default: all heads from ``cache_head_start``).

    Raises:
        ValueError: ``"v_cache must be provided"``, cache mismatches, a head slice outside the cache, a cache with a
            stride-0 dim.
        RuntimeError: ``"Invalid kvops.cache_roll range: ..."`` when either range leaves ``[0, S)``.
    """
    bad = int64_error("kvops.cache_roll", {"src": src, "dst": dst, "num_tokens": num_tokens})
    if bad is not None:  # (torch's schema error gives no fix)
        raise bad
    torch.ops.kvops.cache_roll(k_cache, v_cache, src, dst, num_tokens, cache_head_start, num_heads)


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
