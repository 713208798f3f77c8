"""Paged-cache write: ``kvops::paged_cache_write`` (docs/semantics.md §3; as vLLM's ``reshape_and_cache_flash``).

Schema: ``kvops/_library.py``. Validator: ``kvops/_checks/paged_write.py``. CPU kernel: ``kvops/reference/
paged_write.py``. CUDA kernel: ``kvops/triton/paged_write.py``.
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks import values
from .._checks.paged_write import as_nhd, check_paged_cache_write
from ..reference import paged_write as cpu
from ..triton import HAS_TRITON


def paged_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_head_start: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_layout: str = "NHD",
) -> None:
    """Write ``N`` tokens into a paged KV cache by slot, in place (as vLLM's ``reshape_and_cache_flash``).

    Token ``i`` with slot ``x = slot_mapping[i]`` lands in block ``x // block_size``, row ``x % block_size``, heads
    ``[h0, h0 + H_in)``. A **negative slot means skip** (padding), in every backend, compiled included.

    Args:
        key: ``[N', H_in, D]`` with ``N' >= N``; rows ``>= N`` are never read. Same dtype as ``k_cache`` (for an fp8
            cache: float32, bfloat16 or float16). Any strides.
        value: ``[N', H_in, D_v]``, like ``key``.
        k_cache: ``[P, block_size, H_kv, D]`` (NHD), or ``[P, H_kv, block_size, D]`` with ``kv_layout="HND"``; any
            strides (e.g. ``kv[:, :, 0]`` of a ``[P, block_size, 2, H_kv, D]`` allocation, or ``kv[:, 0]`` of
            ``[P, 2, block_size, H_kv, D]``); mutated in place, never copied.
        v_cache: ``[P, block_size, H_kv, D_v]`` (HND: ``[P, H_kv, block_size, D_v]``); mutated.
        slot_mapping: ``[N]`` int32 or int64 on the caches' device; slot ``x`` in ``[0, P * block_size)`` or
            negative. ``N`` is the number of tokens written.
        cache_head_start: first cache head written when ``H_in != H_kv`` (a tensor-parallel head slice); other heads
            are untouched.
        k_scale, v_scale: float32 ``[1]`` or ``[H_kv]``; required for (and only for) ``float8_e4m3fn`` caches, which
            store ``x / scale`` (fp32 division) saturated to ``±448``, rounded to nearest even. With ``[H_kv]`` and a
            head slice, input head ``i`` uses the scale of cache head ``h0 + i``.
        kv_layout: ``"NHD"`` (default, vLLM's flash layout) or ``"HND"`` (FlashInfer's name for
            ``[P, H_kv, block_size, D]``). Slot semantics are the same in both.

    Raises:
        ValueError: ``kv_layout`` not "NHD"/"HND"; ``"v_cache must be provided"``; missing ``value``; ranks; ``slot_mapping`` not 1-D int32/int64;
            ``key`` with fewer rows than ``slot_mapping`` (``N' < N``); dtype/device/head/head_dim mismatches;
            ``"... requires cache_head_start when cache heads (H_kv) differ from input heads (H_in)."`` (followed by
            "it may be an HND cache ...; if so, pass kv_layout=\"HND\"" when the other dim fits ``H_in``); a head slice
            outside the cache; an fp8 cache without scales; scales for a non-fp8 cache; scales not fp32 ``[1]`` or
            ``[H_kv]``. All raised by the fake rule too, so they fire at trace time under ``torch.compile`` and
            ``torch.export``.
        RuntimeError: a slot ``>= P * block_size`` (value contract, docs/semantics.md §7), before anything is
            written: ``"kvops.paged_cache_write: slot_mapping[i] = x is outside the cache: valid slots are [0, P *
            block_size) ..."`` in the default ``"eager"`` value-check mode (eager calls; not checked while tracing);
            with ``kvops.value_checks("async")`` a ``torch._assert_async`` that also works in compiled and exported
            graphs, and the whole batch is skipped. With ``"off"``: undefined behaviour of the kernel.

    Duplicate non-negative slots within one call: which token lands is unspecified.
    """
    try:  # value contract, docs/semantics.md §7
        slot_mapping = values.check_paged_write(slot_mapping, k_cache, kv_layout)
    except RuntimeError:  # a metadata error (e.g. an HND cache read as NHD) explains the bad slot: it goes first
        check_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale,
                                kv_layout)
        raise
    torch.ops.kvops.paged_cache_write(
        key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout
    )


def check_slot_mapping(slot_mapping: torch.Tensor, k_cache: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Debug check of slot *values*, whatever the value-check mode (reads the tensor: a host sync on CUDA; eager only).

    Raises ``RuntimeError`` for a slot ``>= P * block_size`` (the check ``paged_cache_write`` runs in the default
    ``"eager"`` value-check mode, docs/semantics.md §7) and ``ValueError`` when a non-negative slot repeats (allowed
    by the op, where which token lands is unspecified). Negative slots (padding) are allowed.
    """
    values.raise_bad_slots(slot_mapping, *values.cache_geometry(k_cache, kv_layout), "kvops.paged_cache_write")
    slots = slot_mapping[slot_mapping >= 0].to(torch.int64).cpu()
    uniq, counts = slots.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(
            f"kvops.paged_cache_write: slot {int(uniq[counts > 1][0])} appears more than once in slot_mapping; each "
            f"written token needs its own slot."
        )


# --- fake rule: the contract at trace time ----------------------------------------------------------------------
@torch.library.register_fake("kvops::paged_cache_write")
def _paged_cache_write_fake(key, value, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None,
                            v_scale=None, kv_layout="NHD"):
    check_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout)


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, kernels) -> None:
    @torch.library.impl("kvops::paged_cache_write", device)
    def _write(key, value, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None, v_scale=None,
               kv_layout="NHD"):
        h0 = check_paged_cache_write(
            key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout
        )
        k_cache, v_cache = as_nhd(k_cache, v_cache, kv_layout)  # views: the kernels take strides
        kernels.paged_cache_write(key, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import paged_write as _triton_paged_write

    _register("CUDA", _triton_paged_write)
