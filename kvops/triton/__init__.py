"""Triton kernels and their launchers (CUDA; tested on CPU tensors with ``TRITON_INTERPRET=1``).

``HAS_TRITON`` is False where triton is not installed; the CUDA registrations are skipped then.
"""

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - platforms without triton
    HAS_TRITON = False
