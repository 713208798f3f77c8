"""Packaging: ``lowering/`` installs as ``kvops.lowering`` (no top-level ``lowering``), every package is listed,
``import kvops`` works without triton, the runtime dependencies stay minimal, and the developer tools (``tools/``) are
neither installed nor imported by kvops."""

import os
import pathlib
import subprocess
import sys
import tomllib
import unittest
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(script: str) -> subprocess.CompletedProcess:
    # cwd "/" and no PYTHONPATH: the installed kvops, not a source folder on sys.path (whose lowering/ would import).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/", env=env)


class TestPackaging(unittest.TestCase):
    def test_every_package_folder_is_listed(self):
        folders = {"kvops"} | {
            "kvops." + ".".join(p.parent.relative_to(ROOT / "kvops").parts)
            for p in (ROOT / "kvops").rglob("__init__.py")
            if p.parent != ROOT / "kvops"
        }
        folders |= {
            "kvops.lowering" + "".join("." + x for x in p.parent.relative_to(ROOT / "lowering").parts)
            for p in (ROOT / "lowering").rglob("__init__.py")
        }
        self.assertEqual(sorted(PYPROJECT["tool"]["setuptools"]["packages"]), sorted(folders))

    def test_runtime_never_imports_the_developer_tools(self):
        # tools/ (the ahead-of-time compile check) reaches into kvops' launchers; the runtime must not reach back
        import re

        sources = [*(ROOT / "kvops").rglob("*.py"), *(ROOT / "lowering").rglob("*.py")]
        self.assertGreater(len(sources), 50)
        upward = [str(p.relative_to(ROOT)) for p in sources
                  if re.search(r"^\s*(from\s+tools[\s.]|import\s+tools\b)", p.read_text(), re.M)]
        self.assertEqual(upward, [])
        self.assertTrue((ROOT / "tools" / "aot.py").exists())
        self.assertFalse(list((ROOT / "kvops").rglob("aot*.py")))

    def test_runtime_dependencies(self):
        deps = PYPROJECT["project"]["dependencies"]
        self.assertEqual([d.split(">")[0].split(";")[0].strip() for d in deps], ["torch", "numpy"])

    def test_no_top_level_lowering_module(self):
        out = _run(
            "import sys, importlib.util, kvops\n"
            "print('lowering' in sys.modules, importlib.util.find_spec('lowering') is None,"
            " kvops.lowering.__name__, sys.modules['kvops.lowering'] is kvops.lowering)"
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["False", "True", "kvops.lowering", "True"])

    def test_subpackages_are_attributes_and_optional_integrations_stay_out(self):
        out = _run(
            "import sys, kvops\n"
            "print(callable(kvops.export.functionalize), callable(kvops.transfer.compute_head_slice_params),"
            " kvops.packed.PackedCausalKVCache.__name__, 'transformers' in sys.modules, 'onnxscript' in sys.modules)"
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["True", "True", "PackedCausalKVCache", "False", "False"])

    def test_import_without_triton(self):
        # sys.modules["triton"] = None: `import triton` raises ModuleNotFoundError and importlib.util.find_spec
        # returns None, as where triton is not installed (torch 2.14 probes it with find_spec at import time, where a
        # finder that raises would break `import torch` itself). Output: nothing beyond what a plain `import torch`
        # prints in the same setup (torch 2.13 logged "Triton not available, find_triton_kernels = []" for
        # kvops::paged_attention, torch 2.14 "triton not found; flop counting ..." for kvops' lowerings).
        block = "import sys\nsys.modules['triton'] = None\n"
        plain = _run(block + "import torch")
        out = _run(
            block + "import torch, kvops\n"
            "from kvops.triton import HAS_TRITON\n"
            "k, v = torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2)\n"
            "kvops.cache_write(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), k, v, start=1)\n"
            "print(HAS_TRITON, k[0, :, 0, 0].tolist())"
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "False [0.0, 1.0, 0.0, 0.0]")
        self.assertEqual(out.stderr, plain.stderr)

    def test_wheel_ships_lowering_inside_kvops(self):
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            # Build from a copy: setuptools reuses (and leaves) a build/ folder in the tree it builds.
            src = pathlib.Path(d) / "src"
            shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
            out = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", d, str(src)],
                capture_output=True, text=True, timeout=300,
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            (wheel,) = pathlib.Path(d).glob("kvops-*.whl")
            names = zipfile.ZipFile(wheel).namelist()
        self.assertIn("kvops/lowering/__init__.py", names)
        self.assertFalse([n for n in names if n.startswith(("lowering/", "tools/"))])


if __name__ == "__main__":
    unittest.main()
