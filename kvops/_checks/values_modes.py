"""Value-check modes (``"eager"``, ``"async"``, ``"off"``; docs/semantics.md §7) and the helpers every value check
uses: the current mode (``get_value_checks``, ``set_value_checks``, ``value_checks``), whether and how to check a
call (``_active``), a paged cache's geometry (``cache_geometry``), and the async assert (``_assert``).

The checks themselves are in ``values.py`` (cache writes, FlashAttention's KV cache, rows, positions; the overview
of the modes) and ``values_attention.py`` (``paged_attention``'s metadata values, ALiBi slopes, custom masks);
``values.py`` re-exports every name here.
"""

from __future__ import annotations

import threading

import torch

MODES = ("eager", "async", "off")
_mode = "eager"  # the process default (set_value_checks outside any value_checks block)
_local = threading.local()  # .stack: the modes of this thread's open value_checks blocks, innermost last
_blocks = False  # whether any value_checks block was ever opened (never reset): until then no thread has a stack, and
# get_value_checks skips the thread-local look-up (a miss raises and catches an AttributeError: ~0.5 us per eager call)


def get_value_checks() -> str:
    """The current value-check mode of the calling thread: that of its innermost open ``value_checks`` block, else the
    process default (``"eager"`` unless ``set_value_checks`` changed it)."""
    if not _blocks:
        return _mode
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else _mode


def set_value_checks(mode: str) -> None:
    """Set the value-check mode (docs/semantics.md §7): inside a ``value_checks`` block, that block's mode for the
    calling thread (the block's end restores the mode before it); outside any block, the process default, which every
    thread without a block of its own uses. Raises ``ValueError`` for an unknown mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kvops.set_value_checks: mode must be one of {MODES}, got {mode!r}.")
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1] = mode
    else:
        _mode = mode


class value_checks:
    """Context manager: ``with kvops.value_checks("async"): ...`` runs the block in ``mode`` and restores the mode.

    Modes: ``"eager"`` (default; host-sync checks in eager code, none while tracing), ``"async"`` (graph asserts,
    no host sync, also inside compiled/exported graphs), ``"off"``. The mode applies to the calling thread only
    (blocks of several threads may open and close in any order: each thread sees its own, and the process default is
    never changed by a block). Enter it *outside* a compiled function: the mode is read when the function is traced
    (and guarded on), not at every run.
    """

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"kvops.value_checks: mode must be one of {MODES}, got {mode!r}.")
        self.mode = mode

    def __enter__(self) -> "value_checks":
        global _blocks
        _blocks = True  # (before the stack exists: a thread reading the flag false has no block open)
        if getattr(_local, "stack", None) is None:
            _local.stack = []
        _local.stack.append(self.mode)
        return self

    def __exit__(self, *exc) -> None:
        _local.stack.pop()


def _active(*tensors: torch.Tensor) -> str | None:
    """The mode to apply to this call: ``"eager"`` only on real tensors outside tracing, ``"async"``, or None."""
    mode = get_value_checks()
    if mode == "off":
        return None
    if mode == "async":
        return "async"
    if torch.compiler.is_compiling() or any(type(t) not in _REAL or t.is_meta for t in tensors):  # tracing
        return None
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():  # CUDA-graph capture: no sync
        return None
    return "eager"


_REAL = (torch.Tensor, torch.nn.Parameter)
_INDEX = (torch.int32, torch.int64)


def cache_geometry(k_cache: torch.Tensor, kv_layout: str = "NHD") -> tuple[int, int] | None:
    """``(P, block_size)`` of a paged cache (``[P, block_size, H_kv, D]`` NHD or ``[P, H_kv, block_size, D]`` HND),
    or None when it is not 4-D or has a zero-size dim (the op's validator then raises its metadata error)."""
    if k_cache.dim() != 4 or any(n == 0 for n in k_cache.shape[1:]):
        return None
    return k_cache.shape[0], k_cache.shape[2 if kv_layout == "HND" else 1]


def _index(t, ndim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in _INDEX


def _known(x) -> str:
    """A bound for an assert message: its value when it is a plain int, else a placeholder (never guards a SymInt)."""
    return str(x) if type(x) is int else "?"


def _assert(ok: torch.Tensor, msg: str) -> None:
    torch._assert_async(ok, msg)
