"""Packed (quantized) K/V: the quantize/dequantize ops and the packed streaming cache (semantics.md §2)."""

from ._checks import FORMATS, packed_layout
from .ops import PackedKV, dequantize_kv, empty_packed, quantize_kv

__all__ = ["FORMATS", "packed_layout", "PackedKV", "quantize_kv", "dequantize_kv", "empty_packed"]
