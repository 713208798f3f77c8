"""Every schema of the ``kvops`` namespace is written in ``kvops/_library.py``, and reads there as torch has it.

``_library.py`` defines the schemas (``lib.define("name(...) -> ...")``); an op whose schema torch infers (a
``torch.library.triton_op``) is written there as a module constant named after it in capitals (``PAGED_ATTENTION =
"(...) -> ..."``). The test enumerates every op registered in the namespace once kvops, its exports and its native
build are loaded, and compares each with the text of ``_library.py`` (both parsed by torch, so only the schemas
themselves count, not their spelling); the C++ sources and the other Python modules register kernels only.
"""

import ast
import pathlib
import re
import unittest

import torch

import kvops
import kvops.export  # noqa: F401  (the functional variants' kernels)
import kvops.native

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "kvops" / "_library.py"


def _string(node) -> str | None:
    """The value of a string literal (implicit concatenation is one Constant), else None."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def documented() -> dict[str, str]:
    """{op name: schema text} of ``kvops/_library.py``: its ``lib.define`` calls and its CAPITAL schema constants."""
    out = {}
    for node in ast.walk(ast.parse(LIBRARY.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "define"
                and node.args and _string(node.args[0])):
            text = _string(node.args[0])
            out[text[: text.index("(")]] = text
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id.isupper() and (_string(node.value) or "").startswith("(")):
            out[node.targets[0].id.lower()] = node.targets[0].id.lower() + _string(node.value)
    return out


def registered() -> dict[str, torch.FunctionSchema]:
    """{op name: schema} of every op of the kvops namespace (after the native build registered its kernels)."""
    kvops.native.available()
    out = {}
    for qualname in torch._C._dispatch_get_all_op_names():
        if qualname.startswith("kvops::"):
            name = qualname.split("::", 1)[1]
            overload = name.split(".", 1)[1] if "." in name else "default"
            out[name.split(".")[0]] = getattr(getattr(torch.ops.kvops, name.split(".")[0]), overload)._schema
    return out


class TestSchemas(unittest.TestCase):
    def test_every_registered_op_is_in_library(self):
        docs, ops = documented(), registered()
        self.assertGreaterEqual(len(ops), 15)
        self.assertEqual(sorted(set(ops) - set(docs)), [], "ops registered without their schema in kvops/_library.py")
        self.assertEqual(sorted(set(docs) - set(ops)), [], "schemas in kvops/_library.py no op is registered with")

    def test_documented_schemas_match(self):
        docs = documented()
        for name, schema in sorted(registered().items()):
            with self.subTest(op=name):
                self.assertEqual(str(torch._C.parse_schema(f"kvops::{docs[name]}")), str(schema))

    def test_functional_variants_mirror_their_mutating_ops(self):
        ops = registered()
        for name in ("cache_write", "cache_roll", "paged_cache_write"):
            with self.subTest(op=name):
                mutating, functional = ops[name], ops[f"{name}_functional"]
                self.assertEqual(re.sub(r"\([a-z]!\)", "", str(mutating)).split("(", 1)[1].rsplit(" -> ", 1)[0],
                                 str(functional).split("(", 1)[1].rsplit(" -> ", 1)[0])
                self.assertEqual(str(functional).rsplit(" -> ", 1)[1], "(Tensor, Tensor)")

    def test_no_schema_outside_library(self):
        """C++ sources register kernels only (``TORCH_LIBRARY_IMPL``); no Python module but ``_library.py`` calls
        ``define`` (a ``triton_op``'s inferred schema is checked against its constant above)."""
        for path in sorted((ROOT / "kvops").rglob("*.cpp")) + sorted((ROOT / "kvops").rglob("*.h")):
            code = re.sub(r"//[^\n]*", "", path.read_text())
            defs = re.findall(r"TORCH_LIBRARY(?:_FRAGMENT)?\s*\(|\bm\.def\s*\([^;]*", code)
            self.assertEqual(defs, [], f"{path.relative_to(ROOT)} defines a schema: move it to kvops/_library.py")
        for path in sorted((ROOT / "kvops").rglob("*.py")):
            if path == LIBRARY:
                continue
            calls = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr == "define"]
            self.assertEqual(calls, [], f"{path.relative_to(ROOT)} defines a schema: move it to kvops/_library.py")


if __name__ == "__main__":
    unittest.main()
