"""Inductor lowering of ``kvops::stream_positions``, the position check of ``kvops.export.streaming_update``.

The op raises the step's position contract with its message and the values (an ``ExportedProgram`` and
``torch.export.load`` run it as is); its kernel reads the 9 positions on the host. Compiled code must not: a host read
is a device sync on CUDA, and a call of the op from an AOTInductor package would make every package need kvops
loaded. So in ``torch.compile`` and AOTInductor alike the op is the identity plus one device-side assert per check
(Inductor's own ``aten._assert_async`` lowering, on a 0-d condition, never fused with another kernel: a loop of its
own that is never split over threads, so on CPU it raises a ``RuntimeError`` from the generated code rather than from
an OpenMP region, where a throw aborts the process), with the message of
``kvops.export.streaming.device_message`` (the argument and the fix, not the values). The step masks its moves and
writes with the same checks, so a failing step writes nothing whichever kernel runs first.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.virtualized import V, ops


def register(register_lowering) -> None:
    from torch._inductor.lowering import lowerings

    assert_async = lowerings[torch.ops.aten._assert_async.msg]

    @register_lowering(torch.ops.kvops.stream_positions.default, type_promotion_kind=None)
    def stream_positions(state, sink_tokens, kv_cache_size):
        from kvops.export.streaming import CHECKS, device_message

        load = state.make_loader()
        for i in range(CHECKS):
            def holds(_, i=i):
                return ops.ge(load([6 + i]), ops.constant(0, torch.int64))

            cond = ir.Pointwise.create(device=state.get_device(), dtype=torch.bool, inner_fn=holds, ranges=[])
            # never fused with another kernel: the assert stays a 0-d loop of its own, outside any OpenMP region
            V.graph.no_fuse_buffer_names.add(assert_async(cond, device_message(i)).get_name())
        return state
