"""Branch-free integer clamps for a cache's cursor arithmetic, without ``Max``/``Min`` terms under ``torch.compile``.

Under ``torch.compile`` a cache's int cursors become ``SymInt``s. Clamping them with ``torch.sym_max``/``sym_min``
keeps one graph for appends, rewrites and evictions, but puts sympy ``Max``/``Min`` terms into the guards (the cache's
own range checks, the ops' validators that receive a clamped row, Inductor's size checks). Inductor's on-disk FX
graph cache (on by default, shared by every process using one ``TORCHINDUCTOR_CACHE_DIR``) stores a compiled graph's
guards as one Python expression and, on a hit in a later process, evaluates it again with the new graph's
``SymInt``s (torch 2.13 ``FxGraphCache._lookup_graph``: "re-evaluate with the symints to add any guards to the
current env"). There a stored ``Max(a, b)`` is printed as Python's ``max(a, b)``, which compares ``a`` with ``b`` and
guards on the outcome: the warm graph specializes on whether that call appended or evicted, and the next call of the
other kind recompiles (measured, tests/export/test_warm_cache.py: a sink stream compiled 3 graphs cold and 8, the default
``recompile_limit``, warm).

The clamps below are built from ``abs`` and ``//`` instead (``max(0, x) = (x + |x|) // 2``): re-evaluated,
``abs``/``//`` on ``SymInt``s compare nothing, so a stored guard adds back exactly itself and the warm run compiles
the cold run's graphs. Nested clamps make Inductor's sympy work grow quickly (its loop tiling simplifies sizes that
contain them), so callers keep every clamp's argument linear in the cursors where they can (one level; see
``kvops.cache._placement``). On Python ints they are exact (the values of ``max``/``min``); there is no fast path for them,
because under Dynamo a ``SymInt`` passes ``isinstance(x, int)`` and fails ``isinstance(x, torch.SymInt)``.
"""

from __future__ import annotations

__all__ = ["any_negative", "positive", "relu", "smax", "smin"]


def relu(x):
    """``max(0, x)`` without a comparison: ``(x + |x|) // 2``."""
    return (x + abs(x)) // 2


def positive(x):
    """``1 if x > 0 else 0`` for an integer ``x``, without a comparison: ``relu(x) - relu(x - 1)``."""
    return relu(x) - relu(x - 1)


def smax(a, b):
    """``max(a, b)`` without a comparison."""
    return b + relu(a - b)


def smin(a, b):
    """``min(a, b)`` without a comparison."""
    return a - relu(a - b)


def any_negative(*xs) -> bool:
    """``any(x < 0 for x in xs)`` as one comparison: one guard under ``torch.compile`` whatever the outcome (Python's
    ``or`` would guard on each term up to the first true one, and a compound ``SymBool`` trips torch 2.13's guard
    builder); the guard holds ``Abs`` terms, no ``Min``."""
    return sum(abs(x) - x for x in xs) > 0
