"""An exportable streaming-cache step: the update of docs/semantics.md §1 as a pure function of tensors.

``CausalKVCache`` keeps its cursors in Python ints, which is the fast path under ``torch.compile`` (Dynamo turns the
ints into SymInts and the bookkeeping costs nothing at run time) but cannot be exported as *one reusable program*:
``torch.export`` bakes the ints in (``Guard failed: start == 0`` on the next chunk), non-strict export advances the
live cache's cursors while tracing, and its visible window has a data-dependent length.

:func:`streaming_update` keeps the same state in tensors instead:

- ``cursors``: int64 ``[2]`` = ``(global_end G, local_end L)``, returned updated (the input is not modified);
- ``current_chunk_start``: int64 ``[]`` tensor ``s``;
- the eviction is branch-free index arithmetic on those tensors, and the rows it names never reach the host: the
  eviction move is ``kvops.cache_roll``'s tensor form (a fixed-size masked gather of rows ``[K, S)``, written back
  with ``kvops.paged_cache_write``; see its docstring for the cost) and the chunk a masked ``paged_cache_write`` on
  the cache read as ``B`` blocks of ``S`` rows, so one program (exported, or compiled with
  ``torch.compile(fullgraph=True)``: one graph, no recompile as the positions advance, no host sync) serves appends,
  rewrites and evicting appends;
- the position contract is checked before anything is written, per value-check mode (docs/semantics.md §7):
  ``"eager"`` (default) through the op ``kvops::stream_positions``, whose message (argument, values, fix) eager calls
  and exported programs (``torch.export``, saved and loaded) raise, and which Inductor (``torch.compile``,
  AOTInductor packages) lowers to device-side asserts naming the argument and the fix (no host read:
  lowering/inductor_checks.py); ``"async"``: ``torch._assert_async`` in every path; ``"off"``: unchecked. The moves
  and writes are masked with the same checks, so a failing step writes nothing (and an unchecked one nothing outside
  the cache);
- the visible window is a boolean row mask ``[S]`` over the whole cache instead of a variable-length view, so every
  shape is static: attend with ``scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask[None, :])`` (the row mask broadcast over queries). The keys are the
  same rows as ``CausalKVCache``'s view (in cache-row order, which attention does not depend on).

Covered: sink tokens ``K`` (never evicted), ``attention_window_size`` ``W`` (sglang's windowed view, semantics.md
§1.6: when ``W`` rows no longer hold ``[0, L')``, the sink rows then the newest ``W - K`` rows), rewrites (later
denoising steps, the context pass), appends and evicting appends, batch ``B``, ``D_v != D``. Not covered (use
``CausalKVCache``): growth, pinned chunks, head-sliced writers, ``recent_window_tokens``.

Caches must start zeroed (``torch.zeros``) or otherwise hold finite values: rows outside the mask are multiplied by a
zero attention weight, which is not zero for NaN/inf garbage (``CausalKVCache`` never reads such rows).

Which to use: ``CausalKVCache`` in eager code and under ``torch.compile`` when you need its full feature set (growth,
pins, head slices) or no tensor bookkeeping at all; :func:`streaming_update` for ``torch.export`` (strict and
non-strict), ``torch.export.save/load``, AOTInductor packages and ONNX (``lowering/onnx.py``), and for
``torch.compile`` loops that keep their positions in tensors (one graph for a whole stream,
tests/streaming/test_streaming_compiled.py; no ``torch._dynamo.config.capture_scalar_outputs``, which the step needed while it
read its rows with ``.item()``). Cost of the fixed shapes: every pass gathers rows ``[K, S)`` of both caches into a
temporary of ``B x (S - K) x H x (D + D_v)`` elements (about what an evicting append moves once the cache is full)
and writes back the moved ones, also on passes that evict nothing (rewrites, appends while the cache fills), where
``CausalKVCache`` moves nothing; the chunk itself is written once.
"""

from __future__ import annotations

import torch

from .._checks import values
from .._checks.common import as_int, require_ndim
from .._checks.contiguous import TOKENS_LAYOUT, check_cache_write, check_caches
from ..ops.contiguous import move_rows
from ..ops.paged_write import paged_cache_write


_OP = "kvops.export.streaming_update"


# The position contract of a step, checked before anything is written: one message per margin of the state.
_POSITION_CHECKS = (
    "cursors must be (global_end, local_end) with 0 <= local_end <= global_end and local_end <= kv_cache_size. "
    "Pass the cursors returned by the previous step on these caches (init_cursors() for a new stream)",
    "current_chunk_start is past cursors[0] (global_end): the tokens in between were never written (a gap). Pass "
    "current_chunk_start <= global_end (global_end appends the next chunk)",
    "current_chunk_start is negative or names tokens already evicted (their rows would start before row 0 or land on "
    "the sink rows). Rewrite only tokens still in the cache, current_chunk_start >= global_end - local_end (plus "
    "sink_tokens once tokens were evicted, i.e. global_end > local_end), or append at global_end",
)
CHECKS = len(_POSITION_CHECKS)


def _stream_positions(state: torch.Tensor, sink_tokens: int, kv_cache_size: int) -> torch.Tensor:
    """Kernel of ``kvops::stream_positions`` (CPU and CUDA; one host read): raise the position contract's
    ``RuntimeError`` naming the argument, the values and the fix for the first negative margin; return a copy."""
    values = state.tolist()
    s, g, l = values[:3]
    for margin, text in zip(values[6:], _POSITION_CHECKS):
        if margin < 0:
            raise RuntimeError(
                f"{_OP}: {text}. Got current_chunk_start={s}, cursors=(global_end={g}, local_end={l}), "
                f"sink_tokens={sink_tokens}, kv_cache_size={kv_cache_size}."
            )
    return state.clone()


for _device in ("CPU", "CUDA"):
    torch.library.impl("kvops::stream_positions", _device)(_stream_positions)


@torch.library.register_fake("kvops::stream_positions")
def _stream_positions_fake(state, sink_tokens, kv_cache_size):
    return torch.empty_like(state)


def device_message(i: int) -> str:
    """The message of position check ``i`` where it runs on the device (``"async"`` mode, compiled code): no values
    (no host read); they are in the eager message."""
    return (f"{_OP}: {_POSITION_CHECKS[i]}. Nothing was written. Run the step eagerly with kvops.value_checks('eager') "
            f"to see the values.")


def _check_positions(state: torch.Tensor, sink: int, cache_size: int, k_cache: torch.Tensor) -> torch.Tensor | None:
    """The position contract of ``state`` (``kvops::stream_positions``'s layout) in the current value-check mode;
    returns the 0-d bool ``ok`` that masks the step's moves and writes (None in ``"off"`` mode).

    ``"eager"``: the op ``kvops::stream_positions``: eager calls and exported programs run its kernel (one host read,
    the message with the values); Inductor lowers it to device-side asserts (lowering/inductor_checks.py: no host
    sync, the messages of :func:`device_message`). ``"async"`` (or eager mode while capturing a CUDA graph):
    ``torch._assert_async`` per check. Either way a failing step moves and writes nothing, even where the assert
    fires after the writes (CUDA's asynchronous asserts)."""
    mode = values.get_value_checks()
    if mode == "off":
        return None
    if mode == "eager" and not (k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        margins = torch.ops.kvops.stream_positions(state, sink, cache_size)[6:]
    else:
        margins = state[6:]
        for i in range(CHECKS):
            torch._assert_async(margins[i] >= 0, device_message(i))
    return (margins >= 0).all()


def _check_step(key, value, k_cache, v_cache, cursors, current_chunk_start) -> None:
    """The metadata contract of a step (the write's, plus the cursors' device and all heads), checked before the roll
    so that a failing step moves and writes nothing."""
    if key.shape[2] != k_cache.shape[2] or value.shape[2] != k_cache.shape[2]:
        raise ValueError(
            f"{_OP}: key has {as_int(key.shape[2])} heads and value {as_int(value.shape[2])}, but the caches hold "
            f"{as_int(k_cache.shape[2])} (k_cache shape {tuple(k_cache.shape)}); a streaming step writes all heads. "
            f"Pass key/value with {as_int(k_cache.shape[2])} heads (for a head slice use CausalKVCache with "
            f"cache_head_start)."
        )
    check_cache_write(key, value, k_cache, v_cache, 0, None, op=_OP)
    if k_cache.dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"{_OP}: {k_cache.dtype} caches are not supported: the step moves and writes rows with "
            f"kvops.paged_cache_write, which quantizes into such caches. Use CausalKVCache (plain copies)."
        )
    for name, t in (("cursors", cursors), ("current_chunk_start", current_chunk_start)):
        if isinstance(t, torch.Tensor) and t.device != k_cache.device:
            raise ValueError(
                f"{_OP}: {name} is on {t.device} but the caches are on {k_cache.device}; the step's positions are "
                f"computed next to the caches. Pass {name}.to({str(k_cache.device)!r}) (init_cursors(device) for a "
                f"new stream)."
            )


def init_cursors(device=None) -> torch.Tensor:
    """Cursors of an empty stream: int64 ``[2]`` zeros ``(global_end, local_end)``."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def streaming_update(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cursors: torch.Tensor,
    current_chunk_start: torch.Tensor,
    *,
    sink_tokens: int = 0,
    attention_window_size: int | None = None,
    window_mode: str = "sink",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a chunk at its global position (evicting after the sink as needed); return the visible rows' mask.

    Args:
        key: ``[B, n, H, D]``, value: ``[B, n, H, D_v]`` (the caches' dtype and device; all heads).
        k_cache, v_cache: ``[B, S, H, D]`` / ``[B, S, H, D_v]``, mutated in place through ``kvops.paged_cache_write``
            (the eviction move and the chunk; any strides; not ``float8_e4m3fn``; zero-initialized, see the module
            docstring).
        cursors: int64 ``[2]`` ``(G, L)`` on the caches' device (:func:`init_cursors` for a new stream).
        current_chunk_start: int64 ``[]``, ``s``: global position of the chunk's first token.
        sink_tokens: ``K`` rows never evicted (Python int, part of the program).
        attention_window_size: ``W`` visible rows (default ``S``; Python int).
        window_mode: ``"sink"`` (default: once ``W`` rows no longer hold every row in use, the sink rows then the
            newest ``W - K``) or ``"tail"`` (the newest ``W`` rows only), as ``CausalKVCache``'s (docs/porting.md
            "Window with a sink").

    Returns:
        ``(mask, new_cursors)``: bool ``[S]``, True for the rows the chunk attends to (docs/semantics.md §1.6), and int64
        ``[2]``. With ``e = s + n``: a rewrite (``e <= G``) writes rows ``[s - (G - L), ... + n)`` and keeps the
        cursors; an append (``a = e - G > 0``) evicts ``ev = max(0, L + a - S)`` rows after the sink (rows
        ``[K + ev, L)`` move down to ``K``) and writes rows ``[L + a - ev - n, L + a - ev)``; then ``G = e``,
        ``L = L + a - ev`` (as ``CausalKVCache``, which these results equal bit for bit).

    Raises:
        ValueError (when called or traced, before anything moves): ``K + n > S`` (an evicting append would
            overwrite the sink), ``K >= S``, ``W < 1``, the write op's metadata errors (ranks, dtypes, key/value
            lengths, caches that overlap in memory), ``float8_e4m3fn`` caches, key/value with fewer heads than the
            caches (a step writes all heads), cursors or ``current_chunk_start`` of another dtype, shape or device.
        RuntimeError (when run, before anything is written): cursors that are not ``0 <= L <= min(G, S)``;
            ``s > G`` (a gap); ``s`` negative or naming tokens already evicted (rows before row 0, or a rewrite onto
            the sink rows after eviction). A value contract (docs/semantics.md §7): in the default ``"eager"`` mode
            the message names the argument, the values and the fix in eager code and exported programs
            (``torch.export``, saved and loaded); compiled code (``torch.compile``, AOTInductor packages) raises the
            same text without the values (a device-side assert, :func:`device_message`); ``"async"``:
            ``torch._assert_async`` with that text everywhere; ``"off"``: unchecked (rows outside the cache are
            skipped, nothing else is guaranteed).
    """
    if window_mode not in ("sink", "tail"):
        raise ValueError(f"{_OP}: window_mode must be 'sink' or 'tail' (docs/porting.md), got {window_mode!r}.")
    check_caches(_OP, k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        require_ndim(_OP, name, t, 4, TOKENS_LAYOUT)
    n, cache_size = key.shape[1], k_cache.shape[1]
    window = cache_size if attention_window_size is None else attention_window_size
    sink = sink_tokens
    if not 0 <= sink < cache_size or window < 1 or sink + n > cache_size:
        raise ValueError(
            f"kvops.export.streaming_update: need 0 <= sink_tokens < kv_cache_size, attention_window_size >= 1 and "
            f"sink_tokens + num_new_tokens <= kv_cache_size, got sink_tokens={sink}, attention_window_size={window}, "
            f"num_new_tokens={n}, kv_cache_size={cache_size}. Use a larger cache or smaller chunks."
        )
    if cursors.dtype != torch.int64 or cursors.shape != (2,) or current_chunk_start.dtype != torch.int64 or \
            current_chunk_start.dim() != 0:
        raise ValueError(
            f"kvops.export.streaming_update: cursors must be int64 [2] (global_end, local_end) and "
            f"current_chunk_start an int64 0-d tensor, got {cursors.dtype} {tuple(cursors.shape)} and "
            f"{current_chunk_start.dtype} {tuple(current_chunk_start.shape)}. Pass the cursors the previous step "
            f"returned (kvops.export.init_cursors(device) for a new stream) and "
            f"current_chunk_start=torch.tensor(start, dtype=torch.int64, device=device)."
        )
    _check_step(key, value, k_cache, v_cache, cursors, current_chunk_start)  # all of it before the first mutation
    g, l = cursors[0], cursors[1]
    s = current_chunk_start
    e = s + n
    added = (e - g).clamp(min=0)
    evicted = (l + added - cache_size).clamp(min=0)
    ls = l + s - g - evicted
    count = torch.where(evicted > 0, (l - evicted - sink).clamp(min=0), 0)
    src = evicted + sink
    margins = (torch.minimum(torch.minimum(l, g - l), cache_size - l),  # cursors: 0 <= L <= min(G, S)
               g - s,  # no gap
               torch.where((e <= g) & (g > l), ls - sink, ls))  # rows from row 0; no rewrite onto the sink
    ok = _check_positions(torch.stack([s, g, l, ls, src, count, *margins]), sink, cache_size, k_cache)
    move_rows(k_cache, v_cache, src, sink, count, 0, k_cache.shape[2], ok)  # the eviction: rows [K + ev, L) to K
    rows = ls + torch.arange(n, dtype=torch.int64, device=k_cache.device)
    write = (rows >= 0) & (rows < cache_size)
    if ok is not None:
        write = write & ok
    slots = torch.arange(key.shape[0], dtype=torch.int64, device=k_cache.device)[:, None] * cache_size + rows
    slots = torch.where(write[None, :], slots, -1).view(-1)
    paged_cache_write(key.flatten(0, 1), value.flatten(0, 1), k_cache, v_cache, slots)

    new_l = l + added - evicted
    rows = torch.arange(cache_size, device=k_cache.device)
    start = new_l - window  # > 0: the window no longer holds every row in use
    if window_mode == "tail":  # the plain tail [L' - W, L') (sglang's dense cache, Self-Forcing)
        mask = (rows < new_l) & (rows >= start)
    else:
        mask = (rows < new_l) & ((start <= 0) | (rows < sink) | (rows >= start + sink))
    return mask, torch.stack([g + added, new_l])
