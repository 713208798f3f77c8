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


    def test_runtime_never_imports_the_oracles(self):
        """``kvops/reference/`` holds the readable fp64 oracles the tests compare against; the runtime's CPU kernels
        are ``kvops/cpu/``. No import statement outside ``kvops/reference/`` names it (``kvops/``, and ``lowering/``
        as ``kvops.lowering``), and a process that runs every op family on CPU (native kernels and, with
        ``KVOPS_NATIVE=0``, the composite ones) never loads a ``kvops.reference`` module."""
        import ast

        def module_of(path):
            base, top = (("kvops", "lowering"), ROOT / "lowering") if path.is_relative_to(ROOT / "lowering") else (
                ("kvops",), ROOT / "kvops")
            parts = (*base, *path.relative_to(top).with_suffix("").parts)
            return parts[:-1] if parts[-1] == "__init__" else parts, parts[-1] == "__init__"

        found, sources = [], [*(ROOT / "kvops").rglob("*.py"), *(ROOT / "lowering").rglob("*.py")]
        for path in sources:
            if path.is_relative_to(ROOT / "kvops" / "reference"):
                continue
            module, is_package = module_of(path)
            package = module if is_package else module[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = ".".join((package[:len(package) - node.level + 1] if node.level else ())
                                    + ((node.module,) if node.module else ()))
                    names = [base, *(f"{base}.{a.name}" for a in node.names)]
                else:
                    continue
                if any(n == "kvops.reference" or n.startswith("kvops.reference.") for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        self.assertEqual(found, [])

        script = (
            "import sys, torch, kvops\n"
            "i32 = torch.int32\n"
            "kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)\n"
            "k = torch.randn(3, 2, 8)\n"
            "kvops.paged_cache_write(k, k, kc, vc, torch.tensor([0, 5, 9]))\n"
            "q, cu = torch.randn(3, 4, 8), torch.tensor([0, 1, 3], dtype=i32)\n"
            "lens, table = torch.tensor([3, 6], dtype=i32), torch.tensor([[0, 1], [2, 3]], dtype=i32)\n"
            "kvops.paged_attention(q, kc, vc, cu, lens, table, 2)\n"
            "kvops.paged_attention(q, kc, vc, cu, lens, table, 2, window_left=1, sink_tokens=1, rope_theta=1e4,\n"
            "                      alibi_slopes=torch.rand(4))\n"
            "cos, sin = torch.ones(16, 4), torch.zeros(16, 4)\n"
            "kvops.rotary_paged_cache_write(k, k, kc, vc, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), cos, sin)\n"
            "ck, cv = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)\n"
            "kvops.cache_write(k[None], k[None], ck, cv, 0)\n"
            "kvops.cache_roll(ck, cv, 2, 0, 3)\n"
            "staging = torch.zeros(2, 1, 3, 2, 8)\n"
            "kvops.paged_kv_gather([kc], [vc], table[0], staging)\n"
            "kvops.paged_kv_scatter(staging, [kc], [vc], table[1])\n"
            "print('LOADED', sorted(m for m in sys.modules if m.split('.')[:2] == ['kvops', 'reference']))\n"
        )
        for native in ("1", "0"):
            with self.subTest(KVOPS_NATIVE=native):
                env = {**os.environ, "KVOPS_NATIVE": native, "PYTHONPATH": str(ROOT)}
                out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                     cwd=ROOT, env=env)
                self.assertEqual(out.returncode, 0, out.stderr[-3000:])
                self.assertIn("LOADED []", out.stdout, out.stdout + out.stderr[-3000:])


if __name__ == "__main__":
    unittest.main()
