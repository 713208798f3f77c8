"""Inductor lowering of ``kvops::stream_positions``, the position check of ``kvops.export.streaming_update``.

The op raises the step's position contract with its message (an ``ExportedProgram`` and ``torch.export.load`` run
it as is). Compiled code cannot carry that message safely: an assert inside a generated CPU kernel throws from an
OpenMP region, which aborts the process (``torch._assert_async`` is lowered that way), and a call of the op from an
AOTInductor package would make every package need kvops loaded. So:

- ``torch.compile`` (Python wrapper): the op stays an extern kernel call from the wrapper (the message survives);
- AOTInductor: the op is the identity; the package checks the same margins through the ``torch._check`` calls
  ``streaming_update`` makes on them (runtime asserts in the C++ wrapper, ``Expected u5 >= 0``-style text), so a
  bad position still raises ``RuntimeError`` before anything is written, without the message and without kvops.
"""

from __future__ import annotations

import torch
from torch._inductor.virtualized import V


def register(register_lowering) -> None:
    from torch._inductor.lowering import fallback_handler

    op = torch.ops.kvops.stream_positions.default
    extern = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def stream_positions(state, sink_tokens, kv_cache_size):
        if V.graph.aot_mode:
            return state
        return extern(state, sink_tokens, kv_cache_size)
