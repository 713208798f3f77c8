"""An exportable streaming-cache step: the update of docs/semantics.md §1 as a pure function of tensors.

``CausalKVCache`` keeps its cursors in Python ints, which is the fast path under ``torch.compile`` (Dynamo turns the
ints into SymInts and the bookkeeping costs nothing at run time) but cannot be exported as *one reusable program*:
``torch.export`` bakes the ints in (``Guard failed: start == 0`` on the next chunk), non-strict export advances the
live cache's cursors while tracing, and its visible window has a data-dependent length.

:func:`streaming_update` keeps the same state in tensors instead:

- ``cursors``: int64 ``[2]`` = ``(global_end G, local_end L)``, returned updated (the input is not modified);
- ``current_chunk_start``: int64 ``[]`` tensor ``s``;
- the eviction is branch-free index arithmetic on those tensors; the row positions reach the write/roll ops as
  unbacked SymInts (``.item()``) bounded with ``torch._check``, so one exported program serves appends, rewrites and
  evicting appends;
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
non-strict), ``torch.export.save/load``, AOTInductor packages and ONNX (``lowering/onnx.py``). Under
``torch.compile`` it needs ``torch._dynamo.config.capture_scalar_outputs = True`` (the ``.item()`` calls otherwise
break the graph); then the streaming example's step compiled into 1 graph for a whole stream (``CausalKVCache``: 3)
with a per-pass latency of the same order (measured on a loaded 2-core CPU, too noisy to rank them).
"""

from __future__ import annotations

import torch

from ..ops.contiguous import cache_roll, cache_write


_OP = "kvops.export.streaming_update"


def _check(cond, text: str) -> None:
    if torch.compiler.is_compiling():
        torch._check(cond)
    else:
        torch._check(cond, lambda: f"{_OP}: {text}")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a chunk at its global position (evicting after the sink as needed); return the visible rows' mask.

    Args:
        key: ``[B, n, H, D]``, value: ``[B, n, H, D_v]`` (the caches' dtype and device; all heads).
        k_cache, v_cache: ``[B, S, H, D]`` / ``[B, S, H, D_v]``, mutated in place through ``kvops.cache_roll`` and
            ``kvops.cache_write`` (any strides; zero-initialized, see the module docstring).
        cursors: int64 ``[2]`` ``(G, L)`` on the caches' device (:func:`init_cursors` for a new stream).
        current_chunk_start: int64 ``[]``, ``s``: global position of the chunk's first token.
        sink_tokens: ``K`` rows never evicted (Python int, part of the program).
        attention_window_size: ``W`` visible rows (default ``S``; Python int).

    Returns:
        ``(mask, new_cursors)``: bool ``[S]``, True for the rows the chunk attends to (docs/semantics.md §1.6), and int64
        ``[2]``. With ``e = s + n``: a rewrite (``e <= G``) writes rows ``[s - (G - L), ... + n)`` and keeps the
        cursors; an append (``a = e - G > 0``) evicts ``ev = max(0, L + a - S)`` rows after the sink (rows
        ``[K + ev, L)`` move down to ``K``) and writes rows ``[L + a - ev - n, L + a - ev)``; then ``G = e``,
        ``L = L + a - ev`` (as ``CausalKVCache``, which these results equal bit for bit).

    Raises:
        ValueError (when called or traced): ``K + n > S`` (an evicting append would overwrite the sink), ``K >= S``,
            ``W < 1``, and the write op's metadata errors (ranks, dtypes, head counts).
        RuntimeError (when run; a runtime assertion in exported programs): the write rows leave ``[0, S)`` (e.g.
            rewriting an already evicted chunk), ``s > G`` (a gap), or a rewrite that would land on the sink rows
            after tokens were evicted.
    """
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
            f"{current_chunk_start.dtype} {tuple(current_chunk_start.shape)}."
        )
    g, l = cursors[0], cursors[1]
    s = current_chunk_start
    e = s + n
    added = (e - g).clamp(min=0)
    evicted = (l + added - cache_size).clamp(min=0)
    ls = l + s - g - evicted
    count = torch.where(evicted > 0, (l - evicted - sink).clamp(min=0), 0)
    src = (evicted + sink).clamp(max=cache_size)
    bad = ((e <= g) & (ls < sink) & (g > l)) | (s > g)  # a rewrite of an evicted chunk onto the sink; a gap

    ls_i, src_i, count_i, bad_i = ls.item(), src.item(), count.item(), bad.to(torch.int64).item()
    # Messages only in eager code: strict export (Dynamo) cannot trace the message callables.
    _check(bad_i == 0, ("the chunk starts past global_end (a gap) or was already evicted (its rows would "
                                 "land on the sink)"))
    _check(ls_i >= 0, ("invalid write range: the chunk's rows start before row 0 (already evicted)"))
    _check(ls_i <= cache_size - n, ("invalid write range: the chunk's rows end past kv_cache_size"))
    torch._check(src_i >= sink)
    torch._check(count_i >= 0)
    torch._check(src_i + count_i <= cache_size)
    torch._check(sink + count_i <= cache_size)
    cache_roll(k_cache, v_cache, src_i, sink, count_i)
    cache_write(key, value, k_cache, v_cache, ls_i)

    new_l = l + added - evicted
    rows = torch.arange(cache_size, device=k_cache.device)
    start = new_l - window  # > 0: the window no longer holds every row in use
    mask = (rows < new_l) & ((start <= 0) | (rows < sink) | (rows >= start + sink))
    return mask, torch.stack([g + added, new_l])
