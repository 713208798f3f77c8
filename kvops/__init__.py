"""kvops: KV-cache operations as ``torch.library`` custom ops.

Each op has a schema (``kvops/_library.py``), one validator shared by its eager kernels and its fake rule
(``kvops/_checks/``), a CPU kernel (``kvops/reference/``, ``kvops/native/``), a Triton kernel for CUDA
(``kvops/triton/``) and an Inductor lowering (``lowering/``, imported as ``kvops.lowering``). ``import kvops``
registers all of them; nothing is compiled and no global config is changed. Subsystems: ``kvops.cache`` (streaming,
ring, rolling and paged caches), ``kvops.packed`` (quantized streaming cache), ``kvops.transfer`` (prefill→decode KV
transfer), ``kvops.export`` (exportable streaming step, functional variants for ONNX). ``kvops.integrations`` is
imported explicitly (``import kvops.integrations.transformers``), so ``import kvops`` never imports transformers.
"""

from . import _library  # noqa: F401
from ._checks.values import get_value_checks, set_value_checks, value_checks  # docs/semantics.md §7
from .cache import CausalKVCache, PagedKVCache, RingCausalKVCache
from .ops import (
    apply_rotary,
    cache_roll,
    cache_write,
    check_kvcache_capacity,
    check_slot_mapping,
    flash_attn_with_kvcache,
    paged_attention,
    paged_cache_write,
    rotary_paged_cache_write,
)
from .ops.transfer import paged_kv_gather, paged_kv_scatter

__all__ = [
    "cache_write",
    "cache_roll",
    "paged_cache_write",
    "paged_attention",
    "flash_attn_with_kvcache",
    "rotary_paged_cache_write",
    "apply_rotary",
    "paged_kv_gather",
    "paged_kv_scatter",
    "check_slot_mapping",
    "check_kvcache_capacity",
    "value_checks",
    "set_value_checks",
    "get_value_checks",
    "CausalKVCache",
    "RingCausalKVCache",
    "PagedKVCache",
    "onnx_translation_table",
]
__version__ = "0.1.0"

# The one call from kvops into lowering/ (installed as kvops.lowering): registers the Inductor lowerings so
# torch.compile fuses cache writes.
from ._lowering_path import import_lowering as _import_lowering  # noqa: E402

lowering = _import_lowering()
lowering.register()

from . import export, packed, transfer  # noqa: E402,F401  (subpackages reachable as kvops.export, ...)


def onnx_translation_table() -> dict:
    """The ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)`` of programs using kvops ops.

    Export ``kvops.export.functionalize(torch.export.export(model, args))`` with it (the writes must be functional
    first, see ``lowering/onnx.py``). Requires ``pip install 'kvops[onnx]'`` (onnxscript); raises ``ImportError``
    otherwise.
    """
    from .lowering.onnx import onnx_translation_table as table

    return table()
