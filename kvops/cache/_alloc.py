"""Buffer allocation of the cache classes, with the sizes checked first (docs/semantics.md §7).

A cache of ``num_blocks * block_size * num_kv_heads * head_dim`` elements past what a process can address failed
inside torch's allocator ("Storage size calculation overflowed", "DefaultCPUAllocator: can't allocate memory: you
tried to allocate N bytes"), naming no argument. :func:`allocate` adds the bytes of every buffer up (Python ints: no
overflow) and refuses a total past ``ADDRESSABLE`` with a ``ValueError`` naming the arguments, the byte count and the
fix, before anything is allocated; an allocation that still fails (not enough memory on the device) re-raises the
allocator's exception type with the same facts in front of its message.
"""

from __future__ import annotations

import torch

from .._checks.common import ADDRESSABLE  # bytes (2**47, 128 TiB)


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_size(owner: str, args: dict, numel: int, dtype=None) -> str:
    """``ValueError`` when ``numel`` elements of ``dtype`` (K/V buffers) need more than ``ADDRESSABLE`` bytes,
    naming ``args`` (the sizes that set them), the byte count and the fix; returns the arguments as text."""
    dtype = dtype or torch.get_default_dtype()
    total = numel * dtype.itemsize
    given = ", ".join(f"{k}={v}" for k, v in args.items()) + f" ({dtype})"
    if isinstance(total, int) and total > ADDRESSABLE:  # (symbolic sizes while tracing: checked when they are known)
        raise ValueError(
            f"{owner}: {given} need {total} bytes ({_human(total)}) of K/V buffers, more than a process can address "
            f"({ADDRESSABLE} bytes, 128 TiB). Pass smaller sizes (fewer blocks or tokens, layers or heads)."
        )
    return given


def allocate(owner: str, args: dict, shapes: list[tuple[int, ...]], dtype=None, device=None,
             factory=None) -> list[torch.Tensor]:
    """``[factory(shape, dtype=dtype, device=device) for shape in shapes]`` (default ``torch.zeros``) after checking
    their total size.

    ``owner``: the class or method named in errors; ``args``: the arguments that set the sizes (named with their
    values in errors). Raises ``ValueError`` when the buffers need more than ``ADDRESSABLE`` bytes, and the
    allocator's own exception type (``RuntimeError``, ``torch.OutOfMemoryError``), with the arguments and the byte
    count in front of its message, when the device has not that much memory.
    """
    total = 0
    for shape in shapes:  # plain loops: Dynamo traces them when a cache is built inside a compiled function
        numel = 1
        for n in shape:
            numel = numel * n
        total = total + numel
    given = check_size(owner, args, total, dtype)
    total *= (dtype or torch.get_default_dtype()).itemsize
    factory = factory or torch.zeros
    out = []
    for shape in shapes:
        try:
            out.append(factory(shape, dtype=dtype, device=device))
        except RuntimeError as e:  # (torch.OutOfMemoryError is a RuntimeError)
            raise type(e)(
                f"{owner}: allocating {total} bytes ({_human(total)}) of K/V buffers for {given} failed on "
                f"{device or 'the default device'}: {e}. Pass smaller sizes, or free memory."
            ) from e
    return out
