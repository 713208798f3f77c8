"""Checks of ``kvops.plan_cascade`` (host-side planning) and ``kvops.cascade_attention`` (a plan against a step's
tensors: shapes and Python ints only, so they also run while ``torch.compile`` traces the step; and the value
contract that each group's rows still share the plan's prefix blocks, in the modes of kvops/_checks/values.py).
docs/cascade.md.
"""

from __future__ import annotations

import torch

from . import values
from .common import as_int

PLAN = "kvops.plan_cascade"
OP = "kvops.cascade_attention"


def check_plan_inputs(block_table, seq_lens, cu_seqlens_q, block_size) -> None:
    """The planner's arguments: int32 ``block_table [B, max_blocks]``, ``seq_lens [B]``, ``cu_seqlens_q [B + 1]`` and
    ``block_size >= 1``."""
    for name, t, ndim, layout in (("block_table", block_table, 2, "[B, max_blocks]"), ("seq_lens", seq_lens, 1, "[B]"),
                                  ("cu_seqlens_q", cu_seqlens_q, 1, "[B + 1]")):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype != torch.int32:
            got = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{PLAN}: {name} must be a {ndim}-D int32 tensor {layout} (the step's kvops.paged_attention "
                f"argument), got {got}. Pass the tensor you pass to kvops.paged_attention."
            )
    b = block_table.shape[0]
    if seq_lens.shape[0] != b or cu_seqlens_q.shape[0] != b + 1:
        raise ValueError(
            f"{PLAN}: inconsistent batch size: block_table has {b} rows, seq_lens {seq_lens.shape[0]} entries and "
            f"cu_seqlens_q {cu_seqlens_q.shape[0]} (want B + 1 = {b + 1}). Pass the three tensors of one step."
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(
            f"{PLAN}: block_size must be a positive int (the cache's tokens per block, k_cache.shape[1] for an NHD "
            f"cache), got {block_size!r}."
        )


def check_cascade(plan, q, k_cache, block_table, seq_lens, kv_layout: str, plan_type: type) -> None:
    """A plan (``kvops.CascadePlan``, passed as ``plan_type`` by kvops/ops/cascade.py: the validators are a layer
    below the ops, CONTRIBUTING.md) against one step's tensors: the batch size, the query rows and the cache's
    ``block_size`` it was made for. Raises ``ValueError`` naming the value and the fix (replan)."""
    if not isinstance(plan, plan_type):
        raise ValueError(
            f"{OP}: plan must be a kvops.CascadePlan (from kvops.plan_cascade), got {type(plan).__name__}. Make one "
            f"with kvops.plan_cascade(block_table, seq_lens, cu_seqlens_q, block_size)."
        )
    if kv_layout not in ("NHD", "HND"):  # (kvops.paged_attention names it too; this check needs the layout first)
        raise ValueError(f"{OP}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}.")
    block_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    if k_cache.dim() == 4 and block_size != plan.block_size:
        raise ValueError(
            f"{OP}: the plan was made for block_size {plan.block_size} but k_cache ({kv_layout}, shape "
            f"{tuple(k_cache.shape)}) has block_size {as_int(block_size)}. Plan with this cache's block_size."
        )
    if block_table.dim() != 2 or block_table.shape[0] != plan.num_seqs or seq_lens.shape[0] != plan.num_seqs:
        raise ValueError(
            f"{OP}: the plan was made for {plan.num_seqs} sequences but block_table has shape "
            f"{tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)}. Replan (kvops.plan_cascade) when the "
            f"batch changes."
        )
    if block_table.shape[1] < plan.max_prefix_blocks:
        raise ValueError(
            f"{OP}: the plan's shared prefix spans {plan.max_prefix_blocks} blocks but block_table has only "
            f"{as_int(block_table.shape[1])} columns. Pass the block_table the plan was made from (or a wider one)."
        )
    if q.dim() != 3 or q.shape[0] != plan.num_rows:
        raise ValueError(
            f"{OP}: the plan was made for {plan.num_rows} query rows but q has shape {tuple(q.shape)}. Replan "
            f"(kvops.plan_cascade) when the query lengths change (e.g. between prefill and decode)."
        )


def check_prefix_values(plan, block_table: torch.Tensor, op: str = OP) -> None:
    """Value contract (docs/semantics.md §7, the modes of kvops/_checks/values.py): the rows of each group of
    ``plan`` still share its prefix blocks, ``block_table[seq_start:seq_end, :prefix_blocks]`` equal to row
    ``seq_start``'s (level 1 reads the prefix from the group's first row only). A batch whose rows were replaced
    after planning (continuous batching with the same lengths) would otherwise give wrong results for the group's
    other sequences. eager: ``RuntimeError`` naming the group, the row, the entry and the fix (one host sync); async:
    ``torch._assert_async``; off: unchecked. Run after :func:`check_cascade` (shapes known to agree)."""
    if not plan.groups or block_table.dim() != 2:
        return
    mode = values._active(block_table)
    if mode is None:
        return
    parts = [block_table[s0:s1, :nb] for s0, s1, _, _, nb in plan.groups]
    bad = torch.stack([(part != part[:1]).any() for part in parts])
    if mode == "async":
        values._assert(~bad.any(), f"{op}: a row of block_table does not share its plan group's prefix blocks (the "
                                   f"block tables changed after kvops.plan_cascade). Replan when the batch's block "
                                   f"tables change; run with kvops.value_checks('eager') to see the row.")
        return
    if not bool(bad.any()):
        return
    g = int(bad.nonzero()[0, 0])
    s0, s1, _, _, nb = plan.groups[g]
    row, col = (int(i) for i in (parts[g] != parts[g][:1]).nonzero()[0])
    raise RuntimeError(
        f"{op}: the plan's group {g} (sequences [{s0}, {s1}), a shared prefix of {nb} blocks read from row {s0}) "
        f"does not hold for this block_table: block_table[{s0 + row}, {col}] = {int(block_table[s0 + row, col])} but "
        f"block_table[{s0}, {col}] = {int(block_table[s0, col])}, so sequence {s0 + row} would read another "
        f"sequence's prefix. The block tables changed after planning (e.g. a sequence replaced in the batch); replan "
        f"with kvops.plan_cascade when the batch's block tables change."
    )
