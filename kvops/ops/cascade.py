"""Cascade attention over a paged cache: :func:`plan_cascade` and :func:`cascade_attention` (docs/cascade.md).

FlashInfer's two-level cascade (``MultiLevelCascadeAttentionWrapper``) on kvops' paged cache: sequences whose block
tables start with the same blocks (a shared prompt, prefix caching) read those blocks **once** for all their queries,
then their own suffix blocks, and the two parts are merged exactly (``kvops.merge_attention_states``, docs/semantics.md
§12). Level 1 (the shared prefix) is one attention per group of sequences with the group's queries as one non-causal
query block, GQA folded into the rows (``H_q / H_kv`` query heads per KV head), so it is a GEMM rather than ``B``
passes over the same keys; level 2 is one ``kvops.paged_attention`` over every sequence's suffix blocks.

A composite (Python over ops), like ``kvops.flash_attn_with_kvcache``: ``torch.compile`` traces through it. The plan
holds Python ints and small constant tensors made once per batch, so a compiled decode step does not recompile as
``seq_lens`` and ``block_table`` change from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks.cascade import OP, PLAN, check_cascade, check_plan_inputs, check_prefix_values
from .._checks.forms import python_float
from .merge import merge_attention_states
from .paged_attention import paged_attention

_GEMM = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """Where a batch's shared prefixes are (made by :func:`plan_cascade`; valid while the batch's sequences, their
    order and query lengths stay the same, e.g. across decode steps).

    ``groups``: ``(seq_start, seq_end, row_start, row_end, prefix_blocks)`` per group of consecutive sequences
    ``[seq_start, seq_end)`` (query rows ``[row_start, row_end)``) whose block tables share their first
    ``prefix_blocks`` entries. ``prefix_lens``: int32 ``[B]``, each sequence's shared-prefix tokens (0 outside
    groups). ``segments``: the level-1 query blocks covering every row in order (groups, and the rows between them
    with no prefix), as ``cu``/``seq_lens``/``table_rows`` tensors for ``kvops.paged_attention``;
    ``max_segment_rows`` and ``max_prefix_blocks`` their largest row count and prefix."""

    block_size: int
    num_seqs: int
    num_rows: int
    groups: tuple
    prefix_lens: torch.Tensor
    segment_cu: torch.Tensor
    segment_lens: torch.Tensor
    segment_table_rows: torch.Tensor
    max_segment_rows: int
    max_prefix_blocks: int

    @property
    def shared_tokens(self) -> int:
        """Prefix tokens read once instead of once per sequence: ``sum_g (members_g - 1) * prefix_g``."""
        return sum((g[1] - g[0] - 1) * g[4] * self.block_size for g in self.groups)


def plan_cascade(block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, block_size: int, *,
                 prefix_blocks: int | None = None, causal: bool = True) -> CascadePlan:
    """Find (or take) the shared prefix of a batch's block tables. Host-side: reads the three tensors once.

    Consecutive sequences whose ``block_table`` rows start with the same block form a group; its prefix is the longest
    run of leading blocks all members share, cut to whole blocks every query of the group sees in full (``causal``:
    ``prefix <= seq_len - q_len + 1`` for each member; otherwise ``prefix <= seq_len``), since later steps only grow
    ``seq_lens``. A group of one sequence, or with no such block, has no prefix (level 2 reads it all).

    Args:
        block_table, seq_lens, cu_seqlens_q: int32 ``[B, max_blocks]``, ``[B]``, ``[B + 1]``: one step's
            ``kvops.paged_attention`` arguments.
        block_size: the cache's tokens per block.
        prefix_blocks: take this shared prefix instead of finding one: the first ``prefix_blocks`` entries of every
            row, which must agree and be visible to every query (else ``ValueError`` naming the row and entry).
        causal: whether :func:`cascade_attention` will be called with ``causal=True``.

    Returns a :class:`CascadePlan` for the batch's device. Raises ``ValueError`` for arguments that are not the int32
    tensors of one step, a ``block_size < 1``, or a ``prefix_blocks`` the rows do not share or some query cannot see.
    """
    check_plan_inputs(block_table, seq_lens, cu_seqlens_q, block_size)
    table, lens, cu = block_table.tolist(), seq_lens.tolist(), cu_seqlens_q.tolist()
    b = len(lens)
    q_lens = [cu[i + 1] - cu[i] for i in range(b)]
    seen = [(lens[i] - q_lens[i] + 1 if causal else lens[i]) // block_size for i in range(b)]  # whole blocks in view
    seen = [max(0, min(s, -(-lens[i] // block_size), len(table[i]))) for i, s in enumerate(seen)]
    if prefix_blocks is not None:
        groups = _take(table, seen, prefix_blocks, cu, b)
    else:
        groups = _find(table, seen, cu, b)
    prefix_lens = [0] * b
    for s0, s1, _, _, nb in groups:
        prefix_lens[s0:s1] = [nb * block_size] * (s1 - s0)
    segments, row = [], 0  # (row_start, row_end, prefix tokens, table row) covering every row
    for s0, s1, r0, r1, nb in groups:
        if r0 > row:
            segments.append((row, r0, 0, 0))
        segments.append((r0, r1, nb * block_size, s0))
        row = r1
    if cu[-1] > row:
        segments.append((row, cu[-1], 0, 0))
    device = block_table.device
    return CascadePlan(
        block_size=block_size, num_seqs=b, num_rows=cu[-1], groups=tuple(groups),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        segment_cu=torch.tensor([0] + [s[1] for s in segments], dtype=torch.int32, device=device),
        segment_lens=torch.tensor([s[2] for s in segments], dtype=torch.int32, device=device),
        segment_table_rows=torch.tensor([s[3] for s in segments], dtype=torch.int64, device=device),
        max_segment_rows=max((s[1] - s[0] for s in segments), default=1),
        max_prefix_blocks=max((g[4] for g in groups), default=0),
    )


def _find(table, seen, cu, b):
    groups, i = [], 0
    while i < b:
        j, shared = i + 1, seen[i]
        while j < b and shared > 0 and seen[j] > 0 and table[j][0] == table[i][0]:
            n = 0
            limit = min(shared, seen[j])
            while n < limit and table[j][n] == table[i][n]:
                n += 1
            shared = n
            j += 1
        if j - i >= 2 and shared > 0:
            groups.append((i, j, cu[i], cu[j], shared))
        i = j if j - i >= 2 and shared > 0 else i + 1
    return groups


def _take(table, seen, n, cu, b):
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{PLAN}: prefix_blocks must be an int >= 0 (blocks every sequence shares), got {n!r}.")
    if n == 0 or b < 2:
        return []
    for i in range(b):
        if seen[i] < n:
            raise ValueError(
                f"{PLAN}: prefix_blocks={n} but every query of sequence {i} sees only its first {seen[i]} whole "
                f"blocks: pass prefix_blocks <= {min(seen)}, or let plan_cascade find the prefix "
                f"(prefix_blocks=None)."
            )
        for j in range(n):
            if table[i][j] != table[0][j]:
                raise ValueError(
                    f"{PLAN}: prefix_blocks={n} but block_table[{i}, {j}] = {table[i][j]} differs from "
                    f"block_table[0, {j}] = {table[0][j]}: the rows do not share that prefix. Pass a smaller "
                    f"prefix_blocks, or let plan_cascade find the prefix (prefix_blocks=None)."
                )
    return [(0, b, cu[0], cu[b], n)]


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    plan: CascadePlan,
    scale: float | None = None,
    causal: bool = True,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_lse: bool = False,
    kv_layout: str = "NHD",
):
    """``kvops.paged_attention`` of a batch whose sequences share prefixes, reading each shared prefix once.

    Same arguments, semantics and results as ``kvops.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
    block_table, max_seqlen_q, scale, causal, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    return_lse=return_lse, kv_layout=kv_layout)`` (docs/semantics.md §4) up to rounding, computed as two levels merged
    by ``kvops.merge_attention_states`` (docs/semantics.md §12):

    1. per group of ``plan``: the group's query rows as one non-causal block over its shared prefix blocks (GQA
       folded: ``[H_kv, rows * H_q / H_kv, D]`` against ``[H_kv, prefix, D]``, a GEMM). On CPU with float32/bfloat16
       and no softcap or fp8 scales: torch's flash attention for CPU (``_scaled_dot_product_flash_attention_for_cpu``,
       which returns the LSE) over the prefix blocks gathered once (one ``index_select``); otherwise one
       ``kvops.paged_attention(causal=False)`` over every group's prefix;
    2. one ``kvops.paged_attention`` over each sequence's suffix: ``seq_lens - prefix`` keys from
       ``block_table`` shifted by its prefix blocks (bottom-right causal alignment is unchanged by the shift).

    Args:
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, softcap, k_scale,
            v_scale, kv_layout: as ``kvops.paged_attention`` (windows, sinks and the attention features are not
            supported here: use ``kvops.paged_attention``).
        plan: :func:`plan_cascade` of this batch (made once; valid while the sequences, their order and their query
            lengths stay the same: every decode step of a batch reuses it).
        return_lse: also return ``lse [H_q, T_q]`` float32.

    Returns ``out [T_q, H_q, D_v]`` in q's dtype, or ``(out, lse)``. Raises what ``kvops.paged_attention`` and
    ``kvops.merge_attention_states`` raise, and ``ValueError`` when ``plan`` is not a :class:`CascadePlan` or was
    made for another batch size, number of query rows or ``block_size`` (replan), or ``block_table`` is narrower
    than the plan's prefix; ``RuntimeError`` (a value contract, docs/semantics.md §7, in the current value-check
    mode) when a group's rows of ``block_table`` no longer share the plan's prefix blocks (the block tables changed
    after planning: replan).
    """
    check_cascade(plan, q, k_cache, block_table, seq_lens, kv_layout, CascadePlan)
    check_prefix_values(plan, block_table)  # a value contract (docs/semantics.md §7)
    scale, softcap = python_float(OP, "scale", scale), python_float(OP, "softcap", softcap)  # NumPy scalars: floats
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kw = dict(softcap=softcap, k_scale=k_scale, v_scale=v_scale, return_lse=True, kv_layout=kv_layout)
    if not plan.groups:  # nothing shared: one pass
        out, lse = paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale,
                                   causal, **kw)
        return (out, lse) if return_lse else out
    if len(plan.groups) == 1 and plan.groups[0][:2] == (0, plan.num_seqs):  # one prefix for all: a view
        suffix_table = block_table[:, plan.groups[0][4]:]
    else:
        shift = torch.div(plan.prefix_lens, plan.block_size, rounding_mode="floor").to(torch.int64)
        cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :] + shift[:, None]
        suffix_table = torch.gather(block_table, 1, cols.clamp(max=block_table.shape[1] - 1))
    o_s, lse_s = paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens - plan.prefix_lens, suffix_table,
                                 max_seqlen_q, scale, causal, **kw)
    if _gemm_prefix_ok(q, k_cache, v_cache, softcap, k_scale):
        o_p, lse_p = _prefix_gemm(q, k_cache, v_cache, block_table, plan, scale, kv_layout)
    else:
        o_p, lse_p = paged_attention(q, k_cache, v_cache, plan.segment_cu, plan.segment_lens,
                                     block_table.index_select(0, plan.segment_table_rows), plan.max_segment_rows,
                                     scale, False, **kw)
    out, lse = merge_attention_states(o_p, lse_p, o_s, lse_s)
    return (out, lse) if return_lse else out


def _gemm_prefix_ok(q, k_cache, v_cache, softcap, k_scale) -> bool:
    return (_GEMM is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == q.dtype and softcap == 0.0 and k_scale is None
            and k_cache.shape[-1] == v_cache.shape[-1] == q.shape[-1] and q.shape[-1] > 0)


def _prefix_gemm(q, k_cache, v_cache, block_table, plan, scale, kv_layout):
    """Level 1 on CPU: per group, the prefix blocks gathered once and torch's flash attention for CPU over them
    with the group's rows and GQA heads folded into one query block; rows outside groups get ``(0, -inf)``."""
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    t, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    g = h_q // h_kv
    outs, lses, row = [], [], 0
    for s0, _, r0, r1, nb in plan.groups:
        if r0 > row:
            outs.append(q.new_zeros((r0 - row, h_q, d)))
            lses.append(q.new_full((h_q, r0 - row), float("-inf"), dtype=torch.float32))
        ids = block_table[s0, :nb].to(torch.int64)
        length = nb * plan.block_size
        k = k_cache.index_select(0, ids).reshape(1, length, h_kv, d).transpose(1, 2)  # [1, H_kv, L, D]
        v = v_cache.index_select(0, ids).reshape(1, length, h_kv, d).transpose(1, 2)
        rows = r1 - r0
        qg = q[r0:r1].reshape(rows, h_kv, g, d).permute(1, 0, 2, 3).reshape(1, h_kv, rows * g, d)
        o, lse = _GEMM(qg, k, v, 0.0, False, scale=scale)
        outs.append(o.reshape(h_kv, rows, g, d).permute(1, 0, 2, 3).reshape(rows, h_q, d))
        lses.append(lse.reshape(h_kv, rows, g).permute(0, 2, 1).reshape(h_q, rows))
        row = r1
    if t > row:
        outs.append(q.new_zeros((t - row, h_q, d)))
        lses.append(q.new_full((h_q, t - row), float("-inf"), dtype=torch.float32))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 0), torch.cat(lses, 1)
