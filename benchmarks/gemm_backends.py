"""The examples' GEMMs alone (no kvops): eager ``F.linear`` vs what the compiled step runs in their place.

Both examples are GEMM-bound at their CPU scale (``aten::mm``/``addmm`` are 85-93% of an eager step in
torch.profiler), so a compiled step can only be as much faster than eager as its GEMMs allow: with a GEMM share
``s`` of the eager step and GEMMs ``g`` times faster, the step is ``1 / ((1 - s) + s / g)`` times faster if everything
else takes as long as in eager (Amdahl), and at most ``g / s`` times faster even if everything else took no time
(the ceiling). This script times each GEMM shape of ``examples/llm_serving.py`` (Qwen2.5-0.5B
projections, 32 tokens a step) and ``examples/streaming_video.py`` (Wan-2.1 1.3B projections at this scale, 24 tokens
a pass) four ways, interleaved (thread CPU time per call at 1 thread, wall time at more):

* ``eager``: ``F.linear`` (MKL/oneDNN sgemm on CPU);
* ``default``: ``torch.compile`` of the linear with Inductor's defaults (an extern call to the same GEMM: its gap to
  eager is the compiled call's own cost on a one-op graph, a floor under every compiled variant here);
* ``freezing``: ``torch._inductor.config.freezing`` (weights constant-folded and packed for MKL's packed GEMM);
* ``freezing+CPP``: freezing with ``max_autotune`` and the ``CPP`` GEMM backend only, the examples' setting
  (Inductor's C++ GEMM template over prepacked weights).

It prints per shape and variant (benchmarks/_harness.py, as every benchmark: interleaved rounds in rotated order,
median [p25-p75] over the rounds): time per call, GFLOP/s, and the speedup over eager (per-round eager time / variant
time); then, per example, the step-level estimate and ceiling for each variant (the GEMM share is given by
``--gemm-share``, measured with torch.profiler on an eager step), and a verdict block (no targets: what it found). The outcome depends on the CPU (how fast eager's sgemm is there): on an
AVX2 host (AMD EPYC, Zen 3) a frozen CPP-GEMM LLM step took 70 ms against 110 ms eager; on an AVX-512 host (AMD EPYC
with AVX-512) every compiled variant's GEMMs were 0.88-1.0x eager's, a ceiling of about 1.03x (LLM) and 1.06x
(streaming) at 1 thread, so compiling cannot make these steps much faster there (docs/compile.md).

    python benchmarks/gemm_backends.py                 # 1 thread
    python benchmarks/gemm_backends.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

# (example, name, tokens M, in K, out N) of one layer; the LLM's lm_head runs on the 7 last tokens of a step
SHAPES = [
    ("llm_serving", "qkv (bias)", 32, 896, 1152), ("llm_serving", "o", 32, 896, 896),
    ("llm_serving", "gate_up", 32, 896, 9728), ("llm_serving", "down", 32, 4864, 896),
    ("streaming_video", "qkv (bias)", 24, 1536, 4608), ("streaming_video", "out (bias)", 24, 1536, 1536),
    ("streaming_video", "ffn up (bias)", 24, 1536, 2240), ("streaming_video", "ffn down (bias)", 24, 2240, 1536),
]
VARIANTS = {
    "default": {},
    "freezing": {"freezing": True},
    "freezing+CPP": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median and spread printed)")
    p.add_argument("--calls", type=int, default=20, help="calls per variant per round (a sample times them together)")
    p.add_argument("--gemm-share", type=float, nargs=2, default=[0.93, 0.89], metavar=("LLM", "STREAM"),
                   help="GEMM share of an eager step of each example (torch.profiler; default: measured on a 2-core "
                        "AVX-512 host, 1 thread)")
    p.add_argument("--quick", action="store_true", help="the LLM's qkv and o shapes only, 3 rounds of 5 calls")
    harness.add_json_arg(p)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.calls < 1:
        raise SystemExit("--threads, --repeats and --calls must be >= 1")
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.quick:
        args.repeats, args.calls = min(args.repeats, 3), min(args.calls, 5)
    import torch  # after parsing: --help answers without importing torch
    import torch._inductor.config
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # one thread: this thread's CPU time (what other load on the machine inflates least); more: wall time (the
    # calling thread's CPU time does not count the other threads' work)
    clock = harness.pick_clock(args.threads)[0]
    report = harness.Report("gemm_backends", args, argv)
    report.start(threads=args.threads)
    report.note(f"{clock} clock per call ({args.calls} calls a sample), median [p25-p75] of {args.repeats} "
                "interleaved rounds; speedup: eager time / variant time per round")
    table = report.table("the examples' GEMMs alone: eager F.linear vs the compiled variants",
                         [("example", 15), ("GEMM", 15), ("M x K x N", 16), ("variant", 12), ("us per call", 17, "{:.0f}"),
                          ("GF/s", 5, "{:.0f}"), ("speedup", 17)])
    speedups = {}
    with torch.no_grad():
        for example, name, m, k, n in shapes:
            linear = torch.nn.Linear(k, n, bias="bias" in name).eval()
            x = torch.randn(m, k)
            fns = {"eager": linear}
            torch._dynamo.reset()  # the shapes' graphs would pass Dynamo's recompile limit (then run eagerly)
            for label, settings in VARIANTS.items():
                # a module of its own per variant: Dynamo guards on the module, so each compiles its own graph under
                # its own settings (a shared module would reuse the first variant's graph)
                compiled = torch.compile(copy.deepcopy(linear), fullgraph=True)
                with torch._inductor.config.patch(settings):
                    torch.testing.assert_close(compiled(x), linear(x), atol=1e-3, rtol=1e-4)  # compiles here
                fns[label] = compiled
            t = harness.interleave({label: (lambda fn=fn: fn(x)) for label, fn in fns.items()}, args.repeats,
                                   clock=clock, reps=args.calls, warmup=0)
            eager = t.time("eager").median
            for label in fns:
                med = t.time(label).median
                speedups.setdefault(example, {}).setdefault(label, []).append((eager / med, 2 * m * k * n))
                table.row(example, name, f"{m} x {k} x {n}", label, t.time(label, 1e6), 2 * m * k * n / med / 1e9,
                          t.ratio("eager", label))
    report.print("\ng = the variant's FLOP-weighted GEMM speedup over eager (of the medians), s = the "
                 f"GEMM share of an eager step{' (measured at 1 thread)' if args.threads > 1 else ''}: Amdahl "
                 "1 / ((1 - s) + s / g) with the rest as in eager; ceiling g / s with the rest free")
    steps = report.table("step level: estimate (Amdahl) and ceiling per variant", [("example", 15), ("GEMM share", 10, "{:.0%}"), ("variant", 12),
                                         ("GEMMs g", 7, "{:.2f}"), ("step (Amdahl)", 13, "{:.2f}"),
                                         ("ceiling", 7, "{:.2f}")])
    for (example, per_variant), share in zip(speedups.items(), args.gemm_share):
        for label, items in per_variant.items():
            if label == "eager":
                continue
            flops = sum(f for _, f in items)
            g = flops / sum(f / s for s, f in items)  # total eager time / total variant time
            amdahl = 1 / ((1 - share) + share / g)
            steps.row(example, share, label, g, amdahl, g / share)
            if label == "freezing+CPP":
                report.finding(f"{example}: with the examples' setting (freezing + CPP GEMM) the GEMMs run "
                               f"{g:.2f}x as fast as eager's on this host: a compiled step is estimated at "
                               f"{amdahl:.2f}x eager's speed (ceiling {g / share:.2f}x)")
    report.finish()


if __name__ == "__main__":
    main()
