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

# MLA latent cache (mla.py; docs/mla.md)
from .mla import mla_attention, mla_cache_write  # noqa: E402

__all__ += ["mla_cache_write", "mla_attention"]

# merging attention states over disjoint key sets (merge.py; docs/cascade.md)
from .merge import merge_attention_states, merge_attention_states_many  # noqa: E402

__all__ += ["merge_attention_states", "merge_attention_states_many"]

# cascade attention over shared prefixes (cascade.py; docs/cascade.md)
from .cascade import CascadePlan, cascade_attention, plan_cascade  # noqa: E402

__all__ += ["CascadePlan", "plan_cascade", "cascade_attention"]
