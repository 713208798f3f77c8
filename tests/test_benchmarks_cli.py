"""Every benchmark's command line: ``--help`` answers without importing torch (well under a second), every option has
help text, the description is whole sentences and cites no internal issue numbers; ``plots.py`` says it is a helper.

Generic over ``benchmarks/*.py``: a new benchmark is checked as soon as it exists. Each runs in its own subprocess
(all at once), through ``runpy`` as ``__main__`` with ``--help``, recording the parsers it builds and whether torch
got imported.
"""

import json
import pathlib
import subprocess
import sys
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
HELPERS = {"plots.py"}  # imported by the benchmarks, not run: says so when run

SCRIPT = r"""
import argparse, contextlib, io, json, runpy, sys, time
results = {}
parsers = []
original = argparse.ArgumentParser.parse_args
def recording(self, *args, **kwargs):
    parsers.append(self)
    return original(self, *args, **kwargs)
argparse.ArgumentParser.parse_args = recording
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    seconds = time.perf_counter() - t0
    options = [(a.option_strings, a.help) for p in parsers for a in p._actions if a.option_strings]
    results[path] = dict(code=code if isinstance(code, (int, type(None))) else str(code), stdout=out.getvalue(),
                         stderr=err.getvalue(), seconds=seconds, options=options,
                         descriptions=[p.description for p in parsers],
                         heavy=[m for m in ("torch", "kvops", "numpy") if m in sys.modules])
print(json.dumps(results))
"""


class TestBenchmarkCommandLines(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT) for path in BENCHMARKS]
        cls.results = {}
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr
            cls.results.update({pathlib.Path(k).name: v for k, v in json.loads(stdout.splitlines()[-1]).items()})

    def test_help_answers_without_importing_torch(self):
        self.assertGreaterEqual(len(self.results), 7)
        for name, r in self.results.items():
            with self.subTest(name):
                self.assertEqual(r["heavy"], [], f"{name} --help imported {r['heavy']} (parse arguments first)")
                if name in HELPERS:
                    continue
                self.assertEqual(r["code"], 0, r["stderr"])
                self.assertIn("usage:", r["stdout"])

    def test_every_option_has_help_and_descriptions_are_whole(self):
        for name, r in self.results.items():
            if name in HELPERS:
                continue
            with self.subTest(name):
                self.assertTrue(r["options"], f"{name} builds no argparse parser")
                for flags, text in r["options"]:
                    self.assertTrue(text and text.strip(), f"{name}: {flags} has no help text")
                for description in r["descriptions"]:
                    self.assertTrue(description and description.rstrip().endswith("."), (name, description))
                self.assertNotRegex(r["stdout"], r"(?i)\bissues? \d", f"{name} --help cites an issue number")

    def test_helper_says_what_it_is(self):
        for name in HELPERS:
            with self.subTest(name):
                r = self.results[name]
                self.assertNotEqual(r["code"], 0)
                self.assertIn("is not a benchmark", str(r["code"]))
                self.assertIn("python benchmarks/paged_decode.py", str(r["code"]))


if __name__ == "__main__":
    unittest.main()
