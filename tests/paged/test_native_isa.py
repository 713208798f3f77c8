"""The build variants of the native CPU kernels (``KVOPS_NATIVE_ISA``: kvops/native/_variants.py): selection and its
errors, one cached build per variant, and the kernels' correctness tests against the variant this process did not
load, in a child process (two builds register kernels for the same ops, so one process loads one of them).

On an AVX-512 host the default ``native`` build compiles the kernels' AVX-512 branches (vec.h, paged_problem.h)
and the ``x86-64-v3`` build their AVX2 branches; on an AVX2-only host ``native`` is an AVX2 build and the child checks
that the ``x86-64-v3`` build compiles and passes too. Either way, a change cannot break the path the host does not use
without a test failing here.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import subprocess
import sys
import unittest
from unittest import mock

import expecttest

import kvops.native as native
from kvops.native import _variants

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
ENV = _variants.ENV

# The native kernels' correctness tests the child runs under the other variant (~50 s on 2 idle cores, after its
# build): paged attention against the fp64 reference (the sampled matrix: decode and prefill, every GQA ratio, fp32,
# bf16, fp16, fp8, every feature and layout; the native kernel's own paths: split-KV, staging, HND, row blocks, value
# check, memory safety, compiled graphs), the attention features, packed attention and the paged write, plus
# TestLoadedVariant below, which asserts that the child loaded the variant it was given.
CHILD_TESTS = (
    "tests/paged/test_native_isa.py::TestLoadedVariant",
    "tests/paged/test_native_paged_attention.py",
    "tests/paged/test_native_bf16_words.py",
    "tests/paged/test_native_gemm_path.py::TestGemmPath::test_tiles_of_a_long_prefill_with_threads",
    "tests/paged/test_native_gemm_path.py::TestGemmPath::test_fp8_caches_joint_and_padded_layouts_sinks",
    "tests/paged/test_native_gemm_path.py::TestGemmPath::test_custom_mask_both_forms",
    "tests/paged/test_paged_attention.py::TestPagedAttentionMatrix",
    "tests/paged/test_attention_features.py::TestPagedFeatures",
    "tests/packed/test_packed_attention.py::TestFusedAgainstReference",
    "tests/paged/test_paged_write.py::TestPagedWrite",
    "tests/paged/test_paged_write.py::TestNativeKernel",
)
CHILD_TIMEOUT_S = 900  # each child (the build, then the tests) stops by itself after this long


def _cpu_has(flag: str) -> bool:
    line = native._cpu_flags()
    return line.startswith("flags") and flag in line.partition(":")[2].split()


def _env(**values):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update({k: v for k, v in values.items() if v is not None})
    return env


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestLoadedVariant(unittest.TestCase):
    """Run in this process (the default variant, or what ``KVOPS_NATIVE_ISA`` says) and in the child (the other)."""

    def test_loaded_build_is_the_selected_variant(self):
        self.assertTrue(native.available())
        want = os.environ.get(ENV) or "native"
        self.assertEqual(native.isa(), want)
        maps = pathlib.Path("/proc/self/maps")
        if maps.exists():  # the loaded shared library is this variant's build
            so = os.path.realpath(native.build_directory(native.build_name(want)) / f"{native.build_name(want)}.so")
            self.assertIn(so, maps.read_text())
        macros = native.isa_macros()
        if want == "x86-64-v3":
            self.assertEqual(macros, {"__AVX512F__": False, "__AVX512BF16__": False, "__AVX2__": True, "__FMA__": True})
        elif X86_64:
            self.assertEqual(macros["__AVX512F__"], _cpu_has("avx512f"))
            self.assertEqual(macros["__AVX512BF16__"], _cpu_has("avx512_bf16"))
            self.assertEqual(macros["__AVX2__"], _cpu_has("avx2"))


class TestVariantSelection(expecttest.TestCase):
    def test_each_variant_has_its_own_build(self):
        names = {v: native.build_name(v) for v in _variants.VARIANTS}
        self.assertEqual(len(set(names.values())), len(names), names)
        with mock.patch.dict(os.environ, _env(), clear=True):
            self.assertEqual(native.build_name(), names["native"])
        with mock.patch.dict(os.environ, _env(**{ENV: "x86-64-v3"}), clear=True), \
                mock.patch.object(_variants.platform, "machine", lambda: "x86_64"), \
                mock.patch.object(native, "_cpu_flags", lambda: "flags\t: " + " ".join(_variants.X86_64_V3_CPU_FLAGS)):
            self.assertEqual(native.build_name(), native.build_name("x86-64-v3"))  # the variable selects the build
            self.assertNotEqual(native.build_name(), native.build_name("native"))
        with mock.patch.dict(_variants.VARIANTS, {"native": ("-march=native", "-mno-avx512f")}):
            self.assertNotEqual(native.build_name("native"), names["native"])  # the variant's flags are hashed

    def test_empty_value_is_the_default(self):
        with mock.patch.dict(os.environ, _env(**{ENV: ""}), clear=True):
            self.assertEqual(_variants.selected(native._cpu_flags()), "native")

    def test_unknown_value_raises_at_the_first_build(self):
        with mock.patch.dict(os.environ, _env(**{ENV: "avx512"}, KVOPS_NATIVE="1"), clear=True), \
                mock.patch.object(native, "_state", None):
            with self.assertRaises(ValueError) as cm:
                native.available()
            self.assertIsNone(native._state)  # nothing recorded: the next call raises again
        self.assertExpectedInline(str(cm.exception), """\
KVOPS_NATIVE_ISA='avx512' is not a build variant of the native CPU kernels; accepted values: 'native', 'x86-64-v3' ('native', the default, targets this CPU; 'x86-64-v3' targets AVX2 + FMA without AVX-512). Unset KVOPS_NATIVE_ISA for the default.""")

    def test_x86_64_v3_refused_where_it_cannot_run(self):
        with mock.patch.dict(os.environ, _env(**{ENV: "x86-64-v3"}), clear=True):
            with mock.patch.object(_variants.platform, "machine", lambda: "aarch64"), \
                    self.assertRaises(ValueError) as cm:
                _variants.selected("Features\t: fp asimd")
            self.assertExpectedInline(str(cm.exception), """\
KVOPS_NATIVE_ISA='x86-64-v3' builds x86-64 code, which this aarch64 machine cannot run; unset KVOPS_NATIVE_ISA (or set it to 'native') to build for this CPU.""")
            with mock.patch.object(_variants.platform, "machine", lambda: "x86_64"), \
                    self.assertRaises(ValueError) as cm:
                _variants.selected("flags\t\t: fpu sse sse2 avx xsave")
            self.assertExpectedInline(str(cm.exception), """\
KVOPS_NATIVE_ISA='x86-64-v3': this CPU lacks avx2, bmi1, bmi2, f16c, fma, abm, movbe (/proc/cpuinfo), which x86-64-v3 code needs; unset KVOPS_NATIVE_ISA (or set it to 'native') to build for this CPU.""")

    def test_isa_macros_without_a_loaded_build(self):
        with mock.patch.object(native, "_isa", None), self.assertRaises(ValueError) as cm:
            native.isa_macros()
        self.assertExpectedInline(str(cm.exception), """\
isa_macros(): no native build is loaded in this process (kvops.native.available() is False or was not called yet); pass a variant, one of ['native', 'x86-64-v3']""")

    def test_bad_value_leaves_import_working_and_the_command_says_why(self):
        out = subprocess.run([sys.executable, "-m", "kvops.native"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env=_env(**{ENV: "v4"}))
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)  # kvops imported; the build was refused
        self.assertIn("kvops: KVOPS_NATIVE_ISA='v4' is not a build variant", out.stderr)

    def test_opt_out_says_so_in_the_command(self):
        out = subprocess.run([sys.executable, "-m", "kvops.native"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env=_env(KVOPS_NATIVE="0"))
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertExpectedInline(out.stdout.strip(), """\
kvops: the native CPU kernels are not available (KVOPS_NATIVE=0 is set: unset it to build them); the composite kernels run.""")


@unittest.skipUnless(HAS_COMPILER and X86_64, "the x86-64-v3 variant needs an x86-64 machine and a C++ compiler")
class TestOtherVariantInAChild(unittest.TestCase):
    def test_native_kernel_tests_pass_under_the_other_variant(self):
        self.assertTrue(native.available())
        other = "native" if native.isa() == "x86-64-v3" else "x86-64-v3"
        env = _env(**{ENV: other})
        built = subprocess.run([sys.executable, "-m", "kvops.native", "--isa", other], capture_output=True,
                               text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT, env=_env())
        self.assertEqual(built.returncode, 0, built.stdout + built.stderr)
        self.assertIn(f"native CPU kernels ready in {native.build_directory(native.build_name(other))} ({other}: ",
                      built.stdout)
        if other == "x86-64-v3":
            self.assertIn("__AVX512F__ undefined, __AVX512BF16__ undefined, __AVX2__ defined", built.stdout)
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider", "-k",
                                "not triton", *CHILD_TESTS], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                               cwd=ROOT, env=env)
        self.assertEqual(tests.returncode, 0, tests.stdout[-6000:] + tests.stderr[-3000:])
        # the child loaded the other variant (TestLoadedVariant ran and passed there)
        self.assertIn("PASSED tests/paged/test_native_isa.py::TestLoadedVariant::test_loaded_build_is_the_selected_"
                      "variant", tests.stdout)
        self.assertNotIn("SKIPPED", tests.stdout)
