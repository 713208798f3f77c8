"""What a new user sees first: the native build notice, import output without Triton, missing-extra messages."""

import logging
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import kvops.native as native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Makes a module (and its submodules) unimportable, as if not installed (import raises ModuleNotFoundError naming
# it, importlib.util.find_spec returns None); prepended to the scripts below.
BLOCK = "import sys\nsys.modules[{0!r}] = None\n"


def _python(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS",)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


class TestNativeBuildNotice(unittest.TestCase):
    def _build(self, ext_dir):
        calls = []
        with mock.patch.dict(os.environ, {"TORCH_EXTENSIONS_DIR": ext_dir, "KVOPS_NATIVE": "1"}), \
                mock.patch.object(native, "_has_cpu_kernel", lambda: True):
            with self.assertLogs("kvops.native", level="INFO") as logs:
                logging.getLogger("kvops.native").info("start")  # assertLogs needs one record
                self.assertTrue(native._build(load=lambda **kw: calls.append(kw)))
            build_dir = native.build_directory()
        self.assertEqual(len(calls), 1)
        return [r.getMessage() for r in logs.records[1:]], build_dir

    def test_first_build_says_what_how_long_and_where(self):
        with tempfile.TemporaryDirectory() as d:
            messages, build_dir = self._build(d)
        self.assertEqual(len(messages), 2, messages)
        self.assertIn("compiling the native CPU kernels", messages[0])
        self.assertIn("about 1-2 minutes", messages[0])
        self.assertIn(str(build_dir), messages[0])
        self.assertTrue(str(build_dir).startswith(d))
        self.assertRegex(messages[1], r"^kvops: native CPU kernels built in \d+ s$")

    def test_cached_build_is_silent(self):
        with tempfile.TemporaryDirectory() as d:
            with mock.patch.dict(os.environ, {"TORCH_EXTENSIONS_DIR": d}):
                build_dir = native.build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            (build_dir / f"{native.build_name()}.so").write_bytes(b"")
            messages, _ = self._build(d)
        self.assertEqual(messages, [])

    def test_stale_lock_is_taken_over(self):
        # torch's FileBaton waits forever on a lock a killed build left behind (a hang). A lock found while
        # no process holds the owner flock is stale: it is removed, saying so, and the build goes on.
        with tempfile.TemporaryDirectory() as d:
            with mock.patch.dict(os.environ, {"TORCH_EXTENSIONS_DIR": d}):
                build_dir = native.build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            (build_dir / f"{native.build_name()}.so").write_bytes(b"")
            (build_dir / "lock").write_bytes(b"")
            messages, _ = self._build(d)
            self.assertFalse((build_dir / "lock").exists())
        self.assertEqual(len(messages), 1, messages)
        self.assertIn(f"removing the native build lock {build_dir / 'lock'}, left by a build that was killed",
                      messages[0])

    def test_a_killed_builder_never_blocks_the_next(self):
        """A real process takes the owner lock, leaves torch's lock file and is killed (SIGKILL) mid-build: the next
        build neither hangs nor waits; while a live process builds, the wait names it (pid and host)."""
        import signal
        import time

        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "TORCH_EXTENSIONS_DIR": d, "PYTHONPATH": ROOT}
            # the holder imports kvops.native (which imports the package: kvops/native/__init__.py defines its op's
            # schema through kvops/_library.py); the timing below starts once it holds the lock
            holder = ("import os, signal, sys, time\n"
                      "from kvops import native as n\n"
                      "d = n.build_directory(sys.argv[3])\n"
                      "with n._owner_lock(d):\n"
                      "    (d / 'lock').write_bytes(b'')\n"
                      "    print('HOLDING', flush=True)\n"
                      "    time.sleep(float(sys.argv[1]))\n"
                      "    if sys.argv[2] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
                      "    (d / 'lock').unlink()\n")
            for how in ("kill", "finish"):
                with self.subTest(how):
                    proc = subprocess.Popen([sys.executable, "-c", holder, "2", how, native.build_name()],
                                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                    try:
                        self.assertEqual(proc.stdout.readline().strip(), "HOLDING")
                        t0 = time.monotonic()
                        messages, build_dir = self._build(d)
                        waited = time.monotonic() - t0
                    finally:
                        if how == "kill" or proc.wait(30) is None:
                            proc.kill()
                        proc.wait(30)
                    self.assertLess(waited, 60)
                    self.assertIn(f"waiting for pid {proc.pid} on ", messages[0])
                    self.assertFalse((build_dir / "lock").exists())
                    took_over = any("left by a build that was killed" in m for m in messages)
                    self.assertEqual(took_over, how == "kill", messages)
                    self.assertEqual(proc.returncode, -signal.SIGKILL if how == "kill" else 0)

    def test_two_torch_installs_never_share_a_build(self):
        """Two virtual environments with the same torch version (installed in two folders) get two build names."""
        import types

        other = types.SimpleNamespace(__version__=native.torch.__version__, __file__="/elsewhere/torch/__init__.py")
        with mock.patch.object(native, "torch", other):
            other_name = native.build_name()
        self.assertNotEqual(other_name, native.build_name())
        newer = types.SimpleNamespace(__version__="9.9.9", __file__=native.torch.__file__)
        with mock.patch.object(native, "torch", newer):
            newer_name = native.build_name()
        self.assertEqual(len({other_name, newer_name, native.build_name()}), 3)

    def test_two_checkouts_never_share_a_build(self):
        # build.ninja records absolute source paths: the same sources in another folder get their own build name
        with tempfile.TemporaryDirectory() as d:
            other = os.path.join(d, "native")
            os.mkdir(other)
            for src in (*native.SOURCES, *native.HEADERS):
                with open(os.path.join(other, src.name), "wb") as f:
                    f.write(src.read_bytes())
            import pathlib
            moved = pathlib.Path(other) / native.SOURCE.name
            with mock.patch.object(native, "SOURCE", moved), \
                    mock.patch.object(native, "SOURCES", [moved.with_name(s.name) for s in native.SOURCES]), \
                    mock.patch.object(native, "HEADERS", [moved.with_name(h.name) for h in native.HEADERS]):
                other_name = native.build_name()
        self.assertNotEqual(other_name, native.build_name())


class TestBuildAheadOfTime(unittest.TestCase):
    def test_python_m_kvops_native(self):
        out = subprocess.run([sys.executable, "-m", "kvops.native"], capture_output=True, text=True, timeout=900,
                             cwd=ROOT)
        self.assertEqual(out.returncode == 0, native.available(), out.stdout + out.stderr)
        if native.available():
            self.assertIn(f"native CPU kernels ready in {native.build_directory()}", out.stdout)


class TestMissingExtras(unittest.TestCase):
    def test_each_extra_is_named(self):
        # One process: the transformers integration with transformers missing, the ONNX translations with onnx_ir
        # (a dependency of onnxscript, not named by kvops) missing.
        cases = [("transformers", "import kvops.integrations.transformers", "transformers"),
                 ("onnx_ir", "kvops.onnx_translation_table()", "onnx")]
        script = "".join(BLOCK.format(blocked) for blocked, _, _ in cases) + "import kvops\n"
        for blocked, statement, _ in cases:
            script += ("try:\n"
                       f"    {statement}\n"
                       "    print('NO ERROR')\n"
                       "except ModuleNotFoundError as e:\n"
                       "    print('NAME', e.name, '|', e)\n")
        out = _python(script)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(len(lines), 2, out.stdout)
        for line, (blocked, _, extra) in zip(lines, cases):
            self.assertTrue(line.startswith(f"NAME {blocked} | "), line)
            self.assertIn(f"needs the optional dependencies of kvops' '{extra}' extra", line)
            self.assertIn(f"pip install 'kvops[{extra}]'", line)
            self.assertIn(f"from a clone of kvops: pip install -e '.[{extra}]'", line)


if __name__ == "__main__":
    unittest.main()
