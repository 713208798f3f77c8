"""Ahead-of-time compile check of every Triton kernel kvops launches, for real NVIDIA targets, without a GPU.

The launchers' own ``plan_*`` functions (``kvops/triton/launch.py``) are called on ``meta`` tensors (shapes, dtypes and
strides only; nothing is allocated) for each case of :mod:`tools.aot_cases` and each target; every planned
:class:`~kvops.triton.launch.Launch` is bound with Triton's own argument binder (the signature, the ``== 1`` and
``% 16`` specializations and the constexprs a real launch would get; tensors are taken as 16-byte aligned, as the
CUDA caching allocator returns them) and compiled by ``triton.compile`` to a cubin for that target. Resources come
from the cubin (``cuobjdump -res-usage``: registers, stack and local bytes) and Triton's metadata (dynamic shared
memory, ``num_warps``; ptxas' spill stores where the cubin has a stack frame). A kernel that fails to compile,
spills registers, or needs more shared memory per block than the target allows is a failure.

    python benchmarks/gpu_check.py --aot [--subset] [--targets sm_80,sm_90]

Needs ``TRITON_INTERPRET`` unset when kvops is imported (the interpreter replaces the kernels); the test
(``tests/gpu/test_gpu_aot.py``) runs it in a subprocess for that reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """Per-block / per-SM limits of one NVIDIA architecture (CUDA C Programming Guide, compute capabilities)."""

    name: str
    capability: tuple[int, int]
    smem_block: int  # bytes of shared memory one block may use (opt-in maximum)
    smem_sm: int  # bytes of shared memory per SM
    max_warps: int  # resident warps per SM
    max_blocks: int  # resident blocks per SM
    regs_sm: int = 65536


TARGETS = {
    t.name: t
    for t in (
        Target("sm_80", (8, 0), 166912, 167936, 64, 32),  # A100
        Target("sm_86", (8, 6), 101376, 102400, 48, 16),  # A10, RTX 3090
        Target("sm_89", (8, 9), 101376, 102400, 48, 24),  # L4, L40S, RTX 4090
        Target("sm_90", (9, 0), 232448, 233472, 64, 32),  # H100, H200
        Target("sm_100", (10, 0), 232448, 233472, 64, 32),  # B200 (newest target of Triton 3.9's CUDA backend)
    )
}


def meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def kernel_name(kernel) -> str:
    return kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__


@dataclasses.dataclass(frozen=True)
class Spec:
    """What ``triton.compile`` needs for one launch, as plain data (sent to worker processes)."""

    module: str
    name: str
    signature: tuple
    constexprs: tuple
    attrs: tuple
    options: tuple


def bind(launch, capability: tuple[int, int]) -> Spec:
    """The compile inputs a real launch of ``launch`` on a device of ``capability`` would produce."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability[0] * 10 + capability[1], 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    opts = {k: v for k, v in options.__dict__.items() if k in ("num_warps", "num_stages", "num_ctas")}
    return Spec(kernel.fn.__module__, kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()),
                tuple((k, tuple(tuple(a) for a in v)) for k, v in attrs.items()), tuple(sorted(opts.items())))


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubin_resources(cubin: bytes) -> dict:
    """``REG``, ``SHARED`` (static), ``LOCAL`` and ``STACK`` (per-thread bytes) of a cubin's kernel.

    ``STACK + LOCAL`` is what the driver reports as the kernel's local size (``CompiledKernel.n_spills``); when it
    is not 0, :func:`ptxas_spills` tells spilled registers from a plain stack frame."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", out)}


def ptxas_spills(ptx: str, cap: int) -> int:
    """Bytes of spill stores ptxas reports for ``ptx`` (run as Triton runs it, with ``-v``)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        cmd = [get_ptxas(cap).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(cap)}",
               f.name, "-o", os.devnull]
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", p.stdout + p.stderr))


def occupancy(target: Target, regs: int, shared: int, num_warps: int) -> float:
    """Resident warps / max warps per SM (register allocation in 256-register warp units, 1 KB reserved shared
    memory per block), as the CUDA occupancy calculator."""
    warp_regs = max(256, -(-regs * 32 // 256) * 256)
    by_regs = (target.regs_sm // warp_regs) // num_warps
    by_smem = target.smem_sm // (shared + 1024) if shared else target.max_blocks
    blocks = min(target.max_blocks, target.max_warps // num_warps, by_regs, by_smem)
    return blocks * num_warps / target.max_warps


def compile_spec(spec: Spec, target_name: str) -> dict:
    """Compile one spec for one target; a result row (status ``ok``/``FAIL``, resources, the failure's cause)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = TARGETS[target_name]
    kernel = getattr(importlib.import_module(spec.module), spec.name)
    attrs = {k: [list(a) for a in v] for k, v in spec.attrs}
    src = ASTSource(kernel, dict(spec.signature), dict(spec.constexprs), attrs)
    cap = target.capability[0] * 10 + target.capability[1]
    row = dict(status="FAIL", regs=None, spills=None, shared=None, num_warps=dict(spec.options)["num_warps"],
               occupancy=None, error="")
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(spec.options))
    except Exception as e:  # a compile error is a result of the check, reported in its row
        msg = " ".join(str(e).split())
        row["error"] = f"{type(e).__name__}: {msg[:300]}"
        return row
    res = cubin_resources(ck.asm["cubin"])
    shared = max(ck.metadata.shared, res.get("SHARED", 0))
    spills = res.get("LOCAL", 0) + res.get("STACK", 0)
    if spills:  # a stack frame: ask ptxas whether it holds spilled registers or only the ABI frame
        spills = ptxas_spills(ck.asm["ptx"], cap)
    row.update(regs=res.get("REG"), spills=spills, shared=shared, num_warps=ck.metadata.num_warps)
    row["occupancy"] = occupancy(target, row["regs"], shared, row["num_warps"])
    problems = []
    if row["spills"]:
        problems.append(f"spills {row['spills']} B/thread to local memory")
    if shared > target.smem_block:
        problems.append(f"needs {shared} B shared memory > {target.smem_block} B per block")
    row["status"] = "FAIL" if problems else "ok"
    row["error"] = "; ".join(problems)
    return row


def _compile_job(job):
    target_name, spec = job
    return compile_spec(spec, target_name)


def plan_matrix(targets, subset: bool = False):
    """``{(target, spec): [labels]}``: every distinct compile of the case list, with the cases that launch it, and
    ``refusals`` (case label, target, error message) for cases whose launcher refuses the target by design."""
    from . import aot_cases

    jobs: dict[tuple[str, Spec], list[str]] = {}
    refusals = []
    for target_name in targets:
        cap = TARGETS[target_name].capability
        for label, make in aot_cases.cases(subset):
            if target_name not in getattr(make, "targets", (target_name,)):  # a subset case for other targets
                continue
            try:
                launches = make(cap)
            except NotImplementedError as e:  # the launcher refuses this hardware with a clear error
                refusals.append((label, target_name, str(e)))
                continue
            for launch in launches:
                spec = bind(launch, cap)
                kind = f" KIND={launch.constexprs['KIND']}" if "KIND" in launch.constexprs else ""  # packed segments
                jobs.setdefault((target_name, spec), []).append(f"{kernel_name(launch.kernel)} {label}{kind}")
    return jobs, refusals


def check(targets=tuple(TARGETS), subset: bool = False, workers: int = 2, kernels: str = "", on_row=None):
    """Compile the matrix; returns ``(rows, refusals)`` with one row per distinct (target, compile). ``kernels``:
    a regular expression, only the kernels whose name it matches; ``on_row(row)`` is called as each compile ends
    (in completion order), so a long run reports as it goes."""
    jobs, refusals = plan_matrix(targets, subset)
    keys = [k for k in jobs if re.search(kernels, k[1].name)]

    def row_of(key, res):
        labels = jobs[key]
        row = dict(target=key[0], kernel=key[1].name, spec=labels[0].split(" ", 1)[1], cases=len(labels), **res)
        if on_row is not None:
            on_row(row)
        return row

    if workers > 1 and len(keys) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, 2)) as pool:  # at most 2: the machines are shared
            rows = [row_of(k, r) for k, r in zip(keys, pool.map(_compile_job, keys, chunksize=1))]
    else:
        rows = [row_of(k, _compile_job(k)) for k in keys]
    return rows, refusals


def tables(rows, refusals, verbose: bool) -> int:
    """Print one table per target (every row with ``verbose``, else the failures and each kernel's worst case) and a
    per-kernel summary; returns the number of failures."""
    fails = [r for r in rows if r["status"] != "ok"]
    fmt = "{:<22} {:<6} {:>4} {:>6} {:>7} {:>5} {:>5}  {}"
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]
        print(f"\n=== {target}: {len(mine)} compiles, {sum(r['status'] != 'ok' for r in mine)} failed ===")
        shown = [r for r in mine if verbose or r["status"] != "ok"]
        if not shown:
            print("(no failures; --verbose lists every compile)")
            continue
        print(fmt.format("kernel", "status", "regs", "spills", "shared", "warps", "occ", "specialization / cause"))
        for r in mine:
            if verbose or r["status"] != "ok":
                print(fmt.format(r["kernel"], r["status"], r["regs"] if r["regs"] is not None else "-",
                                 r["spills"] if r["spills"] is not None else "-",
                                 r["shared"] if r["shared"] is not None else "-", r["num_warps"],
                                 f"{r['occupancy']:.2f}" if r["occupancy"] is not None else "-",
                                 r["spec"] + (f"  [{r['error']}]" if r["error"] else "")))
    print("\n=== worst case per kernel and target (max registers / spills / shared, min occupancy) ===")
    print(f"{'target':<7} {'kernel':<22} {'n':>4} {'fail':>4} {'regs':>5} {'spills':>6} {'shared':>7} {'occ':>5}")
    for target in dict.fromkeys(r["target"] for r in rows):
        for kernel in sorted({r["kernel"] for r in rows if r["target"] == target}):
            ks = [r for r in rows if r["target"] == target and r["kernel"] == kernel]
            ok = [r for r in ks if r["regs"] is not None]
            worst = lambda key: max((r[key] for r in ok), default="-")  # noqa: E731
            occ = min((r["occupancy"] for r in ok), default=None)
            print(f"{target:<7} {kernel:<22} {len(ks):>4} {sum(r['status'] != 'ok' for r in ks):>4} "
                  f"{worst('regs'):>5} {worst('spills'):>6} {worst('shared'):>7} "
                  f"{f'{occ:.2f}' if occ is not None else '-':>5}")
    for label, target, msg in refusals:
        print(f"refused by design on {target}: {label}: {msg}")
    return len(fails)


def main(args) -> int:
    """``benchmarks/gpu_check.py --aot``: compile, print the tables; returns the exit status (1 if anything failed)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gpu_check --aot: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    t0 = time.perf_counter()
    targets = args.targets.split(",") if args.targets else list(TARGETS)

    def progress(row):  # one line per compile as it ends: a run stopped by a timeout still leaves its results
        print(f"[{row['status']}] {row['target']} {row['kernel']} regs={row['regs']} spills={row['spills']} "
              f"shared={row['shared']} warps={row['num_warps']} {row['spec']} {row['error']}", flush=True)

    rows, refusals = check(targets, subset=args.subset, workers=args.workers, kernels=args.kernels,
                               on_row=progress if args.progress else None)
    failed = tables(rows, refusals, args.verbose)
    print(f"\n{len(rows)} compiles for {', '.join(targets)} in {time.perf_counter() - t0:.0f} s: {failed} failed")
    return 1 if failed else 0
