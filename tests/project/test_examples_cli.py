"""Every example's ``--help``: it answers when run from another working directory (the examples import their shared
helpers, ``examples/_common.py``, from their own folder), every option has help text, and every option that takes a
value shows its default.

Generic over ``examples/*.py``: a new example is checked as soon as it exists. Each runs in its own subprocess (all at
once, in a temporary working directory), through ``runpy`` as ``__main__`` with ``--help``, recording the parsers
it builds and each option's help as ``--help`` prints it.
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))

SCRIPT = r"""
import argparse, contextlib, io, json, runpy, sys
parsers = []
original = argparse.ArgumentParser.parse_args
def recording(self, *args, **kwargs):
    parsers.append(self)
    return original(self, *args, **kwargs)
argparse.ArgumentParser.parse_args = recording
path = sys.argv[1]
sys.argv = [path, "--help"]
out = io.StringIO()
code = None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
options = []
for p in parsers:
    formatter = p._get_formatter()
    for a in p._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            flag = isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            options.append(dict(flags=a.option_strings, help=a.help, shown=formatter._expand_help(a) if a.help else "",
                                flag=flag))
print(json.dumps(dict(code=code, stdout=out.getvalue(), options=options)))
"""


class TestExampleCommandLines(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        procs = {path.name: subprocess.Popen([sys.executable, "-c", SCRIPT, str(path)], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, cwd=cls.tmp.name)
                 for path in EXAMPLES}
        cls.results = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            cls.results[name] = json.loads(stdout.splitlines()[-1])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_help_answers_from_another_directory(self):
        self.assertGreaterEqual(len(self.results), 4)
        for name, r in self.results.items():
            with self.subTest(name):
                self.assertEqual(r["code"], 0)
                self.assertIn(f"usage: {name}", r["stdout"])

    def test_every_option_has_help_and_shows_its_default(self):
        for name, r in self.results.items():
            with self.subTest(name):
                self.assertTrue(r["options"], f"{name} builds no argparse parser")
                for option in r["options"]:
                    self.assertTrue(option["help"] and option["help"].strip(), f"{name}: {option['flags']} has no help")
                    if not option["flag"]:  # a flag is off unless given; every other option says its default
                        self.assertRegex(option["shown"], r"\(default: [^)]+\)", f"{name}: {option['flags']}")
                        self.assertIn(" ".join(option["shown"].split()), " ".join(r["stdout"].split()))


if __name__ == "__main__":
    unittest.main()
