"""Minimal reproducer, without kvops, of why the examples' compiled CPU path has no warm start.

The examples compile under ``torch.no_grad`` with Inductor's ``freezing`` and the C++ GEMM (``max_autotune`` with
``max_autotune_gemm_backends="CPP"``; docs/compile.md): that is where their steady-state speedup comes from. torch
2.13 then caches nothing on disk: the AOTAutograd cache refuses any graph compiled with freezing ("Cannot cache a
graph with freezing enabled", ``torch/_functorch/_aot_autograd/autograd_cache.py``) and the FX graph cache refuses
the MKL-packed weights freezing leaves as constants ("mkldnn tensors unpickleable", ``torch/_inductor/codecache.py``).
So a second process traces, freezes and lowers again; only the C++ compiler's outputs come from Inductor's code
cache.

This script compiles a two-layer MLP (256 -> 512 -> 256, GELU, batch 8, fp32) in two fresh processes that share
one empty ``TORCHINDUCTOR_CACHE_DIR``, for three settings (defaults, freezing, freezing + C++ GEMM), and prints for
each process the wall time of the first call and the cache counters torch reports. The workaround it measures is
AOTInductor: ``torch.export`` + ``aoti_compile_and_package`` with the same Inductor settings once, then
``aoti_load_package`` in a fresh process (the package holds the frozen, prepacked weights).

Output (benchmarks/_harness.py, as every benchmark): a host line, one table (one row per process), a verdict block
(no targets: what the run found) and ``--json`` for tools. One process per row: a single measurement, no spread.

    python benchmarks/frozen_cache_repro.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

SETTINGS = {
    "defaults": {},
    "freezing": {"freezing": True},
    "freezing + CPP GEMM": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
}

_CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
mode, cfg, package = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).eval()
x = torch.randn(8, 256)
t0 = time.perf_counter()
with torch.no_grad():
    if mode == "compile":
        for k, v in cfg.items():
            setattr(torch._inductor.config, k, v)
        torch.compile(model, fullgraph=True)(x)
    elif mode == "aoti-build":
        ep = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(ep, package_path=package, inductor_configs=cfg)
    else:
        torch._inductor.aoti_load_package(package)(x)
first = time.perf_counter() - t0
c = torch._dynamo.utils.counters
keys = {k: n for g in ("aot_autograd", "inductor") for k, n in c[g].items() if "cache" in k}
print(json.dumps(dict(first_s=first, since_start_s=time.perf_counter() - t_start, caches=keys)))
"""


def child(mode: str, cfg: dict, cache_dir: str, package: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    p = subprocess.run([sys.executable, "-c", _CHILD, mode, json.dumps(cfg), package], env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"frozen_cache_repro.py: the {mode} process failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def counters(caches: dict) -> str:
    """``{"inductor.fxgraph_cache_miss": 1, ...}`` as ``fxgraph miss 1, ...`` (what the table has room for)."""
    return ", ".join(f"{k.replace('_cache', '').replace('_', ' ')} {n}" for k, n in caches.items()) or "-"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Show, without kvops, that torch caches no frozen graph on disk "
                                                 "(two fresh processes per setting), and time the AOTInductor "
                                                 "workaround.")
    parser.add_argument("--skip-aoti", action="store_true", help="skip the AOTInductor package rows")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    report = harness.Report("frozen_cache_repro", args, argv)
    report.start(threads=1)
    table = report.table("first call of a compiled two-layer MLP per fresh process, sharing one TORCHINDUCTOR_CACHE_DIR",
                         [("setting", 22), ("process", 14), ("first call s", 12, "{:.2f}"), ("since start s", 13,
                                                                                             "{:.2f}"),
                          ("cache counters", 30, None, "<")])
    first = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in SETTINGS.items():
            cache_dir = tempfile.mkdtemp(dir=tmp)
            for proc in ("first (cold)", "second (warm)"):
                r = child("compile", cfg, cache_dir, "")
                first[name, proc] = r["first_s"]
                table.row(name, proc, r["first_s"], r["since_start_s"], counters(r["caches"]), caches=r["caches"])
        for name in SETTINGS:
            cold, warm = first[name, "first (cold)"], first[name, "second (warm)"]
            report.finding(f"{name}: the second process's first call takes {warm / cold:.2f}x the first's "
                           f"({warm:.2f} s vs {cold:.2f} s)")
        if not args.skip_aoti:
            cfg = SETTINGS["freezing + CPP GEMM"]
            package = os.path.join(tmp, "mlp.pt2")
            r = child("aoti-build", cfg, tempfile.mkdtemp(dir=tmp), package)
            table.row("AOTI, freezing + CPP", "build package", r["first_s"], r["since_start_s"], "-")
            r = child("aoti-load", cfg, tempfile.mkdtemp(dir=tmp), package)
            table.row("AOTI, freezing + CPP", "load + 1st call", r["first_s"], r["since_start_s"], "-")
            report.finding(f"an AOTInductor package loads and runs its first call in a fresh process in "
                           f"{r['first_s']:.2f} s, against {first['freezing + CPP GEMM', 'second (warm)']:.2f} s for "
                           "the warm torch.compile process")
    report.finish()


if __name__ == "__main__":
    main()
