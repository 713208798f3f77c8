"""Custom masks among a sequence's new keys (docs/tree-mask.md): the formats ``kvops.paged_attention``'s
``custom_mask`` / ``packed_custom_mask`` take, and the draft-tree mask of speculative decoding.

Format (FlashInfer's ``custom_mask`` / ``packed_custom_mask``, restricted to the new keys): sequence ``b`` with
``q_len_b`` new rows owns a ``q_len_b x q_len_b`` block, row-major (query row ``i``, new key ``c``; True = visible);
the blocks are concatenated in batch order, so the bool form is ``[sum_b q_len_b ** 2]``. The packed form is the
same flattened mask as bits, little-endian within a byte (``flashinfer.packbits(..., bitorder="little")``), each
sequence's segment padded to whole bytes (``flashinfer.segment_packbits``): ``[sum_b ceil(q_len_b ** 2 / 8)]``
uint8, and bit ``k`` of a segment is bit ``k % 8`` of its byte ``k // 8``.

* :func:`tree_mask` / :func:`tree_depths`: the mask and the positions of a draft tree given by parent indices.
* :func:`packbits` / :func:`segment_packbits`: bool -> bits, as FlashInfer's (``bitorder="little"`` is what the
  kernels read).
* :func:`mask_indptr`: each sequence's first element (bool form) or byte (packed form), from ``cu_seqlens_q``
  without a host sync.
* :func:`dense_custom_mask`: the per-sequence blocks as one padded ``[B, M, M]`` bool tensor, without a host sync
  (what the composite CPU kernel masks with).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["tree_mask", "tree_depths", "packbits", "segment_packbits", "mask_indptr", "dense_custom_mask"]


def _check_parents(parents: Sequence[int]) -> list[int]:
    parents = [int(p) for p in parents]
    for i, p in enumerate(parents):
        if not -1 <= p < i or (p == -1 and i > 0):
            raise ValueError(
                f"tree_mask: parents[{i}] = {p}; node 0 is the root (parent -1) and every other node's parent must "
                f"be an earlier node (0 <= parent < {i}): list the tree in topological order (e.g. breadth first)."
            )
    return parents


def tree_mask(parents: Sequence[int], device=None) -> torch.Tensor:
    """bool ``[n, n]``: node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors (a draft tree's
    attention among its own nodes, as Medusa's / EAGLE's tree masks). ``parents[0] == -1`` (the root, e.g. the last
    accepted token); every other ``parents[i]`` is an earlier node. Flatten it (``.flatten()``) for one sequence's
    block of ``custom_mask``."""
    parents = _check_parents(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(device) if device is not None else mask


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (root 0): a node's position is the root's position plus its depth (its RoPE angle)."""
    parents = _check_parents(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _bit_weights(bitorder: str, device) -> torch.Tensor:
    if bitorder not in ("little", "big"):
        raise ValueError(f"packbits: bitorder must be 'little' or 'big', got {bitorder!r}.")
    w = 1 << torch.arange(8, device=device)
    return (w if bitorder == "little" else w.flip(0)).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "little") -> torch.Tensor:
    """uint8 ``[ceil(n / 8)]`` of a 1-D bool (or 0/1) tensor ``x [n]``, as ``numpy.packbits`` / FlashInfer's
    ``packbits`` (the last byte is zero-padded). ``bitorder="little"``: element ``k`` is bit ``k % 8`` of byte
    ``k // 8`` (what ``packed_custom_mask`` holds); ``"big"``: bit ``7 - k % 8``."""
    if x.dim() != 1:
        raise ValueError(f"packbits: x must be 1-D, got shape {tuple(x.shape)}; flatten the mask first.")
    n = x.shape[0]
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=x.device)
    padded[:n] = x.to(torch.bool).to(torch.uint8)
    w = _bit_weights(bitorder, x.device)
    return (padded.view(-1, 8) * w).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "little"):
    """``(y, indptr_new)``: segment ``x[indptr[i]:indptr[i + 1]]`` packed into ``y[indptr_new[i]:indptr_new[i + 1]]``
    (``indptr_new[i + 1] - indptr_new[i] == (indptr[i + 1] - indptr[i] + 7) // 8``), as FlashInfer's
    ``segment_packbits``. Reads ``indptr`` on the host (a preparation step, not for compiled regions)."""
    bounds = [int(v) for v in indptr.tolist()]
    parts = [packbits(x[a:b], bitorder) for a, b in zip(bounds[:-1], bounds[1:])]
    y = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=x.device)
    lens = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
    return y, lens.cumsum(0).to(device=indptr.device, dtype=indptr.dtype)


def mask_indptr(cu_seqlens_q: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """int64 ``[B + 1]``: where each sequence's block starts in ``custom_mask`` (``cumsum(q_len ** 2)``) or, with
    ``packed=True``, its first byte in ``packed_custom_mask`` (``cumsum(ceil(q_len ** 2 / 8))``); the last entry is
    the length the mask must have. Torch ops only (no host sync: usable inside compiled regions)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    sizes = q_lens * q_lens
    if packed:
        sizes = (sizes + 7) // 8
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])


def dense_custom_mask(custom_mask: torch.Tensor | None, packed_custom_mask: torch.Tensor | None,
                      cu_seqlens_q: torch.Tensor, max_seqlen_q: int) -> torch.Tensor:
    """bool ``[B, M, M]`` (``M = max_seqlen_q``): ``[b, i, c]`` is whether query row ``i`` of sequence ``b`` sees its
    new key ``c`` (False where ``i`` or ``c >= q_len_b``). Exactly one of ``custom_mask`` (bool) and
    ``packed_custom_mask`` (uint8 bits) is given. Elements are gathered with indices clamped into the mask, so a
    mask shorter than the contract never reads out of bounds (its length is a value contract checked before the
    kernels run, docs/tree-mask.md). Torch ops only (no host sync)."""
    packed = packed_custom_mask is not None
    mask = packed_custom_mask if packed else custom_mask
    device = cu_seqlens_q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    offsets = mask_indptr(cu_seqlens_q, packed)[:-1]
    idx = torch.arange(max_seqlen_q, device=device)
    inside = (idx[None, :] < q_lens[:, None])  # [B, M]
    inside = inside[:, :, None] & inside[:, None, :]  # [B, M, M]
    k = idx[:, None] * q_lens[:, None, None] + idx[None, :]  # [B, M, M] element index within the sequence's block
    numel = mask.shape[0]
    if numel == 0:
        return torch.zeros_like(inside)
    if packed:
        byte = (offsets[:, None, None] + k // 8).clamp(0, numel - 1)
        bits = (mask[byte.flatten()].view(byte.shape).to(torch.int32) >> (k % 8).to(torch.int32)) & 1
        return inside & (bits != 0)
    flat = (offsets[:, None, None] + k).clamp(0, numel - 1)
    return inside & mask[flat.flatten()].view(flat.shape).to(torch.bool)
