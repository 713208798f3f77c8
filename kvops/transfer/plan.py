"""Deprecated name of :mod:`kvops.transfer.routing` (docs/names.md): importing it warns, then re-exports that module's
public names (and ``plan_for_writer``, the deprecated name of ``routes_for_writer``). Removed in kvops 0.2."""

from .._deprecation import warn_renamed

warn_renamed("the module kvops.transfer.plan", "kvops.transfer.routing", stacklevel=3)

from . import plan_for_writer  # noqa: E402
from .routing import (  # noqa: E402
    DEFAULT_CHUNKED_PREFILL_SIZE,
    HeadSlice,
    KVArgs,
    check_transfer_metadata,
    compute_grid_segments,
    compute_head_slice_params,
    heads_per_rank,
    rank_head_range,
    resolve_total_kv_heads,
    routes_for_writer,
    staging_grid_tokens,
    writer_bytes,
)

__all__ = [
    "DEFAULT_CHUNKED_PREFILL_SIZE", "HeadSlice", "KVArgs", "check_transfer_metadata", "compute_grid_segments",
    "compute_head_slice_params", "heads_per_rank", "plan_for_writer", "rank_head_range", "resolve_total_kv_heads",
    "routes_for_writer", "staging_grid_tokens", "writer_bytes",
]
