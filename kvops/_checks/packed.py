"""Layouts of the packed K/V formats and the one validator per op (shared by the kernels and the fake rules).

A packed tensor stands for dense K or V ``[B, T, H, D]`` (tokens-major, as the caches). Every format stores
``codes`` and ``scales``; some add ``zeros``, ``centroids`` and ``cluster_ids`` (see :func:`packed_layout`). The
validators read metadata only (shapes, dtypes, devices), so the same errors fire in eager mode, under
``torch.compile(fullgraph=True)`` and under ``torch.export``, at trace time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import require_finite

FORMATS = ("int8", "fp8", "int4", "int2")
GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KMEANS_ITERS = 1000  # quantize_kv's kmeans_iters bound
SCALE_DTYPE = torch.float16  # int8 / int4 / int2 scales (fp8: one fp32 scale per (batch, head))
ZERO_DTYPE = torch.int8  # int4 / int2 zero points, in eighths of the group's scale
_FIELDS = ("codes", "scales", "zeros", "centroids", "cluster_ids")


class Spec(NamedTuple):
    """Expected ``shape`` and ``dtype`` of one stored tensor."""

    shape: tuple
    dtype: torch.dtype


def packed_layout(
    quant: str,
    batch: int,
    tokens: int,
    heads: int,
    head_dim: int,
    *,
    group_size: int = 64,
    stages: int = 1,
    num_clusters: int = 16,
) -> dict[str, Spec | None]:
    """The tensors a ``quant``-packed ``[B, T, H, D]`` K or V consists of (``None``: not stored by this format).

    - ``"int8"``: symmetric per (token, head). ``codes [B, T, H, D]`` int8 in ``[-127, 127]``, ``scales [B, T, H]``
      fp16 (``amax / 127``); ``x ≈ codes · scale``. ``D + 2`` bytes per (token, head) (D=128: 0.508 × bf16).
    - ``"fp8"``: e4m3 with per-head scales. ``codes [B, T, H, D]`` float8_e4m3fn, ``scales [B, H]`` fp32 (``amax``
      over the call's tokens and ``D`` divided by 448); ``x ≈ codes · scale``. ``D + 4 / T`` bytes (0.500 × bf16).
    - ``"int4"``: asymmetric, groups of ``group_size`` along ``D``. ``codes [B, T, H, D/2]`` uint8 (element ``2j`` in
      the low nibble, ``2j+1`` in the high one), ``scales [B, T, H, D/group_size]`` fp16 and ``zeros`` (same shape)
      int8 zero points in eighths of a step (an 8-bit integer zero point, as GPTQ/AWQ store it, with 3 fractional
      bits); ``x ≈ (code - zero / 8) · scale``. Bytes per (token, head):
      ``D/2 + 3·D/group_size`` (D=128: 76 / 70 / 67 for groups 32 / 64 / 128, i.e. 0.297 / 0.273 / 0.262 × bf16).
    - ``"int2"``: Quant VideoGen's progressive residual quantization. Per (batch, head) a k-means over the tokens
      gives ``centroids [B, H, C, D]`` fp16 and ``cluster_ids [B, T, H]`` uint8; the residual ``x - centroid`` is
      quantized in ``stages`` 2-bit asymmetric stages, each of the previous stage's residual, with groups of
      ``group_size`` along ``D``: ``codes [B, T, H, stages, D/4]`` uint8 (element ``4j+i`` in bits ``2i..2i+1``),
      ``scales [B, T, H, stages, D/group_size]`` fp16 and ``zeros`` (same shape) int8 zero points in eighths of a
      step; ``x ≈ centroid + Σ_s (code_s - zero_s / 8) · scale_s``. Bytes per (token, head):
      ``stages · (D/4 + 3·D/group_size) + 1`` (cluster id) ``+ 2·C·D / T`` (centroids, amortized over the ``T``
      tokens of the call). At QVG's chunk (T = 3 × 1560), C = 16, D = 128, group 64: 1 stage = 38 + 1 + 0.88 =
      39.9 B = 0.156 × bf16 (the default, <= 0.18 ×); every further stage adds 38 B (0.148 ×), so 2 stages = 0.304 ×
      (4 bits per value cannot be <= 0.25 ×).
    """
    b, t, h, d, g = batch, tokens, heads, head_dim, group_size
    out: dict[str, Spec | None] = dict.fromkeys(_FIELDS)
    if quant == "int8":
        out.update(codes=Spec((b, t, h, d), torch.int8), scales=Spec((b, t, h), SCALE_DTYPE))
    elif quant == "fp8":
        out.update(codes=Spec((b, t, h, d), torch.float8_e4m3fn), scales=Spec((b, h), torch.float32))
    elif quant == "int4":
        out.update(codes=Spec((b, t, h, d // 2), torch.uint8), scales=Spec((b, t, h, d // g), SCALE_DTYPE),
                   zeros=Spec((b, t, h, d // g), ZERO_DTYPE))
    elif quant == "int2":
        out.update(
            codes=Spec((b, t, h, stages, d // 4), torch.uint8), scales=Spec((b, t, h, stages, d // g), SCALE_DTYPE),
            zeros=Spec((b, t, h, stages, d // g), ZERO_DTYPE),
            centroids=Spec((b, h, num_clusters, d), SCALE_DTYPE), cluster_ids=Spec((b, t, h), torch.uint8),
        )
    else:
        raise ValueError(f"quant must be one of {FORMATS}, got {quant!r}.")
    return out


def check_format(op: str, quant: str, head_dim: int, group_size: int, stages: int = 1, num_clusters: int = 16) -> None:
    """Format parameters: ``quant`` known, ``group_size`` in (32, 64, 128) or ``head_dim`` and dividing it, ..."""
    if quant not in FORMATS:
        raise ValueError(f"{op}: quant must be one of {FORMATS}, got {quant!r}.")
    if quant in ("int4", "int2"):
        per_byte = 2 if quant == "int4" else 4
        if head_dim % per_byte != 0:
            raise ValueError(
                f"{op}: quant={quant!r} packs {per_byte} values per byte, so head_dim must be a multiple of "
                f"{per_byte}; got head_dim {head_dim}."
            )
        if not (group_size in GROUP_SIZES or group_size == head_dim) or head_dim % group_size != 0:
            raise ValueError(
                f"{op}: group_size must be one of {GROUP_SIZES} (or head_dim) and divide head_dim {head_dim}; got "
                f"group_size {group_size}. Use group_size={head_dim} for one group per head."
            )
    if quant == "int2":
        if stages < 1:
            raise ValueError(f"{op}: stages must be >= 1 for quant='int2', got {stages}.")
        if not 1 <= num_clusters <= 256:
            raise ValueError(f"{op}: num_clusters must be in [1, 256] (cluster ids are uint8), got {num_clusters}.")


def _check_tensors(op: str, quant: str, tensors: dict, layout: dict, device, context: str) -> None:
    for name in _FIELDS:
        t, spec = tensors[name], layout[name]
        if spec is None:
            if t is not None:
                raise ValueError(f"{op}: quant={quant!r} stores no {name}; pass {name}=None.")
            continue
        if t is None:
            raise ValueError(f"{op}: quant={quant!r} needs {name} ({spec.dtype}, shape {spec.shape}); got None.")
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ValueError(
                f"{op}: {name} must be {spec.dtype} of shape {spec.shape} for quant={quant!r} ({context}); got "
                f"{t.dtype} of shape {tuple(t.shape)}. Allocate it from kvops.packed.packed_layout(...)."
            )
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but the data is on {device}. Move both to one device.")


def _grouping(op: str, quant: str, head_dim: int, scales: torch.Tensor | None) -> tuple[int, int]:
    """(group_size, stages) read from the scales' shape for int4/int2 (defaults otherwise)."""
    if quant not in ("int4", "int2") or scales is None:
        return 64, 1
    want = 4 if quant == "int4" else 5
    if scales.dim() != want:
        raise ValueError(
            f"{op}: scales must be {want}-D for quant={quant!r} (see kvops.packed.packed_layout); got shape "
            f"{tuple(scales.shape)}."
        )
    groups = scales.shape[-1]
    if groups < 1 or head_dim % groups != 0:
        raise ValueError(
            f"{op}: scales' last dim ({groups} groups) must divide head_dim {head_dim} for quant={quant!r}."
        )
    return head_dim // groups, scales.shape[3] if quant == "int2" else 1


def check_quantize_kv(x, codes, scales, zeros, centroids, cluster_ids, quant: str, kmeans_iters: int) -> None:
    """Contract of ``kvops::quantize_kv``: ``x [B, T, H, D]`` float; the outputs match :func:`packed_layout`."""
    op = "kvops.quantize_kv"
    if quant not in FORMATS:
        raise ValueError(f"{op}: quant must be one of {FORMATS}, got {quant!r}.")
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [B, T, H, D] (NHD tokens), got shape {tuple(x.shape)}.")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x must be one of {FLOAT_DTYPES}, got {x.dtype}.")
    if kmeans_iters < 0:
        raise ValueError(f"{op}: kmeans_iters must be >= 0, got {kmeans_iters}.")
    if kmeans_iters > MAX_KMEANS_ITERS:  # (2**40 steps ran for hours: a hang)
        raise ValueError(f"{op}: kmeans_iters must be <= {MAX_KMEANS_ITERS} (Lloyd's k-means settles in tens of "
                         f"steps; the default is 4), got {kmeans_iters}.")
    b, t, h, d = x.shape
    if d == 0:
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} has head_dim D = 0; quantization needs D >= 1.")
    group, stages = _grouping(op, quant, d, scales)
    clusters = centroids.shape[2] if quant == "int2" and centroids is not None and centroids.dim() == 4 else 16
    check_format(op, quant, d, group, stages, clusters)
    layout = packed_layout(quant, b, t, h, d, group_size=group, stages=stages, num_clusters=clusters)
    tensors = dict(codes=codes, scales=scales, zeros=zeros, centroids=centroids, cluster_ids=cluster_ids)
    _check_tensors(op, quant, tensors, layout, x.device, f"x of shape {tuple(x.shape)}, group_size {group}")
    for name, out in tensors.items():
        if out is not None and any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
            raise ValueError(f"{op}: {name} has a stride-0 dim (an expanded view) and cannot be written in place.")


def check_dequantize_kv(codes, scales, zeros, centroids, cluster_ids, quant: str, dtype: torch.dtype):
    """Contract of ``kvops::dequantize_kv``; returns ``(B, T, H, D)`` of the dense output."""
    op = "kvops.dequantize_kv"
    if quant not in FORMATS:
        raise ValueError(f"{op}: quant must be one of {FORMATS}, got {quant!r}.")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype must be one of {FLOAT_DTYPES}, got {dtype}.")
    want = 5 if quant == "int2" else 4
    if codes.dim() != want:
        raise ValueError(
            f"{op}: codes must be {want}-D for quant={quant!r} (see kvops.packed.packed_layout); got shape "
            f"{tuple(codes.shape)}."
        )
    tensors = dict(codes=codes, scales=scales, zeros=zeros, centroids=centroids, cluster_ids=cluster_ids)
    return _check_packed(op, tensors, quant)


def _check_packed(op: str, tensors: dict, quant: str) -> tuple[int, int, int, int]:
    """One packed tensor's stored tensors (``codes`` of the format's rank) against its layout: ``(B, T, H, D)``."""
    codes, scales, centroids = tensors["codes"], tensors["scales"], tensors["centroids"]
    b, t, h = codes.shape[:3]
    d = codes.shape[-1] * {"int8": 1, "fp8": 1, "int4": 2, "int2": 4}[quant]
    group, stages = _grouping(op, quant, d, scales)
    clusters = centroids.shape[2] if quant == "int2" and centroids is not None and centroids.dim() == 4 else 16
    check_format(op, quant, d, group, stages, clusters)
    layout = packed_layout(quant, b, t, h, d, group_size=group, stages=stages, num_clusters=clusters)
    _check_tensors(op, quant, tensors, layout, codes.device, f"codes of shape {tuple(codes.shape)}, group_size {group}")
    return b, t, h, d


SEGMENT_FIELDS = {"int8": 2, "fp8": 2, "int4": 3, "int2": 5}  # stored tensors per packed segment, in _FIELDS order


def split_segments(quant: str, flat) -> list[dict]:
    """A flat list of packed segments' tensors (``kvops::packed_attention``'s ``k_packed``) -> one dict per segment
    (``_FIELDS`` -> tensor or None)."""
    n = SEGMENT_FIELDS[quant]
    return [dict(zip(_FIELDS, list(flat[i : i + n]) + [None] * (5 - n))) for i in range(0, len(flat), n)]


def check_packed_attention(q, k_dense, v_dense, k_packed, v_packed, quant, scale, row_counts=None) -> tuple[float, int]:
    """Contract of ``kvops::packed_attention``; returns ``(scale, D_v)`` (scale defaults to ``D ** -0.5``).
    ``row_counts``: None or int32 ``[total rows]`` (dense segments' rows, then packed ones') on ``q``'s device."""
    op = "kvops.packed_attention"
    if q.dim() != 4 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: q must be 4-D [B, T, H_q, D] of {FLOAT_DTYPES}; got {q.dtype} of shape {tuple(q.shape)}."
        )
    if len(k_dense) != len(v_dense) or len(k_packed) != len(v_packed):
        raise ValueError(
            f"{op}: K and V need the same segments; got {len(k_dense)} dense K and {len(v_dense)} dense V segments, "
            f"{len(k_packed)} packed K and {len(v_packed)} packed V tensors."
        )
    if quant is None and k_packed:
        raise ValueError(f"{op}: packed segments given without their format; pass quant (one of {FORMATS}).")
    if quant is not None and quant not in FORMATS:
        raise ValueError(f"{op}: quant must be one of {FORMATS} (or None), got {quant!r}.")
    if quant is not None and len(k_packed) % SEGMENT_FIELDS[quant]:
        raise ValueError(
            f"{op}: quant={quant!r} stores {SEGMENT_FIELDS[quant]} tensors per segment (see "
            f"kvops.packed.packed_layout), so k_packed/v_packed need a multiple of {SEGMENT_FIELDS[quant]}; got "
            f"{len(k_packed)}."
        )
    if not k_dense and not k_packed:
        raise ValueError(f"{op}: need at least one K/V segment (dense or packed), got none.")
    b, _, hq, d = q.shape
    shapes = []  # (what, batch, tokens, heads, head_dim, device) of every segment
    for kind, segs in (("K", k_dense), ("V", v_dense)):
        for i, x in enumerate(segs):
            if x.dim() != 4 or x.dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{op}: dense {kind} segment {i} must be 4-D [B, n, H_kv, D] of {FLOAT_DTYPES}; got {x.dtype} "
                    f"of shape {tuple(x.shape)}."
                )
            shapes.append((f"dense {kind} segment {i}", *x.shape, x.device))
    for kind, flat in (("K", k_packed), ("V", v_packed)):
        for i, seg in enumerate(split_segments(quant, flat) if quant else []):
            where = f"{op} (packed {kind} segment {i})"
            if seg["codes"].dim() != (5 if quant == "int2" else 4):
                raise ValueError(f"{where}: codes must be {5 if quant == 'int2' else 4}-D for quant={quant!r}; got "
                                 f"shape {tuple(seg['codes'].shape)}.")
            shapes.append((f"packed {kind} segment {i}", *_check_packed(where, seg, quant), seg["codes"].device))
    hkv = shapes[0][3]
    d_v = next(s[4] for s in shapes if s[0].split()[1] == "V")
    for what, size in (("num_kv_heads", hkv), ("head_dim", d), ("value head_dim", d_v)):
        if size == 0:
            raise ValueError(
                f"{op}: {what} is 0 (q of shape {tuple(q.shape)}, {shapes[0][0]} of {shapes[0][3]} KV heads); "
                f"attention needs {what} >= 1. Pass segments with at least one KV head and q/K/V with head_dim >= 1."
            )
    if hq % hkv != 0:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (GQA).")
    for what, sb, _, sh, sd, dev in shapes:
        want_d = d if what.split()[1] == "K" else d_v
        if (sb, sh, sd) != (b, hkv, want_d):
            raise ValueError(
                f"{op}: {what} has batch {sb}, {sh} KV heads and head_dim {sd}; expected batch {b} (q), "
                f"num_kv_heads {hkv} and head_dim {want_d} ({'q' if what.split()[1] == 'K' else 'the first V'})."
            )
        if dev != q.device:
            raise ValueError(f"{op}: {what} is on {dev} but q is on {q.device}. Move them to one device.")
    for kind in ("dense", "packed"):
        ks = [s for s in shapes if s[0].startswith(kind + " K")]
        vs = [s for s in shapes if s[0].startswith(kind + " V")]
        for sk, sv in zip(ks, vs):
            if sk[2] != sv[2]:
                raise ValueError(f"{op}: {sk[0]} has {sk[2]} tokens but {sv[0]} has {sv[2]}; K and V must match.")
    if row_counts is not None:
        total = sum(s[2] for s in shapes if s[0].split()[1] == "K")
        if row_counts.dim() != 1 or row_counts.dtype != torch.int32 or row_counts.shape[0] != total:
            raise ValueError(
                f"{op}: row_counts must be int32 of shape ({total},) (one count per K row, dense segments first, "
                f"then packed ones); got {row_counts.dtype} of shape {tuple(row_counts.shape)}. Pass view.k of "
                f"PackedCausalKVCache.update, or None to attend every row."
            )
        if row_counts.device != q.device:
            raise ValueError(
                f"{op}: row_counts is on {row_counts.device} but q is on {q.device}. Move them to one device."
            )
    require_finite(op, "scale", scale, "the score scale on q·k; None: head_dim ** -0.5",
                   "Pass a finite scale, or None for the default.")
    return (d**-0.5 if scale is None else scale), d_v


def check_row_count_values(row_counts) -> None:
    """Values of ``packed_attention``'s ``row_counts`` (kvops/_checks/values.py modes): every count ``>= 0``."""
    from . import values

    if row_counts is None or row_counts.numel() == 0:
        return
    mode = values._active(row_counts)
    msg = "kvops.packed_attention: row_counts must be >= 0 (0 skips a row, 1 attends it)"
    if mode == "async":
        values._assert(row_counts.min() >= 0, msg)
    elif mode == "eager" and int(row_counts.min()) < 0:
        raise RuntimeError(f"{msg}; got {int(row_counts.min())} at row {int(row_counts.argmin())}.")
