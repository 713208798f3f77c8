"""Staging-buffer ops of prefill→decode KV transfer: ``kvops::paged_kv_gather`` and ``kvops::paged_kv_scatter``.

Semantics: ``docs/semantics.md`` §6 (after sglang's ``gather_all_layers_to_staging`` /
``scatter_staging_to_kv``). Schema: ``kvops/_library.py``. Validator: ``kvops/_checks/transfer.py``. CPU kernel:
``kvops/cpu/transfer.py``. CUDA kernel: ``kvops/triton/transfer.py`` (all layers in one launch).

Staging layout (one writer's buffer, contiguous): ``staging[0, l]`` is layer ``l``'s K, ``staging[1, l]`` its V, each
``[n, h, D]`` for the request's tokens ``[start, start + n)`` and heads ``[h0, h0 + h)``; i.e. ``[2, L, n, h, D]``,
K layers then V layers, so one send moves one buffer. A decode rank receiving from several writers places their
buffers back to back in the order of ``compute_head_slice_params`` (writer-major).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._deprecation import renamed_keyword
from .._checks.common import int64_error
from .._checks.transfer import check_paged_kv_transfer
from ..cpu import transfer as cpu
from ..triton import HAS_TRITON

GATHER = "kvops.paged_kv_gather"
SCATTER = "kvops.paged_kv_scatter"


def staging_shape(num_layers: int, num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """Shape of one writer's staging buffer: ``(2, L, n, h, D)`` (K layers then V layers)."""
    return (2, num_layers, num_tokens, num_heads, head_dim)


def paged_kv_gather(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    staging: torch.Tensor,
    start: int = 0,
    cache_head_start: int = 0,
) -> None:
    """Copy one request's KV head slice, all layers, from paged caches into a contiguous staging buffer (in place).

    ``staging[0, l, i] = k_caches[l][b, r, cache_head_start : cache_head_start + h]`` and ``staging[1, l, i]`` likewise from
    ``v_caches[l]``, where token ``p = start + i`` sits in block ``b = block_table[p // block_size]``, row
    ``r = p % block_size``. Bit-exact (any dtype, fp8 included); the caches are only read, never copied.

    Args:
        k_caches, v_caches: ``L`` caches each, ``[P, block_size, H_kv, D]`` (NHD), any strides (e.g. K/V views of a
            joint allocation), one shape/dtype/device for all (``D_v == D``). NHD only: for HND caches
            ``[P, H_kv, block_size, D]`` pass their NHD views ``cache.transpose(1, 2)`` (no copy; ambiguous when
            the misread head count still holds the slice, e.g. ``H_kv == block_size``: read as NHD).
        block_table: ``[num_blocks_of_request]`` int32/int64, the request's physical blocks in order.
        staging: ``[2, L, n, h, D]``, contiguous, the caches' dtype; ``n`` tokens and ``h`` heads come from its shape.
        start: first token position of the request to gather (a grid segment's start). SymInt.
        cache_head_start: first head of the slice in the caches (the writer's ``src_head_start``; ``head_start``,
            its name before kvops 0.1, still works with a ``DeprecationWarning``: docs/names.md).

    Raises:
        ValueError: bad list lengths, ranks, mismatched caches, ``block_table`` dtype/rank, a staging buffer of the
            wrong shape/dtype or not contiguous, a head slice outside ``[0, H_kv)`` (the message says when a cache may
            be HND), ``start < 0``, tokens beyond the ``block_table``'s capacity, a ``staging`` sharing memory with a
            cache (named in the message; nothing is written). Raised by the fake rule too (trace time under
            compile/export).
        IndexError: (CPU kernel, eager) a used block id outside ``[0, P)``.
    """
    bad = int64_error("kvops.paged_kv_gather", {"start": start, "cache_head_start": cache_head_start})
    if bad is not None:  # (torch's schema error gives no fix)
        raise bad
    torch.ops.kvops.paged_kv_gather(list(k_caches) + list(v_caches), block_table, staging, start, cache_head_start)


paged_kv_gather = renamed_keyword(paged_kv_gather, "head_start", "cache_head_start")


def paged_kv_scatter(
    staging: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    start: int = 0,
    cache_head_start: int = 0,
) -> None:
    """Write a staging buffer ``[2, L, n, h, D]`` into a request's pages of the decode side's caches (in place).

    The inverse of :func:`paged_kv_gather`: tokens ``[start, start + n)`` at the decode side's own ``block_table``,
    heads ``[cache_head_start, cache_head_start + h)``; every other head, row and block is untouched. Bit-exact.

    Args:
        staging: ``[2, L, n, h, D]``, contiguous, the caches' dtype.
        k_caches, v_caches: as :func:`paged_kv_gather`; mutated in place (no stride-0 dims).
        block_table: the decode side's ``[num_blocks_of_request]`` int32/int64 row.
        start: first token position (SymInt). cache_head_start: the writer's destination head start.

    Raises:
        ValueError: as :func:`paged_kv_gather`, plus a cache that cannot be written in place (stride 0).
        IndexError: (CPU kernel, eager) a used block id outside ``[0, P)``.
    """
    bad = int64_error("kvops.paged_kv_scatter", {"start": start, "cache_head_start": cache_head_start})
    if bad is not None:  # (torch's schema error gives no fix)
        raise bad
    torch.ops.kvops.paged_kv_scatter(staging, list(k_caches) + list(v_caches), block_table, start, cache_head_start)


# --- fake rules: the contract at trace time ---------------------------------------------------------------------
@torch.library.register_fake("kvops::paged_kv_gather")
def _gather_fake(caches, block_table, staging, start, cache_head_start):
    check_paged_kv_transfer(GATHER, caches, block_table, staging, start, cache_head_start, "cache_head_start", False)


@torch.library.register_fake("kvops::paged_kv_scatter")
def _scatter_fake(staging, caches, block_table, start, cache_head_start):
    check_paged_kv_transfer(SCATTER, caches, block_table, staging, start, cache_head_start, "cache_head_start", True)


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, kernels) -> None:
    @torch.library.impl("kvops::paged_kv_gather", device)
    def _gather(caches, block_table, staging, start, cache_head_start):
        check_paged_kv_transfer(GATHER, caches, block_table, staging, start, cache_head_start, "cache_head_start",
                                False)
        kernels.paged_kv_gather(caches, block_table, start, cache_head_start, staging)

    @torch.library.impl("kvops::paged_kv_scatter", device)
    def _scatter(staging, caches, block_table, start, cache_head_start):
        check_paged_kv_transfer(SCATTER, caches, block_table, staging, start, cache_head_start, "cache_head_start",
                                True)
        kernels.paged_kv_scatter(staging, caches, block_table, start, cache_head_start)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import transfer as _triton_transfer

    _register("CUDA", _triton_transfer)
