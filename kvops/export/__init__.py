"""Deployment paths: functional variants of the cache writes and the ExportedProgram pass that uses them
(``kvops.export.functional``).

Nothing here is needed for eager use or ``torch.compile``; ``import kvops.export`` registers the functional ops.
"""

from .functional import (
    FUNCTIONAL,
    cache_roll_functional,
    cache_write_functional,
    functionalize,
    paged_cache_write_functional,
)

__all__ = [
    "FUNCTIONAL",
    "cache_write_functional",
    "cache_roll_functional",
    "paged_cache_write_functional",
    "functionalize",
]
from .streaming import init_cursors, streaming_update  # noqa: E402

__all__ += ["init_cursors", "streaming_update"]
