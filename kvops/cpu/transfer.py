"""CPU kernels of ``kvops::paged_kv_gather`` / ``kvops::paged_kv_scatter``.

Token ``start + i`` of the request sits in block ``block_table[(start + i) // block_size]``, row
``(start + i) % block_size``. Per cache one ``index_select`` (gather) or ``index_copy_`` (scatter, shared with
``paged_cache_write``) on a ``[P * block_size, h, D]`` view of the head slice; caches are never copied. fp8 caches
move as bytes (``uint8`` views). The caches are separate allocations, so the CPU kernel visits them one by one (one
op each); the CUDA kernel (``kvops/triton/transfer.py``) moves all layers in one launch.
"""

from __future__ import annotations

import torch

from .paged_write import _flat_rows, scatter_rows


def request_slots(block_table: torch.Tensor, block_size: int, start: int, num_tokens: int) -> torch.Tensor:
    """int64 slots ``block * block_size + row`` of tokens ``[start, start + num_tokens)`` of one request (block ids
    are checked separately by :func:`check_block_ids`)."""
    pos = torch.arange(start, start + num_tokens, device=block_table.device)
    return block_table.to(torch.int64)[pos // block_size] * block_size + pos % block_size


def check_block_ids(op: str, block_table: torch.Tensor, block_size: int, start: int, num_tokens: int,
                    num_blocks: int) -> None:
    """``IndexError`` when a block the tokens use is outside ``[0, num_blocks)`` (reads the table: CPU kernel only)."""
    used = block_table[start // block_size : -(-(start + num_tokens) // block_size)]
    low, top = (int(x) for x in torch.aminmax(used))
    if low < 0 or top >= num_blocks:
        bad = low if low < 0 else top
        raise IndexError(
            f"{op}: block_table holds block {bad} but the caches have {num_blocks} blocks; valid block ids are "
            f"[0, {num_blocks})."
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as same-size uint8 views (index_select/index_copy_ have no fp8 CPU kernels)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, h0: int, out: torch.Tensor) -> None:
    """``out[i] = cache[slots[i] // block_size, slots[i] % block_size, h0 : h0 + h]`` for ``out [n, h, D]``."""
    cache, out = _bytes(cache), _bytes(out)
    heads = cache[:, :, h0 : h0 + out.shape[1]]
    flat = _flat_rows(heads)
    if flat is not None:
        torch.index_select(flat, 0, slots, out=out)
    else:  # block and row dims cannot be merged for these strides
        block_size = cache.shape[1]
        out.copy_(heads[slots // block_size, slots % block_size])


def _request_rows(op: str, caches, block_table, start: int, staging: torch.Tensor):
    """``(slots, rows)`` of one request: its tokens' slots (block ids checked) and ``staging`` as ``[2L, n, h, D]``
    rows per cache; None when it has no tokens."""
    num_tokens = staging.shape[2]
    if num_tokens == 0:
        return None
    block_size = caches[0].shape[1]
    check_block_ids(op, block_table, block_size, start, num_tokens, caches[0].shape[0])
    return request_slots(block_table, block_size, start, num_tokens), staging.view(len(caches), *staging.shape[2:])


def paged_kv_gather(caches, block_table, start: int, head_start: int, staging: torch.Tensor) -> None:
    """Fill ``staging [2, L, n, h, D]`` with heads ``[head_start, head_start + h)`` of tokens ``[start, start + n)``."""
    request = _request_rows("kvops.paged_kv_gather", caches, block_table, start, staging)
    if request is not None:
        slots, rows = request
        for i, cache in enumerate(caches):
            gather_rows(cache, slots, head_start, rows[i])


def paged_kv_scatter(staging: torch.Tensor, caches, block_table, start: int, cache_head_start: int) -> None:
    """Write ``staging [2, L, n, h, D]`` into heads ``[cache_head_start, + h)`` of tokens ``[start, start + n)``."""
    request = _request_rows("kvops.paged_kv_scatter", caches, block_table, start, staging)
    if request is not None:
        slots, rows = request
        for i, cache in enumerate(caches):
            scatter_rows(rows[i], cache, slots, cache_head_start)
