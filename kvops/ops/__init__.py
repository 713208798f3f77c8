"""Public, documented wrappers around ``torch.ops.kvops.*``; importing a module registers its kernels."""

from .contiguous import cache_roll, cache_write

__all__ = ["cache_write", "cache_roll"]
