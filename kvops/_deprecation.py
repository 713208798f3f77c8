"""Deprecated names of the public API (docs/names.md): each still works for one release, with a ``DeprecationWarning``
that names its replacement. kvops 0.1 keeps them; the release after removes them."""

from __future__ import annotations

import functools
import warnings

REMOVED_IN = "0.2"


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """One ``DeprecationWarning``: ``old`` is deprecated, use ``new`` (removed in kvops ``REMOVED_IN``)."""
    warnings.warn(f"{old} is deprecated and will be removed in kvops {REMOVED_IN}; use {new} (docs/names.md).",
                  DeprecationWarning, stacklevel=stacklevel)


def renamed_method(old: str, new: str):
    """A method ``old`` of a class that calls its method ``new`` after warning (``old = renamed_method("old", "new")``
    in the class body)."""

    def method(self, *args, **kwargs):
        warn_renamed(f"{type(self).__name__}.{old}()", f"{type(self).__name__}.{new}()")
        return getattr(self, new)(*args, **kwargs)

    method.__name__ = method.__qualname__ = old
    method.__doc__ = f"Deprecated name of :meth:`{new}` (docs/names.md); warns, then calls it."
    return method


def renamed_function(func, old: str, new: str):
    """``func`` under its deprecated name ``old`` (a qualified name, e.g. ``"kvops.transfer.plan_for_writer"``)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        warn_renamed(f"{old}()", f"{new}()")
        return func(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = old.rsplit(".", 1)[-1]
    wrapper.__doc__ = f"Deprecated name of :func:`{new}` (docs/names.md); warns, then calls it."
    return wrapper


def renamed_keyword(func, old: str, new: str):
    """``func`` that also accepts its keyword argument ``new`` under the deprecated name ``old`` (with a warning)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"{func.__name__}() got both {new}= and its deprecated name {old}=; pass {new}= only.")
            warn_renamed(f"{func.__name__}({old}=...)", f"{func.__name__}({new}=...)")
            kwargs[new] = kwargs.pop(old)
        return func(*args, **kwargs)

    return wrapper
