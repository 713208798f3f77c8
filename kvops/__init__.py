"""kvops: KV-cache operations as ``torch.library`` custom ops.

Each op has a schema (``kvops/_library.py``), one validator shared by its eager kernels and its fake rule
(``kvops/_checks/``), a CPU kernel (``kvops/reference/``), a Triton kernel for CUDA (``kvops/triton/``) and an Inductor
lowering (``lowering/``). ``import kvops`` registers all of them; nothing is compiled and no global config is changed.
"""

from . import _library  # noqa: F401
from .ops import cache_roll, cache_write
from .ops import check_slot_mapping, paged_cache_write
from .ops import paged_attention
from .ops import check_kvcache_capacity, flash_attn_with_kvcache
from .cache import CausalKVCache
from .cache import PagedKVCache

__all__ = ["cache_write", "cache_roll", "paged_cache_write", "check_slot_mapping", "paged_attention", "CausalKVCache", "PagedKVCache",
           "flash_attn_with_kvcache", "check_kvcache_capacity"]
__version__ = "0.1.0"

from lowering import register as _register_lowerings  # noqa: E402  (the one call into lowering/: Inductor fuses writes)

_register_lowerings()
