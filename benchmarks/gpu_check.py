"""One-shot GPU check of kvops on a CUDA machine as it is (no install step), or ``--aot`` without a GPU.

Run from the repository root, with the machine's own torch and Triton (torch 2.11 with Triton 3.6 and up):

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out OUT [--deadline-s 500] [--only oracle,timings]
    python benchmarks/gpu_check.py --aot [--subset] [--targets sm_80,sm_90] [--kernels REGEX] [--progress]

Stages, printed as each finishes, each guarded (a failing stage is reported and the next one runs) and cut at the
global deadline (the rest then reads "skipped (deadline)"); the results are rewritten under ``--out`` after every
stage, so a run stopped from outside still leaves them (at most 7 files: log.txt, summary.txt, results.json,
oracle.jsonl, cudagraphs.txt, fusion_code.txt, resources.txt):

1. environment: Python, torch, Triton, kvops, the device; kvops must import without its native CPU build;
2. oracle self-check (no GPU needed): the sweep's fp64 attention oracle against kvops/reference/attention.py with every
   attention feature, and one case of each kernel family on kvops' CPU kernels;
3. oracle (CUDA): every Triton kernel through the public ops against the fp64 oracle or the CPU kernels, over dtypes
   (fp16/bf16/fp32, fp8 caches), head dims 64/128/256, GQA groups 1/4/7/8, block sizes 1/16/64, NHD/HND, the
   flags and attention features, decode and prefill (tools/gpu_oracle.py; one line per case in oracle.jsonl);
4. CUDA graphs: a decode step of examples/llm_serving.py compiled with ``mode="reduce-overhead"``: no "skipping
   cudagraphs", the caches updated in place and equal to eager's;
5. fusion: Inductor's CUDA code for projection -> RoPE -> ``paged_cache_write`` is one generated kernel;
6. bandwidth and timings: HBM bandwidth (copy of 1 GiB), paged decode and prefill against SDPA over a contiguous
   cache, the cache writes; each as GB/s and as a fraction of the measured bandwidth;
7. kernel resources: the Triton compiles of the CI subset for this device, device-reported vs cubin;
8. the Triton tests on CUDA (pytest, when pytest and expecttest are installed) and the two examples with
   ``--device cuda``, in the time left.

Without CUDA the stages that need it are reported as skipped. Exit status 1 when a stage failed (a stage cut by the
deadline reads "timeout" and does not fail the run). ``--aot`` needs no GPU:
it compiles every kernel and specialization the launchers plan (tools/aot.py, cases in tools/aot_cases.py) to cubins
for sm_80, sm_86, sm_89, sm_90 and sm_100 and prints one table per target; exit 1 if anything fails to compile,
spills or exceeds the target's shared memory. ``--subset`` runs the CI subset (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
T0 = time.monotonic()
GPU, CPU = True, False  # a stage needs CUDA / runs anywhere


class Deadline(BaseException):
    """Raised in the main thread when a stage's time is up (or on SIGTERM). A BaseException, so that no ``except
    Exception`` on the way (Dynamo's error wrapping, the oracle's per-case guard) turns it into a failure."""


class Tee:
    """Every write to stdout/stderr also goes to ``log.txt``, flushed as it comes."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.stream.write(text)
        self.stream.flush()
        self.log.write(text)
        self.log.flush()
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class Run:
    def __init__(self, args):
        self.args, self.rows, self.facts, self.timings, self.oracle = args, [], {}, {}, []
        self.deadline = T0 + args.deadline_s
        self.out = pathlib.Path(args.out) if args.out else None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stage(self, name: str, needs_gpu: bool, fn, *args, cap_s: float | None = None):
        import torch  # noqa: F401  (imported once by the first stage; --help stays light)

        if self.args.only and not any(w in name for w in self.args.only.split(",")):
            return
        status, detail, t0 = "ok", "", time.monotonic()
        if needs_gpu and not torch.cuda.is_available():
            status, detail = "skipped", "needs CUDA (none on this machine)"
        elif self.left() < 5:
            status, detail = "skipped", "deadline"
        else:
            budget = min(self.left() - 3, cap_s or 1e9)
            signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, max(budget, 1))
            try:
                detail = fn(*args) or ""
            except Deadline:
                status, detail = "timeout", f"cut after {budget:.0f} s"
            except Exception as e:  # report and continue with the next stage
                status = "FAIL"
                detail = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                traceback.print_exc()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        self.rows.append(dict(stage=name, status=status, seconds=round(time.monotonic() - t0, 1), detail=detail))
        print(f"[{status}] {name} ({self.rows[-1]['seconds']:.1f} s) {detail}", flush=True)
        self.write()

    def summary(self) -> str:
        lines = [f"gpu_check: {time.monotonic() - T0:.0f} s, " + ", ".join(
            f"{k} {self.facts[k]}" for k in ("python", "torch", "triton", "device") if k in self.facts),
            f"{'stage':<42} {'status':<8} {'s':>6}  detail"]
        lines += [f"{r['stage']:<42} {r['status']:<8} {r['seconds']:>6.1f}  {r['detail']}" for r in self.rows]
        if self.oracle:
            bad = [r for r in self.oracle if r["status"] != "ok"]
            lines.append(f"\noracle: {len(self.oracle)} cases, {len(bad)} not ok")
            lines += [f"  {r['status']} {r['case']}: {r['detail']}" for r in bad[:20]]
        if self.timings:
            copy_bw = self.timings.get("copy_ 1 GiB", (0, 0, None))[1]
            lines.append(f"\n{'kernel':<40} {'ms':>8} {'GB/s':>8} {'of HBM':>7} {'/SDPA':>6}")
            for name, (ms, bw, ratio) in self.timings.items():
                frac = f"{bw / copy_bw:.0%}" if copy_bw else "-"
                lines.append(f"{name:<40} {ms:>8.3f} {bw:>8.0f} {frac:>7} {f'{ratio:.2f}' if ratio else '-':>6}")
        return "\n".join(lines)

    def write(self):
        if self.out is None:
            return
        (self.out / "summary.txt").write_text(self.summary() + "\n")
        (self.out / "results.json").write_text(json.dumps(dict(facts=self.facts, stages=self.rows, timings={
            k: dict(ms=v[0], gb_s=v[1], vs_sdpa=v[2]) for k, v in self.timings.items()},
            oracle=self.oracle), indent=1))

    def oracle_row(self, row):
        self.oracle.append(row)
        print(f"  [{row['status']}] {row['case']} ({row['seconds']:.1f} s) {row['detail']}", flush=True)
        if self.out is not None:
            with open(self.out / "oracle.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def _alarm(signum, frame):
    raise Deadline()


def _sigterm(signum, frame):  # `timeout` sends SIGTERM: unwind through the stage, which records and writes
    raise Deadline()


def run_cmd(cmd: list[str], timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("TRITON_INTERPRET", None)  # real GPU launches
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1))
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], sep="\n")
        raise RuntimeError(f"exit {p.returncode}: {tail[0]}")
    return tail[0][:160]


def pytest_triton(run: Run) -> str:
    import importlib.util

    missing = [m for m in ("pytest", "expecttest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not run: {', '.join(missing)} not installed here (the oracle stage covers the kernels)"
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*triton*.py"))
    return run_cmd([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], run.left() - 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for the results (created; rewritten after every stage)")
    parser.add_argument("--deadline-s", type=float, default=500,
                        help="the whole run ends within this many seconds of its start (default 500: under 9 min)")
    parser.add_argument("--only", default="", help="comma-separated words: run only the stages whose name has one")
    parser.add_argument("--oracle-limit", type=int, default=None, help="run only the first N oracle cases")
    parser.add_argument("--aot", action="store_true", help="no GPU needed: compile every kernel the launchers plan for "
                        "sm_80, sm_86, sm_89, sm_90 and sm_100 and report registers, spills and shared memory")
    parser.add_argument("--subset", action="store_true", help="--aot: the CI subset only")
    parser.add_argument("--targets", default="", help="--aot: comma-separated, e.g. sm_80,sm_90 (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="--aot: compile processes (at most 2)")
    parser.add_argument("--verbose", action="store_true", help="--aot: print every compile, not only failures")
    parser.add_argument("--kernels", default="", help="--aot: only kernels whose name matches this regex")
    parser.add_argument("--progress", action="store_true", help="--aot: one line per compile as it ends")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.aot:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (as the test does)
        from tools import aot

        sys.exit(aot.main(args))
    os.environ.setdefault("KVOPS_NATIVE", "0")  # the native CPU kernel is never needed here (nor built)
    run = Run(args)
    if run.out is not None:
        run.out.mkdir(parents=True, exist_ok=True)
        for name in ("oracle.jsonl", "log.txt"):
            (run.out / name).unlink(missing_ok=True)
        log = open(run.out / "log.txt", "a")
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
    signal.signal(signal.SIGTERM, _sigterm)
    from tools import gpu_oracle, gpu_stages

    try:
        run.stage("environment", CPU, gpu_stages.environment, run.facts)
        run.stage("oracle self-check (CPU)", CPU, gpu_stages.oracle_self_check, cap_s=90)

        def oracle():
            end = time.monotonic() + 0.45 * run.left()
            rows = gpu_oracle.sweep("cuda", end, on_row=run.oracle_row, limit=args.oracle_limit)
            total = sum(1 for _ in gpu_oracle.cases()) if args.oracle_limit is None else args.oracle_limit
            bad = [r for r in rows if r["status"] != "ok"]
            if bad:
                first = f"{bad[0]['case']}: {bad[0]['detail']}"
                raise AssertionError(f"{len(bad)} of {len(rows)} cases not ok, e.g. {first}")
            return f"{len(rows)} of {total} cases ok" + ("" if len(rows) == total else " (deadline: the rest not run)")

        run.stage("oracle: Triton kernels vs fp64 (CUDA)", GPU, oracle)
        run.stage("CUDA graphs: compiled decode step", GPU, gpu_stages.cudagraph_decode, run.out, cap_s=120)
        run.stage("fusion: projection->RoPE->paged write", GPU, gpu_stages.fusion_code, run.out, cap_s=60)
        run.stage("HBM bandwidth (copy_ 1 GiB)", GPU, gpu_stages.copy_bandwidth, run.timings, cap_s=30)
        run.stage("timings: attention vs SDPA", GPU, lambda: gpu_stages.attention_timings(
            run.timings, time.monotonic() + min(90, run.left() - 10)), cap_s=100)
        run.stage("timings: cache writes", GPU, gpu_stages.write_timings, run.timings, cap_s=30)
        run.stage("kernel resources: device vs cubin", GPU, gpu_stages.device_resources, run.out, cap_s=90)
        run.stage("Triton tests on CUDA (pytest)", GPU, pytest_triton, run)
        for name in ("llm_serving", "streaming_video"):
            run.stage(f"examples/{name}.py --device cuda", GPU, lambda n=name: run_cmd(
                [sys.executable, f"examples/{n}.py", "--device", "cuda", "--dtype", "bfloat16", "--repeats", "1"],
                run.left() - 5))
    except Deadline:  # a SIGTERM between stages: the finished stages are already written
        run.rows.append(dict(stage="(stopped from outside)", status="timeout", seconds=0.0, detail="SIGTERM"))
    print("\n=== gpu_check summary ===\n" + run.summary(), flush=True)
    run.write()
    sys.exit(1 if any(r["status"] == "FAIL" for r in run.rows) else 0)


if __name__ == "__main__":
    main()
