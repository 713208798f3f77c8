"""Inductor: ``kvops::merge_attention_states`` and ``kvops::merge_attention_states_many`` decompose into the CPU
kernel's pointwise torch ops (``kvops/cpu/merge.py``), so Inductor fuses the merge (weights from the LSEs, the
weighted sum of the parts, the LSE) into one loop per output and with the ops that produce or consume the parts.

A decomposition, not a hand-written IR lowering: the ops are pure (they write nothing), so there is no store to place,
and the composite is already written in functional aten ops. On CUDA the compiled graph then runs Inductor's
generated Triton kernel rather than ``kvops/triton/merge.py``; eager CUDA calls run the latter.
"""

from __future__ import annotations

import torch


def register() -> None:
    """Add the two decompositions to Inductor's table (idempotent)."""
    from torch._inductor.decomposition import decompositions

    from kvops.cpu import merge

    decompositions[torch.ops.kvops.merge_attention_states.default] = merge.merge_attention_states
    decompositions[torch.ops.kvops.merge_attention_states_many.default] = merge.merge_attention_states_many
