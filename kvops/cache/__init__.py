"""Cache modules: bookkeeping in Python ints, all tensor work through the kvops ops.

- :class:`CausalKVCache` (``causal.py``): contiguous streaming cache for block-causal generation
  (docs/semantics.md §1).
- :class:`PagedKVCache` (``paged.py``): paged caches with a block manager and per-step metadata
  (docs/semantics.md §3-4).
"""

from .causal import CausalKVCache, CausalKVView
from .paged import OutOfBlocksError, PagedKVCache, PagedStep

__all__ = ["CausalKVCache", "CausalKVView", "PagedKVCache", "PagedStep", "OutOfBlocksError"]

# Rolling-window (sliding-window) contiguous cache: rolling.py
from .rolling import RollingKVCache  # noqa: E402

__all__ += ["RollingKVCache"]

# --- packed (quantized) streaming cache (packed.py, docs/semantics.md §2) ----------------------------------------------
from .packed import PackedCausalKVCache, PackedKVView  # noqa: E402

__all__ += ["PackedCausalKVCache", "PackedKVView"]

# --- ring-layout streaming cache (ring.py, docs/ring-cache.md) ---------------------------------------------------
from .ring import RingCausalKVCache, RingKVView  # noqa: E402

__all__ += ["RingCausalKVCache", "RingKVView"]

# --- MLA latent caches with the paged block manager (mla.py, docs/mla.md) ------------------------------------------
from .mla import PagedMLACache  # noqa: E402

__all__ += ["PagedMLACache"]
