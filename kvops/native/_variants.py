"""Build variants of the native CPU kernels: the instruction set the compiler targets, chosen by ``KVOPS_NATIVE_ISA``.

``native`` (the default) compiles for the building machine's CPU (``-march=native``: AVX-512 where it has it, AVX2 on
an AVX2-only x86, NEON on Arm). ``x86-64-v3`` compiles for the x86-64-v3 level (``-march=x86-64-v3``: AVX2, FMA, F16C,
BMI2, no AVX-512) on any x86-64 CPU that has it: on an AVX-512 machine it builds and runs the AVX2 code paths of
``vec.h`` and ``paged_problem.h`` (the ``__AVX2__ && !__AVX512F__`` branches), which an AVX-512 host's ``native``
build never compiles; the tests run the kernels' correctness tests against both (tests/paged/test_native_isa.py).

The variant is read when the build is first needed (``kvops.native._build``), not at import. A value other than the
two raises a ``ValueError`` naming the variable, the value and the accepted values, as does ``x86-64-v3`` on a machine
that cannot run it (not x86-64, or a CPU without the level's features): a user error, not a build failure, so it is
not turned into the build-failure warning and the composite fallback.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess

ENV = "KVOPS_NATIVE_ISA"
DEFAULT = "native"
VARIANTS = {  # variant -> its compiler flags (part of the build name's hash: each variant has its own cached build)
    "native": ("-march=native",),
    "x86-64-v3": ("-march=x86-64-v3",),
}
# The x86-64-v3 level's CPU features, as /proc/cpuinfo names them (abm: LZCNT); a CPU without one of them would stop
# on an illegal instruction in the x86-64-v3 build, so it is refused before building.
X86_64_V3_CPU_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
# what isa_macros() reports: the compiler's view of a build's ISA
MACROS = ("__AVX512F__", "__AVX512BF16__", "__AVX2__", "__FMA__")


def _accepted() -> str:
    return ", ".join(repr(v) for v in VARIANTS)


def selected(cpu_flags: str) -> str:
    """The variant ``KVOPS_NATIVE_ISA`` asks for (unset or empty: ``native``), checked against this machine.

    ``cpu_flags`` is the ``flags`` line of /proc/cpuinfo (or, without it, the processor's name: then the CPU's features
    are not checked)."""
    value = os.environ.get(ENV, "") or DEFAULT
    if value not in VARIANTS:
        raise ValueError(
            f"{ENV}={value!r} is not a build variant of the native CPU kernels; accepted values: {_accepted()} "
            f"('native', the default, targets this CPU; 'x86-64-v3' targets AVX2 + FMA without AVX-512). Unset "
            f"{ENV} for the default."
        )
    if value == "x86-64-v3":
        machine = platform.machine()
        if machine.lower() not in ("x86_64", "amd64"):
            raise ValueError(
                f"{ENV}={value!r} builds x86-64 code, which this {machine} machine cannot run; unset {ENV} (or set "
                f"it to 'native') to build for this CPU."
            )
        if cpu_flags.startswith("flags"):
            have = set(cpu_flags.partition(":")[2].split())
            missing = [f for f in X86_64_V3_CPU_FLAGS if f not in have]
            if missing:
                raise ValueError(
                    f"{ENV}={value!r}: this CPU lacks {', '.join(missing)} (/proc/cpuinfo), which x86-64-v3 code "
                    f"needs; unset {ENV} (or set it to 'native') to build for this CPU."
                )
    return value


@functools.lru_cache(maxsize=None)
def macros(flags: tuple[str, ...]) -> dict[str, bool]:
    """Which of ``MACROS`` the C++ compiler (``$CXX``, as torch's build uses) predefines under ``flags``: the ISA the
    kernels' ``#if`` branches see in a build with those flags (``c++ -dM -E``, a few milliseconds)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    out = subprocess.run([get_cxx_compiler(), *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return {m: m in defined for m in MACROS}
