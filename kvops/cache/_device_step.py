"""Device-side step metadata for a paged cache: ``PagedKVCache.step_at`` (docs/semantics.md §4.1).

``PagedKVCache.prepare`` plans a step on the host (block manager, Python lists). A compiled generate loop that keeps
its positions in a tensor (gpt-fast's ``input_pos``) and has its blocks reserved up front needs the same metadata
computed from that tensor *inside* the compiled step: no host sync, and no recompile as the positions advance
(every size here comes from shapes). This module computes it.
"""

from __future__ import annotations

import torch

from .._checks import values
from .._checks.common import as_int, index_fix

_LAYOUT = "[num_new_tokens] (shared by every sequence, as gpt-fast's input_pos) or [batch, num_new_tokens]"


def check_step_args(where: str, positions, block_table, device) -> None:
    """Metadata of :func:`step_at`'s arguments (``ValueError`` naming the argument; no tensor contents read)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) or \
            positions.dim() not in (1, 2) or positions.shape[-1] == 0:
        got = (f"shape {tuple(positions.shape)} and dtype {positions.dtype}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(
            f"{where}: positions must be an int32/int64 tensor {_LAYOUT} with at least one token, got {got}. Each "
            f"sequence's positions are its new tokens' positions, consecutive (a prefill chunk arange(s, s + T), a "
            f"decode step [s]). "
            + (index_fix("positions", positions, None, (torch.int32, torch.int64), "[num_new_tokens]")
               if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) or
               positions.dim() not in (1, 2) else "Pass at least one position per sequence.")
        )
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[1] == 0):
        got = (f"shape {tuple(block_table.shape)} and dtype {block_table.dtype}"
               if isinstance(block_table, torch.Tensor) else type(block_table).__name__)
        raise ValueError(
            f"{where}: block_table must be an int32 tensor [batch, max_blocks] with max_blocks >= 1 "
            f"(PagedKVCache.block_table(seq_ids) gives it for sequences whose blocks are reserved), got {got}. "
            + (index_fix("block_table", block_table, 2, (torch.int32,), "[batch, max_blocks]")
               if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or
               block_table.dim() != 2 else "Reserve blocks first (PagedKVCache.extend(seq_id, max_tokens)).")
        )
    if positions.dim() == 2 and positions.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"{where}: positions of shape {tuple(positions.shape)} has {as_int(positions.shape[0])} rows but "
            f"block_table has {as_int(block_table.shape[0])}; pass one row of positions per sequence (or a 1-D tensor "
            f"shared by all)."
        )
    for name, t in (("positions", positions), ("block_table", block_table)):
        if t.device != device:
            raise ValueError(f"{where}: {name} is on {t.device} but the cache is on {device}. Move it to {device}.")


def step_at(where: str, positions: torch.Tensor, block_table: torch.Tensor, block_size: int, num_blocks: int):
    """``(block_table, seq_lens, cu_seqlens_q, slot_mapping, positions, max_seqlen_q, num_tokens)`` of a step whose
    sequence ``b`` (row ``b`` of ``block_table``) writes its ``T`` new tokens at ``positions[b]`` (``positions``
    broadcast to ``[B, T]``), consecutive positions after which it holds ``positions[b, -1] + 1`` tokens.

    ``slot_mapping[b * T + t] = block_table[b, p // block_size] * block_size + p % block_size`` for ``p =
    positions[b, t]`` (sequence-major, as ``q``/``key`` rows ``[B, T] -> [B * T]``); causal attention then puts query
    ``t`` of sequence ``b`` at ``positions[b, t]``. Metadata errors (``check_step_args``): ``ValueError``. Value
    contract (docs/semantics.md §7; ``values.check_step_positions``), per the value-check mode: a position outside
    ``[0, max_blocks * block_size)`` or the block holding it outside ``[0, P)`` raises ``RuntimeError`` (eager) or
    asserts (async; the step then writes nothing); unchecked (``"off"``, or compiled code in ``"eager"`` mode) such a
    token's slot is ``-1`` (never written) and ``seq_lens`` is clamped to ``[0, max_blocks * block_size]``, so nothing
    outside the sequence's blocks is touched.
    """
    batch, width = block_table.shape
    num_new = positions.shape[-1]
    capacity = width * block_size
    pos = positions.to(torch.int64).expand(batch, num_new)
    cols = (pos // block_size).clamp(0, width - 1)
    blocks = block_table.gather(1, cols).to(torch.int64)
    inside = (pos >= 0) & (pos < capacity) & (blocks >= 0) & (blocks < num_blocks)
    ok = values.check_step_positions(pos, blocks, block_table, capacity, num_blocks, where)
    if ok is not None:  # async value checks: a failing step writes nothing
        inside = inside & ok
    slots = torch.where(inside, blocks * block_size + pos % block_size, -1).reshape(-1)
    seq_lens = (pos[:, -1] + 1).clamp(0, capacity).to(torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=block_table.device) * num_new
    return block_table, seq_lens, cu_seqlens_q, slots, pos.reshape(-1), num_new, batch * num_new
