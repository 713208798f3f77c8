"""Public, documented wrappers around ``torch.ops.kvops.*``; importing a module registers its kernels."""

from .contiguous import cache_roll, cache_write
from .paged_write import check_slot_mapping, paged_cache_write
from .paged_attention import paged_attention
from .flash_attn import check_kvcache_capacity, flash_attn_with_kvcache
from .transfer import paged_kv_gather, paged_kv_scatter

__all__ = [
    "cache_write",
    "cache_roll",
    "paged_cache_write",
    "check_slot_mapping",
    "paged_attention",
    "flash_attn_with_kvcache",
    "check_kvcache_capacity",
    "paged_kv_gather",
    "paged_kv_scatter",
]

# rotary embeddings fused into the paged write (rotary.py)
from .rotary import apply_rotary, rotary_paged_cache_write  # noqa: E402

__all__ += ["rotary_paged_cache_write", "apply_rotary"]

# the value checks' native fast path (kvops/_checks/values_attention.py) asks whether the native build is available:
# the validators are a layer below kvops.native, so the ops layer hands them the question
from .. import native as _native  # noqa: E402
from .._checks import values_attention as _values_attention  # noqa: E402

_values_attention.native_available = _native.available

# packed (quantized) K/V (packed.py, packed_attention.py; docs/packed-cache.md; public namespace kvops.packed)
from .packed import dequantize_kv, quantize_kv  # noqa: E402
from .packed_attention import packed_attention  # noqa: E402

__all__ += ["quantize_kv", "dequantize_kv", "packed_attention"]

# MLA latent cache (mla.py; docs/mla.md)
from .mla import mla_attention, mla_cache_write  # noqa: E402

__all__ += ["mla_cache_write", "mla_attention"]

# merging attention states over disjoint key sets (merge.py; docs/cascade.md)
from .merge import merge_attention_states, merge_attention_states_many  # noqa: E402

__all__ += ["merge_attention_states", "merge_attention_states_many"]

# cascade attention over shared prefixes (cascade.py; docs/cascade.md)
from .cascade import CascadePlan, cascade_attention, plan_cascade  # noqa: E402

__all__ += ["CascadePlan", "plan_cascade", "cascade_attention"]
