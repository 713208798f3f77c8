"""Test helper: import an example or benchmark script (``examples/<name>.py``, ``benchmarks/``) as a module."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example(name: str):
    return load_module(ROOT / "examples" / f"{name}.py", f"kvops_example_{name}")


def load_module(path: pathlib.Path, name: str):
    """Import the script at ``path`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # strict export (Dynamo) imports the module of the code it traces
    spec.loader.exec_module(module)
    return module
