"""CPU kernel of rotary embeddings (FlashAttention's ``rotary_cos``/``rotary_sin`` semantics).

``x[..., :rotary_dim]`` is rotated in fp32 and rounded once to ``x``'s dtype; dims ``>= rotary_dim`` pass through.
GPT-NeoX (``interleaved=False``): dim ``i < rotary_dim / 2`` pairs with ``i + rotary_dim / 2``; GPT-J
(``interleaved=True``): dim ``2i`` pairs with ``2i + 1``. Pair ``j`` at position ``p`` turns by the angle whose
cosine/sine are ``cos[p, j]``/``sin[p, j]``: ``(a, b) -> (a cos - b sin, b cos + a sin)``.
"""

from __future__ import annotations

import torch

from . import paged_write


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """``x [..., H, D]`` rotated at ``positions`` (shape ``x.shape[:-2]``, int) with tables ``[seqlen_ro, rd / 2]``."""
    rd = 2 * cos.shape[-1]
    c = cos[positions].to(torch.float32).unsqueeze(-2)  # [..., 1, rd / 2]
    s = sin[positions].to(torch.float32).unsqueeze(-2)
    xr = x[..., :rd].to(torch.float32)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def check_positions(positions: torch.Tensor, seqlen_ro: int) -> None:
    """The kernel's own bounds check (any value-check mode; a CPU kernel reads host memory, so no device sync):
    ``IndexError`` naming the first position outside ``[0, seqlen_ro)`` (negative ones would index from the end)."""
    bad = (positions < 0) | (positions >= seqlen_ro)
    if positions.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"kvops.rotary_paged_cache_write: positions[{i}] = {int(positions[i])} is outside [0, {seqlen_ro}), the "
            f"rows of rotary_cos/rotary_sin; nothing was written. Pass positions in [0, seqlen_ro)."
        )


def rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, cos, sin, interleaved: bool,
                             h0: int, k_scale, v_scale) -> None:
    """Rotate ``key[:N]`` at ``positions[:N]``, then the paged write (``N = len(slot_mapping)``; validated args)."""
    n = slot_mapping.shape[0]
    check_positions(positions[:n], cos.shape[0])
    rotated = apply_rotary(key[:n], cos, sin, positions[:n].to(torch.int64), interleaved)
    paged_write.paged_cache_write(rotated, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale)
