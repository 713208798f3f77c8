"""kvops: KV-cache operations as ``torch.library`` custom ops.

Each op has a schema (``kvops/_library.py``), one validator shared by its eager kernels and its fake rule
(``kvops/_checks/``), a CPU kernel (``kvops/reference/``), a Triton kernel for CUDA (``kvops/triton/``) and an Inductor
lowering (``lowering/``, imported as ``kvops.lowering``). ``import kvops`` registers all of them; nothing is compiled and no global config is changed.
"""

from . import _library  # noqa: F401
from .cache import CausalKVCache, PagedKVCache
from .ops import (
    cache_roll,
    cache_write,
    check_kvcache_capacity,
    check_slot_mapping,
    flash_attn_with_kvcache,
    paged_attention,
    paged_cache_write,
)

__all__ = [
    "cache_write",
    "cache_roll",
    "paged_cache_write",
    "paged_attention",
    "flash_attn_with_kvcache",
    "check_slot_mapping",
    "check_kvcache_capacity",
    "CausalKVCache",
    "PagedKVCache",
]
__version__ = "0.1.0"

# rotary embeddings fused into the paged write (kvops/ops/rotary.py)
from .ops import apply_rotary, rotary_paged_cache_write  # noqa: E402

__all__ += ["rotary_paged_cache_write", "apply_rotary"]

# The one call from kvops into lowering/ (installed as kvops.lowering): registers the Inductor lowerings so
# torch.compile fuses cache writes.
from ._lowering_path import import_lowering as _import_lowering  # noqa: E402

lowering = _import_lowering()
lowering.register()
