"""Checks shared by the streaming caches' updates, run before anything is written (a failing call changes nothing).

The write op's validator (``kvops._checks.contiguous.check_cache_write``) checks the metadata of one write. A cache
update is several writes and moves (an eviction's roll, a growth, a ring's two halves, a packed chunk's quantization),
so the caches check the writer as a whole first: a failing update then leaves every tensor and cursor as it was.
These checks read shapes and Python ints only (no tensor contents, no host sync), so they run at trace time too.
"""

from __future__ import annotations

import torch

from .._checks.common import as_int, require_ndim
from .._checks.contiguous import TOKENS_LAYOUT

__all__ = ["check_position", "check_writer", "check_window_mode", "WINDOW_MODES"]

# docs/porting.md "Window with a sink": what the visible window is once it no longer holds every row in use.
WINDOW_MODES = ("sink", "tail")


def check_window_mode(name: str, window_mode: str) -> str:
    """``window_mode`` of a streaming cache: ``"sink"`` (default) or ``"tail"`` (docs/semantics.md §1.6)."""
    if window_mode not in WINDOW_MODES:
        raise ValueError(
            f"{name}: window_mode must be 'sink' (the sink rows, then the newest rows: kvops' default, LongLive-2, "
            f"sglang's QVG packed cache) or 'tail' (the newest attention_window_size rows only: sglang's dense "
            f"CausalSelfAttentionKVCache, Self-Forcing's max_attention_size), got {window_mode!r}."
        )
    return window_mode


def check_position(name: str, arg: str, x) -> None:
    """``x`` is a token position or count: a Python int (a ``SymInt`` under ``torch.compile``), not a bool, float or
    tensor (a float position would silently address fractional rows; a tensor would read its value on the host)."""
    if isinstance(x, bool) or not isinstance(x, (int, torch.SymInt)):
        raise TypeError(
            f"{name}: {arg} must be an int (a token position), got {type(x).__name__} {x!r}. Pass a Python int "
            f"(e.g. int({arg}) outside the compiled region)."
        )


def check_writer(name: str, key: torch.Tensor, value: torch.Tensor, cache_heads: int, cache_head_start) -> None:
    """``key [B, n, H_in, D]`` and ``value [B, n, H_in, D_v]`` of one update: 4-D, not in SDPA's swapped layout, and
    agreeing in ``[batch, num_new_tokens, num_heads]``. The remaining metadata (dtypes, devices, batch, head_dim, the
    head slice) is the write op's validator's, which the caches call next."""
    for arg, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor {TOKENS_LAYOUT}, got {type(t).__name__}.")
    require_ndim(name, "key", key, 4, TOKENS_LAYOUT)
    require_ndim(name, "value", value, 4, TOKENS_LAYOUT)
    tokens, heads = key.shape[1], key.shape[2]
    if heads > cache_heads and tokens <= cache_heads:  # no head slice of the cache fits: the swap is likelier
        raise ValueError(
            f"{name}: key of shape {tuple(key.shape)} looks like SDPA's layout [batch, num_heads, seq_len, head_dim] "
            f"(heads and tokens swapped): its dim 2 ({as_int(heads)}) is more heads than the cache's "
            f"{as_int(cache_heads)} KV heads, while dim 1 ({as_int(tokens)}) fits them. The caches take key/value as "
            f"{TOKENS_LAYOUT}: pass key.transpose(1, 2) and value.transpose(1, 2) (or, if key really carries "
            f"{as_int(heads)} heads, allocate the cache with {as_int(heads)} KV heads)."
        )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"{name}: key of shape {tuple(key.shape)} and value of shape {tuple(value.shape)} must agree in "
            f"[batch, num_new_tokens, num_heads] (key holds {as_int(tokens)} tokens, value {as_int(value.shape[1])}). "
            f"Pass the keys and values of the same tokens and heads."
        )


def check_update_args(name: str, key: torch.Tensor, value: torch.Tensor, cache_heads: int, current_chunk_start,
                      cache_head_start, recent_window_tokens) -> None:
    """The argument checks every streaming cache's update shares: positions are ints, ``recent_window_tokens`` is
    non-negative or None (sglang's text, then the value), and the writer's key/value fit the cache's heads."""
    check_position(name, "current_chunk_start", current_chunk_start)
    if cache_head_start is not None:
        check_position(name, "cache_head_start", cache_head_start)
    if recent_window_tokens is not None:
        check_position(name, "recent_window_tokens", recent_window_tokens)
        if recent_window_tokens < 0:
            raise ValueError(
                f"recent_window_tokens must be non-negative or None (got recent_window_tokens="
                f"{as_int(recent_window_tokens)}; 0 shows the sink and the current chunk only)"
            )
    check_writer(name, key, value, cache_heads, cache_head_start)
