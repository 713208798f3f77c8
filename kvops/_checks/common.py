"""Helpers shared by the validators."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_scalar


def as_int(x) -> int:
    """A concrete int for an error message (``int()`` of a SymInt uses its hint; only called on the error path)."""
    return int(x)


def require_ndim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(
            f"{op}: {name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}. "
            f"Reshape {name} to {layout}."
        )


def require_writable(op: str, name: str, t: torch.Tensor) -> None:
    """A cache written in place must not have elements sharing memory (a stride-0 dim, e.g. an ``expand``ed view).

    kvops never copies a cache behind the caller's back, so such a cache is an error rather than a silent copy.
    """
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{op}: {name} of shape {tuple(t.shape)} has stride 0 in dim {dim} (an expanded view): its elements "
                f"share memory, so it cannot be written in place. Allocate the cache with its own storage "
                f"(e.g. torch.zeros, or .clone() the expanded view once)."
            )


def require_same_dtype(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(
            f"{op}: {name_a} dtype {a.dtype} does not match {name_b} dtype {b.dtype}. "
            f"Cast {name_a} to {b.dtype}."
        )


def require_same_device(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(
            f"{op}: {name_a} is on {a.device} but {name_b} is on {b.device}. Move both to the same device."
        )


def require_same_shape(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{op}: {name_a} shape {tuple(a.shape)} does not match {name_b} shape {tuple(b.shape)}. "
            f"Pass {name_a} and {name_b} with identical shapes."
        )


def require_dim_match(
    op: str, what: str, name_a: str, a: torch.Tensor, dim_a: int, name_b: str, b: torch.Tensor, dim_b: int
) -> None:
    if a.shape[dim_a] != b.shape[dim_b]:
        raise ValueError(
            f"{op}: {what} mismatch: {name_a} has shape {tuple(a.shape)} ({what} {a.shape[dim_a]}) but {name_b} "
            f"has shape {tuple(b.shape)} ({what} {b.shape[dim_b]})."
        )


def check_head_slice(op: str, cache_heads: int, in_heads: int, cache_head_start: int | None) -> int:
    """Resolve ``cache_head_start`` for a writer carrying ``in_heads`` of the cache's ``cache_heads`` KV heads.

    Returns the first cache head written. Raises the ``requires cache_head_start`` ValueError of docs/semantics.md §1
    when the head counts differ and no start was given, and a ValueError when the slice leaves ``[0, cache_heads)``.
    """
    if cache_head_start is None:
        if in_heads != cache_heads:
            more = (
                f" The input carries more heads than the cache holds, so no head slice fits: allocate the cache with "
                f"{in_heads} KV heads, or pass the key/value of this writer's {cache_heads} heads."
                if not isinstance(in_heads, torch.SymInt) and not isinstance(cache_heads, torch.SymInt)
                and in_heads > cache_heads else ""
            )
            raise ValueError(
                f"{op} requires cache_head_start when cache heads ({cache_heads}) differ from input heads "
                f"({in_heads}).{more or head_slice_fix(cache_heads, in_heads)}"
            )
        return 0
    if cache_head_start < 0 or cache_head_start + in_heads > cache_heads:
        raise ValueError(
            f"{op}: head slice [{cache_head_start}, {cache_head_start + in_heads}) is outside the cache's heads "
            f"[0, {cache_heads}). Pass 0 <= cache_head_start <= {cache_heads - in_heads} for {in_heads} input heads."
        )
    return cache_head_start


def head_slice_fix(cache_heads, in_heads) -> str:
    """The fix sentences of the ``requires cache_head_start`` error when the input carries fewer heads than the cache.

    The likely mistake is the cache's head count (allocated for another model), so that fix comes first: a head slice
    written into a cache whose other heads nobody writes gives attention that reads never-written heads, silently."""
    top, n = cache_heads - in_heads, as_int(in_heads)
    heads = f"{n} KV head{'s' if n != 1 else ''}"
    return (f" If the model has {heads}, allocate the cache with {heads} (num_kv_heads={n}). A head slice is "
            f"for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= "
            f"cache_head_start <= {as_int(top)}) to write the input heads as heads [cache_head_start, cache_head_start"
            f" + {n}), and have the other writers fill the other heads before attention. Or pass key/value with all "
            f"{as_int(cache_heads)} heads.")


def gqa_fix(num_heads, num_kv_heads, cache: str = "allocate it") -> str:
    """The fix sentence of a ``num_heads % num_kv_heads != 0`` error: the likely mistake is the cache's head count
    (allocated for another model), so that fix comes first (``cache``: how to get a cache with other heads)."""
    return (f"If the cache was allocated with another head count than the model's, {cache} with the model's "
            f"num_kv_heads (a divisor of {as_int(num_heads)}); else pass q with a multiple of {as_int(num_kv_heads)} "
            f"heads.")


def index_fix(name: str, t, ndim: int | None, dtypes: tuple, layout: str, want: torch.dtype | None = None) -> str:
    """The fix sentence for an index tensor ``t`` (``slot_mapping``, ``block_table``, ``seq_lens``, positions, ...)
    whose dtype is not one of ``dtypes`` or whose rank is not ``ndim`` (None: any), in the op's ``layout`` terms:
    ``Pass slot_mapping.to(torch.int64).`` for a float one, ``Reshape ... to [num_tokens].`` for a wrong rank.
    ``want``: the dtype the fix names (default int64 when allowed, else int32)."""
    want = str(want) if want is not None else "torch.int64" if torch.int64 in dtypes else "torch.int32"
    if not isinstance(t, torch.Tensor):
        return f"Pass {name} as a {want} tensor {layout}."
    fixes = []
    if t.dtype not in dtypes:
        how = " (built with integer ops: // rather than /)" if t.is_floating_point() else ""
        fixes.append(f"Pass {name}.to({want}){how}")
    if ndim is not None and t.dim() != ndim:
        fixes.append(f"{'reshape it' if fixes else 'Reshape ' + name} to {layout}")
    return (", and ".join(fixes) + ".") if fixes else f"Pass {name} with the shape {layout}."


def check_kv_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor | None, layout: str, agree: str) -> None:
    """K and V caches: both present (``"v_cache must be provided"``), 4-D ``layout``, same dtype and device, and equal
    in the first three dims (``agree`` names them); only ``head_dim`` may differ."""
    if v_cache is None:
        raise ValueError(f"{op}: v_cache must be provided (the V cache written or read with k_cache).")
    require_ndim(op, "k_cache", k_cache, 4, layout)
    require_ndim(op, "v_cache", v_cache, 4, layout)
    require_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    require_same_device(op, "v_cache", v_cache, "k_cache", k_cache)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"{op}: k_cache shape {tuple(k_cache.shape)} and v_cache shape {tuple(v_cache.shape)} must agree in "
            f"{agree}; only head_dim may differ."
        )


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: writes saturate to [-FP8_MAX, FP8_MAX]


def check_fp8_scales(op: str, k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """fp8 (``float8_e4m3fn``) caches need ``k_scale`` and ``v_scale``, float32 of shape ``[1]`` or ``[H_kv]`` on the
    caches' device (the cache holds ``x / scale``; reads dequantize as ``cache.float() * scale``); other caches take
    no scales."""
    num_kv_heads = k_cache.shape[2]
    if k_cache.dtype == FP8_DTYPE:
        if k_scale is None or v_scale is None:
            raise ValueError(
                f"{op}: a {FP8_DTYPE} cache needs k_scale and v_scale (float32, shape [1] or [{as_int(num_kv_heads)}]);"
                f" the cache holds x / scale. Pass both scales."
            )
    elif k_scale is not None or v_scale is not None:
        raise ValueError(
            f"{op}: k_scale/v_scale were given but the cache dtype is {k_cache.dtype}; scales apply only to "
            f"{FP8_DTYPE} caches. Drop the scales or allocate the caches as {FP8_DTYPE}."
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if scale.dtype != torch.float32 or scale.dim() != 1 or scale.shape[0] not in (1, num_kv_heads):
            raise ValueError(
                f"{op}: {name} must be a float32 tensor of shape [1] (per tensor) or [{as_int(num_kv_heads)}] (per "
                f"KV head of the cache), got shape {tuple(scale.shape)} and dtype {scale.dtype}."
            )
        require_same_device(op, name, scale, "k_cache", k_cache)


_FAR = 1e300  # number_text's probe: every backed number is either side of -_FAR


def number_text(x) -> str | None:
    """``repr`` of the Python number ``x`` (an int or a float) for an error message, also when ``torch.compile`` traces
    it: Dynamo makes a number argument symbolic (a SymInt or SymFloat) when a later call passes another value, and
    cannot format a traced number ("repr_impl not implemented"). A traced number is guarded to its value at this call
    (the call raises: the guard costs nothing), so the message is the eager one; a traced number without a value
    (unbacked: e.g. from ``.item()``, which no guard can read) gives None. Only called on the error path."""
    if not torch.compiler.is_compiling() and not isinstance(x, (torch.SymInt, torch.SymFloat)):
        return repr(x)
    return repr(guard_scalar(x)) if has_value(x) else None


def has_value(x) -> bool:
    """Whether the number ``x`` has a value while tracing: a Python number, or a traced one that is backed (Dynamo's
    symbol for a number argument that changed between calls; the check installs a guard on it). False for a traced
    number without a value (unbacked): ``.item()`` of a traced tensor, or a NumPy scalar under ``torch.compile`` that
    Dynamo does not read (:func:`kvops._checks.forms.python_float`). A NaN Python float counts as having one."""
    if not torch.compiler.is_compiling() and not isinstance(x, (torch.SymInt, torch.SymFloat)):
        return True
    # a number is either side of -_FAR, or NaN (x != x is False for a symbol): all three undecided: unbacked
    return guard_or_false(x > -_FAR) or guard_or_false(x <= -_FAR) or guard_or_false(x != x)


def require_finite(op: str, name: str, value, what: str, fix: str) -> None:
    """``ValueError`` when the float ``value`` is NaN or +-inf (``what``: what it is; ``fix``: the sentence that says
    what to pass). A NaN or infinite scalar turns every score into NaN or 0 inside the kernels, indistinguishable from
    "no keys": refused at the contract."""
    if isinstance(value, (int, float, torch.SymFloat)) and not -float("inf") < value < float("inf"):
        raise ValueError(f"{op}: {name} must be a finite number ({what}), got {value}. {fix}")


def int64_error(op: str, args: dict) -> ValueError | None:
    """A ``ValueError`` for the first Python int of ``args`` (``{name: value}``) outside int64, else None: the ops'
    integer arguments are 64-bit, and torch's own error for them ("Expected a value of type 'int' ... found type
    'int'") gives no fix. Wrappers call it before the op (SymInts and other types pass)."""
    for name, x in args.items():
        if type(x) is int and not -(2**63) <= x < 2**63:
            return ValueError(f"{op}: {name} = {x} does not fit in 64 bits (the op's integer arguments are int64). "
                              f"Pass {name} in [-2**63, 2**63), within the range the op documents.")
    return None


ADDRESSABLE = 2**47  # bytes: the user virtual address space of x86-64 and AArch64 (128 TiB); no device holds more

# Sequence positions and lengths are int32 (seq_lens, cu_seqlens_q, cache_seqlens): a window or a sink count of at
# least this many positions covers every key, whatever its size beyond (sys.maxsize overflowed int64
# arithmetic such as pos + window_right + 1 in the kernels).
UNBOUNDED = 2**31


def resolve_bounds(window_left, window_right, sink_tokens):
    """``(window_left, window_right, sink_tokens)`` as the kernels take them: a window of ``UNBOUNDED`` positions or
    more is no window (-1), and so are sink tokens that cover every key (``sink_tokens >= UNBOUNDED``: no window,
    no sinks), so that "unbounded" stays unbounded (no int64 overflow in any backend). Other values are unchanged."""
    if window_left >= UNBOUNDED or sink_tokens >= UNBOUNDED:
        window_left, sink_tokens = -1, 0
    if window_right >= UNBOUNDED:
        window_right = -1
    return window_left, window_right, sink_tokens


def check_varlen_metadata(op: str, q, cu_seqlens_q, seq_lens, block_table, max_seqlen_q) -> None:
    """The batch metadata every paged attention op shares (``kvops.paged_attention``, ``kvops.mla_attention``):
    ``block_table [B, max_blocks_per_seq]``, ``seq_lens [B]`` and ``cu_seqlens_q [B + 1]`` int32 on q's device, one
    batch size, and ``max_seqlen_q >= 1`` when q has tokens. Raises ``ValueError`` naming ``op``."""
    for name, t, ndim, layout in (("block_table", block_table, 2, "[batch, max_blocks_per_seq]"),
                                  ("seq_lens", seq_lens, 1, "[batch]"),
                                  ("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")):
        if t.dim() != ndim or t.dtype != torch.int32:
            raise ValueError(
                f"{op}: {name} must be a {ndim}-D int32 tensor {layout}, got shape {tuple(t.shape)} and dtype "
                f"{t.dtype}. " + index_fix(name, t, ndim, (torch.int32,), layout)
            )
        require_same_device(op, name, t, "q", q)
    batch = block_table.shape[0]
    if seq_lens.shape[0] != batch or cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{op}: inconsistent batch size: block_table has {as_int(batch)} rows, seq_lens has "
            f"{as_int(seq_lens.shape[0])} entries and cu_seqlens_q has {as_int(cu_seqlens_q.shape[0])}; expected "
            f"seq_lens [B] and cu_seqlens_q [B + 1] for block_table [B, max_blocks_per_seq]."
        )
    if q.shape[0] > 0 and max_seqlen_q < 1:
        raise ValueError(
            f"{op}: max_seqlen_q must be >= 1 (the longest query length in the batch) when q has tokens, got "
            f"{as_int(max_seqlen_q)} for {as_int(q.shape[0])} tokens."
        )


def require_scale_tensor(op: str, name: str, scale, what: str = "float32 scalar tensor") -> None:
    """``scale`` is None or a tensor: public wrappers call this before dispatch (the dispatcher's own error for a
    Python float names the schema type, not the fix; ``.dim()`` on a float is an AttributeError). ``ValueError``
    naming ``name``, the value and ``torch.tensor(value, dtype=torch.float32)`` as the fix."""
    if scale is not None and not isinstance(scale, torch.Tensor):
        number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
        text = number_text(scale) if number else repr(scale)
        got = f"{type(scale).__name__} {text}" if text is not None else f"a traced {type(scale).__name__}"
        raise ValueError(
            f"{op}: {name} must be a {what} (or None), got {got}. "
            f"Pass {name}=torch.tensor({text if number and text is not None else 's'}, dtype=torch.float32) on the "
            f"cache's device."
        )



def kv_scale_tensors(op: str, k_scale, v_scale):
    """``(k_scale, v_scale)`` as the ops take them: each None or a tensor (:func:`require_scale_tensor`, the fp8 scales
    ``float32 [1]`` or ``[H_kv]``), a 0-d float32 per-tensor scale (vLLM's form) as ``[1]`` (a view). A 0-d scale of
    another dtype is left as it is, so that the validator's error reports the shape and dtype it was passed with.
    Public wrappers call it before dispatch."""
    if k_scale is None and v_scale is None:
        return None, None
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):  # a float: a clear error
        require_scale_tensor(op, name, scale, "float32 tensor of shape [1] or [H_kv]")
    return tuple(t.reshape(1) if t is not None and t.dim() == 0 and t.dtype == torch.float32 else t
                 for t in (k_scale, v_scale))