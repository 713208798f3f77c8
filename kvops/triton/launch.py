"""One launch of a Triton kernel, as planned by a launcher: kernel, grid, arguments and compile options.

Every launcher in ``kvops/triton/`` and ``kvops/triton/packed_*.py`` is split in two: a ``plan_*`` function that
computes the grid, ``num_warps``, ``num_stages`` and the ``BLOCK_*`` constexprs from the arguments' shapes, dtypes and
the target's compute capability and returns :class:`Launch` records, and the launcher proper, which runs them. The
ahead-of-time check (``tools/aot.py``, ``python benchmarks/gpu_check.py --aot``) calls the same ``plan_*``
functions on ``meta`` tensors and compiles each record for real CUDA targets, so what it checks is what a launch runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# what a launch on a non-CUDA device (the Triton interpreter on CPU tensors) plans for: an H100/H200
DEFAULT_CAPABILITY = (9, 0)

# The oldest Triton every kernel is compiled with (torch 2.11's pin; the ahead-of-time check runs with it and with
# Triton 3.9, docs/gpu.md). A kernel that needs a newer one is listed in NEWER_TRITON (kernel name -> version).
OLDEST_TRITON = (3, 6)
NEWER_TRITON: dict[str, tuple[int, int]] = {}


def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton (``"3.6.0"``, ``"3.9.0+git1a2b"``)."""
    import triton

    return tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])


def require_triton(kernel, installed: tuple[int, int] | None = None) -> None:
    """Raise ``RuntimeError`` naming the kernel, the Triton it needs and the one installed when it is older."""
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else getattr(kernel, "__name__", str(kernel))
    need = max(OLDEST_TRITON, NEWER_TRITON.get(name, OLDEST_TRITON))
    have = triton_version() if installed is None else installed
    if have < need:
        raise RuntimeError(
            f"kvops: the Triton kernel {name} needs Triton >= {need[0]}.{need[1]}, but Triton {have[0]}.{have[1]} is "
            f"installed. Install a newer one (pip install 'triton>={need[0]}.{need[1]}', or the torch build that "
            f"pins it), or run the op on CPU tensors."
        )


def capability_of(t: torch.Tensor) -> tuple[int, int]:
    """Compute capability of ``t``'s CUDA device; :data:`DEFAULT_CAPABILITY` for other devices (interpreter)."""
    if t.device.type == "cuda":
        return tuple(torch.cuda.get_device_capability(t.device))
    return DEFAULT_CAPABILITY


@dataclass
class Launch:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)``.

    ``wrap`` launches through ``torch.library.wrap_triton`` (inside a ``triton_op``, so ``torch.compile`` sees the
    kernel). ``num_stages=None`` keeps Triton's default (3).
    """

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int | None = None
    wrap: bool = False

    @property
    def options(self) -> dict:
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts

    def __call__(self) -> None:
        kernel = self.kernel
        if _TRITON_CHECKED.get(kernel) is None:  # once per kernel: a plain dict lookup on later launches
            require_triton(kernel)
            _TRITON_CHECKED[kernel] = True
        if self.wrap:
            from torch.library import wrap_triton

            kernel = wrap_triton(kernel)
        kernel[self.grid](*self.args, **self.constexprs, **self.options)


_TRITON_CHECKED: dict = {}


def run(launches) -> None:
    for launch in launches:
        launch()
