"""End to end: the examples' models eager vs torch.compile, and what compiling costs, in one table.

Rows (each example runs in its own process, so thread count and compile caches are clean; the examples print their
own medians and spreads, and this script collects their ``--json`` results):

* ``llm_serving`` steady state: tokens/s of kvops' compiled serving loop over eager, per interleaved pair of whole
  runs (median [min-max] over ``--repeats`` pairs); target >= 1.3x.
* ``streaming_video`` steady state: eager/compiled per-chunk latency (median over the chunks after warm-up, then
  median [min-max] over interleaved streams), every cache configuration; target >= 1.5x.
* compile cost: time to the first compiled step of each example (``llm_serving``: the first step; ``streaming_video``:
  the first compiled stream, whose first chunks compile every graph) with kvops and with ``--impl aten`` (the same
  model on plain aten cache writes + SDPA), cold (a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``) and warm (a second
  process on that cache). Compiles run with ``TORCHINDUCTOR_COMPILE_THREADS=1`` so that their CPU seconds (the
  process and its finished children: the C++ compiler) are counted; CPU seconds are the figure to compare on a
  loaded machine, wall seconds are printed next to them. Targets: kvops adds <= 20% to the cold compile's CPU
  seconds; the warm start takes < 5 s. (The examples' compiled CPU path freezes the weights, and torch 2.13 caches
  no frozen graph on disk, so the warm start re-traces and regenerates code: docs/compile.md.) Two more rows per
  example: ``--package`` (the step as an AOTInductor package with the same settings) built by one process (empty
  caches) and loaded by the next: that second process's first step (stream) is the warm start the caches cannot
  give.
* transformers decode (``benchmarks/hf_decode.py``, when present): run as a subprocess, its output printed.

Nothing is asserted; the ``met`` column says whether a row meets its target (by the median; ``noisy`` when the
spread straddles the target). With matplotlib (``pip install -e '.[bench]'``) a PNG of the ratios is written.

    python benchmarks/e2e.py                    # 1 and 2 threads, 3 pairs each (tens of minutes on 2 cores)
    python benchmarks/e2e.py --quick            # smaller workloads, 1 thread, for a first look
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = {"llm_serving": 1.3, "streaming_video": 1.5}
WORKLOADS = {  # example: (full args, --quick args)
    "llm_serving": ([], ["--requests", "6", "--max-new", "12"]),
    "streaming_video": ([], ["--chunks", "8"]),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts of the steady-state rows")
    p.add_argument("--repeats", type=int, default=3, help="interleaved eager/compiled pairs per steady-state row")
    p.add_argument("--examples", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS),
                   help="which examples to measure")
    p.add_argument("--skip", nargs="+", default=[], choices=["steady", "compile", "hf"],
                   help="leave out these parts: steady-state ratios, compile cost, the transformers row")
    p.add_argument("--quick", action="store_true", help="smaller workloads, 1 thread, 2 pairs: a first look")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="folder for e2e.json (e2e_quick.json with --quick) and the PNG plot")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.threads, args.repeats = [1], min(args.repeats, 2)
    return args


def run_example(name: str, extra: list[str], env: dict | None = None) -> dict:
    """Run ``examples/<name>.py`` with ``extra`` arguments in a fresh process; returns its ``--json`` result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, str(ROOT / "examples" / f"{name}.py"), *extra, "--json", str(out)]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            raise SystemExit(f"{name} failed (exit {proc.returncode})")
        for line in proc.stdout.splitlines():  # the example's own summary lines
            if "median" in line or "identical" in line or "compilations" in line or line.startswith("=="):
                print(f"    {line.strip()}")
        result = json.loads(out.read_text())
        result["process_wall_s"] = wall
        return result


def spread(values, fmt="{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def verdict(values, target: float) -> str:
    med = statistics.median(values)
    if min(values) < target <= max(values):
        return ("yes" if med >= target else "no") + " (noisy)"
    return "yes" if med >= target else "no"


def steady_rows(args, workload) -> list[dict]:
    rows = []
    for name in args.examples:
        for threads in args.threads:
            r = run_example(name, [*workload[name], "--threads", str(threads), "--repeats", str(args.repeats)])
            if name == "llm_serving":
                rows.append({"row": "llm_serving tokens/s", "threads": threads,
                             "eager": spread(r["eager_tokens_per_s"], "{:.1f}"),
                             "compiled": spread(r["compiled_tokens_per_s"], "{:.1f}"),
                             "ratios": r["ratios"], "target": TARGETS[name], "correct": r["identical"]})
            else:
                for config, c in r["configs"].items():
                    rows.append({"row": f"streaming_video ms/chunk, {config}", "threads": threads,
                                 "eager": spread(c["eager_ms"], "{:.1f}"),
                                 "compiled": spread(c["compiled_ms"], "{:.1f}"),
                                 "ratios": c["ratios"], "target": TARGETS[name], "correct": c["within_tolerance"]})
    return rows


def compile_rows(args, workload) -> list[dict]:
    rows = []
    for name in args.examples:
        small = {**dict(zip(workload[name][::2], workload[name][1::2])), "--repeats": "1", "--threads": "1"}
        if name == "llm_serving":
            small.update({"--requests": "2", "--max-new": "6"})
        small = [item for flag_value in small.items() for item in flag_value]
        # --package: the step as an AOTInductor package built by a first process (empty Inductor cache), loaded by a
        # second: the warm start that torch.compile's caches do not give a frozen graph in torch 2.13
        phases = ("cold", "warm", "package build", "package load")
        res = {}
        for impl in ("aten", "kvops"):
            with tempfile.TemporaryDirectory(prefix="e2e_inductor_") as cache_dir, \
                    tempfile.TemporaryDirectory(prefix="e2e_package_") as package_dir:
                env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                for phase in phases:
                    if phase == "package build":  # its own empty Inductor cache, as the cold row
                        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(package_dir, "inductor")
                    package = ["--package", package_dir] if phase.startswith("package") else []
                    r = run_example(name, [*small, "--impl", impl, *package], env)
                    if name == "llm_serving":
                        res[impl, phase] = (r["first_step_s"], r["first_step_cpu_s"], r["graphs_first"])
                    else:  # the first compiled stream of the first configuration
                        c = next(iter(r["configs"].values()))
                        res[impl, phase] = (c["first_stream_s"], c["first_stream_cpu_s"], c["graphs_first"])
        what = "first step" if name == "llm_serving" else "first compiled stream"
        for phase in phases:
            (aw, ac, ag), (kw, kc, kg) = res["aten", phase], res["kvops", phase]
            cold = phase in ("cold", "package build")
            package = phase.startswith("package")  # no torch.compile graph: say "package", not "0 g"
            rows.append({"example": name, "what": what, "phase": phase,
                         "aten": f"{aw:.1f} s ({ac:.1f} s CPU, {'package' if package else f'{ag} g'})",
                         "kvops": f"{kw:.1f} s ({kc:.1f} s CPU, {'package' if package else f'{kg} g'})",
                         "extra": kc / ac - 1,
                         "target": "<= +20% CPU" if cold else "< 5 s wall",
                         "met": (kc / ac - 1 <= 0.2) if cold else kw < 5.0})
    return rows


def print_tables(steady, compile_cost) -> None:
    if steady:
        print("\nsteady state (compiled over eager: tokens/s ratio, or eager/compiled ms per chunk; per interleaved "
              "pair, median [min-max])")
        w = max(len(r["row"]) for r in steady)
        head = (f"{'row':{w}} {'thr':>3}  {'eager':>20}  {'compiled':>20}  {'ratio':>20}  {'target':>6}  {'met':11} "
                f"correct")
        print(head)
        print("-" * len(head))
        for r in steady:
            print(f"{r['row']:{w}} {r['threads']:>3}  {r['eager']:>20}  {r['compiled']:>20}  {spread(r['ratios']):>20}  "
                  f"{r['target']:>5}x  {verdict(r['ratios'], r['target']):11} {r['correct']}")
    if compile_cost:
        print("\ncompile cost: time to the first compiled step, 1 thread, TORCHINDUCTOR_COMPILE_THREADS=1 "
              "(wall, CPU seconds incl. the C++ compiler, torch.compile graphs)")
        head = (f"{'example':16} {'what':22} {'phase':13}  {'aten + SDPA':>30}  {'kvops':>30}  {'kvops CPU':>9}  "
                f"{'target':12} met")
        print(head)
        print("-" * len(head))
        for r in compile_cost:
            print(f"{r['example']:16} {r['what']:22} {r['phase']:13}  {r['aten']:>30}  {r['kvops']:>30}  "
                  f"{r['extra']:>+8.0%}  {r['target']:12} {'yes' if r['met'] else 'no'}")


def hf_row(args) -> None:
    script = ROOT / "benchmarks" / "hf_decode.py"
    if not script.exists():
        print("\ntransformers decode row: benchmarks/hf_decode.py is not in this checkout (not measured)")
        return
    print(f"\ntransformers decode row: $ {script.name}" + (" --quick" if args.quick else ""), flush=True)
    subprocess.run([sys.executable, str(script), *(["--quick"] if args.quick else [])], cwd=ROOT, check=False)


def plot(steady, out: pathlib.Path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plots import save_ratio_plot

    panels, targets = {}, {}
    for r in steady:
        med, lo, hi = statistics.median(r["ratios"]), min(r["ratios"]), max(r["ratios"])
        panels.setdefault(r["row"], {}).setdefault("compiled / eager", []).append((r["threads"], med, lo, hi))
        targets[r["row"]] = r["target"]
    return save_ratio_plot(out / "e2e.png", panels, "threads", "compiled speedup", targets, log_x=False)


def main(argv=None) -> None:
    args = parse_args(argv)
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C: the running example is killed and the temporary Inductor caches
    # and packages (hundreds of MB) are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    workload = {k: v[1] if args.quick else v[0] for k, v in WORKLOADS.items()}
    steady = [] if "steady" in args.skip else steady_rows(args, workload)
    compile_cost = [] if "compile" in args.skip else compile_rows(args, workload)
    print_tables(steady, compile_cost)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("e2e_quick.json" if args.quick else "e2e.json")).write_text(json.dumps(
        {"steady": steady, "compile": compile_cost}, indent=1))
    if steady:
        png = plot(steady, out)
        print(f"plot: {png}" if png else "no plot: matplotlib is not installed (pip install -e '.[bench]')")
    if "hf" not in args.skip:
        hf_row(args)


if __name__ == "__main__":
    main()
