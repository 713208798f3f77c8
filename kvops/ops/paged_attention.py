"""Paged attention: ``kvops::paged_attention`` (docs/semantics.md §4), decode and chunked prefill in one varlen batch.

Registered with ``torch.library.triton_op`` (schema inferred from the annotations of ``_paged_attention_op``; it is
written out in ``kvops/_library.py`` as ``PAGED_ATTENTION``, checked equal by a test). The optional features (docs/attention_features.md) travel as one record, ``AttnFeatures`` (``kvops/_checks/features.py``),
which the validator resolves and every kernel takes. One function serves every face of the op:

* it first calls the validator (``kvops/_checks/paged_attention.py``), so eager calls, the fake rule (``triton_op``
  registers the function itself as the fake kernel) and ``torch.export`` raise the same errors;
* on CUDA tensors it launches the Triton kernels (``kvops/triton/paged_attention.py``) through
  ``torch.library.wrap_triton``, so ``torch.compile`` on CUDA sees the Triton kernels rather than an opaque call;
* on CPU it calls the native C++ kernel ``kvops::_paged_attention_native`` (``kvops/native/``, built on first use; an
  opaque op with a fake rule, so ``torch.compile`` graphs call it as an extern kernel), or, where it cannot be built
  (no C++ compiler; one warning) and under AOTInductor (packages must run without kvops), the vectorized torch
  kernel (``kvops/cpu/paged_attention.py``), which has no host syncs, so ``torch.compile`` on CPU traces it
  into the graph as ordinary torch ops.

An eager call on plain CPU tensors (nothing tracing, no dispatch/function mode, functorch transform or autograd
watching: ``_direct``) runs ``_eager_native``: the same validator (remembering the signatures of calls that passed),
value contracts and native kernel, without the dispatcher layers of ``triton_op``: what decode at B = 1 spends on
per-call costs (``benchmarks/paged_decode.py``, its B = 1 rows).
"""

from typing import Optional

import torch

from .. import _library
from .._checks import values
from .._checks.common import UNBOUNDED, int64_error, kv_scale_tensors
from .._checks.features import NO_FEATURES, AttnFeatures, resolve
from .._checks.forms import python_float
from .._checks.paged_attention import OP, check_paged_attention
from .._checks.paged_write import as_nhd
from .. import native
from ..cpu.paged_attention import paged_attention as _cpu_paged_attention
from ..triton import HAS_TRITON

if HAS_TRITON:
    from ..triton.paged_attention import paged_attention as _triton_paged_attention


# (triton_op infers the schema from these annotations and ignores a schema string on the torch versions kvops supports:
# kvops/_library.py keeps the string, PAGED_ATTENTION, and tests/paged/test_attention_features.py checks the two agree.)
@torch.library.triton_op("kvops::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    scale: Optional[float] = None,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    alibi_slopes: Optional[torch.Tensor] = None,  # from here on: the fields of AttnFeatures, in order
    window_right: int = -1,
    cache_leftpad: Optional[torch.Tensor] = None,
    sink_tokens: int = 0,
    rope_theta: Optional[float] = None,
    rope_scale: float = 1.0,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    features = AttnFeatures(alibi_slopes, window_right, cache_leftpad, sink_tokens, rope_theta, rope_scale,
                            custom_mask, packed_custom_mask)
    return _implementation(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal,
                           window_left, softcap, sinks, k_scale, v_scale, kv_layout, features)


def _implementation(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal,
                    window_left, softcap, sinks, k_scale, v_scale, kv_layout, features=NO_FEATURES):
    """The op's body (validator, then the device's kernel): what ``kvops::paged_attention`` runs (an eager CPU call
    that ``_direct`` admits runs the same validator and native kernel through ``_eager_native``). The validator
    resolves the features into the record every kernel takes."""
    sm_scale, window_left, features = check_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left, softcap,
        sinks, k_scale, v_scale, kv_layout, features,
    )
    k_cache, v_cache = as_nhd(k_cache, v_cache, kv_layout)  # views: the kernels take strides
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, sm_scale, causal, window_left,
            softcap, sinks, k_scale, v_scale)
    if q.device.type == "cuda":
        if not HAS_TRITON:
            raise RuntimeError("kvops.paged_attention: CUDA tensors need triton; pip install triton.")
        return _triton_paged_attention(*args, features)
    # CPU: the native kernel (an opaque op with a fake rule, so compiled graphs call it too), else the composite
    if not native.use_native():
        return _cpu_paged_attention(*args, features)
    return torch.ops.kvops._paged_attention_native(*args, *features)


def _direct(tensors):
    """Whether an eager call may run ``_eager_native`` rather than the dispatcher (the same validator, kernel and
    results, fewer layers per call): plain CPU tensors, the native kernel, nothing tracing, no dispatch or
    function mode, functorch transform or profiler active (a profile shows ``kvops::paged_attention``), and no
    autograd to record (the op has no derivative, and the dispatcher is what reports that).

    A true value says yes: the validator's memo key of ``tensors`` (``native.eager_key``: their dtypes and shapes, in
    one native pass that also asks the tensor questions above), or True where the build has no ``eager_key``."""
    if (_is_compiling() or _dispatch_modes() > 0 or _profiling() or _function_modes()
            or _functorch_transform() is not None):
        return False
    if not native.available():  # (real tensors outside tracing: no AOTInductor compilation is running)
        return False
    if native.eager_key is not None:
        return native.eager_key(*tensors)  # None: a tensor the dispatcher must see
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not _Tensor or not t.is_cpu or (grad and t.requires_grad)):
            return False
    return True


# what _direct asks on every eager call, looked up once
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_profiling = torch.autograd._profiler_enabled
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch_transform = torch._C._functorch.peek_interpreter_stack
_grad_enabled = torch.is_grad_enabled


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_lse: bool = False,
    kv_layout: str = "NHD",
    *,
    alibi_slopes: torch.Tensor | None = None,
    window_right: int = -1,
    cache_leftpad: torch.Tensor | None = None,
    sink_tokens: int = 0,
    rope_theta: float | None = None,
    rope_scale: float = 1.0,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
):
    """Attention of packed queries over a paged KV cache: decode and chunked prefill in one varlen batch.

    Semantics as vLLM's / FlashAttention's varlen paged attention (``flash_attn_varlen_func`` with ``block_table`` and
    ``seqused_k``): sequence ``b`` owns query rows ``[cu_seqlens_q[b], cu_seqlens_q[b+1])`` (``q_len`` new tokens,
    already written to the cache) and KV positions ``[0, seq_lens[b])``, position ``j`` stored in block
    ``block_table[b, j // block_size]``, row ``j % block_size``.

    Args:
        q: ``[T_q, H_q, D]`` float32/bfloat16/float16, packed queries of all sequences (any strides).
        k_cache: ``[P, block_size, H_kv, D]`` (NHD), or ``[P, H_kv, block_size, D]`` with ``kv_layout="HND"``; q's
            dtype or ``float8_e4m3fn``; any strides (e.g. K and V as views of one ``[P, block_size, 2, H_kv, D]``
            allocation); never copied.
        v_cache: ``[P, block_size, H_kv, D_v]`` (HND: ``[P, H_kv, block_size, D_v]``), same dtype, ``P``,
            ``block_size`` and ``H_kv`` as ``k_cache``.
        cu_seqlens_q: ``[B + 1]`` int32, cumulative query lengths (``0 = cu[0] <= cu[1] <= ... <= cu[B] = T_q``).
        seq_lens: ``[B]`` int32, KV length of each sequence including its new tokens (normally ``q_len <=
            seq_len``; a query whose position ``seq_len - q_len + i`` is negative sees no key under ``causal``).
        block_table: ``[B, max_blocks]`` int32 physical block ids; entries past ``ceil(seq_len / block_size)`` are
            never read (any value, e.g. -1 padding). Blocks may be shared between sequences (prefix sharing).
        max_seqlen_q: int, ``>= max_b q_len`` (as FlashAttention's varlen API; sizes grids without a host sync).
            Decode batches pass 1.
        scale: softmax scale on ``q·k`` (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask: query ``i`` of a sequence sits at position ``seq_len - q_len + i``
            and sees positions ``<=`` its own. With ``causal=False`` every query sees ``[0, seq_len)``.
        window_left: sliding window (``-1``: none): keeps positions ``> pos - window_left - 1``, i.e. the query's
            own position and ``window_left`` before it (FlashAttention's ``window_size[0]``; vLLM passes a model's
            ``sliding_window`` W as ``W - 1``). No right bound beyond ``causal``.
        softcap: if ``> 0``, scores become ``softcap * tanh(score / softcap)`` *before* masking (Gemma-2).
        sinks: ``[H_q]`` float32 attention-sink logits (gpt-oss), natural-log units, not multiplied by ``scale``:
            ``exp(sinks[h])`` joins head ``h``'s softmax denominator and contributes no value.
        k_scale, v_scale: float32 ``[1]`` or ``[H_kv]`` (a 0-d tensor, vLLM's per-tensor form, counts as ``[1]``),
            required for (and only allowed with) fp8 caches, which are dequantized as ``cache.float() * scale`` (the
            inverse of ``kvops.paged_cache_write``'s ``x / scale``).
        return_lse: also return the log-sum-exp.
        kv_layout: ``"NHD"`` (default) or ``"HND"`` (FlashInfer's name for ``[P, H_kv, block_size, D]``). An HND
            cache is read through its NHD view ``transpose(1, 2)``: no copy.
        alibi_slopes: (keyword-only, as every argument below; docs/attention_features.md) float32 ``[H_q]`` or
            ``[B, H_q]``: FlashAttention's ALiBi, score ``- slope * |pos - j|`` added after softcap, before masking.
        window_right: right window (``-1``: none) when ``causal=False``: keys ``j <= pos + window_right`` are
            visible (FlashAttention's ``window_size[1]``). With ``causal=True`` it is ignored: the causal bound
            (0) wins, as in FlashAttention (``flash_api.cpp`` sets ``window_size_right = 0`` when ``is_causal``).
        cache_leftpad: int32 ``[B]``, the first KV row of each sequence (FlashAttention's ``cache_leftpad``): rows
            ``[0, cache_leftpad[b])`` are never read; the keys are rows ``[cache_leftpad[b], seq_lens[b])`` and
            positions (causal, window, ALiBi distances) are rows; RoPE at read time counts from the first key.
        sink_tokens: StreamingLLM: with ``window_left >= 0`` the first ``sink_tokens`` keys of each sequence stay
            visible besides the window (still subject to ``causal``/``window_right``). Table entries of blocks that
            no query can see (wholly between the sinks and the earliest query's window) are never read: evicted
            blocks may hold ``-1`` (``PagedKVCache(window_left=..., sink_tokens=...)`` frees them). Without a
            window (``window_left=-1``) it changes nothing (every key is visible already) and is accepted, so one
            setting serves a model's windowed and global layers.
        rope_theta, rope_scale: RoPE at read time (FlashInfer's ``pos_encoding_mode="ROPE_LLAMA"``): the cache holds
            un-rotated keys; q and k are rotated GPT-NeoX style (pairs ``(j, j + D/2)``) by angle
            ``position / rope_scale * rope_theta ** (-2i / D)`` inside the kernel; q's position is its sequence
            position ``pos - cache_leftpad``, a key's its row ``j - cache_leftpad``. With ``sink_tokens`` and a
            window the kept keys take contiguous positions (StreamingLLM): a sink is seen at distance
            ``pos - gap - j`` with ``gap = max(0, pos - window_left - sink_end)``, ``sink_end = cache_leftpad +
            sink_tokens`` (the first key past the sinks). ``None``: no rotation.
        custom_mask: bool ``[sum_b q_len_b ** 2]``: a mask among each sequence's new keys (docs/tree-mask.md,
            FlashInfer's ``custom_mask`` restricted to the new keys), e.g. a speculative draft tree's: sequence
            ``b``'s ``q_len_b x q_len_b`` block, row-major (query row ``i``, new key ``c``, True = visible), the
            blocks concatenated in batch order. Keys before the new rows stay visible; among the new keys the mask
            replaces the causal rule (``causal`` True or False alike); ``window_left``/``sink_tokens``/
            ``cache_leftpad`` apply on top, softcap, ALiBi, sinks and RoPE at read time as without a mask; not
            with ``window_right``. Calls with a mask run the prefill kernel on CUDA.
        packed_custom_mask: uint8 ``[sum_b ceil(q_len_b ** 2 / 8)]``: the same mask as little-endian bits, each
            sequence's segment padded to whole bytes (``kvops.custom_mask.segment_packbits``, as FlashInfer's
            ``packbits``/``segment_packbits`` with ``bitorder="little"``). At most one of the two.

    Returns:
        ``out [T_q, H_q, D_v]`` in q's dtype (fp32 accumulation; for 16-bit inputs the native CPU kernel's low-precision
        GEMM form and its AVX512-BF16 decode form (by default on AMD CPUs with AVX512-BF16; ``KVOPS_NATIVE_BF16_DOT``
        1 / 0 forces it on / off) round the probabilities P to that dtype before P V, as FlashAttention and PyTorch's
        CPU flash attention do: docs/native-kernel.md, "Which form the GEMM path below takes"), or
        ``(out, lse)`` with ``lse [H_q, T_q]`` float32, natural log (FlashAttention's varlen ``softmax_lse`` layout) of
        the softmax denominator **including the sink term** ``exp(sinks[h])`` (as FlashAttention's ``learnable_sink`` in
        ``flash_attn/cute``), so ``out == sum_j exp(s_j - lse) v_j`` holds in every case. A query with no visible key
        gets ``out = 0`` (never NaN) and ``lse = -inf`` (or ``sinks[h]`` when sinks are given). GQA: query head ``h``
        reads KV head ``h // (H_q // H_kv)``. Values stored in slots at or beyond ``seq_len`` never reach the output,
        even when NaN/inf; a NaN score of a visible key (NaN in q or K) makes the query's output and LSE NaN, as SDPA's
        math backend's (docs/semantics.md). The native CPU kernel's output is guaranteed finite while max ``|v|`` times
        the number of visible keys stays below the fp32 maximum / 256 (1.3e36; its lazy softmax rescale), the other
        kernels' below the fp32 maximum (docs/native-kernel.md, "Lazy rescale"). Windows and ``sink_tokens`` of
        ``2**31`` or more (e.g. ``sys.maxsize``) are unbounded.

    Raises:
        ValueError: ``kv_layout`` not "NHD"/"HND"; ``"v_cache must be provided"``; ``block_size``, ``H_kv`` or a
            ``head_dim`` of 0; ``H_q % H_kv != 0`` (when the cache may be in the other ``kv_layout`` the message
            leads with that); ``head_dim`` of q vs ``k_cache``; index
            tensors not int32 or of the wrong rank; ``block_table``/``seq_lens``/``cu_seqlens_q`` inconsistent with
            ``B``; K/V caches disagreeing in dtype, ``P``, ``block_size`` or ``H_kv``; a non-fp8 cache dtype
            different from q's; ``sinks`` not float32 ``[H_q]``; an fp8 cache without scales (or scales without
            one, or scales not float32 ``[1]``/``[H_kv]``); devices; ``max_seqlen_q < 1`` with tokens;
            ``window_left < -1``; ``softcap < 0``; ``scale``, ``softcap``, ``rope_theta`` or ``rope_scale`` NaN or
            infinite; features: ``alibi_slopes`` not float32 ``[H_q]``/``[B, H_q]``,
            ``window_right < -1``, ``cache_leftpad`` not int32 ``[B]``, ``sink_tokens < 0``, ``rope_theta``/
            ``rope_scale`` not > 0 or an odd ``head_dim`` with RoPE; a custom mask not 1-D bool (packed: 1-D
            uint8), both forms, ``window_right`` beside one, or one longer than ``max_seqlen_q * T_q`` elements
            (docs/tree-mask.md). Raised by the fake rule too (trace time under ``torch.compile`` and
            ``torch.export``).
        RuntimeError: value contracts (docs/semantics.md §7), checked per the value-check mode (default
            ``"eager"``: eager calls, one host sync; ``"async"``: ``torch._assert_async``, also compiled): a
            sequence's ``q_len > max_seqlen_q``; ``seq_lens[b]`` outside ``[0, max_blocks * block_size]`` (the
            capacity of ``block_table``); a block id outside ``[0, P)`` in the first ``ceil(seq_len / block_size)``
            entries of a ``block_table`` row (the message names ``block_table[b, j]``, the id and ``P``);
            ``cu_seqlens_q`` not non-decreasing from 0 or ending past ``T_q``; a ``cache_leftpad[b]`` outside
            ``[0, seq_lens[b]]``; a NaN or infinite ALiBi slope (``alibi_slopes[h]``); a custom mask whose
            length is not ``sum_b q_len_b ** 2`` (packed: ``sum_b ceil(q_len_b ** 2 / 8)``). With
            a window (or ``cache_leftpad``) only the block ids of rows some query can see are checked
            (docs/attention_features.md). ``cu_seqlens_q[-1] < T_q`` is allowed: rows ``[cu_seqlens_q[-1], T_q)`` belong to no sequence and are 0 (LSE ``-inf``), as the padded
            rows of a CUDA-graph batch. On CPU with the native kernel, eager checks are one native pass over the
            index tensors (a few us); only a failing call computes the message. The native kernel itself checks
            the contracts that address memory (all but ``max_seqlen_q``) before any work and raises the same
            messages in every mode (also ``"off"``, and inside compiled graphs): it never reads out of bounds.

    Kernels: CPU: native C++ (``kvops/native/paged_attention.cpp``: vectorized online softmax over 16-token chunks,
    all GQA heads of a KV head at once, K/V read once in their stored dtype, ``at::parallel_for`` over (sequence,
    query tile, KV split)); without a C++ compiler, vectorized torch with an online softmax over tiles of blocks
    (memory bounded by the tile). CUDA:
    Triton split-KV decode (``max_seqlen_q == 1``) + merge, otherwise a prefill kernel over KV tiles.
    """
    if type(max_seqlen_q) is not int or not -_INT62 < max_seqlen_q < _INT62:  # (the common case skips the lookup)
        bad = int64_error("kvops.paged_attention", {"max_seqlen_q": max_seqlen_q})
        if bad is not None:  # (torch's schema error gives no fix)
            raise bad
    if ((scale is not None and type(scale) is not float) or type(softcap) is not float
            or (rope_theta is not None and type(rope_theta) is not float) or type(rope_scale) is not float):
        scale, softcap, rope_theta, rope_scale = (python_float(OP, name, x) for name, x in (  # NumPy scalars: floats
            ("scale", scale), ("softcap", softcap), ("rope_theta", rope_theta), ("rope_scale", rope_scale)))
    # windows / sink counts beyond every int32 position are "none" (docs/attention_features.md)
    if (alibi_slopes is None and window_right == -1 and cache_leftpad is None and sink_tokens == 0
            and rope_theta is None and rope_scale == 1.0 and custom_mask is None and packed_custom_mask is None):
        features = NO_FEATURES  # no record built per call; resolve's rule without features:
        if window_left >= UNBOUNDED:
            window_left = -1
    else:
        window_left, features = resolve(
            window_left, AttnFeatures(alibi_slopes, window_right, cache_leftpad, sink_tokens, rope_theta, rope_scale,
                                      custom_mask, packed_custom_mask))
    k_scale, v_scale = kv_scale_tensors(OP, k_scale, v_scale)
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left,
            softcap, sinks, k_scale, v_scale, kv_layout)
    key = _direct((q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, sinks, k_scale, v_scale, alibi_slopes,
                   cache_leftpad, custom_mask, packed_custom_mask))  # (in check_paged_attention's tensor_key order)
    if key:
        return _eager_native(args, features, None if key is True else key, return_lse)
    if ((window_left < -1 or features.window_right < -1 or features.sink_tokens < 0)
            and not torch.compiler.is_compiling()):
        check_paged_attention(*args, features)  # the validator's error, before the value pass (traced: the op's)
    try:  # value contracts, docs/semantics.md §7
        _check_values(args, features)
    except RuntimeError:  # a metadata error (e.g. an HND cache read as NHD) explains the bad values: it goes first
        check_paged_attention(*args, features)
        raise
    if features.used():
        out, lse = torch.ops.kvops.paged_attention(*args, *features)
    else:  # the schema's defaults: graphs of calls without features keep their call of before the features
        out, lse = torch.ops.kvops.paged_attention(*args)
    return (out, lse) if return_lse else out


_INT62 = 2**62  # |max_seqlen_q| below this fits in int64 without int64_error's look


def _check_values(args, features, validated: bool = False) -> None:
    """The value contracts of a call (docs/semantics.md §7), in the current mode: the batch metadata's, then the ALiBi
    slopes', then the custom mask's (``validated``: see ``values.check_paged_attention``)."""
    q, k_cache, _, cu_seqlens_q, seq_lens, block_table, max_seqlen_q = args[:7]
    values.check_paged_attention(q, k_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, args[14],
                                 window_left=args[9], sink_tokens=features.sink_tokens,
                                 cache_leftpad=features.cache_leftpad, validated=validated)
    if features.alibi_slopes is not None:
        values.check_alibi_slopes(features.alibi_slopes)
    if features.mask() is not None:
        values.check_custom_mask(features.custom_mask, features.packed_custom_mask, cu_seqlens_q)


def _eager_native(args, features, tensor_key=None, return_lse=True):
    """An eager CPU call on the native kernel (``_direct``): the validator first (remembering what passed:
    ``memo``; ``tensor_key``: the memo key of the tensor arguments, which ``_direct`` returned), so a metadata error
    explains bad values as on the dispatched path; then the value contracts; then ``kvops::_paged_attention_native``
    itself. Returns ``(out, lse)``, or ``out`` without ``return_lse``.

    In the ``"eager"`` mode the native kernel's own check (the contracts it addresses memory with: ``cu_seqlens_q``,
    ``seq_lens``, the block ids read, whatever the mode; the same messages, word for word) stands in for the separate
    value pass when it covers every contract of the call (``values.native_checks_all``) and there are no ALiBi
    slopes or custom mask (checked before the kernel, in this order): one dispatcher call fewer. Without features the
    kernel itself is called without the dispatcher too (``native.eager_entry``, ``kvops/native/eager_entry.cpp``:
    the same kernel, checks and messages; no LSE tensor without ``return_lse``): a few us less per call."""
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left, softcap, \
        sinks, k_scale, v_scale, kv_layout = args
    sm_scale, window_left, features = check_paged_attention(*args, features, memo=True, tensor_key=tensor_key)
    mode = values.get_value_checks()
    if mode != "off" and (mode != "eager" or features.alibi_slopes is not None or features.mask() is not None
                          or not values.native_checks_all(q, cu_seqlens_q, max_seqlen_q, features.cache_leftpad)):
        _check_values(args, features, validated=True)
    if kv_layout == "HND":
        k_cache, v_cache = as_nhd(k_cache, v_cache, kv_layout)  # views: the kernel takes strides
    if features is NO_FEATURES and native.eager_entry is not None:  # the kernel without the dispatcher
        return native.eager_entry(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, sm_scale,
                                  causal, window_left, softcap, sinks, k_scale, v_scale, return_lse)
    out, lse = _NATIVE(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, sm_scale, causal,
                       window_left, softcap, sinks, k_scale, v_scale, *features)
    return (out, lse) if return_lse else out


_NATIVE = torch.ops.kvops._paged_attention_native.default
_NATIVE = getattr(_NATIVE, "_op", _NATIVE)  # (the C++ callable the overload's __call__ forwards to: one frame less)
