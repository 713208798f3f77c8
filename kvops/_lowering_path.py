"""Import the compiler integrations (the repository's ``lowering/`` folder) as the subpackage ``kvops.lowering``.

An installed wheel ships ``lowering/`` as ``kvops/lowering`` (``pyproject.toml``: ``package-dir``), so the plain import
works. In a source tree (a checkout, an editable install, a git worktree) the folder sits next to ``kvops/``: it is
loaded from there, so a checkout always uses its own ``lowering/`` and no top-level module named ``lowering`` exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys


def import_lowering():
    name = "kvops.lowering"
    if name in sys.modules:
        return sys.modules[name]
    sibling = pathlib.Path(__file__).resolve().parents[1] / "lowering"
    if not (sibling / "__init__.py").is_file():
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(
        name, sibling / "__init__.py", submodule_search_locations=[str(sibling)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
