"""Inductor: ``kvops::dequantize_kv`` decomposes into its elementwise torch ops, so it fuses with its consumer.

Registered in Inductor's decomposition table (not a hand-written IR lowering): the CPU kernel is already written in
functional aten ops (unpack, gather of centroids, ``code · scale + zero``), which Inductor fuses into the loop that
reads the dequantized values. ``kvops::quantize_kv`` stays an extern call (it mutates its outputs and is run once
per chunk).
"""

from __future__ import annotations

import torch

_registered = False


def register() -> None:
    """Add the decomposition to Inductor's table (idempotent; imports ``torch._inductor.decomposition``)."""
    global _registered
    if _registered:
        return
    from torch._inductor.decomposition import decompositions

    from kvops.cpu import packed as cpu

    def dequantize(codes, scales, zeros, centroids, cluster_ids, quant, dtype):
        return cpu.dequantize(codes, scales, zeros, centroids, cluster_ids, quant, dtype)

    decompositions[torch.ops.kvops.dequantize_kv.default] = dequantize
    _registered = True
