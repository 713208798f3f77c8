"""``kvops::packed_attention``: attention over a packed visible window that reads the packed bytes directly.

:meth:`PackedCausalKVCache.update` returns the window as the cache's storage (dense views of the ring and sink rows,
packed pool slots: a fixed list) and ``row_counts``, the visible rows' mask. The op takes them all at once, skips the
rows with count 0 (a tile with none visible is not read) and runs ONE online softmax over the rest, dequantizing each
packed tile (16 tokens of codes, scales, integer zero points, centroids, cluster ids) into fp32 registers inside its tile
loop -- so the bytes read per call shrink with the format and no dense copy of any segment is made (the online
softmax across segments is the LSE merge of FlashAttention's KV splits, done incrementally).

Schema: ``kvops/_library.py``. Validator (shared by the kernels and the fake rule): ``check_packed_attention`` in
``kvops/_checks/packed.py``. Kernels:

* CPU: native C++ (``kvops/native/packed_attention.cpp``, built on first use with the paged-attention kernel; where it
  cannot be built -- one warning -- or ``KVOPS_NATIVE=0``, the composite ``kvops.cpu.packed.packed_attention``:
  one segment dequantized at a time, torch's flash SDPA, LSE merge);
* CUDA: Triton (``kvops/triton/packed_attention.py``; one launch per segment carrying the softmax state).

Under ``torch.compile`` the op is an extern call (its fake rule gives the shapes), so a compiled step never
materializes the window either.
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .. import native
from ..triton import HAS_TRITON
from .._checks.forms import python_float
from .._checks.packed import check_packed_attention, check_row_count_values
from ..cpu import packed as reference
from .packed import PackedKV, PackedSegments


def _split(segments: list) -> tuple[list, list]:
    dense = [s for s in segments if not isinstance(s, PackedKV)]
    packed = [t for s in segments if isinstance(s, PackedKV) for t in s.tensors()]
    return dense, packed


def _op_order(segments: list, counts: torch.Tensor) -> torch.Tensor:
    """``row_counts`` over ``segments`` in list order -> the op's order (dense segments, then packed ones)."""
    kinds = [isinstance(s, PackedKV) for s in segments]
    if kinds == sorted(kinds):  # already dense first
        return counts
    pieces, row = ([], []), 0
    for s, packed in zip(segments, kinds):
        n = s.codes.shape[1] if packed else s.shape[1]
        pieces[packed].append(counts.narrow(0, row, n))
        row += n
    return torch.cat(pieces[0] + pieces[1])


def packed_attention(
    q: torch.Tensor, k_segments, v_segments, *, row_counts: torch.Tensor | None = None, scale: float | None = None,
    return_lse: bool = False,
):
    """Softmax attention of ``q`` to the rows of the segments (no causal mask: a chunk sees its whole visible window).

    Args:
        q: ``[B, T, H_q, D]`` (fp32/bf16/fp16, any strides); ``H_q`` a multiple of the segments' ``H_kv`` (GQA:
            query head ``h`` reads KV head ``h // (H_q / H_kv)``; K/V are never repeated).
        k_segments, v_segments: the window: ``view.k``, ``view.v`` of ``PackedCausalKVCache.update`` (a
            :class:`kvops.packed.PackedSegments`: the storage and its ``row_counts``), or lists of dense
            ``[B, n, H_kv, D]`` tensors (fp32/bf16/fp16, any strides) and :class:`PackedKV` of ``n`` rows, all packed
            ones of one format; K and V segment ``i`` have the same ``n``. The result does not depend on their
            order (softmax over the union of the rows).
        row_counts: int32 ``[sum n_i]`` (segments concatenated in list order), how many times each row is attended
            (0: skipped); default all 1, or the ``PackedSegments``' own.
        scale: score scale (default ``D ** -0.5``).
        return_lse: also return the LSE ``[B, H_q, T]`` (fp32, natural log).

    Returns:
        ``out [B, T, H_q, D_v]`` in ``q.dtype`` (and the LSE): softmax attention over the concatenated dequantized
        window (row ``j`` weighted by ``row_counts[j]``), computed in fp32 (``kvops::packed_attention``). A window
        with no rows gives zeros (LSE ``-inf``).

    Raises:
        ValueError: no segments, different K and V segments, mixed packed formats, ``H_q`` not a multiple of
            ``H_kv``, a segment whose batch / heads / head_dim / tokens / device / layout does not match (messages
            name the segment), ``row_counts`` not int32 ``[total rows]`` on ``q``'s device, or (eager) negative.
            Raised at trace time too (the values check: eager only). ``H_kv`` or a ``head_dim`` of 0.
        RuntimeError: an int2 cluster id outside ``[0, C)``; ``backward()`` through the output (no autograd
            formula: inference only).
    """
    if isinstance(k_segments, PackedSegments):
        row_counts = k_segments.row_counts if row_counts is None else row_counts
        k_segments = k_segments.segments
    if isinstance(v_segments, PackedSegments):
        v_segments = v_segments.segments
    formats = {s.quant for s in (*k_segments, *v_segments) if isinstance(s, PackedKV)}
    if len(formats) > 1:
        raise ValueError(f"kvops.packed_attention: all packed segments must have one format, got {sorted(formats)}.")
    if len(k_segments) != len(v_segments):
        raise ValueError(
            f"kvops.packed_attention: need the same number of K and V segments, got {len(k_segments)} and "
            f"{len(v_segments)}."
        )
    if row_counts is not None and row_counts.dim() == 1 and len(k_segments) > 1:
        rows = sum(s.codes.shape[1] if isinstance(s, PackedKV) else s.shape[1] for s in k_segments)
        if row_counts.shape[0] == rows:  # (else the op's validator names the mismatch)
            row_counts = _op_order(list(k_segments), row_counts)
    (k_dense, k_packed), (v_dense, v_packed) = _split(k_segments), _split(v_segments)
    scale = python_float("kvops.packed_attention", "scale", scale)  # a NumPy scalar: a float
    out, lse = torch.ops.kvops.packed_attention(
        q, k_dense, v_dense, k_packed, v_packed, formats.pop() if formats else None, scale, row_counts
    )
    return (out, lse) if return_lse else out


NATIVE_OP = "kvops::_packed_attention_native"  # schema: kvops/_library.py; kernel: native/packed_attention.cpp


# --- fake rule and kernels ----------------------------------------------------------------------------------------
@torch.library.register_fake("kvops::packed_attention")
def _fake(q, k_dense, v_dense, k_packed, v_packed, quant=None, scale=None, row_counts=None):
    _, d_v = check_packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale, row_counts)
    b, t, hq, _ = q.shape
    return q.new_empty(b, t, hq, d_v), q.new_empty(b, hq, t, dtype=torch.float32)


@torch.library.impl("kvops::packed_attention", "CPU")
def _cpu(q, k_dense, v_dense, k_packed, v_packed, quant=None, scale=None, row_counts=None):
    sm_scale, _ = check_packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale, row_counts)
    check_row_count_values(row_counts)
    if native.available() and torch._C._dispatch_has_kernel_for_dispatch_key(NATIVE_OP, "CPU"):
        return torch.ops.kvops._packed_attention_native(
            q, k_dense, v_dense, k_packed, v_packed, quant or "", sm_scale,
            None if row_counts is None else row_counts.contiguous())
    return reference.packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, sm_scale, row_counts)


def _no_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "Trying to backward through kvops.packed_attention, which has no autograd formula: attention over a packed "
        "(quantized) window is inference-only. Run it under torch.no_grad(), or attend dense K/V with "
        "torch.nn.functional.scaled_dot_product_attention to train."
    )


# as kvops::paged_attention: the output requires grad when q does, and backward raises (never a silent q.grad=None)
torch.library.register_autograd("kvops::packed_attention", _no_backward)


@torch.library.impl("kvops::packed_attention", "CUDA")
def _cuda(q, k_dense, v_dense, k_packed, v_packed, quant=None, scale=None, row_counts=None):
    sm_scale, _ = check_packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale, row_counts)
    check_row_count_values(row_counts)
    if not HAS_TRITON:  # pragma: no cover - CUDA builds without triton
        return reference.packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, sm_scale, row_counts)
    from ..triton import packed_attention as triton_attention

    return triton_attention.packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, sm_scale, row_counts)
