"""Validators: one per op, called by the op's eager kernels *and* its fake rule.

Because the fake rule calls the same function, a contract violation raises the same exception type and message in
eager mode, under ``torch.export`` (propagated unchanged) and under ``torch.compile(fullgraph=True)`` (raised at trace
time; Dynamo wraps it in ``TorchRuntimeError`` whose text carries the original type and message).

Validators only look at metadata (shapes, dtypes, devices) and at position arguments, which may be ``SymInt``s at
trace time. They never read tensor contents, so they add no host sync.
"""
