"""Packed (quantized) K/V, the public namespace: the quantize/dequantize ops, attention over a packed window and the
packed streaming cache (docs/semantics.md §2, docs/packed-cache.md).

Re-exports only. The code lives in the core's layers: the ops in ``kvops/ops/packed.py`` and
``kvops/ops/packed_attention.py``, their validators in ``kvops/_checks/packed.py``, the composite CPU kernels in
``kvops/cpu/packed.py``, the Triton kernels in ``kvops/triton/packed_quant.py`` and
``kvops/triton/packed_attention.py``, the cache in ``kvops/cache/packed.py`` and the Inductor decomposition in
``lowering/inductor_packed.py``.
"""

from .._checks.packed import FORMATS, packed_layout
from ..cache.packed import PackedCausalKVCache, PackedKVView
from ..ops.packed import (
    PackedKV, PackedSegments, default_group_size, dequantize_kv, empty_packed, materialize, quantize_kv,
)
from ..ops.packed_attention import packed_attention

__all__ = [
    "FORMATS", "packed_layout", "PackedKV", "quantize_kv", "dequantize_kv", "empty_packed", "default_group_size",
    "packed_attention", "PackedCausalKVCache", "PackedKVView", "PackedSegments", "materialize",
]
