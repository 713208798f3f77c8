"""Optional dependencies (the extras in ``pyproject.toml``): a missing one names the extra that installs it."""

from __future__ import annotations

import importlib


def require(extra: str, feature: str, *modules: str) -> None:
    """Import ``modules`` or raise ``ModuleNotFoundError`` naming ``extra`` and the pip lines that install it.

    ``feature`` is what needs them (e.g. ``"kvops.integrations.transformers"``). A transitive dependency missing
    (``onnx_ir`` under onnxscript) gets the same message: the extra pins all of them.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"{feature} needs the optional dependencies of kvops' '{extra}' extra ({e}). Install them with "
                f"pip install 'kvops[{extra}]', or from a clone of kvops: pip install -e '.[{extra}]'",
                name=e.name,
            ) from e
