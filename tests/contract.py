"""Test helper: a contract error must be the same in eager, ``torch.compile(fullgraph=True)`` and ``torch.export``.

Usage in a test (``expecttest.TestCase``)::

    msg = raises_everywhere(self, ValueError, lambda k, v: kvops.cache_write(...), (k, v))
    self.assertExpectedInline(msg, '''...''')
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.utils._python_dispatch


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def raises_everywhere(
    test,
    exc_type: type[BaseException],
    fn,
    args,
    modes=("eager", "compile", "export"),
    compile_exc: type[BaseException] = torch._dynamo.exc.TorchRuntimeError,
) -> str:
    """Run ``fn(*args)`` in each mode; assert it raises ``exc_type`` with one message everywhere; return it.

    - eager: the exception itself.
    - export: the original exception propagates unchanged (same type, same message).
    - compile (fullgraph=True): raised at trace time; Dynamo wraps it in ``compile_exc`` whose text carries
      ``TypeName('message')``: ``TorchRuntimeError`` for an error raised by a fake rule (the default),
      ``torch._dynamo.exc.Unsupported`` ("Observed exception") for one raised by Python code Dynamo traces (e.g. a
      cache module's bookkeeping).
    """
    message = None
    if "eager" in modes:
        with test.assertRaises(exc_type) as cm:
            fn(*args)
        assert type(cm.exception) is exc_type, type(cm.exception)
        message = str(cm.exception)
    if "export" in modes:
        with test.assertRaises(exc_type) as cm:
            torch.export.export(_Wrap(fn), tuple(args), strict=False)
        assert type(cm.exception) is exc_type, type(cm.exception)
        if message is None:
            message = str(cm.exception)
        test.assertEqual(str(cm.exception), message)
    if "compile" in modes:
        torch._dynamo.reset()
        with test.assertRaises(compile_exc) as cm:
            torch.compile(fn, fullgraph=True, backend="eager")(*args)
        text = str(cm.exception)
        test.assertTrue(any(form in text for form in dynamo_exception_forms(exc_type, message)), text)
    return message


def raises_for_each(
    test,
    exc_type: type[BaseException],
    fn,
    args,
    values,
    compile_exc: type[BaseException] = torch._dynamo.exc.TorchRuntimeError,
) -> list[str]:
    """``fn(*args, value)`` for each of ``values`` (Python numbers) must raise ``exc_type`` with one message in eager,
    ``torch.export`` and one ``torch.compile(fullgraph=True)`` function called with each value in turn; returns the
    messages, one per value.

    The compiled function is the same across the values, so its second call recompiles with the number symbolic
    (Dynamo's automatic dynamic shapes: a SymFloat or SymInt): a message that formats the traced number must still
    come out whole, not as Dynamo's error about formatting it (``compile_exc``: as in :func:`raises_everywhere`).
    """
    messages = []
    for value in values:
        messages.append(raises_everywhere(test, exc_type, lambda *a, v=value: fn(*a, v), args,
                                          modes=("eager", "export"), compile_exc=compile_exc))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for value, message in zip(values, messages):
        with test.assertRaises(compile_exc) as cm:
            compiled(*args, value)
        text = str(cm.exception)
        test.assertTrue(any(form in text for form in dynamo_exception_forms(exc_type, message)), text)
    return messages


def dynamo_exception_forms(exc_type: type[BaseException], message: str) -> tuple[str, ...]:
    """How Dynamo's error text shows the exception ``exc_type(message)`` it traced: ``ValueError('msg')`` (torch
    2.13-2.15, and any wrapped fake-rule error); torch 2.11 prints an exception raised by traced Python code with its
    argument as Dynamo's variable, ``ValueError([ConstantVariable(str: 'msg')])``. Either form carries the whole
    message, so the check stays exact."""
    return (f"{exc_type.__name__}({message!r})", f"{exc_type.__name__}([ConstantVariable(str: {message!r})])")


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees (``ops``): shows that a fast path still lets modes
    see the op."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
