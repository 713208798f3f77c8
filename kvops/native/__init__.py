"""Native (C++) CPU kernels, built on first use.

``paged_attention.cpp`` registers ``kvops::_paged_attention_native`` (the CPU kernel behind ``kvops::paged_attention``,
see the comment at its top) and ``kvops::_paged_attention_values_bad`` (the one-pass value-contract check of eager CPU
calls, ``kvops/_checks/values_attention.py``). It is compiled by ``torch.utils.cpp_extension.load`` the first time a
CPU paged attention runs (not at import), with the machine's C++ compiler (the one ``torch.compile`` on CPU needs
too), into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that hashes the
source, the flags, the CPU's instruction-set flags and the torch it is built against (version and install folder), so
later processes load the cached build in well under a second, and differing sources, machines or torch installs
(two virtual environments) never share, or rebuild each other's, binary. One process builds at a time (an ``flock``
on ``kvops.owner`` in the build folder, which names the builder); a build that was killed leaves torch's lock file
behind, which the next build removes (the dead owner's ``flock`` is gone) instead of waiting on it forever. A build that is not cached yet says so once on the
``kvops.native`` logger (about 1-2 minutes on 2 idle cores; where it is cached) and how long it took; ``python -m kvops.native``
builds ahead of time. It is not built at install time: the binary is specific to the machine's CPU (``-march=native``)
and to the torch it was compiled against, and a wheel or an install outlives both (torch upgrades, images moved
between machines).

Build variants (``kvops/native/_variants.py``): ``KVOPS_NATIVE_ISA=native`` (the default, ``-march=native``) or
``x86-64-v3`` (``-march=x86-64-v3``: AVX2 + FMA, no AVX-512, on any x86-64 CPU that has them), read when the build is
first needed. The kernels have AVX-512 and AVX2 code paths (``#if`` in ``vec.h``, ``paged_problem.h``); on an AVX-512
machine the ``x86-64-v3`` build compiles and runs the AVX2 ones (tests/paged/test_native_isa.py runs the kernels'
tests against both). bf16 decode has two forms on builds with AVX512-BF16 (``chunk_pairs.h``, fp32 FMAs;
``chunk_dot.h``, ``vdpbf16ps``), chosen per call: the dot products on AMD CPUs, the word form's fp32 FMAs elsewhere,
or what ``KVOPS_NATIVE_BF16_DOT`` (``1``: dot products, ``0``: word form) says (docs/native-kernel.md). Each variant has its own cached build (its
flags are in the name's hash). Another value, or ``x86-64-v3`` on a machine that cannot run it, raises a
``ValueError`` at that first build (a user error, not a build failure). ``isa()`` says which variant this process
loaded, ``isa_macros()`` which ISA macros (``__AVX512F__``, ``__AVX512BF16__``, ``__AVX2__``, ``__FMA__``) the
compiler defined in it; ``python -m kvops.native --isa x86-64-v3`` builds a variant ahead of time.

The schema of ``kvops::_paged_attention_native`` is defined at import (``kvops/_library.py``), not by the build, with
the composite kernel as its ``CompositeExplicitAutograd`` fallback (registered here): a graph that calls it (an Inductor graph reloaded from the
on-disk FX graph cache, any program traced below ``kvops::paged_attention``) runs in any process that imports
kvops, also one with ``KVOPS_NATIVE=0`` or without a compiler. The build adds its CPU kernel.
(``kvops::_paged_write_native`` and ``kvops::_packed_attention_native`` are only called inside the CPU kernels of
``kvops::paged_cache_write`` and ``kvops::packed_attention``, after asking ``use_native()``/``available()`` in the
running process: no graph names them.) The native kernels check the index values they address memory with (block
ids, sequence lengths, slots, cluster ids) and raise instead of reading or writing out of bounds, whatever the
value-check mode.

``use_native()`` is what ``kvops.paged_attention`` asks: ``available()``, except under AOTInductor compilation, whose
packages must load without kvops and so get the composite traced into aten ops (unless compiled inside
``native_in_aoti_packages()``, whose packages call the native kernel and need ``import kvops`` where they load).
``available()`` says whether the kernel is usable. When the build fails (no compiler, missing headers) it returns
False after ONE ``RuntimeWarning`` per process, and ``kvops.paged_attention`` keeps using the composite torch kernel
(``kvops/cpu/paged_attention.py``), which gives the same results (up to rounding; the native kernel's accumulator
overflows 256x sooner near the fp32 maximum: docs/native-kernel.md, "Lazy rescale"), only slower. Setting
``KVOPS_NATIVE=0`` selects the composite without trying to build.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import sys
import time
import warnings

import torch

from .. import _library
from . import _variants

SOURCE = pathlib.Path(__file__).with_name("paged_attention.cpp")
SOURCES = [
    SOURCE,  # kvops::_paged_attention_native (and its value check kvops::_paged_attention_values_bad)
    SOURCE.with_name("packed_attention.cpp"),  # kvops::_packed_attention_native
    SOURCE.with_name("paged_write.cpp"),  # kvops::_paged_write_native (CPU kernel of paged_cache_write)
    SOURCE.with_name("eager_entry.cpp"),  # the build's Python module: eager_entry (paged attention, no dispatcher)
]
# included by the sources: part of the build hash
HEADERS = [SOURCE.with_name(h) for h in ("vec.h", "paged_problem.h", "attend_regs.h", "chunk_pairs.h", "chunk_dot.h",
                                          "scores_rows.h", "attend_gemm.h", "paged_checks.h", "packed_tile.h")]
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # and the variant's -march flag: cflags()
OP_NAME = "kvops::_paged_attention_native"

_state: bool | None = None  # None: not tried yet in this process
_isa: str | None = None  # the build variant loaded in this process: isa()
_native_in_aoti = False  # native_in_aoti_packages()
# The loaded build's ``paged_attention`` (kvops/native/eager_entry.cpp): kvops::_paged_attention_native's CPU kernel
# without the dispatcher and without the feature arguments, for the eager CPU path of kvops.paged_attention
# (``_eager_native``, on the calls ``_direct`` admits); None while no build is loaded.
eager_entry = None
eager_key = None  # and its eager_key: _direct's test of the tensor arguments and the validator's memo key of them

# The one-time build notice goes to this logger at WARNING, so Python's default handling prints it to stderr without
# any logging set up (a warning category would turn it into an error under ``-W error`` and into noise in tests that
# record warnings); logging.getLogger("kvops.native").setLevel(logging.ERROR) silences it.
log = logging.getLogger("kvops.native")
BUILD_SECONDS = "about 1-2 minutes on 2 idle CPU cores, longer on a busy machine"  # 62-128 s measured


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cflags(variant: str) -> list[str]:
    """The compiler flags of a build variant (``native``, ``x86-64-v3``: ``kvops/native/_variants.py``)."""
    return [*_variants.VARIANTS[variant], *CFLAGS]


def build_name(variant: str | None = None) -> str:
    """Extension name: ``kvops_native_<hash of source, its folder, flags, CPU flags, torch version and folder>``.

    ``variant``: the build variant whose flags are hashed (default: the one ``KVOPS_NATIVE_ISA`` selects), so each
    variant has its own build.

    The folders are part of the hash because the build's ``build.ninja`` records absolute paths: two checkouts with
    the same sources, or two virtual environments with the same torch version (installed in two places), sharing one
    build folder would rebuild each other's binary, without notice (about 2 minutes), on every switch."""
    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    torch_dir = str(pathlib.Path(torch.__file__).parent.resolve())
    flags = cflags(variant or _variants.selected(_cpu_flags()))
    for part in (*flags, _cpu_flags(), torch.__version__, torch_dir, str(SOURCE.parent.resolve())):
        h.update(part.encode())
    return f"kvops_native_{h.hexdigest()[:16]}"


# --- kvops::_paged_attention_native: always defined ---------------------------------------------------------------
# The schema lives in kvops/_library.py, not in the C++ source, so every graph that calls it (an Inductor graph from
# the on-disk FX graph cache, any program traced below kvops::paged_attention) loads in any process that imports
# kvops, including one with KVOPS_NATIVE=0 or no C++ compiler. The build registers the CPU kernel; elsewhere the
# CompositeExplicitAutograd kernel below runs: it builds the extension on first use and re-dispatches to it, or runs
# the composite torch kernel (kvops/cpu/paged_attention.py: the same attention, fp32 accumulation, slower).
# Its arguments after v_scale are the fields of AttnFeatures (kvops/_checks/features.py): ``*features``.


def _has_cpu_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(OP_NAME, "CPU")


def _without_build(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal,
                   window_left, softcap, sinks, k_scale, v_scale, *features):
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left,
            softcap, sinks, k_scale, v_scale)
    if q.is_cpu and available() and _has_cpu_kernel():  # built just now (first kvops call of this process)
        return torch.ops.kvops._paged_attention_native.default(*args, *features)
    from .._checks.features import AttnFeatures
    from .._checks.paged_attention import check_paged_attention
    from ..cpu.paged_attention import paged_attention as composite

    # a direct call (torch.ops.kvops._paged_attention_native) gets the op's contract, as the built kernel checks it
    check_paged_attention(*args)

    return composite(*args, AttnFeatures(*features))


def _fake(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal, window_left,
          softcap, sinks, k_scale, v_scale, *features):
    return (q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3]),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))


_library.lib.impl("_paged_attention_native", _without_build, "CompositeExplicitAutograd")
torch.library.register_fake(OP_NAME, _fake, lib=_library.lib)


def build_directory(name: str | None = None) -> pathlib.Path:
    """Where ``torch.utils.cpp_extension`` keeps this build (under ``$TORCH_EXTENSIONS_DIR``)."""
    from torch.utils.cpp_extension import _get_build_directory

    return pathlib.Path(_get_build_directory(name or build_name(), verbose=False))


def _build(load=None) -> bool:
    """Build (or load the cached build of) the extension and register its fake rule; False + one warning on failure.

    A build that is not cached yet is announced once on the ``kvops.native`` logger (what it is, how long it takes,
    where it goes) and its duration reported when it ends: the first CPU paged attention otherwise blocks silently.
    """
    global _isa, eager_entry, eager_key
    if os.environ.get("KVOPS_NATIVE", "1") == "0":
        return False
    variant = _variants.selected(_cpu_flags())  # a bad KVOPS_NATIVE_ISA raises: a user error, not a build failure
    try:
        if load is None:
            from torch.utils.cpp_extension import load
        name = build_name(variant)
        build_dir = build_directory(name)
        with _owner_lock(build_dir) as owner:  # one kvops build at a time; the kernel releases a dead owner's lock
            fresh = not (build_dir / f"{name}.so").exists()
            if fresh:
                log.warning(
                    "kvops: compiling the native CPU kernels (kvops/native/*.cpp, %s) on first use, once per machine "
                    "and torch version: %s. The build is cached in %s (set TORCH_EXTENSIONS_DIR to move it); "
                    "`python -m kvops.native` builds it ahead of time, KVOPS_NATIVE=0 skips it (slower composite "
                    "kernels).", " ".join(_variants.VARIANTS[variant]), BUILD_SECONDS, build_dir,
                )
            if owner:
                _take_over_stale_baton(build_dir)
            t0 = time.perf_counter()
            module = load(name=name, sources=[str(src) for src in SOURCES], extra_cflags=cflags(variant),
                          extra_ldflags=["-fopenmp"], is_python_module=True, verbose=False)
        if fresh:
            log.warning("kvops: native CPU kernels built in %.0f s", time.perf_counter() - t0)
        if not _has_cpu_kernel():
            raise RuntimeError(f"the built library does not register the CPU kernel of {OP_NAME}")
        _isa = variant
        eager_entry = getattr(module, "paged_attention", None)
        eager_key = getattr(module, "eager_key", None)
    except Exception as e:  # any build/load failure: fall back, never crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(
            f"kvops: the native CPU paged-attention kernel could not be built ({type(e).__name__}: {first}"
            f"{'' if variant == _variants.DEFAULT else f'; {_variants.ENV}={variant}'}); "
            "kvops.paged_attention on CPU uses the slower composite torch kernel (same results). A C++ compiler "
            "(g++/clang++, as torch.compile on CPU needs) makes it available; KVOPS_NATIVE=0 silences this.",
            RuntimeWarning, stacklevel=3,
        )
        return False
    return True


OWNER_FILE = "kvops.owner"  # in the build folder: flock()ed by the building process, which writes its pid and host


@contextlib.contextmanager
def _owner_lock(build_dir: pathlib.Path):
    """Hold an exclusive ``flock`` on ``build_dir / OWNER_FILE`` while building (yields True). The kernel releases it
    when the holder exits or is killed, so a waiter never waits on a dead process; while a live process builds, the
    wait is announced with that process's pid and host. (Without ``fcntl``, e.g. on Windows: yields False, torch's own
    lock alone.)"""
    try:
        import fcntl
    except ImportError:
        lock = build_dir / "lock"
        if lock.exists():  # torch's FileBaton waits on it forever, silently
            log.warning(
                "kvops: waiting for the native build lock %s: another process is building the kernels. If none is "
                "(a build that was killed leaves its lock behind), delete that file and this wait ends.", lock,
            )
        yield False
        return
    import socket

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / OWNER_FILE, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "another process"
            log.warning("kvops: waiting for %s, which is building the native CPU kernels in %s (the wait ends when "
                        "it finishes, or at once if it is killed).", owner, build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _take_over_stale_baton(build_dir: pathlib.Path) -> None:
    """torch's build lock (``build_dir / "lock"``, a ``FileBaton`` it waits on forever) found while holding the owner
    lock was left by a build that was killed (every kvops build holds the owner lock while torch's exists): remove it,
    saying so, so that this build does not wait forever."""
    lock = build_dir / "lock"
    if lock.exists():
        log.warning("kvops: removing the native build lock %s, left by a build that was killed (no process holds %s); "
                    "building again.", lock, build_dir / OWNER_FILE)
        lock.unlink(missing_ok=True)


def available() -> bool:
    """True when ``torch.ops.kvops._paged_attention_native`` is usable (built on the first call, then cached)."""
    global _state
    if _state is None:
        _state = _build()
    return _state


def isa() -> str | None:
    """The build variant loaded in this process (``"native"`` or ``"x86-64-v3"``, from ``KVOPS_NATIVE_ISA``), or None
    while none is (before the first ``available()``, after a failed build, with ``KVOPS_NATIVE=0``)."""
    return _isa


def isa_macros(variant: str | None = None) -> dict[str, bool]:
    """The compiler's view of a build variant's instruction set (default: the loaded one): whether ``__AVX512F__``,
    ``__AVX512BF16__``, ``__AVX2__`` and ``__FMA__`` are defined under its flags, i.e. which ``#if`` branches of the
    kernels it compiled.
    Runs the C++ compiler's preprocessor once per variant. ValueError when no variant is given and none is loaded."""
    if variant is None and _isa is None:
        raise ValueError("isa_macros(): no native build is loaded in this process (kvops.native.available() is "
                         f"False or was not called yet); pass a variant, one of {list(_variants.VARIANTS)}")
    variant = variant or _isa
    if variant not in _variants.VARIANTS:
        raise ValueError(f"isa_macros(): variant={variant!r} is not a build variant; pass one of "
                         f"{list(_variants.VARIANTS)}")
    return _variants.macros(tuple(cflags(variant)))


def use_native() -> bool:
    """Whether a CPU paged attention should call the native kernel now: when it is available, except while
    AOTInductor compiles (its packages must run in processes that never import kvops, so they get the composite
    traced into aten ops) outside ``native_in_aoti_packages()``."""
    inductor_v = sys.modules.get("torch._inductor.virtualized")
    if inductor_v is not None and inductor_v.V.aot_compilation and not _native_in_aoti:
        return False
    return available()


@contextlib.contextmanager
def native_in_aoti_packages():
    """Within this context, AOTInductor packages compiled for CPU call the native paged attention
    (``kvops::_paged_attention_native``, an extern call through the package's proxy executor) instead of the
    composite traced into aten ops, which the package otherwise carries so that it runs without kvops.

    Cost and contract: the process that runs such a package must ``import kvops`` before ``aoti_load_package``
    (the op's schema is defined at import; otherwise loading fails with "Could not find schema for
    kvops::_paged_attention_native"). The package's first call loads the native extension, building it (1-2 minutes,
    needs a C++ compiler) where ``TORCH_EXTENSIONS_DIR`` has no build yet: run ``python -m kvops.native`` when
    deploying. With ``KVOPS_NATIVE=0`` or no compiler the call runs the composite kernel (same results, slower).

        with kvops.native.native_in_aoti_packages():
            path = torch._inductor.aoti_compile_and_package(torch.export.export(step, args))

    Speed: one ``examples/llm_serving.py`` step (Qwen2.5-0.5B geometry, 2 layers, 32 tokens, 1 thread) took
    44-48 ms in a native package against 54-63 ms in a composite one (``--package`` uses this context).
    """
    global _native_in_aoti
    before, _native_in_aoti = _native_in_aoti, True
    try:
        yield
    finally:
        _native_in_aoti = before
