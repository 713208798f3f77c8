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

    python benchmarks/frozen_cache_repro.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Show, without kvops, that torch caches no frozen graph on disk "
                                                 "(two fresh processes per setting), and time the AOTInductor "
                                                 "workaround.")
    parser.add_argument("--skip-aoti", action="store_true", help="skip the AOTInductor package rows")
    args = parser.parse_args(argv)
    print("| setting | process | first call (s) | since interpreter start (s) | cache counters |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in SETTINGS.items():
            cache_dir = tempfile.mkdtemp(dir=tmp)
            for proc in ("first (cold)", "second (warm)"):
                r = child("compile", cfg, cache_dir, "")
                print(f"| {name} | {proc} | {r['first_s']:.2f} | {r['since_start_s']:.2f} | {r['caches']} |",
                      flush=True)
        if args.skip_aoti:
            return
        cfg = SETTINGS["freezing + CPP GEMM"]
        package = os.path.join(tmp, "mlp.pt2")
        r = child("aoti-build", cfg, tempfile.mkdtemp(dir=tmp), package)
        print(f"| AOTInductor, freezing + CPP GEMM | build the package | {r['first_s']:.2f} | "
              f"{r['since_start_s']:.2f} | - |", flush=True)
        r = child("aoti-load", cfg, tempfile.mkdtemp(dir=tmp), package)
        print(f"| AOTInductor, freezing + CPP GEMM | fresh process: load + first call | {r['first_s']:.2f} | "
              f"{r['since_start_s']:.2f} | - |", flush=True)


if __name__ == "__main__":
    main()
