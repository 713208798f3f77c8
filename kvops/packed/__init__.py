"""Packed (quantized) K/V: the quantize/dequantize ops and the packed streaming cache (docs/semantics.md §2)."""

from ._checks import FORMATS, packed_layout
from .ops import PackedKV, default_group_size, dequantize_kv, empty_packed, quantize_kv
from .attention import packed_attention
from .cache import PackedCausalKVCache, PackedKVView, PackedSegments, materialize
from ._lowering import register as _register_lowering

__all__ = [
    "FORMATS", "packed_layout", "PackedKV", "quantize_kv", "dequantize_kv", "empty_packed", "default_group_size",
    "packed_attention", "PackedCausalKVCache", "PackedKVView", "PackedSegments", "materialize",
]
_register_lowering()
