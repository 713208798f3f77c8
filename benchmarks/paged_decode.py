"""Paged attention: kvops.paged_attention against the unpaged ideal, gather-then-SDPA and FlexAttention, side by side.

Candidates, all on the same K/V values (synthetic: K/V, q ~ N(0, 1)):

* **ideal**: ``scaled_dot_product_attention`` over a contiguous ``[B, H_kv, S, D]`` cache, each KV head's query heads
  folded into query rows (``q.view(B, H_kv, G, D)``): K/V read once, no block table, no ``repeat_interleave``. It is
  the attention with the paging taken away, the bar a paged kernel is measured against. It is not a lower bound:
  kvops' kernel is a different kernel, specialised for decode (it splits long contexts across threads, reads
  bf16/fp16 K/V with vectorized conversion and software prefetch), so it can be faster than torch's general SDPA
  kernel, and a ratio below 1 means exactly that.
* **kvops eager / compiled**: ``kvops.paged_attention`` over a paged cache (block_size 16, randomly permuted block
  table), eagerly and under ``torch.compile(fullgraph=True, dynamic=True)``.
* **gather**: gather-then-SDPA, what a model without a paged kernel does: ``k_cache[block_table]`` into a contiguous
  copy, then the ideal's SDPA (eager).
* **flex**: FlexAttention with torch's ``PagedAttention`` (``torch.nn.attention.experimental``), compiled
  (``torch.compile(flex_attention)``), page size 128 (FlexAttention's KV block), decode rows only. Its compile takes
  one to two minutes per shape on a 2-core CPU, so ``--quick`` leaves it out unless ``--peers`` names it.

Workloads: decode (every sequence decodes one token over ``context`` cached tokens, B in {1, 8, 32} x context in
{256, 1024, 4096}) for Qwen2.5-0.5B (14/2 heads x 64, GQA 7:1) and Llama-3.1-8B (32/8 x 128, GQA 4:1); chunked
prefill, 4 sequences x (512 cached + 128 new tokens) with the bottom-right causal mask; bfloat16 and float32.

Timing (benchmarks/_harness.py, shared by every benchmark): candidates run interleaved (the order rotated every
round), after a warm-up, each sample a batch of calls lasting >= ~2 ms; a ratio is taken per round, and a cell prints
its median [p25-p75] over the rounds, so load from other processes hits both sides of a ratio; '~' marks a figure
whose spread is wider than 20% of its median: rerun it on an idle machine before believing it. With one thread the
clock is the thread's CPU time (``time.thread_time``: time the process is preempted by other jobs is not counted);
with more threads, and on CUDA, wall time (CUDA: synchronized). GB/s are the K/V bytes a call must read over its
median time. Only ratios are meaningful; nothing is asserted. At B = 1 a second line gives eager kvops with the
default value checks over the ideal, and compiled kvops over the compiled ideal (both pay torch.compile's per-call
graph entry, printed above each table).

Targets (the ``TARGETS`` table below, the one place they live), "CPU kernels at the roofline":

* decode, eager and compiled kvops, both geometries, bf16 and fp32: <= 1.0x the ideal at B in {8, 32} x context in
  {1024, 4096}; eager only, <= 1.5x the ideal at B = 1 x context 256 (the plain eager call, value checks off, as the
  row times it: per-call overhead counted);
* decode bandwidth, context >= 4096, bf16, 1 thread: the K/V bytes eager kvops reads per second >= 0.6x the copy
  bandwidth measured in the row's own rounds (a tensor copy's read + write bytes per second, per round; a sub-line
  under each such row gives the fraction, the bytes bound (the K/V at the copy's rate), the FMA bound (the row's
  score and PV FMAs at the faster of the fp32 and the bf16 FMA rate of a ``torch.mm`` timed in the same run; at GQA 7
  the FMAs may bound first) and which is the larger, and the same calls timed with every block table cycling over a
  few blocks, so that the K/V sit in the core's caches: the fraction the kernel's own work allows; below the target,
  the kernel binds, above it the reads);
* chunked prefill, eager and compiled: <= 1.0x gather-then-SDPA and <= 1.2x the ideal;
* two threads, eager kvops, decode B = 8 x context 4096 and the prefill case: >= 1.7x the one-thread throughput, when
  the run has threads 1 and 2 (a dedicated section times both thread counts interleaved with the wall clock; under a
  decode row, the same calls with the K/V in the core's caches: how the kernel's own work scales).

The target column gives, per kvops mode (eager/compiled), whether its median meets the row's ratio targets; the
verdict block at the end gives one line per target (ok or MISS, how many cases hold, the worst case's value and, for a
miss, what it means) and the largest miss. A table of packed (quantized) attention follows: ``kvops.packed``'s
``packed_attention`` over int8 and int4 K/V against dense ``kvops.paged_attention`` over the same values (decode, B =
8 x context 1024, 4096, bf16; bytes, accuracy and the streaming cache's tables: ``benchmarks/packed_cache.py``). The
header names the host ISA and the kvops native build variant loaded; ``--emulate-avx2`` reruns the benchmark in a
child process with torch (ATen, oneDNN, MKL) and kvops' native build on their AVX2 code, on an AVX-512 host, and the
header says so (not a real AVX2 host: caches, memory and clocks are the AVX-512 host's; results go to
``paged_decode_avx2.txt``). ``--json`` writes every row and target for tools. With matplotlib installed
(``pip install -e '.[bench]'``) a PNG of the ratios against context is written next to the table.

    python benchmarks/paged_decode.py [--quick] [--threads 1 2] [--peers gather flex] [--emulate-avx2] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

GEOMETRIES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}  # (H_q, H_kv, D), docs/models.md
QUICK = dict(batches=[1, 8], contexts=[256, 1024], rounds=5, threads=[1], peers=["gather"], packed_contexts=[1024])
FULL = dict(batches=[1, 8, 32], contexts=[256, 1024, 4096], rounds=9, threads=[1, 2], peers=["gather", "flex"],
            packed_contexts=[1024, 4096])
PACKED_BATCH = 8  # the packed-vs-dense table's decode batch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true",
                        help="a smaller run: B in {1, 8} x context in {256, 1024}, 5 rounds, 1 thread, peers: gather "
                             "(options given explicitly still apply); its table goes to paged_decode_quick.txt")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the tensors live (cuda: kvops' Triton kernels, wall clock)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="cache and query dtypes")
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES),
                        help="attention geometries (query heads / KV heads x head_dim of these models)")
    parser.add_argument("--threads", nargs="+", type=int, help="torch CPU thread counts, one table each "
                        f"(default {FULL['threads']}, --quick {QUICK['threads']})")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"),
                        help="how kvops.paged_attention is called")
    parser.add_argument("--peers", nargs="*", choices=("gather", "flex"),
                        help=f"other candidates besides the ideal (default {FULL['peers']}, --quick {QUICK['peers']})")
    parser.add_argument("--batches", nargs="+", type=int,
                        help=f"decode batch sizes (default {FULL['batches']}, --quick {QUICK['batches']})")
    parser.add_argument("--contexts", nargs="+", type=int,
                        help=f"decode context lengths in tokens (default {FULL['contexts']}, --quick "
                             f"{QUICK['contexts']})")
    parser.add_argument("--rounds", type=int,
                        help=f"interleaved rounds per row (default {FULL['rounds']}, --quick {QUICK['rounds']})")
    parser.add_argument("--no-prefill", action="store_true", help="skip the chunked-prefill row")
    parser.add_argument("--packed-contexts", nargs="*", type=int,
                        help=f"contexts of the packed (int8/int4) vs dense table, B = {PACKED_BATCH}, bf16; the "
                             f"option alone: no table (default {FULL['packed_contexts']}, --quick "
                             f"{QUICK['packed_contexts']})")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="rerun in a child process with torch (ATen, oneDNN, MKL) and kvops' native build on "
                             "their AVX2 code (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, "
                             "MKL_ENABLE_INSTRUCTIONS=AVX2, KVOPS_NATIVE_ISA=x86-64-v3), on an AVX-512 host; tables "
                             "go to paged_decode_avx2.txt (or _quick_avx2)")
    parser.add_argument("--value-checks", default="off", choices=("eager", "async", "off"),
                        help="kvops.set_value_checks mode while timing (default off: the kernels alone; B = 1 rows "
                             "also time the default eager mode)")
    parser.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                        help="auto: thread CPU time at 1 CPU thread, wall time otherwise")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"),
                        help="folder for the table (paged_decode.txt, or paged_decode_quick.txt with --quick) and "
                             "the plot (.png, with matplotlib)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda":
        args.threads = args.threads[:1]  # CPU threads do not matter to CUDA kernels
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once
    if ARGS.emulate_avx2:  # the child's torch must start with the variables set
        sys.exit(harness.emulate_avx2(__file__, [a for a in sys.argv[1:] if a != "--emulate-avx2"]))

import torch  # noqa: E402

import kvops  # noqa: E402

import _decode_sections as sections  # noqa: E402
import _paged_cases as cases  # noqa: E402
from _paged_cases import BLOCK_SIZE, make_case, measure, run_kvops  # noqa: E402
from plots import save_ratio_plot  # noqa: E402

PREFILL = (4, 128, 640)  # chunked prefill: batch, new tokens, context (512 cached + 128 new)
# The targets, one entry each (change or add targets here only). Which rows a target applies to: kind ("decode" or
# "prefill"), batches, contexts, dtypes, threads (None or absent = every one), min_context. metric: "ratio" (kvops
# mode / baseline candidate, per round), "bandwidth" (K/V bytes read per second / the copy's read + write bytes per
# second) or "speedup" (time at 1 thread / time at 2 threads, wall clock, section "two threads"). op, bound: what the
# median must meet. modes: the kvops modes held to it.
TARGETS = {
    "decode B in {8, 32} x ctx in {1024, 4096}: kvops <= 1.0x ideal":
        dict(kind="decode", batches=(8, 32), contexts=(1024, 4096), modes=("eager", "compiled"), metric="ratio",
             baseline="ideal", op="<=", bound=1.0),
    "decode B=1 ctx=256: eager kvops (value checks off) <= 1.5x ideal":
        dict(kind="decode", batches=(1,), contexts=(256,), modes=("eager",), metric="ratio", baseline="ideal",
             op="<=", bound=1.5),
    "decode ctx >= 4096, bf16, 1 thread: eager kvops' K/V read GB/s >= 0.6x the copy's read+write GB/s":
        dict(kind="decode", min_context=4096, dtypes=("bfloat16",), threads=(1,), modes=("eager",),
             metric="bandwidth", op=">=", bound=0.6),
    "chunked prefill: kvops <= 1.0x gather-then-SDPA":
        dict(kind="prefill", modes=("eager", "compiled"), metric="ratio", baseline="gather", op="<=", bound=1.0),
    "chunked prefill: kvops <= 1.2x ideal":
        dict(kind="prefill", modes=("eager", "compiled"), metric="ratio", baseline="ideal", op="<=", bound=1.2),
    "decode B=8 ctx=4096: eager kvops at 2 threads >= 1.7x its 1-thread throughput":
        dict(kind="decode", batches=(8,), contexts=(4096,), modes=("eager",), metric="speedup", op=">=", bound=1.7),
    "chunked prefill: eager kvops at 2 threads >= 1.7x its 1-thread throughput":
        dict(kind="prefill", modes=("eager",), metric="speedup", op=">=", bound=1.7),
}
MEANING = {  # what a miss means for a user: per kind of row for ratios ({baseline}: BASELINES' words), else per metric
    "decode": "on this host, decode attention over kvops' paged cache takes {value:.2f}x the time of {baseline} "
              "({over:.0%} past the target): the attention part of every decode step costs that much more; the whole "
              "step slows by less, in proportion to attention's share of it (small at short contexts)",
    "prefill": "on this host, chunked-prefill attention over kvops' paged cache takes {value:.2f}x the time of "
               "{baseline} ({over:.0%} past the target): prompt processing (time to the first token) pays that on its "
               "attention",
    "bandwidth": "on this host, eager kvops reads a long bf16 context's K/V at {value:.2f}x the copy's read + write "
                 "bytes per second ({over:.0%} short of {bound}x): long-context decode, whose attention is mostly "
                 "reading the cache, runs slower than the memory allows (unless the row's FMA bound is the larger: "
                 "then the FMAs set the pace; where the sub-line's fraction with the K/V in the caches is short of "
                 "the target too, the kernel's own work binds, not the memory)",
    "speedup": "on this host, eager kvops at 2 threads is only {value:.2f}x as fast as at 1 thread ({over:.0%} short "
               "of {bound}x): a second core shortens this attention by less than it should (work split, "
               "imbalance or shared memory bandwidth)",
}
BASELINES = {"ideal": "SDPA over the same K/V stored contiguously", "gather": "gathering the blocks and calling SDPA",
             "flex": "compiled FlexAttention with torch's PagedAttention"}


def targets_for(kind: str, batch=None, context=None, dtype=None, threads=None, metric=None) -> dict:
    """The TARGETS entries that apply to a row (an argument left None does not filter)."""
    fits = lambda v, allowed: v is None or allowed is None or v in allowed  # noqa: E731
    return {name: t for name, t in TARGETS.items() if t["kind"] == kind and fits(metric, (t["metric"],))
            and fits(batch, t.get("batches")) and fits(context, t.get("contexts")) and fits(dtype, t.get("dtypes"))
            and fits(threads, t.get("threads")) and (context is None or context >= t.get("min_context", 0))}


def _braced(values) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def run_label(target: str, t: dict, args) -> str:
    """``target`` as this run reports it: a target over a grid ``B in {...} x ctx in {...}`` names the part of the
    grid the run measured (``--quick``, ``--batches`` and ``--contexts`` run fewer shapes), the cases it counts."""
    if "batches" not in t or "contexts" not in t:
        return target
    grid = f"B in {_braced(t['batches'])} x ctx in {_braced(t['contexts'])}"
    ran = (f"B in {_braced(b for b in t['batches'] if b in args.batches)} x ctx in "
           f"{_braced(s for s in t['contexts'] if s in args.contexts)}")
    return target.replace(grid, ran)


def meaning(t: dict) -> str:
    if t["metric"] != "ratio":
        return MEANING[t["metric"]]
    return MEANING[t["kind"]].replace("{baseline}", BASELINES[t["baseline"]])


def ratio_to(r, mode: str, baseline: str):
    """kvops ``mode`` over ``baseline`` (the ideal, or a peer measured in the same rounds); None if not measured."""
    return r.get(mode) if baseline == "ideal" else r["vs"].get((mode, baseline))


def met(value: float, t: dict) -> bool:
    return value <= t["bound"] if t["op"] == "<=" else value >= t["bound"]


def target_cell(r, row_targets: dict, modes) -> str:
    """Per target of the row: its bound (and baseline, if not the ideal) and, per kvops mode (eager/compiled), ok or
    MISS by the median ("-": the mode is not held to it, or its baseline was not measured)."""
    parts = []
    for t in row_targets.values():
        cells = []
        for m in modes:
            value = ratio_to(r, m, t["baseline"]) if m in t["modes"] else None
            cells.append("-" if value is None else "ok" if met(value.median, t) else "MISS")
        parts.append(f"{t['bound']:g}{'' if t['baseline'] == 'ideal' else ' ' + t['baseline']}: {'/'.join(cells)}")
    return " ".join(parts) or "-"


def row_targets_and_bounds(report, table, c, r, name: str, dtype_name: str, threads: int, host: dict, args):
    """Record the row's ratio targets, and under a decode row a bandwidth target applies to (its kind, context and
    dtype; the target only at its thread counts), print the bounds sub-line and record the bandwidth target (labels:
    :func:`run_label`)."""
    kind = "decode" if c["q_len"] == 1 else "prefill"
    for target, t in targets_for(kind, c["batch"], c["context"], dtype_name, threads, metric="ratio").items():
        for mode in t["modes"]:
            value = ratio_to(r, mode, t["baseline"]) if mode in r else None
            if value is not None:
                report.target(run_label(target, t, args), f"{name}, {mode}", value, t["bound"], t["op"],
                              meaning(t))
    if kind != "decode":
        return
    for target, t in targets_for(kind, c["batch"], c["context"], dtype_name, metric="bandwidth").items():
        for mode in (m for m in t["modes"] if m in r["bw"]):
            gflops = sections.row_gflops(host, c["k_cache"].dtype)
            b = sections.bounds(c, r, mode, gflops)
            timely = t.get("threads") is None or threads in t["threads"]
            verdict = (f": target {t['op']} {t['bound']:g} {'ok' if met(b['fraction'].median, t) else 'MISS'}"
                       if timely else f" (the target applies at {'/'.join(map(str, t['threads']))} thread(s))")
            table.sub(sections.bounds_text(b, r, mode, gflops, verdict))
            table.rows[-1].update(bandwidth_fraction=b["fraction"].json(), bytes_bound_ms=b["bytes_ms"],
                                  fma_bound_ms=b["fma_ms"], larger_bound=b["larger"])
            table.rows[-1].update(copy_gbs=r["copy_gbs"].json())
            if "in_cache_fraction" in b:
                table.rows[-1].update(in_cache_fraction=b["in_cache_fraction"].json(), in_cache_ms=b["in_cache_ms"],
                                      in_cache_blocks=r["in_cache_blocks"], in_cache_kib=r["in_cache_kib"])
            if timely:
                report.target(run_label(target, t, args), f"{name}, {mode}", b["fraction"], t["bound"], t["op"],
                              meaning(t))


def thread_section(report, args, device, threads: int, panels: dict) -> float:
    """One thread count's tables (every geometry x dtype: decode rows, the prefill row); returns the largest output
    difference from the ideal."""
    torch.set_num_threads(threads)
    clock_name = harness.pick_clock(threads, device.type, args.clock)[0]
    where = f"{threads} CPU thread(s)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    report.print(f"\n=== {where}, {clock_name} clock ===")
    host = dict(copy_gbs=sections.copy_bandwidth_gbs(device, clock_name, cases.sync),
                gflops=sections.fma_gflops(device, clock_name, cases.sync),
                gflops_bfloat16=sections.fma_gflops(device, clock_name, cases.sync, dtype=torch.bfloat16))
    report.print(f"copy bandwidth (read + write bytes per second of a 256 MiB tensor copy) {host['copy_gbs']:.1f} "
                 f"GB/s; FMA rate (torch.mm {sections.MM_SIZE}^3) fp32 {host['gflops']:.0f}, bf16 "
                 f"{host['gflops_bfloat16']:.0f} GFLOP/s"
                 + (f"; torch.compile graph entry {cases.graph_entry_us(device, clock_name):.1f} us per call"
                    if "compiled" in args.modes else ""))
    report.extra.setdefault("host_figures", {})[str(threads)] = host
    cand_cols = [*args.modes, *args.peers]
    col_names = {"eager": "eager/ideal", "compiled": "compiled/ideal", "gather": "gather/ideal", "flex": "flex/ideal"}
    max_err = 0.0
    for geometry in args.geometries:
        h_q, h_kv, d = GEOMETRIES[geometry]
        for dtype_name in args.dtypes:
            table = report.table(
                f"{geometry} ({h_q}/{h_kv} heads x {d}), {dtype_name}, {where}",
                [("case", 13), ("ideal ms", 8, "{:.3f}"), *((col_names[n], 17) for n in cand_cols),
                 ("GB/s", 6, "{:.2f}"), ("target", 13)])
            shapes = [("decode", b, 1, s) for b in args.batches for s in args.contexts]
            if not args.no_prefill:
                shapes.append(("prefill", *PREFILL))
            for kind, batch, q_len, context in shapes:
                row_cands = [n for n in cand_cols if not (n == "flex" and kind == "prefill")]
                c = make_case(GEOMETRIES[geometry], batch, q_len, context, getattr(torch, dtype_name), device,
                              flex="flex" in row_cands)
                bw_row = kind == "decode" and any(m in row_cands for t in targets_for(
                    kind, batch, context, dtype_name, metric="bandwidth").values() for m in t["modes"])
                r = measure(c, row_cands, args.rounds, clock_name, extras=batch == 1,
                            copy=(sections.copy_fn(device), 2 * sections.COPY_BYTES) if bw_row else None)
                max_err = max(max_err, r["err"])
                case = f"B={batch} ctx={context}" if kind == "decode" else "prefill"
                kv = args.modes[0] if args.modes else None
                table.row(case, r["ms"]["ideal"], *(r.get(n) for n in cand_cols), r["gbs"][kv] if kv else None,
                          target_cell(r, targets_for(kind, batch, context, dtype_name, threads, "ratio"), args.modes),
                          geometry=geometry, dtype=dtype_name, threads=threads, kind=kind, batch=batch,
                          context=context, ms=r["ms"], gbs=r["gbs"], max_err=r["err"],
                          **{f"{m}/{b}": v for (m, b), v in r["vs"].items()})
                if "checked" in r:
                    table.sub(f"B = 1: eager kvops with value checks (default mode) / ideal {r['checked']}"
                              + (f"; compiled kvops / compiled ideal {r['compiled_vs_compiled']}"
                                 if "compiled_vs_compiled" in r else ""))
                name = f"{geometry} {dtype_name} {case}" + (f", {threads} thread{'s' * (threads > 1)}"
                                                             if len(args.threads) > 1 else "")
                row_targets_and_bounds(report, table, c, r, name, dtype_name, threads, host, args)
                del c
                if kind == "decode":
                    for mode in cand_cols:
                        series = panels.setdefault(f"{geometry} {dtype_name} {mode}", {})
                        series.setdefault(f"B={batch}, {threads}T", []).append(
                            (context, r[mode].median, r[mode].p25, r[mode].p75))
    return max_err


def speedup_section(report, args, device) -> None:
    """Eager kvops at 1 and 2 threads, wall clock both, interleaved, for the speedup targets' rows."""
    wanted = {n: t for n, t in TARGETS.items() if t["metric"] == "speedup" and not (t["kind"] == "prefill"
                                                                                     and args.no_prefill)}
    if not wanted or "eager" not in args.modes:
        return
    table = report.table("two threads vs one: eager kvops at 1 and 2 torch threads, interleaved in the same rounds "
                         "(torch.set_num_threads switched between samples), WALL clock at both (the tables above time "
                         "1 thread with the thread CPU clock); speedup = 1-thread time / 2-thread time per round",
                         [("case", 34), ("1 thread ms", 18, "{:.3f}"), ("2 threads ms", 18, "{:.3f}"),
                          ("speedup", 17), ("target", 12)])
    for geometry in args.geometries:
        for dtype_name in args.dtypes:
            for target, t in wanted.items():
                shapes = ([(b, 1, s) for b in t["batches"] for s in t["contexts"]] if t["kind"] == "decode"
                          else [PREFILL])
                for batch, q_len, context in shapes:
                    c = make_case(GEOMETRIES[geometry], batch, q_len, context, getattr(torch, dtype_name), device,
                                  flex=False)
                    cached = cases.in_cache_case(c) if q_len == 1 else None  # decode: also K/V in the caches
                    tm = sections.thread_speedup(lambda: run_kvops(c), args.rounds, cases.sync,
                                                 cached=None if cached is None else lambda: run_kvops(cached))
                    del c
                    speedup = tm.ratio("1 thread", "2 threads")
                    case = f"{geometry} {dtype_name} " + (f"B={batch} ctx={context}" if q_len == 1 else "prefill")
                    table.row(case, tm.time("1 thread", 1e3), tm.time("2 threads", 1e3), speedup,
                              f"{t['op']} {t['bound']:g} {'ok' if met(speedup.median, t) else 'MISS'}",
                              geometry=geometry, dtype=dtype_name, batch=batch, context=context, q_len=q_len)
                    if cached is not None:
                        in_cache = tm.ratio("1 thread in cache", "2 threads in cache")
                        ms1, ms2 = tm.time("1 thread in cache", 1e3), tm.time("2 threads in cache", 1e3)
                        table.sub(f"with the K/V in the core's caches (every table cycling over "
                                  f"{cached['in_cache_blocks']} blocks, {cached['in_cache_kib']} KiB of K + V; the "
                                  f"same calls, in the same rounds): 1 thread {ms1} ms, 2 threads {ms2} ms, speedup "
                                  f"{in_cache}: how the kernel's own work scales (near 2 while the row misses: the "
                                  f"memory path binds; short of the target too: the kernel's work or its split, or a "
                                  f"second core slowed by other load)")
                        table.rows[-1].update(in_cache_speedup=in_cache.json(), in_cache_ms_1_thread=ms1.json(),
                                              in_cache_ms_2_threads=ms2.json())
                    report.target(target, f"{case}, eager", speedup, t["bound"], t["op"], meaning(t))


def packed_section(report, args, device) -> None:
    """kvops.packed.packed_attention (int8, int4) against dense eager kvops.paged_attention, decode, bf16."""
    threads = args.threads[0]
    torch.set_num_threads(threads)
    clock_name = harness.pick_clock(threads, device.type, args.clock)[0]
    table = report.table(
        f"packed (quantized) vs dense attention: kvops.packed.packed_attention over int8 / int4 (group 64) K/V "
        f"against eager kvops.paged_attention over the same values, decode B={PACKED_BATCH}, bfloat16, {threads} "
        f"thread(s), {clock_name} clock; ratio = packed time / dense time per round",
        [("case", 24), ("dense ms", 8, "{:.3f}"), ("int8/dense", 17), ("int4/dense", 17), ("int8 bytes", 10, "{:.3f}"),
         ("int4 bytes", 10, "{:.3f}"), ("max |diff|", 17)])
    for geometry in args.geometries:
        for context in args.packed_contexts:
            c = make_case(GEOMETRIES[geometry], PACKED_BATCH, 1, context, torch.bfloat16, device, flex=False)
            p = sections.packed_vs_dense(c, run_kvops, args.rounds, clock_name, cases.sync)
            del c
            table.row(f"{geometry} ctx={context}", p["dense_ms"].median, p["int8"]["ratio"], p["int4"]["ratio"],
                      p["int8"]["bytes"], p["int4"]["bytes"], f"{p['int8']['err']:.1e}/{p['int4']['err']:.1e}",
                      geometry=geometry, batch=PACKED_BATCH, context=context, dense_ms=p["dense_ms"])
    table.sub("bytes: the packed K/V's bytes (codes, scales, zero points) / the dense bf16 K/V's; max |diff|: the "
              "largest |packed - dense| output (int8/int4: quantization error, not a kernel error). Bytes, accuracy "
              "and time of every format in the streaming cache: benchmarks/packed_cache.py.")


def main(args) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        cases.sync = torch.cuda.synchronize
    kvops.set_value_checks(args.value_checks)
    with kvops.value_checks(args.value_checks):
        pass  # its first use adds the thread-local that compiled graphs guard on: later uses recompile nothing
    kernel = ("Triton" if device.type == "cuda" else
              "native C++" if kvops.native.available() else "composite torch (no native build)")
    report = sections.TargetReport("paged_decode", args)
    facts = dict(kvops_kernel=kernel)
    if device.type == "cpu":
        facts["kvops_native_build"] = sections.native_build(kvops.native)
    report.start(threads=args.threads, device=args.device, **facts)
    report.note(f"block_size {BLOCK_SIZE}; value checks {args.value_checks}; {args.rounds} interleaved rounds per row"
                + (" (--quick)" if args.quick else ""))
    report.note("ideal = SDPA over the same K/V stored contiguously (query heads folded, K/V read once, no block "
                "table): the attention without paging. It is a bar, not a bound: kvops' decode kernel (context split "
                "across threads, vectorized bf16 loads, prefetch) can beat torch's general SDPA kernel, so ratios < 1 "
                "are possible.")
    report.note("cells: candidate time / ideal time per round, median [p25-p75]; eager, compiled = "
                "kvops.paged_attention eagerly and under torch.compile; gather = gather-then-SDPA; flex = compiled "
                "FlexAttention + PagedAttention (decode rows); GB/s: K/V bytes read per second by eager kvops (or "
                "the first mode); target: the row's ratio targets (bound, baseline if not the ideal) and, per mode "
                "(eager/compiled), ok or MISS by the median (the verdict at the end names each target); prefill = "
                f"{PREFILL[0]} x ({PREFILL[2] - PREFILL[1]} cached + {PREFILL[1]} new). Under decode rows at context "
                ">= 4096 in bf16: eager kvops' K/V bytes read per second as a fraction of the copy's read + write "
                "bytes per second (the copy timed in the row's rounds), the bytes and FMA bounds, and the fraction "
                "with the K/V in the core's caches.")
    panels, max_err = {}, 0.0
    for threads in args.threads:
        max_err = max(max_err, thread_section(report, args, device, threads, panels))
    report.print(f"\nlargest |candidate - ideal| over every row: {max_err:.1e} (outputs agree; only the times differ)")
    if device.type == "cpu" and {1, 2} <= set(args.threads):
        speedup_section(report, args, device)
    if args.packed_contexts:
        packed_section(report, args, device)
    report.finish()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("paged_decode_quick" if args.quick else "paged_decode") + ("_avx2" if harness.EMULATED in os.environ
                                                                       else "")
    (out / f"{stem}.txt").write_text("\n".join(report.lines) + "\n")
    bound = min(t["bound"] for t in TARGETS.values() if t["kind"] == "decode" and t["metric"] == "ratio")
    png = save_ratio_plot(out / f"{stem}.png", panels, "context (tokens)", "candidate / ideal",
                          targets={p: bound for p in panels})
    report.print(f"\ntable: {out / (stem + '.txt')}" + (f"; plot: {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main(ARGS)
