"""The readable meaning of ``custom_mask`` / ``packed_custom_mask`` (docs/tree-mask.md), for the fp64 oracle of
``kvops.paged_attention``: one query row and one key at a time, in plain Python, independent of the kernels'
vectorized forms (``kvops/custom_mask.py``)."""

from __future__ import annotations


def custom_mask_offsets(q_lens: list[int], packed: bool) -> list[int]:
    """Where each sequence's block starts: element ``sum_{c<b} q_len_c ** 2`` of the bool form, byte
    ``sum_{c<b} ceil(q_len_c ** 2 / 8)`` of the packed form (each segment padded to whole bytes)."""
    offsets, at = [], 0
    for n in q_lens:
        offsets.append(at)
        at += (n * n + 7) // 8 if packed else n * n
    return offsets


def new_key_visible(mask: list, packed: bool, offset: int, q_len: int, i: int, c: int) -> bool:
    """Whether query row ``i`` of a sequence whose block starts at ``offset`` (see :func:`custom_mask_offsets`) sees
    its new key ``c`` (``0 <= i, c < q_len``): element ``i * q_len + c`` of the block, row-major; in the packed form
    bit ``k % 8`` (little-endian) of byte ``k // 8`` of the segment."""
    k = i * q_len + c
    if packed:
        return bool((int(mask[offset + k // 8]) >> (k % 8)) & 1)
    return bool(mask[offset + k])


def visible(j: int, pos: int, kv_len: int, q_len: int, causal: bool, window_right: int, mask, packed: bool,
            offset: int, i: int) -> bool:
    """The rule a custom mask replaces: whether key row ``j`` passes the causal / right-window bound for query row
    ``i`` at position ``pos``. With a mask, keys before the new rows (``j < kv_len - q_len``) pass and new key
    ``c = j - (kv_len - q_len)`` passes iff its mask element is True, whatever ``causal`` (as FlashInfer, whose
    custom mask mode replaces its causal mode). The left window, ``sink_tokens`` and ``cache_leftpad`` apply on top,
    as without a mask."""
    if mask is not None:
        first_new = kv_len - q_len
        return j < first_new or new_key_visible(mask, packed, offset, q_len, i, j - first_new)
    if causal:
        return j <= pos
    return window_right < 0 or j <= pos + window_right
