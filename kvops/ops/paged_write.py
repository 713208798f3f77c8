"""Paged-cache write: ``kvops::paged_cache_write`` (docs/semantics.md §3; as vLLM's ``reshape_and_cache_flash``).

Schema: ``kvops/_library.py``. Validator: ``kvops/_checks/paged_write.py``. CPU kernel: native C++
(``kvops/native/paged_write.cpp``, one call for K and V; built on first use) or, without a compiler, the composite
``kvops/cpu/paged_write.py``. CUDA kernel: ``kvops/triton/paged_write.py``. A plain eager CPU call runs the
native kernel directly (no custom-op dispatch; memoized validation; the slot check happens as the kernel reads the
slots, so the default ``"eager"`` value check is free): see ``_fast_eager``.
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks import values
from .. import native
from .._checks.common import index_fix, kv_scale_tensors
from .._checks.paged_write import as_nhd, check_paged_cache_write
from ..cpu import paged_write as cpu
from ..triton import HAS_TRITON

# Traced calls read these two module globals: each global a traced function reads becomes a Dynamo guard evaluated on
# every call of the compiled function, and an attribute chain (``torch.ops.kvops.paged_cache_write``) one guard per
# link, so the compiled-write benchmark (benchmarks/cache_write.py) pays for every name the traced path touches.
_traced = torch.compiler.is_compiling
_op = torch.ops.kvops.paged_cache_write.default


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
        k_scale, v_scale: float32 ``[1]`` or ``[H_kv]`` (a 0-d tensor, vLLM's per-tensor form ``(key.amax() /
            64.0).to(torch.float32)``, counts as ``[1]``); required for (and only for) ``float8_e4m3fn`` caches, which
            store ``x / scale`` (fp32 division) saturated to ``±448``, rounded to nearest even. With ``[H_kv]`` and a
            head slice, input head ``i`` uses the scale of cache head ``h0 + i``.
        kv_layout: ``"NHD"`` (default, vLLM's flash layout) or ``"HND"`` (FlashInfer's name for
            ``[P, H_kv, block_size, D]``). Slot semantics are the same in both.

    Raises:
        ValueError: ``kv_layout`` not "NHD"/"HND"; ``"v_cache must be provided"``; missing ``value``; ranks;
            ``block_size``, ``H_kv`` or a ``head_dim`` of 0; caches that overlap in memory (``"k_cache and v_cache
            overlap in memory"``, or one overlapping itself; joint K/V layouts are disjoint and fine); ``slot_mapping`` not 1-D int32/int64;
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

    Duplicate non-negative slots within one call: which token lands is unspecified. ``key``/``value`` may alias the
    caches (e.g. rows of ``k_cache`` rewritten to other slots): they are read before anything is written, as in
    compiled code (every kernel copies such a source first; docs/semantics.md §3). Under ``torch.compile`` (torch
    2.13) pass a ``.clone()`` of such a view on every call, the first included: torch does not recompile when the
    inputs' aliasing changes (pytorch/pytorch#139789), so a later call can read the traced offset or fail.
    """
    k_scale, v_scale = kv_scale_tensors("kvops.paged_cache_write", k_scale, v_scale)
    if _traced():  # traced: the op (and the async value check), through few globals (few guards, see above)
        if values.get_value_checks() == "async":
            slot_mapping = values.check_paged_write(slot_mapping, k_cache, kv_layout)
        _op(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout)
        return
    if _fast_eager(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        h0 = _validated(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout)
        _native_write(key, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale, kv_layout, fast_path=True)
        return
    try:  # value contract, docs/semantics.md §7
        slot_mapping = values.check_paged_write(slot_mapping, k_cache, kv_layout)
    except RuntimeError:  # a metadata error (e.g. an HND cache read as NHD) explains the bad slot: it goes first
        check_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale,
                                kv_layout)
        raise
    torch.ops.kvops.paged_cache_write(
        key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout
    )


# --- eager fast path -------------------------------------------------------------------------------------------
# A plain eager CPU call skips the custom-op dispatcher (~10 us) and validates through a memo of the validator's
# verdict on the arguments' metadata: the native kernel checks the slot values while reading them (no extra pass),
# so the default value check costs nothing. Anything that must see the op (torch.compile, torch.export, FakeTensor,
# TorchDispatchMode / TorchFunctionMode, functorch transforms, tensor subclasses, autograd) takes the op path.
_PLAIN = torch.Tensor
_memo: dict = {}


def _fast_eager(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    if (type(key) is not _PLAIN or type(value) is not _PLAIN or type(k_cache) is not _PLAIN
            or type(v_cache) is not _PLAIN or type(slot_mapping) is not _PLAIN):
        return False
    if not (k_cache.is_cpu and key.is_cpu and value.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu):
        return False
    if k_scale is not None and (type(k_scale) is not _PLAIN or type(v_scale) is not _PLAIN):
        return False
    if values.get_value_checks() == "async" or torch.jit.is_tracing():
        return False
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad or k_cache.requires_grad
                                    or v_cache.requires_grad):
        return False
    return native.use_native()


def _validated(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale, kv_layout) -> int:
    """``check_paged_cache_write``'s result (the first cache head written), memoized on everything it reads: shapes,
    dtypes, the caches' strides (stride-0 check) and, when they share a storage, offsets (overlap check), the scales' shapes and dtypes, ``cache_head_start``, ``kv_layout``
    (devices: all CPU on the fast path). Errors are raised again on every call, never memoized."""
    memo_key = (key.shape, key.dtype, value.shape, value.dtype, k_cache.shape, k_cache.stride(), k_cache.dtype,
                v_cache.shape, v_cache.stride(), v_cache.dtype, slot_mapping.shape, slot_mapping.dtype,
                cache_head_start, kv_layout, _shared(k_cache, v_cache),
                None if k_scale is None else (k_scale.shape, k_scale.dtype, k_scale.is_cpu),
                None if v_scale is None else (v_scale.shape, v_scale.dtype, v_scale.is_cpu))
    h0 = _memo.get(memo_key)
    if h0 is None:
        h0 = check_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, cache_head_start, k_scale, v_scale,
                                     kv_layout)
        if len(_memo) >= 256:
            _memo.clear()
        _memo[memo_key] = h0
    return h0


def _shared(k_cache, v_cache):
    """The overlap check's input (kvops/_checks/overlap.py): None for caches on separate storages, else the offsets."""
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None
    return k_cache.storage_offset(), v_cache.storage_offset()


def _native_write(key, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale, kv_layout, fast_path) -> None:
    """The native CPU kernel on validated arguments; a slot ``>= P * block_size`` writes nothing and raises (on the
    fast path in the ``"eager"`` value-check mode that mode's ``RuntimeError``, else the kernel's ``IndexError``).
    On the fast path the caches' version counters are bumped, as an in-place torch op bumps them. A key/value
    overlapping a cache is copied by the kernel before it writes (snapshot semantics, docs/semantics.md §3)."""
    k_nhd, v_nhd = as_nhd(k_cache, v_cache, kv_layout)
    bad = torch.ops.kvops._paged_write_native(key, value, k_nhd, v_nhd, slot_mapping, h0, k_scale, v_scale)
    if bad >= 0:
        num_blocks, block_size = k_nhd.shape[0], k_nhd.shape[1]
        if fast_path and values.get_value_checks() == "eager":
            values.raise_bad_slots(slot_mapping, num_blocks, block_size, "kvops.paged_cache_write")
        raise cpu.slot_error(int(slot_mapping.max()), num_blocks, block_size)
    if fast_path:
        torch.autograd.graph.increment_version((k_cache, v_cache))


def check_slot_mapping(slot_mapping: torch.Tensor, k_cache: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Debug check of slot *values*, whatever the value-check mode (reads the tensor: a host sync on CUDA; eager only).

    Raises ``RuntimeError`` for a slot ``>= P * block_size`` (the check ``paged_cache_write`` runs in the default
    ``"eager"`` value-check mode, docs/semantics.md §7) and ``ValueError`` when a non-negative slot repeats (allowed
    by the op, where which token lands is unspecified). Negative slots (padding) are allowed. A ``slot_mapping`` that
    is not a 1-D int32/int64 tensor is a ``ValueError``, as in the op.
    """
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or \
            slot_mapping.dtype not in (torch.int32, torch.int64):
        got = (f"shape {tuple(slot_mapping.shape)} and dtype {slot_mapping.dtype}"
               if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__)
        raise ValueError(
            f"kvops.check_slot_mapping: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got {got}. "
            + index_fix("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), "[num_tokens]")
        )
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
        if kernels is cpu and native.use_native():
            _native_write(key, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale, kv_layout, False)
            return
        k_cache, v_cache = as_nhd(k_cache, v_cache, kv_layout)  # views: the kernels take strides
        kernels.paged_cache_write(key, value, k_cache, v_cache, slot_mapping, h0, k_scale, v_scale)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import paged_write as _triton_paged_write

    _register("CUDA", _triton_paged_write)
