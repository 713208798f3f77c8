"""Unhappy-path harness (docs/semantics.md): a failing call raises a clear error and changes nothing.

A *case* is a call that must fail. ``check_failing_call`` snapshots every tensor (its whole storage, bytewise) and every
plain cursor (ints, floats, bools, strings, ``None``, tuples of them) reachable from ``state``, runs the call, and
asserts

(a) it raises exactly ``exc`` and the message contains each of ``needles`` (the argument's name, the value, the fix);
(b) every snapshotted tensor byte and cursor is unchanged (NaN payloads compare bitwise, so they count as equal);

``run_isolated`` runs code in a fresh interpreter and reports a death by signal, for (c) "no input kills the
process" on native paths.

Usage::

    check_failing_call(self, lambda: cache.update(k, v_short), ValueError, ["value", "2", "key"], state=cache)

**The case registry and the report**: every adversarial case of the project, whatever file defines it, is
counted by one runner::

    python -m tests.unhappy --report            # counts per class, per source and in total (JSON on the last line)
    python -m tests.unhappy --report -v         # also every case that is not "clear", with its detail
    python -m tests.unhappy --report --source ops   # one source only
    python -m tests.unhappy --report --repo /work/main   # count another checkout's kvops (the same cases)

Each case runs in a forked child (a crash or a hang is one outcome, not the end of the run) and is classified as
``clear`` (the documented error: type, every needle, nothing changed; or, for a case that must succeed, a result its
``check`` accepts), ``unclear`` (another type, or a message missing a needle; nothing changed), ``changed-on-failure``
(raised after changing a tensor byte or a cursor), ``silent-wrong`` (returned where it must fail, or returned a wrong
result / changed state where it must succeed), ``crash`` (killed by a signal) or ``hang`` (no outcome within its
timeout).

To add cases, append to ``SOURCES`` below (``label: module``) or create a module ``tests/unhappy_*_cases.py`` (found
automatically, labelled by its middle part). A source module exposes either

- ``unhappy_cases() -> list[Case]`` (``Case(name, build, exc, needles, mode=None, check=None, timeout=None)``,
  ``build() -> (call, state)``; ``exc=None``: the call must succeed and ``check(result)`` returns ``None`` or what is
  wrong; with both ``exc`` and ``check``, refusing clearly and returning a checked result both count as clear), or
- ``CASES: {name: (build, exc, needles)}`` with ``build() -> (state, call)`` (``tests/errors/test_unhappy_caches.py``'s form).
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
        elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):  # (NaN == NaN)
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


# --- the case registry and the report --------------------------------------------------------------------------------
OUTCOMES = ("clear", "unclear", "changed-on-failure", "silent-wrong", "crash", "hang")

# label -> module: every source of cases the report counts. Append a line for a new source (or name a module
# tests/unhappy_<label>_cases.py, which is found without one).
SOURCES = {
    "ops": "tests.unhappy_ops_cases",
    "caches": "tests.errors.test_unhappy_caches",
}


class Case:
    """One adversarial call. ``build()`` -> ``(call, state)``: a fresh call and everything it may touch (snapshotted).

    ``exc``: the exception it must raise (``needles``: strings its message must contain: the argument, the value, the
    fix); ``None``: it must succeed. ``check(result)`` -> ``None`` if the result is right, else what is wrong (with
    ``exc`` set too: refusing clearly and returning a right result are both clear). ``mode``: the value-check mode to
    run it in (default "eager"); ``timeout``: seconds before it counts as a hang (default: the runner's)."""

    def __init__(self, name, build, exc, needles=(), mode=None, check=None, timeout=None):
        self.name, self.build, self.exc, self.needles, self.mode = name, build, exc, tuple(needles), mode
        self.check, self.timeout = check, timeout


def classify(case: Case) -> tuple[str, str]:
    """``(outcome, detail)`` of one case, run in this process (see ``OUTCOMES``)."""
    import kvops

    call, state = case.build()
    before = snapshot(state)
    try:
        with kvops.value_checks(case.mode or "eager"):
            result = call()
    except BaseException as e:  # noqa: BLE001 - every exception is an outcome here
        msg = f"{type(e).__name__}: {e}"
        if changed(before, snapshot(state)):
            return "changed-on-failure", msg
        if case.exc is None or type(e) is not case.exc or not all(str(n) in str(e) for n in case.needles):
            return "unclear", msg
        return "clear", msg
    diffs = changed(before, snapshot(state))
    if case.check is not None:
        wrong = case.check(result)
        if wrong is None and (case.exc is not None or not diffs):
            return "clear", "right result"
        return "silent-wrong", wrong or f"state changed: {diffs[:3]}"
    if case.exc is None:
        if diffs:
            return "silent-wrong", f"state changed: {diffs[:3]}"
        if result is None or isinstance(result, (torch.Tensor, tuple)):
            return "clear", "returned"
    return "silent-wrong", f"returned {type(result).__name__} without an error"


def _run_forked(case: Case, timeout: float) -> tuple[str, str]:
    import json
    import select
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            outcome = classify(case)
        except BaseException:  # noqa: BLE001 - the case's build (or the harness) failed: report it
            outcome = ("unclear", "harness: " + traceback.format_exc()[-500:])
        os.write(w, json.dumps(outcome).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], case.timeout or timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return "hang", f"no outcome within {case.timeout or timeout} s"
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "crash", f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return tuple(json.loads(data)) if data else ("crash", f"exit status {os.WEXITSTATUS(status)}, no outcome")


def prepare_parent() -> None:
    """What forked children must inherit rather than redo: one intra-op thread (a started OpenMP pool does not
    survive a fork) and the native kernels, built and loaded."""
    torch.set_num_threads(1)
    import kvops
    from kvops import native

    kvops.paged_attention  # noqa: B018
    native.available()


def run_cases(cases, timeout: float = 60.0, fork: bool = True) -> list[tuple[str, str, str]]:
    """``[(case name, outcome, detail)]``; ``fork``: each case in a forked child (crash/hang isolation)."""
    prepare_parent()
    return [(c.name, *(_run_forked(c, timeout) if fork else classify(c))) for c in cases]


def source_modules() -> dict[str, str]:
    """``SOURCES`` and every ``tests/unhappy_*_cases.py`` (label: the ``*``)."""
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    found = dict(SOURCES)
    for path in sorted(glob.glob(os.path.join(here, "unhappy_*_cases.py"))):
        stem = os.path.basename(path)[:-3]
        label = stem[len("unhappy_"):-len("_cases")]
        if f"tests.{stem}" not in found.values():
            found[label] = f"tests.{stem}"
    return found


def cases_of(module_name: str) -> list[Case]:
    """A source module's cases (``unhappy_cases()``, or the ``CASES`` dict of test_unhappy_caches.py's form)."""
    import importlib

    mod = importlib.import_module(module_name)
    if hasattr(mod, "unhappy_cases"):
        return list(mod.unhappy_cases())
    out = []
    for name, (build, exc, needles) in mod.CASES.items():
        def swapped(build=build):
            state, call = build()
            return call, state
        out.append(Case(name, swapped, exc, needles))
    return out


def report(argv=None) -> dict:
    """``python -m tests.unhappy --report [-v] [--source LABEL ...] [--repo PATH] [--timeout S]``: run every source's
    cases and print the counts per class (per source, then in total; the last line is JSON)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m tests.unhappy", description=report.__doc__)
    p.add_argument("--report", action="store_true", help="run every registered case and print the counts")
    p.add_argument("-v", "--verbose", action="store_true", help="list every case that is not clear, with its detail")
    p.add_argument("--source", action="append", help="only this source (a SOURCES label; repeatable)")
    p.add_argument("--repo", help="import kvops from this checkout instead (the same cases, another kvops)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():  # Triton cases run in the interpreter (set before kvops is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.repo:
        sys.path.insert(0, os.path.abspath(args.repo))
    totals = dict.fromkeys(OUTCOMES, 0)
    per_source = {}
    for label, module in source_modules().items():
        if args.source and label not in args.source:
            continue
        results = run_cases(cases_of(module), timeout=args.timeout)
        counts = dict.fromkeys(OUTCOMES, 0)
        for name, outcome, detail in results:
            counts[outcome] = counts.get(outcome, 0) + 1
            totals[outcome] = totals.get(outcome, 0) + 1
            if args.verbose and outcome != "clear":
                print(f"{label:8s} {outcome:19s} {name}: {detail[:300]}", flush=True)
        per_source[label] = {"total": len(results), **counts}
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in per_source[label].items()), flush=True)
    out = {"total": sum(s["total"] for s in per_source.values()), **totals, "sources": per_source}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    report()
