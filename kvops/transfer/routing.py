"""Routing of prefill→decode KV transfer between different TP sizes (pure Python, no tensors).

Semantics: ``docs/semantics.md`` §6 (the design notes' ``semantics.md`` §6), after sglang's staging buffer
(``sglang/srt/disaggregation/common/staging_buffer.py``: ``compute_head_slice_params``, ``resolve_total_kv_heads``,
``compute_staging_layout``) with its replication bug fixed by construction.

Head placement. With ``H`` total KV heads and TP size ``tp``, rank ``r`` holds ``max(1, H // tp)`` heads:
``[r * (H // tp), (r + 1) * (H // tp))`` when ``tp <= H``, else the single head ``r // (tp // H)`` (GQA replication:
*consecutive* ranks share a head, so ``tp=4, H=2`` places heads 0, 0, 1, 1, never 0, 1, 0, 1). ``H % tp == 0`` or
``tp % H == 0`` is required.

Writers. A decode rank needs its heads ``[ds, ds + dn)``. Prefill ranks holding the same heads form a *replica group*;
for each replica group overlapping ``[ds, ds + dn)`` exactly one member writes the overlap (so a head held by several
prefill ranks is sent once per decode rank that needs it), chosen as member ``j % src_replication`` where ``j`` is the
decode rank's own replica index (``rank % (D_tp // H)`` when decode replicates heads, else 0); this spreads decode
replicas over prefill replicas.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """One writer's part of a decode rank's heads.

    Attributes:
        writer: the prefill TP rank (index in the prefill group) that sends this slice.
        src_head_start: first head of the slice in the *writer's local* cache (``[0, H // P_tp)``).
        num_heads: heads in the slice.
        cache_head_start: first head of the slice in the *decode rank's local* cache (``cache_head_start`` of the
            scatter op).
    """

    writer: int
    src_head_start: int
    num_heads: int
    cache_head_start: int


def _check_ints(where: str, **values) -> None:
    """``TypeError`` naming the argument unless every value is a Python int (not a bool): a float head count or
    token count would flow on as floats (``heads_per_rank(8.0, 2) == 4.0``)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__} {v!r}.")


def _check_split(total_kv_heads: int, tp_size: int, side: str) -> None:
    _check_ints(f"{side} tp split", total_kv_heads=total_kv_heads, tp_size=tp_size)
    if total_kv_heads <= 0:
        raise ValueError(f"total_kv_heads must be positive, got {total_kv_heads}.")
    if tp_size <= 0:
        raise ValueError(f"{side} tp_size must be positive, got {tp_size}.")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(
            f"total_kv_heads={total_kv_heads} cannot be split over {side} tp_size={tp_size}: need "
            f"total_kv_heads % tp_size == 0 (each rank holds total_kv_heads // tp_size heads) or "
            f"tp_size % total_kv_heads == 0 (each head replicated on tp_size // total_kv_heads ranks)."
        )


def _tp_rank(rank: int, tp_size: int, side: str) -> int:
    """sglang's rank rule: a rank is taken modulo its TP group (``src_tp_rank % src_attn_tp_size``, ``dst_tp_rank %
    dst_attn_tp_size`` in ``compute_head_slice_params``), so a global rank maps to its rank in the group. It must be
    a non-negative int (a negative rank is no rank; Python's ``%`` would silently map -1 to the last rank)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        side = f"{side} " if side else ""
        raise ValueError(
            f"{side}tp_rank={rank!r} must be a non-negative int (a TP rank, or a global rank, which is taken modulo "
            f"{side}tp_size={tp_size} as sglang does)."
        )
    return rank % tp_size


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``max(1, H // tp)`` (1 with replication when ``tp > H``)."""
    _check_split(total_kv_heads, tp_size, "the")
    return max(1, total_kv_heads // tp_size)


def rank_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global heads ``[start, end)`` held by ``tp_rank`` of a TP group of ``tp_size`` ranks (see module docstring).

    ``tp_rank`` may be a global rank: it is taken modulo ``tp_size`` (sglang's rule, docs/transfer.md)."""
    _check_split(total_kv_heads, tp_size, "the")
    tp_rank = _tp_rank(tp_rank, tp_size, "")
    n = max(1, total_kv_heads // tp_size)
    replication = max(1, tp_size // total_kv_heads)
    start = (tp_rank // replication) * n
    return start, start + n


def compute_head_slice_params(
    prefill_tp_size: int, decode_tp_size: int, decode_tp_rank: int, total_kv_heads: int
) -> tuple[HeadSlice, ...]:
    """The writers of one decode rank, in ascending ``cache_head_start`` (the staging buffer's writer order).

    Name as sglang's; sglang returns ``(src_head_start, num_heads, dst_head_start, num_heads)`` for one
    ``(src_rank, dst_rank)`` pair and leaves writer selection to its callers; this returns the whole list for a
    decode rank, so a head replicated on several prefill ranks is assigned to exactly one of them here.

    ``decode_tp_rank`` may be a global rank: as sglang (``dst_tp_rank % dst_attn_tp_size``), it is taken modulo
    ``decode_tp_size``, i.e. mapped to its rank in the TP group (rank 5 of a world with decode TP 4 is TP rank 1).
    It must be a non-negative int. (sglang's function also takes the prefill rank, modulo the prefill TP size; here
    :func:`routes_for_writer` takes it, with the same rule.)

    Worked cases (``P_tp, D_tp, H``): ``(4, 2, 8)``: each decode rank has 2 writers with ``cache_head_start``
    ``[0, 2]``; ``(2, 4, 8)``: decode ranks take ``src_head_start`` 0, 2, 0, 2; ``(1, 4, 2)``: 0, 0, 1, 1;
    ``(8, 2, 2)``: one writer per decode rank (prefill ranks 0 and 4), no duplicate bytes.

    Raises:
        ValueError: non-positive sizes, ``H`` not splittable over a TP size, a negative ``decode_tp_rank``.
    """
    _check_split(total_kv_heads, prefill_tp_size, "prefill")
    _check_split(total_kv_heads, decode_tp_size, "decode")
    decode_tp_rank = _tp_rank(decode_tp_rank, decode_tp_size, "decode")
    ds, de = rank_head_range(total_kv_heads, decode_tp_size, decode_tp_rank)
    src_n = max(1, total_kv_heads // prefill_tp_size)
    src_rep = max(1, prefill_tp_size // total_kv_heads)
    dst_rep = max(1, decode_tp_size // total_kv_heads)
    replica = (decode_tp_rank % dst_rep) % src_rep
    slices = []
    for group in range(ds // src_n, -(-de // src_n)):  # replica groups overlapping [ds, de)
        a, b = max(ds, group * src_n), min(de, (group + 1) * src_n)
        slices.append(HeadSlice(group * src_rep + replica, a - group * src_n, b - a, a - ds))
    return tuple(slices)


def routes_for_writer(
    prefill_tp_size: int, decode_tp_size: int, prefill_tp_rank: int, total_kv_heads: int
) -> tuple[tuple[int, HeadSlice], ...]:
    """What one prefill rank sends: ``(decode_tp_rank, HeadSlice)`` pairs in decode-rank order (possibly empty, when
    its heads are replicated and another replica writes them).

    ``prefill_tp_rank`` may be a global rank: as sglang (``src_tp_rank % src_attn_tp_size``), it is taken modulo
    ``prefill_tp_size`` (prefill rank 5 of a world with prefill TP 4 is TP rank 1; the slices' ``writer`` is then 1).
    Raises ``ValueError`` for a negative or non-int rank and the errors of :func:`compute_head_slice_params`."""
    _check_split(total_kv_heads, prefill_tp_size, "prefill")
    prefill_tp_rank = _tp_rank(prefill_tp_rank, prefill_tp_size, "prefill")
    return tuple(
        (d, s)
        for d in range(decode_tp_size)
        for s in compute_head_slice_params(prefill_tp_size, decode_tp_size, d, total_kv_heads)
        if s.writer == prefill_tp_rank
    )


def writer_bytes(num_tokens: int, num_heads: int, bytes_per_head_token: int, num_layers: int) -> int:
    """Bytes one writer sends for ``num_tokens`` tokens: ``tokens * heads * bytes_per_head_token * layers * 2`` (K, V).

    ``bytes_per_head_token`` is ``head_dim * dtype.itemsize``.
    """
    _check_ints("writer_bytes", num_tokens=num_tokens, num_heads=num_heads,
                bytes_per_head_token=bytes_per_head_token, num_layers=num_layers)
    if min(num_tokens, num_heads, bytes_per_head_token, num_layers) < 0:
        raise ValueError(f"writer_bytes needs non-negative counts, got num_tokens={num_tokens}, num_heads={num_heads}, "
                         f"bytes_per_head_token={bytes_per_head_token}, num_layers={num_layers}.")
    return num_tokens * num_heads * bytes_per_head_token * num_layers * 2


DEFAULT_CHUNKED_PREFILL_SIZE = 8192  # sglang's default chunked-prefill size (and its staging grid's fallback)


def staging_grid_tokens(chunked_prefill_size: int | None = DEFAULT_CHUNKED_PREFILL_SIZE, page_size: int = 1) -> int:
    """Tokens per staging-grid cell: ``max(1, chunked_prefill_size // page_size) * page_size`` (a whole number of
    pages, about one prefill chunk). ``chunked_prefill_size=None`` means sglang's default chunked-prefill size,
    8192 tokens (as sglang's ``staging_grid_tokens``). Raises ``ValueError`` for non-positive arguments, ``TypeError``
    for non-ints."""
    if chunked_prefill_size is None:
        chunked_prefill_size = DEFAULT_CHUNKED_PREFILL_SIZE
    _check_ints("staging_grid_tokens", chunked_prefill_size=chunked_prefill_size, page_size=page_size)
    if chunked_prefill_size <= 0 or page_size <= 0:
        raise ValueError(
            f"staging_grid_tokens needs positive chunked_prefill_size and page_size, got {chunked_prefill_size} and "
            f"{page_size}."
        )
    return max(1, chunked_prefill_size // page_size) * page_size


def compute_grid_segments(start: int, end: int, base: int, grid_tokens: int) -> list[tuple[int, int]]:
    """Split the token range ``[start, end)`` at the grid boundaries ``base + k * grid_tokens``.

    Returns ``[(s0, e0), (s1, e1), ...]`` covering ``[start, end)`` in order. An empty range yields one empty
    segment ``[(start, start)]`` (as sglang: a fully cached prompt still sends its metadata-only last chunk).
    Example: ``compute_grid_segments(0, 14336, 0, 8192) == [(0, 8192), (8192, 14336)]``.
    Raises ``ValueError`` when ``grid_tokens <= 0``, ``start < 0`` or ``end < start``; ``TypeError`` for non-ints.
    """
    _check_ints("compute_grid_segments", start=start, end=end, base=base, grid_tokens=grid_tokens)
    if grid_tokens <= 0:
        raise ValueError(f"compute_grid_segments needs grid_tokens > 0, got {grid_tokens}.")
    if start < 0:
        raise ValueError(f"compute_grid_segments needs start >= 0 (a token position), got start={start}.")
    if end < start:
        raise ValueError(f"compute_grid_segments needs start <= end, got start={start}, end={end}.")
    if start == end:
        return [(start, start)]
    segments = []
    s = start
    while s < end:
        e = min(end, base + ((s - base) // grid_tokens + 1) * grid_tokens)
        segments.append((s, e))
        s = e
    return segments


def resolve_total_kv_heads(kv_args, attn_tp_size: int) -> int:
    """The model's total KV head count from transfer metadata (as sglang's helper of the same name).

    ``kv_args.total_kv_head_num`` if > 0, else ``kv_args.kv_head_num * attn_tp_size`` if > 0 (per-rank heads times
    the TP size: exact only without replication, hence the explicit field first), else ``ValueError``. Missing
    attributes count as 0.
    """
    total = getattr(kv_args, "total_kv_head_num", 0) or 0
    if total > 0:
        return total
    per_rank = getattr(kv_args, "kv_head_num", 0) or 0
    if per_rank > 0:
        return per_rank * attn_tp_size
    raise ValueError(
        "Cannot resolve total_kv_heads: kv_args has neither total_kv_head_num nor kv_head_num. "
        "Ensure DecodePreallocQueue._init_kv_manager sets kv_args.kv_head_num."
    )


# --- metadata both sides must agree on -------------------------------------------------------------------------
_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64", "int8", "uint8")


@dataclass(frozen=True)
class KVArgs:
    """The KV layout one side of a transfer serves; exchanged (as :meth:`encode`) before any KV byte moves.

    Attributes:
        total_kv_head_num: ``H``, the model's KV heads (0: unknown, use ``kv_head_num``; see
            :func:`resolve_total_kv_heads`).
        kv_head_num: KV heads per rank on this side.
        head_dim: ``D``. dtype: cache dtype name (e.g. ``"bfloat16"``). page_size: ``block_size`` of the paged cache.
        num_layers: layers whose caches are transferred. tp_size: this side's attention TP size.
    """

    total_kv_head_num: int
    kv_head_num: int
    head_dim: int
    dtype: str
    page_size: int
    num_layers: int
    tp_size: int

    @property
    def total_kv_heads(self) -> int:
        return resolve_total_kv_heads(self, self.tp_size)

    def encode(self) -> list[int]:
        """Fixed-length integer form for the wire (an int64 tensor of 7 values)."""
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVArgs: dtype {self.dtype!r} is not one of {_DTYPES}.")
        return [self.total_kv_head_num, self.kv_head_num, self.head_dim, _DTYPES.index(self.dtype), self.page_size,
                self.num_layers, self.tp_size]

    @classmethod
    def decode(cls, values) -> "KVArgs":
        v = [int(x) for x in values]
        dtype = _DTYPES[v[3]] if 0 <= v[3] < len(_DTYPES) else f"<unknown dtype code {v[3]}>"
        return cls(v[0], v[1], v[2], dtype, v[4], v[5], v[6])


def check_transfer_metadata(prefill: KVArgs, decode: KVArgs) -> None:
    """Reject a transfer between sides whose KV layouts differ, before any byte moves.

    Compared: ``head_dim``, ``dtype``, ``page_size``, ``num_layers`` and the total KV heads (resolved with
    :func:`resolve_total_kv_heads` on each side). Raises ``ValueError`` naming every differing field with both
    values, e.g. ``"KV transfer metadata mismatch: head_dim: prefill 64 vs decode 128. ..."``.
    """
    diffs = [
        f"{name}: prefill {a} vs decode {b}"
        for name, a, b in (
            ("head_dim", prefill.head_dim, decode.head_dim),
            ("dtype", prefill.dtype, decode.dtype),
            ("page_size", prefill.page_size, decode.page_size),
            ("num_layers", prefill.num_layers, decode.num_layers),
            ("total_kv_heads", prefill.total_kv_heads, decode.total_kv_heads),
        )
        if a != b
    ]
    if diffs:
        raise ValueError(
            "KV transfer metadata mismatch: " + "; ".join(diffs) + ". Both sides must serve the same model with the "
            "same KV cache layout (head_dim, dtype, page_size, layers, total KV heads); no KV was transferred."
        )
