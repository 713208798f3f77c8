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
from ._checks.values import get_value_checks, set_value_checks, value_checks  # noqa: E402  (docs/semantics.md §7)

__all__ += ["value_checks", "set_value_checks", "get_value_checks"]
__version__ = "0.1.0"

# Prefill->decode KV transfer staging ops (kvops/ops/transfer.py); the planner and transport live in kvops.transfer.
from .ops.transfer import paged_kv_gather, paged_kv_scatter  # noqa: E402

__all__ += ["paged_kv_gather", "paged_kv_scatter"]

# rotary embeddings fused into the paged write (kvops/ops/rotary.py)
from .ops import apply_rotary, rotary_paged_cache_write  # noqa: E402

__all__ += ["rotary_paged_cache_write", "apply_rotary"]

# The one call from kvops into lowering/ (installed as kvops.lowering): registers the Inductor lowerings so
# torch.compile fuses cache writes.
from ._lowering_path import import_lowering as _import_lowering  # noqa: E402

lowering = _import_lowering()
lowering.register()


# --- deployment (issue 9): ONNX translations; needs the `onnx` extra (onnxscript), imported on first use ----------
def onnx_translation_table() -> dict:
    """The ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)`` of programs using kvops ops.

    Export ``kvops.export.functionalize(torch.export.export(model, args))`` with it (the writes must be functional
    first, see ``lowering/onnx.py``). Requires ``pip install 'kvops[onnx]'`` (onnxscript); raises ``ImportError``
    otherwise.
    """
    from .lowering.onnx import onnx_translation_table as table

    return table()


__all__.append("onnx_translation_table")

# --- ring-layout streaming cache (kvops/cache/ring.py, issue 12 §3) -------------------------------------------------
from .cache import RingCausalKVCache  # noqa: E402

__all__ += ["RingCausalKVCache"]
