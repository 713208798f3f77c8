"""The README and docs/ pages: CI runs exactly the README's test command, the quick subset exists, the README's tour
and every ```python block of every docs/*.md page run, links resolve, and the docs agree on what `import kvops`
changes.

Convention for docs pages: a ```python block runs here (the blocks of one page share a scope, in order); a ```py,
```bash or indented block is illustrative (it needs a model, a GPU, several processes, ...) and is not run.
"""

import pathlib
import re
import tomllib
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


class TestReadme(unittest.TestCase):
    def test_ci_runs_the_readme_test_command(self):
        bash = [b.strip() for b in blocks(README, "bash")]
        full = [b for b in bash if "pytest" in b and "-m quick" not in b]
        self.assertEqual(len(full), 1, bash)
        ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
        self.assertIn(full[0], ci_lines)

    def test_quick_subset_is_declared(self):
        bash = [b.strip() for b in blocks(README, "bash")]
        # a reader may run it first: it installs the test extra (pytest, xdist) itself
        self.assertIn("pip install -e '.[test]' && python -m pytest -q -n 2 --dist loadfile -m quick tests", bash)
        markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
        self.assertTrue(any(m.startswith("quick:") for m in markers), markers)
        from tests.conftest import QUICK_MODULES

        for module in QUICK_MODULES:
            self.assertEqual(len(list((ROOT / "tests").glob(f"*/{module}.py"))), 1, module)

    def test_tour_runs(self):
        (tour,) = blocks(README, "python")
        self.assertLessEqual(len(tour.strip().splitlines()), 25, "the README's tour stays short: docs/api-tour.md")
        scope: dict = {}
        exec(compile(tour, "README.md", "exec"), scope)
        self.assertEqual(tuple(scope["out"].shape), (6, 14, 64))

    def test_docs_snippets_run(self):
        ran = {}
        for page in DOCS:
            code = blocks(page.read_text(), "python")
            if not code:
                continue
            scope: dict = {}
            with self.subTest(page.name):
                for i, block in enumerate(code):
                    exec(compile(block, f"docs/{page.name} (python block {i + 1})", "exec"), scope)
            ran[page.name] = scope
        tour = ran["api-tour.md"]
        self.assertEqual(tuple(tour["out"].shape), (6, 14, 64))
        self.assertEqual(tuple(tour["o"].shape), (2, 1, 14, 64))

    def test_links_resolve(self):
        for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS]:
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
                if "://" in target:
                    continue
                with self.subTest(page=page.name, target=target):
                    self.assertTrue((page.parent / target).exists())

    def test_every_docs_page_is_linked_from_the_readme(self):
        for page in DOCS:
            with self.subTest(page.name):
                self.assertIn(f"(docs/{page.name})", README)

    def test_import_side_effect_is_documented_alike(self):
        # kvops/__init__.py, CONTRIBUTING.md and docs/compile.md all say: import appends to cache_key_tag, nothing else.
        import kvops

        for name, text in [("kvops/__init__.py", kvops.__doc__), ("CONTRIBUTING.md", (ROOT / "CONTRIBUTING.md").read_text()),
                           ("docs/compile.md", (ROOT / "docs" / "compile.md").read_text())]:
            with self.subTest(name):
                flat = " ".join(text.split())
                self.assertIn("torch.compiler.config.cache_key_tag", flat)
                self.assertNotIn("no global config is changed", flat)


if __name__ == "__main__":
    unittest.main()
