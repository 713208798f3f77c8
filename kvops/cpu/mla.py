"""CPU kernels of the MLA latent-cache ops (docs/mla.md): ``kvops::mla_cache_write`` and ``kvops::mla_attention``.

The write is vLLM's ``concat_and_cache_mla``: row ``[kv_c | k_pe]`` (``k_pe`` optionally rotated first, fp32 math
rounded once to its dtype) lands at slot ``slot_mapping[i]`` (negative: skipped), fp8 caches storing ``x / kv_scale``
saturated to ``±448``; one ``index_copy_`` on a ``[P * block_size, 1, W]`` view (the cache is never copied).

Attention is the absorbed form of FlashMLA's ``flash_mla_with_kvcache``: one latent "head" shared by all ``H`` query
heads (MQA), scores against the whole row ``[kv_lora_rank + rope_dim]``, values its first ``kv_lora_rank`` columns. Per
sequence, the used blocks are gathered once (whole blocks, ``index_select`` of block ids: any cache strides), widened
to fp32 (dequantized for fp8), and every query tile is two GEMMs with all ``H`` heads stacked as rows
(``[tile * H, W] @ [W, S]``, then ``[tile * H, S] @ [S, kv_lora_rank]``, the value operand a strided view of the
gathered rows), so the latent rows are read once per tile, not once per head. Query tiles bound the fp32 scores to
``_SCORE_BUDGET`` elements; a causal tile reads only the keys its last query can see.
"""

from __future__ import annotations

import torch

from ..reference.paged_write import quantize_fp8, scatter_rows
from ..reference.rotary import apply_rotary

_SCORE_BUDGET = 1 << 22  # fp32 scores of one query tile (16 MiB)
_LOWEST = torch.finfo(torch.float32).min


def _positions_error(positions: torch.Tensor, seqlen_ro: int) -> IndexError | None:
    bad = (positions < 0) | (positions >= seqlen_ro)
    if positions.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        return IndexError(
            f"kvops.mla_cache_write: positions[{i}] = {int(positions[i])} is outside [0, {seqlen_ro}), the rows of "
            f"rotary_cos/rotary_sin; nothing was written. Pass positions in [0, seqlen_ro)."
        )
    return None


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                    rotary_interleaved: bool) -> None:
    """Write ``[kv_c[i] | k_pe[i]]`` at ``slot_mapping[i]`` for ``i < N`` (validated arguments; in place).

    Raises ``IndexError`` (nothing written) for a slot ``>= P * block_size`` or a rotary position outside the tables:
    the CPU kernel reads them anyway, so these checks are free and hold in every value-check mode.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    kv_c, k_pe = kv_c[:n], k_pe[:n]
    if positions is not None:
        pos = positions[:n]
        err = _positions_error(pos, rotary_cos.shape[0])
        if err is not None:
            raise err
        k_pe = apply_rotary(k_pe.unsqueeze(1), rotary_cos, rotary_sin, pos.to(torch.int64), rotary_interleaved)[:, 0]
    rows = torch.cat((kv_c, k_pe), dim=1)  # a new tensor: sources aliasing the cache are read before the write
    slots = slot_mapping.to(torch.int64)
    low, top = (int(x) for x in torch.aminmax(slots))
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if top >= num_slots:
        raise IndexError(
            f"kvops.mla_cache_write: slot_mapping holds slot {top} but kv_cache has only {num_slots} slots "
            f"({kv_cache.shape[0]} blocks x block_size {kv_cache.shape[1]}); valid slots are [0, {num_slots}) or "
            f"negative (skip). Nothing was written."
        )
    if low < 0:  # padding: keep the non-negative slots
        keep = slots >= 0
        slots, rows = slots[keep], rows[keep]
        if slots.numel() == 0:
            return
    rows = rows.unsqueeze(1)  # [N, 1, W]: the paged write's one-head form
    if kv_scale is not None:
        rows = quantize_fp8(rows, kv_scale.reshape(1), 0, kv_cache.dtype)
    scatter_rows(rows, kv_cache.unsqueeze(2), slots, 0)


def _gather(kv_cache, blocks: torch.Tensor, seq_len: int, kv_scale) -> torch.Tensor:
    """fp32 ``[seq_len, W]``: the rows of ``blocks`` (whole blocks, then cut), dequantized for fp8."""
    cache = kv_cache
    fp8 = cache.dtype.itemsize == 1
    if fp8:  # index_select has no fp8 CPU kernel: gather the bytes
        cache = cache.view(torch.uint8)
    rows = cache.index_select(0, blocks).reshape(-1, cache.shape[2])[:seq_len]
    if fp8:
        return rows.view(kv_cache.dtype).to(torch.float32) * kv_scale.to(torch.float32).reshape(())
    return rows.to(torch.float32)


def _batched_decode(active, cu, lens, t_q, num_heads, width) -> bool:
    """Whether to run a decode batch (one query per sequence) as batched GEMMs over rows padded to the longest
    sequence: at least two sequences, padding under a quarter of the rows, scores and rows within 4 tiles' budget."""
    if len(active) < 2 or any(min(cu[b + 1], t_q) - cu[b] != 1 for b in active):
        return False
    longest, total = max(lens[b] for b in active), sum(lens[b] for b in active)
    return 4 * len(active) * longest <= 5 * total and len(active) * longest * (num_heads + width) <= 4 * _SCORE_BUDGET


def _decode(q, kv_cache, table, active, cu, lens, kv_lora_rank, sm_scale, kv_scale, out, lse) -> None:
    """One query per sequence of ``active`` (each sees all its rows, causal or not): the rows gathered padded to the
    longest, ``[B, S]``, then batched GEMMs over all heads. Padding rows are redirected to the sequence's row 0 (a
    written row: whatever an unused slot or block holds is never read) and masked."""
    block_size = kv_cache.shape[1]
    whole = len(active) == table.shape[0]
    idx = slice(None) if whole else torch.tensor(active, device=q.device)
    seq = torch.tensor([lens[b] for b in active], device=q.device)
    j = torch.arange(max(lens[b] for b in active), device=q.device)
    visible = j[None, :] < seq[:, None]  # [B, S]
    j = torch.where(visible, j[None, :], 0)
    blocks = table[idx].gather(1, j // block_size)
    cache = kv_cache.view(torch.uint8) if kv_cache.dtype.itemsize == 1 else kv_cache  # (no fp8 CPU indexing)
    if cache.shape[0] == 1 or block_size == 1 or cache.stride(0) == block_size * cache.stride(1):
        flat = cache.view(-1, cache.shape[2])  # [P * block_size, W]: one row gather (a memcpy per row)
        kv = flat.index_select(0, (blocks * block_size + j % block_size).flatten()).view(*j.shape, -1)
    else:
        kv = cache[blocks, j % block_size]  # [B, S, W]
    if cache is not kv_cache:
        kv = kv.view(kv_cache.dtype).to(torch.float32) * kv_scale.to(torch.float32).reshape(())
    else:
        kv = kv.to(torch.float32)
    first = [cu[b] for b in active]
    # a plain decode batch owns query rows r0, r0 + 1, ...: slices, not index ops
    rows = slice(first[0], first[-1] + 1) if first == list(range(first[0], first[0] + len(first))) else \
        torch.tensor(first, device=q.device)
    qb = q[rows].to(torch.float32) * sm_scale  # [B, H, W]
    s = torch.bmm(qb, kv.transpose(1, 2)).masked_fill_(~visible[:, None, :], float("-inf"))  # [B, H, S]
    m = s.amax(dim=-1, keepdim=True)  # finite: every active sequence has a row
    p = s.sub_(m).exp_()
    denom = p.sum(dim=-1)  # [B, H]
    o = torch.bmm(p, kv[..., :kv_lora_rank]).div_(denom.unsqueeze(-1))
    out[rows] = o.to(out.dtype)
    lse[:, rows] = (m.squeeze(-1) + denom.log()).t()


def mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank: int, sm_scale: float,
                  causal: bool, kv_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T_q, H, kv_lora_rank] in q's dtype, lse [H, T_q] float32)`` on validated arguments.

    A query with no visible key (``seq_len == 0``, a causal position below 0, or a row past ``cu_seqlens_q[-1]``) gets
    ``out = 0`` and ``lse = -inf``, as ``kvops.paged_attention``. The index tensors are read on the host (a CPU
    kernel; an opaque call inside compiled graphs).
    """
    t_q, num_heads, width = q.shape
    out = torch.zeros(t_q, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, t_q), float("-inf"), dtype=torch.float32, device=q.device)
    if t_q == 0 or block_table.shape[0] == 0:
        return out, lse
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    table = block_table.to(torch.int64)
    block_size = kv_cache.shape[1]
    fp32_out = q.dtype == torch.float32 and out.is_contiguous()
    active = [b for b, n in enumerate(lens) if n > 0 and min(cu[b + 1], t_q) > cu[b]]
    if _batched_decode(active, cu, lens, t_q, num_heads, width):
        _decode(q, kv_cache, table, active, cu, lens, kv_lora_rank, sm_scale, kv_scale, out, lse)
        return out, lse
    for b, seq_len in enumerate(lens):
        q0, q1 = cu[b], min(cu[b + 1], t_q)
        n = q1 - q0
        if n <= 0 or seq_len <= 0:
            continue
        first = seq_len - n  # position of the sequence's first query (causal)
        if causal and first + n <= 0:
            continue
        blocks = table[b, : -(-seq_len // block_size)]
        kv = _gather(kv_cache, blocks, seq_len, kv_scale)
        values = kv[:, :kv_lora_rank]
        tile = max(1, _SCORE_BUDGET // (num_heads * seq_len))
        for i0 in range(0, n, tile):
            i1 = min(n, i0 + tile)
            keys = min(seq_len, first + i1) if causal else seq_len  # what the tile's last query sees
            if keys <= 0:
                continue
            qt = q[q0 + i0 : q0 + i1].reshape(-1, width).to(torch.float32) * sm_scale  # rows (query, head)
            s = torch.matmul(qt, kv[:keys].t()).view(i1 - i0, num_heads, keys)
            if causal and first + i0 + 1 < keys:  # some query of the tile sees fewer keys than the last
                pos = torch.arange(first + i0, first + i1, device=q.device)
                hidden = torch.arange(keys, device=q.device)[None, :] > pos[:, None]
                s.masked_fill_(hidden[:, None, :], float("-inf"))
            # a query with no visible key has m = -inf: clamped, its exp(-inf - m) is 0 and its denominator 0
            m = s.amax(dim=-1, keepdim=True).clamp_(min=_LOWEST)
            p = s.sub_(m).exp_()
            denom = p.sum(dim=-1)  # [tile, H]: >= 1 with a visible key (its max scores exp(0)), else 0
            o = out[q0 + i0 : q0 + i1] if fp32_out else torch.empty(i1 - i0, num_heads, kv_lora_rank)
            torch.matmul(p.view(-1, keys), values[:keys], out=o.view(-1, kv_lora_rank))
            o.div_(denom.clamp(min=1.0).unsqueeze(-1))  # exact: rows without keys stay 0
            if not fp32_out:
                out[q0 + i0 : q0 + i1] = o
            lse[:, q0 + i0 : q0 + i1] = (m.squeeze(-1) + denom.log()).t()  # log(0) = -inf: no key
    return out, lse
