"""Prefill→decode KV transfer between different TP sizes (docs/semantics.md §6).

- :mod:`kvops.transfer.routing`: the routing (pure Python): head placement, writers per decode rank
  (:func:`compute_head_slice_params`), bytes per writer, staging grid, metadata checks.
- :mod:`kvops.transfer.transport` (protocol, shared parts), :mod:`~kvops.transfer.sender` (``KVSender``),
  :mod:`~kvops.transfer.receiver` (``KVReceiver``), :mod:`~kvops.transfer.wire` (what travels): the transfer over
  ``torch.distributed`` (gloo on CPU, NCCL on GPU) with the staging ops ``kvops.paged_kv_gather`` /
  ``kvops.paged_kv_scatter``; docs/transfer.md.
"""

from .routing import (
    HeadSlice,
    KVArgs,
    check_transfer_metadata,
    compute_grid_segments,
    compute_head_slice_params,
    heads_per_rank,
    routes_for_writer,
    rank_head_range,
    resolve_total_kv_heads,
    staging_grid_tokens,
    writer_bytes,
)
from .._deprecation import renamed_function
from .receiver import KVReceiver
from .sender import KVSender
from .transport import KVTransferError, TransferGroups, TransferStats

plan_for_writer = renamed_function(routes_for_writer, "kvops.transfer.plan_for_writer",
                                   "kvops.transfer.routes_for_writer")  # its name before kvops 0.1 (docs/names.md)

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferGroups",
    "TransferStats",
    "HeadSlice",
    "KVArgs",
    "check_transfer_metadata",
    "compute_grid_segments",
    "compute_head_slice_params",
    "heads_per_rank",
    "routes_for_writer",
    "rank_head_range",
    "resolve_total_kv_heads",
    "staging_grid_tokens",
    "writer_bytes",
]
