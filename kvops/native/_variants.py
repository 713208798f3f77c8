"""Build variants of the native CPU kernels: the instruction set the compiler targets, chosen by ``KVOPS_NATIVE_ISA``.

``native`` (the default) compiles for the building machine's CPU (``-march=native``: AVX-512 where it has it, AVX2 on
an AVX2-only x86, NEON on Arm). The x86-64 levels compile the code paths a host's ``native`` build may never compile,
on any x86-64 CPU that has the level:
- ``x86-64-v3`` (``-march=x86-64-v3``: AVX2, FMA, F16C, BMI2, no AVX-512): the ``__AVX2__ && !__AVX512F__`` branches of
  ``vec.h`` and ``paged_problem.h``, on an AVX-512 machine;
- ``x86-64-v4`` (``-march=x86-64-v4``: AVX-512 F/BW/CD/DQ/VL, no AVX512-BF16): the AVX-512 kernels without the bf16
  dot products of ``chunk_dot.h``, on a machine with AVX512-BF16 (Zen 4 and later, Sapphire Rapids), whose ``native``
  build runs bf16 decode through ``chunk_dot.h`` instead of ``chunk_pairs.h``.
The tests run the kernels' correctness tests against them (tests/paged/test_native_isa.py).

The variant is read when the build is first needed (``kvops.native._build``), not at import. Another value raises a
``ValueError`` naming the variable, the value and the accepted values, as does a level on a machine that cannot run it
(not x86-64, or a CPU without the level's features): a user error, not a build failure, so it is not turned into the
build-failure warning and the composite fallback.
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
    "x86-64-v4": ("-march=x86-64-v4",),
}
# The x86-64 levels' CPU features, as /proc/cpuinfo names them (abm: LZCNT); a CPU without one of them would stop on
# an illegal instruction in that level's build, so it is refused before building.
X86_64_V3_CPU_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
LEVEL_CPU_FLAGS = {
    "x86-64-v3": X86_64_V3_CPU_FLAGS,
    "x86-64-v4": (*X86_64_V3_CPU_FLAGS, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
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
            f"('native', the default, targets this CPU; 'x86-64-v3' targets AVX2 + FMA without AVX-512; "
            f"'x86-64-v4' AVX-512 without AVX512-BF16). Unset {ENV} for the default."
        )
    if value in LEVEL_CPU_FLAGS:
        machine = platform.machine()
        if machine.lower() not in ("x86_64", "amd64"):
            raise ValueError(
                f"{ENV}={value!r} builds x86-64 code, which this {machine} machine cannot run; unset {ENV} (or set "
                f"it to 'native') to build for this CPU."
            )
        if cpu_flags.startswith("flags"):
            have = set(cpu_flags.partition(":")[2].split())
            missing = [f for f in LEVEL_CPU_FLAGS[value] if f not in have]
            if missing:
                raise ValueError(
                    f"{ENV}={value!r}: this CPU lacks {', '.join(missing)} (/proc/cpuinfo), which {value} code "
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
