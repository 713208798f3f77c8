"""Unhappy-path harness (issue 17 §2): a failing call raises a clear error and changes nothing.

A *case* is a call that must fail. ``check_failing_call`` snapshots every tensor (its whole storage, bytewise) and every
plain cursor (ints, floats, bools, strings, ``None``, tuples of them) reachable from ``state``, runs the call, and
asserts

(a) it raises exactly ``exc`` and the message contains each of ``needles`` (the argument's name, the value, the fix);
(b) every snapshotted tensor byte and cursor is unchanged (NaN payloads compare bitwise, so they count as equal);

``run_isolated`` runs code in a fresh interpreter and reports a death by signal, for (c) "no input kills the
process" on native paths.

Usage::

    check_failing_call(self, lambda: cache.update(k, v_short), ValueError, ["value", "2", "key"], state=cache)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor | None:
    if t.device.type == "meta" or t.is_sparse:
        return None
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s).cpu().clone()


def snapshot(state, max_depth: int = 4) -> dict:
    """``{path: value}`` for every tensor and plain cursor reachable from ``state`` (objects' ``__dict__``/slots,
    lists, tuples, dicts, ``nn.Module`` buffers), tensors as (shape, stride, offset, dtype, whole-storage bytes)."""
    out: dict = {}
    seen: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            out[path] = ("tensor", tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype,
                         _storage_bytes(obj))
            return
        if isinstance(obj, _ATOMS):
            out[path] = obj
            return
        if depth >= max_depth or id(obj) in seen or callable(obj) and not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            out[path + ".__len__"] = len(obj)
            for i, x in enumerate(obj):
                walk(x, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            out[path + ".__keys__"] = tuple(sorted(map(repr, obj)))
            for k, x in obj.items():
                walk(x, f"{path}[{k!r}]", depth + 1)
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    fields[name] = getattr(obj, name)
            if isinstance(obj, torch.nn.Module):
                fields.update({f"buffer:{n}": b for n, b in obj.named_buffers()})
            for name, x in fields.items():
                walk(x, f"{path}.{name}", depth + 1)

    walk(state, "state", 0)
    return out


def changed(before: dict, after: dict) -> list[str]:
    """The paths whose value differs between two snapshots (tensors compared bytewise, whole storage)."""
    diffs = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path, "<absent>"), after.get(path, "<absent>")
        if isinstance(a, tuple) and a and a[0] == "tensor" and isinstance(b, tuple) and b and b[0] == "tensor":
            if a[:5] != b[:5]:
                diffs.append(f"{path}: layout {a[1:5]} -> {b[1:5]}")
            elif (a[5] is None) != (b[5] is None) or a[5] is not None and not torch.equal(a[5], b[5]):
                diffs.append(f"{path}: contents changed")
        elif a != b:
            diffs.append(f"{path}: {a!r} -> {b!r}")
    return diffs


def check_failing_call(test, call, exc: type[BaseException], needles=(), state=()) -> str:
    """Assert ``call()`` raises exactly ``exc`` with every needle in its message and leaves ``state`` unchanged;
    return the message (for ``assertExpectedInline``)."""
    before = snapshot(state)
    with test.assertRaises(BaseException) as cm:
        call()
    e = cm.exception
    test.assertIs(type(e), exc, f"expected {exc.__name__}, got {type(e).__name__}: {e}")
    message = str(e)
    for needle in needles:
        test.assertIn(str(needle), message)
    test.assertEqual(changed(before, snapshot(state)), [], f"state changed by a failing call ({message})")
    return message


def run_isolated(code: str, timeout: float = 300.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process (the repository root on ``sys.path``); raise ``AssertionError`` if it
    died of a signal (segfault, SIGFPE, SIGABRT) or hung past ``timeout`` seconds. Returns the finished process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=root)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hung for more than {timeout} s:\n{code}") from e
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise AssertionError(f"process killed by {name}:\n{code}\nstderr:\n{proc.stderr[-3000:]}")
    return proc
