"""Helpers shared by the validators."""

from __future__ import annotations

import torch


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

    Returns the first cache head written. Raises the ``requires cache_head_start`` ValueError of semantics.md §1 when
    the head counts differ and no start was given, and a ValueError when the slice leaves ``[0, cache_heads)``.
    """
    if cache_head_start is None:
        if in_heads != cache_heads:
            raise ValueError(
                f"{op} requires cache_head_start when cache heads ({cache_heads}) differ from input heads "
                f"({in_heads})."
            )
        return 0
    if cache_head_start < 0 or cache_head_start + in_heads > cache_heads:
        raise ValueError(
            f"{op}: head slice [{cache_head_start}, {cache_head_start + in_heads}) is outside the cache's heads "
            f"[0, {cache_heads}). Pass 0 <= cache_head_start <= {cache_heads - in_heads} for {in_heads} input heads."
        )
    return cache_head_start
