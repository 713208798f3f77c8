"""Dependencies point down (CONTRIBUTING.md, "Where things live"): every ``import`` in ``kvops/`` and ``lowering/``,
read by AST (function-level imports included), goes to the importing module's own folder or file, or to a layer with
a larger number in CONTRIBUTING.md's layer table. The table is read from CONTRIBUTING.md, so the rule and its test
cannot drift apart; every module must belong to a row. An order of layers also rules out import cycles between them.
"""

import ast
import pathlib
import re
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"


def layer_table() -> dict[str, int]:
    """{path (``kvops/cache/`` or ``kvops/_library.py``): layer number} from CONTRIBUTING.md's table."""
    rows = {}
    for line in CONTRIBUTING.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for path in re.findall(r"`([^`]+)`", m.group(2)):
                rows[path] = int(m.group(1))
    return rows


def module_files() -> list[pathlib.Path]:
    return sorted([*(ROOT / "kvops").rglob("*.py"), *(ROOT / "lowering").rglob("*.py")])


def module_name(path: pathlib.Path) -> str:
    """``kvops.cache.packed`` for kvops/cache/packed.py; lowering/ is ``kvops.lowering``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "lowering":
        parts = ["kvops", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def path_of(module: str) -> str | None:
    """The repository path of a kvops module (a file, or a package's ``__init__.py``); None outside kvops. A name
    that is not a module (``from kvops.ops import paged_attention``: a function) is its parent's."""
    parts = module.split(".")
    if parts[0] != "kvops":
        return None
    while parts:
        in_lowering = parts[1:2] == ["lowering"]
        base = ROOT.joinpath("lowering", *parts[2:]) if in_lowering else ROOT.joinpath("kvops", *parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file() and (len(parts) > 1 or candidate.name == "__init__.py"):
                return candidate.relative_to(ROOT).as_posix()
        parts = parts[:-1]
    return None


def entry_of(path: str, table: dict[str, int]) -> str | None:
    """The table's entry (folder or file) a repository path belongs to: the longest matching one."""
    matches = [e for e in table if path == e or (e.endswith("/") and path.startswith(e))]
    return max(matches, key=len) if matches else None


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in the file (``from X import a`` names ``X.a`` and ``X``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


class TestLayers(unittest.TestCase):
    def test_the_table(self):
        table = layer_table()
        self.assertIn("kvops/_library.py", table)
        self.assertLess(table["kvops/cache/"], table["kvops/ops/"])
        self.assertLess(table["kvops/ops/"], table["kvops/_checks/"])
        self.assertLess(table["kvops/_checks/"], table["kvops/_library.py"])

    def test_every_module_has_a_layer(self):
        table = layer_table()
        missing = [p.relative_to(ROOT).as_posix() for p in module_files()
                   if entry_of(p.relative_to(ROOT).as_posix(), table) is None]
        self.assertEqual(missing, [], "add these to CONTRIBUTING.md's layer table")

    def test_imports_point_down(self):
        table = layer_table()
        bad = []
        for path in module_files():
            rel = path.relative_to(ROOT).as_posix()
            source = entry_of(rel, table)
            for line, module in imports(path):
                target_path = path_of(module)
                if target_path is None:
                    continue  # not kvops (torch, triton, the standard library)
                target = entry_of(target_path, table)
                if target == source:
                    continue
                if target is None or table[target] <= table[source]:
                    bad.append(f"{rel}:{line} imports {module} ({target}, layer {table.get(target)}) from layer "
                               f"{table[source]} ({source})")
        self.assertEqual(bad, [], "dependencies point down (CONTRIBUTING.md's layer table)")

    def test_the_checker_sees_a_violation(self):
        table = layer_table()
        self.assertEqual(entry_of(path_of("kvops.cache.causal"), table), "kvops/cache/")
        self.assertEqual(entry_of(path_of("kvops.lowering.inductor_paged"), table), "lowering/")
        self.assertEqual(entry_of(path_of("kvops.ops.paged_attention.paged_attention"), table), "kvops/ops/")
        self.assertEqual(path_of("kvops"), "kvops/__init__.py")
        self.assertIsNone(path_of("torch.library"))
        self.assertGreater(table[entry_of(path_of("kvops._checks.values"), table)], table["kvops/ops/"])


if __name__ == "__main__":
    unittest.main()
