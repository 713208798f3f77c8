"""Compiler integrations for kvops ops: Inductor lowerings (and, elsewhere in this package, ONNX translations).

``register()`` is the single entry point; ``import kvops`` calls it. It does not import Inductor (a multi-second
import): if ``torch._inductor.lowering`` is already loaded the lowerings are registered at once, otherwise a one-shot
post-import hook registers them right after that module is first imported, which ``torch.compile`` does before it
lowers any graph. Nothing is compiled and no torch config is changed.

Lowerings (each replaces the op's extern kernel call by a scatter that fuses with the producer of the written values):

- ``kvops::cache_write``, ``kvops::cache_roll``: ``lowering/inductor_contiguous.py``
- ``kvops::paged_cache_write``: ``lowering/inductor_paged.py``
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

_INDUCTOR_LOWERING = "torch._inductor.lowering"
_registered = False


def register_inductor_lowerings() -> None:
    """Register the Inductor lowerings of the kvops write ops now (imports Inductor). Idempotent."""
    global _registered
    if _registered:
        return
    import torch
    from torch._inductor.lowering import register_lowering

    import kvops  # noqa: F401  (defines the ops)

    from . import inductor_contiguous, inductor_paged

    ops = torch.ops.kvops
    register_lowering(ops.cache_write.default, type_promotion_kind=None)(inductor_contiguous.cache_write)
    register_lowering(ops.cache_roll.default, type_promotion_kind=None)(inductor_contiguous.cache_roll)
    inductor_paged.register(register_lowering)
    _registered = True


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then ``callback``; anything else is delegated to the real loader."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot hook: when module ``name`` is imported, run ``callback`` right after it has executed."""

    def __init__(self, name, callback):
        self._name, self._callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self._callback)
                return spec
        return None


def _register_after_inductor_import() -> None:
    try:
        register_inductor_lowerings()
    except Exception as e:  # never break torch.compile: without the lowerings the ops run as extern kernels
        warnings.warn(f"kvops: Inductor lowerings not registered ({type(e).__name__}: {e}); writes will not fuse.")


def register() -> None:
    """Make ``torch.compile`` (Inductor) fuse kvops cache writes with their producers. Idempotent, cheap."""
    if _registered:
        return
    if _INDUCTOR_LOWERING in sys.modules:
        register_inductor_lowerings()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_INDUCTOR_LOWERING, _register_after_inductor_import))
