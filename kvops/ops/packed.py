"""``kvops::quantize_kv`` / ``kvops::dequantize_kv``: pack dense K or V ``[B, T, H, D]`` into a quantized format.

Schema: ``kvops/_library.py``. Validators and layouts: ``kvops/_checks/packed.py``. CPU kernels:
``kvops/cpu/packed.py``. CUDA: Triton kernels (``kvops/triton/packed_quant.py``) for int8/fp8/int4 and the
int2 dequantize; the int2 k-means runs as torch ops on CUDA. Attention over packed segments (reads the packed bytes
directly): ``kvops/ops/packed_attention.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from ..triton import HAS_TRITON
from .._checks.common import ADDRESSABLE
from ..cpu import packed as reference
from .._checks.packed import check_dequantize_kv, check_format, check_quantize_kv, packed_layout


class PackedKV(NamedTuple):
    """One packed K or V: the stored tensors of format ``quant`` (``None`` where the format stores nothing).

    Token-indexed tensors (``codes``, ``scales`` except fp8's, ``zeros``, ``cluster_ids``) have the tokens in dim 1 and
    the heads in dim 2; fp8 ``scales [B, H]`` and int2 ``centroids [B, H, C, D]`` are per (batch, head).
    """

    quant: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    centroids: torch.Tensor | None = None
    cluster_ids: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self[1:] if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor (codes, scales, zero points, centroids, cluster ids)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, start: int, length: int) -> PackedKV:
        """Tokens ``[start, start + length)`` (views; per-(batch, head) tensors are shared)."""
        per_head = self.quant == "fp8"
        return PackedKV(
            self.quant,
            self.codes.narrow(1, start, length),
            self.scales if per_head else self.scales.narrow(1, start, length),
            None if self.zeros is None else self.zeros.narrow(1, start, length),
            self.centroids,
            None if self.cluster_ids is None else self.cluster_ids.narrow(1, start, length),
        )

    def heads(self, h0: int, h1: int) -> PackedKV:
        """Heads ``[h0, h1)`` (views)."""
        per_head = self.quant == "fp8"
        return PackedKV(
            self.quant,
            self.codes[:, :, h0:h1],
            self.scales[:, h0:h1] if per_head else self.scales[:, :, h0:h1],
            None if self.zeros is None else self.zeros[:, :, h0:h1],
            None if self.centroids is None else self.centroids[:, h0:h1],
            None if self.cluster_ids is None else self.cluster_ids[:, :, h0:h1],
        )


class PackedSegments(NamedTuple):
    """The visible window of K or V as the cache's whole storage and a row mask (:meth:`PackedCausalKVCache.update`).

    ``segments``: every storage slot in a fixed order (the same list on every call of one cache), each a dense view
    ``[B, n_i, H_in, D]`` or a :class:`PackedKV` of ``n_i`` rows. ``row_counts``: int32 ``[sum n_i]``, how many
    times each stored row (segments concatenated in list order) is in the window, 0 for rows not visible. Pass it to
    :func:`kvops.packed.packed_attention` as is (``packed_attention(q, view.k, view.v)``).
    """

    segments: list
    row_counts: torch.Tensor


def default_group_size(head_dim: int) -> int:
    """64 when it divides ``head_dim``, else 32, else ``head_dim`` (one group per head, e.g. head_dim 80)."""
    return next((g for g in (64, 32) if head_dim % g == 0), head_dim)


def empty_packed(
    quant: str, batch: int, tokens: int, heads: int, head_dim: int, *, group_size: int | None = None, stages: int = 1,
    num_clusters: int = 16, device=None, leading: tuple[int, ...] = (),
) -> PackedKV:
    """Uninitialized storage for a packed ``[B, T, H, D]`` (with extra ``leading`` dims, e.g. a pool's slots)."""
    group_size = default_group_size(head_dim) if group_size is None else group_size
    check_format("kvops.packed", quant, head_dim, group_size, stages, num_clusters)
    layout = packed_layout(
        quant, batch, tokens, heads, head_dim, group_size=group_size, stages=stages, num_clusters=num_clusters
    )
    nbytes = sum(math.prod(leading + spec.shape) * spec.dtype.itemsize for spec in layout.values() if spec)
    if nbytes > ADDRESSABLE:  # (stages=2**40 failed in the allocator, naming nothing)
        raise ValueError(
            f"kvops.packed: quant={quant!r}, batch={batch}, tokens={tokens}, heads={heads}, head_dim={head_dim}, "
            f"group_size={group_size}, stages={stages}, num_clusters={num_clusters} need {nbytes} bytes of packed "
            f"storage, more than a process can address ({ADDRESSABLE} bytes). Pass smaller sizes (fewer stages or "
            f"tokens).")
    alloc = {
        k: None if spec is None else torch.empty(leading + spec.shape, dtype=spec.dtype, device=device)
        for k, spec in layout.items()
    }
    return PackedKV(quant, **alloc)


def quantize_kv(
    x: torch.Tensor,
    quant: str,
    *,
    group_size: int | None = None,
    stages: int = 1,
    num_clusters: int = 16,
    kmeans_iters: int = 4,
    out: PackedKV | None = None,
) -> PackedKV:
    """Quantize dense K or V ``x [B, T, H, D]`` (fp32/bf16/fp16) into ``quant`` (layouts: :func:`packed_layout`).

    Args:
        x: the tokens to pack (any strides).
        quant: ``"int8"`` (symmetric per (token, head)), ``"fp8"`` (e4m3, per-head scales over the call's tokens),
            ``"int4"`` (asymmetric groups of ``group_size`` along ``D``, two codes per byte) or ``"int2"`` (Quant
            VideoGen's PRQ: per-head k-means with ``num_clusters`` centroids and ``kmeans_iters`` Lloyd steps from a
            deterministic init, then ``stages`` progressive 2-bit residual stages with groups of ``group_size``).
        group_size: 32, 64 or 128 (or ``D``); must divide ``D`` (int4, int2 only). Default: 64 if it divides
            ``D``, else 32, else ``D``.
        out: write into this storage (e.g. a slot of a cache's pool) instead of allocating.

    Returns:
        :class:`PackedKV` (``out`` when given).

    Raises:
        ValueError: unknown ``quant``, ``x`` not 4-D float, ``D == 0``, a group size not dividing ``D``, ``out``
            tensors with the wrong shape/dtype/device (messages name the expected layout). Raised at trace time too.

    Non-finite ``x`` (docs/semantics.md §2.0): scales come from the finite values only; ``±inf`` is stored as its
    group's largest code of that sign, NaN as 0 (int2: both as 0), so no other value's code changes.

    Semantics: KIVI-style group quantization for int4; Quant VideoGen (arXiv 2602.02958) for int2. Rounding is
    round-half-to-even; scales are stored in fp16 (clamped to its normal range), int4/int2 zero points as int8 in
    eighths of a step (``x ≈ (code - zero / 8) · scale``, GPTQ/AWQ-style integer zero points with 3 fractional bits);
    codes are computed with the stored values so that ``dequantize_kv`` reproduces exactly what was rounded.
    """
    if out is None:
        b, t, h, d = x.shape if x.dim() == 4 else (0, 0, 0, 0)
        if x.dim() != 4:
            raise ValueError(f"kvops.quantize_kv: x must be 4-D [B, T, H, D] (NHD tokens), got shape {tuple(x.shape)}.")
        out = empty_packed(
            quant, b, t, h, d, group_size=group_size, stages=stages, num_clusters=num_clusters, device=x.device
        )
    torch.ops.kvops.quantize_kv(x, *out[1:], quant, kmeans_iters)
    return out


def dequantize_kv(packed: PackedKV, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense ``[B, T, H, D]`` in ``dtype`` from a :class:`PackedKV` (a new tensor; the packed data is not changed).

    Raises:
        ValueError: inconsistent shapes/dtypes of the stored tensors, an unknown format, a non-float ``dtype``.
        RuntimeError: an int2 cluster id outside ``[0, C)`` (``"cluster_ids[b, t, h] = id is not a centroid ..."``).
    """
    return torch.ops.kvops.dequantize_kv(*packed[1:], packed.quant, dtype)


def materialize(segments, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[B, V, H, D]`` of a list of segments (a view when there is one dense segment) or of
    :class:`PackedSegments` (the visible rows, each repeated ``row_counts`` times, in storage order; eager only: the
    row count is data dependent)."""
    items = segments.segments if isinstance(segments, PackedSegments) else segments
    parts = [dequantize_kv(x, dtype) if isinstance(x, PackedKV) else x for x in items]
    dense = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if isinstance(segments, PackedSegments):
        rows = torch.arange(dense.shape[1], device=dense.device).repeat_interleave(segments.row_counts.long())
        dense = dense.index_select(1, rows)
    return dense


# --- fake rules: the contract at trace time ---------------------------------------------------------------------
@torch.library.register_fake("kvops::quantize_kv")
def _quantize_fake(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters=4):
    check_quantize_kv(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters)


@torch.library.register_fake("kvops::dequantize_kv")
def _dequantize_fake(codes, scales, zeros, centroids, cluster_ids, quant, dtype):
    b, t, h, d = check_dequantize_kv(codes, scales, zeros, centroids, cluster_ids, quant, dtype)
    return codes.new_empty((b, t, h, d), dtype=dtype)


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, quantize, dequantize) -> None:
    @torch.library.impl("kvops::quantize_kv", device)
    def _quantize(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters=4):
        check_quantize_kv(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters)
        quantize(x, codes, scales, zeros, centroids, cluster_ids, quant, kmeans_iters)

    @torch.library.impl("kvops::dequantize_kv", device)
    def _dequantize(codes, scales, zeros, centroids, cluster_ids, quant, dtype):
        check_dequantize_kv(codes, scales, zeros, centroids, cluster_ids, quant, dtype)
        return dequantize(codes, scales, zeros, centroids, cluster_ids, quant, dtype)


_register("CPU", reference.quantize, reference.dequantize)
if HAS_TRITON:
    from ..triton import packed_quant as _triton

    _register("CUDA", _triton.quantize, _triton.dequantize)
else:  # pragma: no cover - CUDA builds without triton
    _register("CUDA", reference.quantize, reference.dequantize)
