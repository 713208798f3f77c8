"""Paged attention on CPU: kvops.paged_attention (eager and compiled) vs. the unpaged ideal, measured side by side.

The ideal is SDPA over a contiguous ``[B, H_kv, S, D]`` cache with each KV head's query heads folded into query rows
(``q.view(B, H_kv, G, D)``): K/V read once, no table indirection and no ``repeat_interleave`` (SDPA with
``enable_gqa=True`` is several times slower than that on CPU, so it is not the bar). kvops reads a paged cache
(block_size 16, randomly permuted block table) with the same values.

* decode: every sequence decodes one token over ``context`` cached tokens, B in {1, 8, 32} x context in
  {256, 1024, 4096}, for Qwen2.5-0.5B (14/2 heads x 64, GQA 7:1) and Llama-3.1-8B (32/8 x 128, GQA 4:1);
* chunked prefill: 4 sequences x (512 cached + 128 new tokens), against SDPA with the same bottom-right causal mask
  (query rows folded the same way);
* bf16 and fp32; 1 and 2 threads (one table each, ``--threads``); kvops eager and
  ``torch.compile(fullgraph=True, dynamic=True)``. At B = 1, where per-call costs dominate, a second line gives eager
  kvops with the default value checks (``"eager"`` mode) over the ideal, and compiled kvops over the compiled ideal:
  every compiled call pays torch.compile's graph entry (guards and wrappers, printed in each table's header; the
  ideal itself runs eagerly), which a model pays once per step, not once per attention call.

Timing: with one thread, the clock is the thread's CPU time (``time.thread_time``: time the process is preempted
by other jobs on a shared machine is not counted); with more threads it is wall time (``--clock`` overrides).
Candidates run interleaved (ideal, eager, compiled, alternating order each round), each sample a batch of
calls lasting >= ~2 ms; the ratio is taken per round, and the table prints its median and spread (25th-75th
percentile) over the rounds, so load from other processes hits both sides of a ratio. GB/s are the K/V bytes each
call must read (``B * S * H_kv * (D + D_v) * itemsize``) over the median time, next to the machine's copy
bandwidth (read + write of a 256 MiB ``copy_``) measured at each thread count. Synthetic data: K/V ~ N(0, 1), q ~
N(0, 1). Only ratios are meaningful; nothing is asserted.

Targets (issue 12): decode <= 1.2x at B in {8, 32} x context in {1024, 4096}, <= 2x at B = 1 and small contexts;
prefill <= 1.3x. With matplotlib installed (``pip install -e '.[bench]'``) a PNG of the ratios against context is
written next to the table (``--out``).

    python benchmarks/paged_decode.py [--quick] [--threads 1 2] [--dtypes bfloat16 float32] [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kvops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from plots import save_ratio_plot  # noqa: E402

BLOCK_SIZE = 16
GEOMETRIES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}  # (H_q, H_kv, D), models.md
TARGETS = {"decode": {(8, 1024): 1.2, (8, 4096): 1.2, (32, 1024): 1.2, (32, 4096): 1.2, (1, 256): 2.0},
           "prefill": 1.3}


CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def _sample(fn, reps: int) -> float:
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def interleaved(cands: dict, rounds: int, min_sample_s: float = 2e-3) -> dict:
    """Per-call seconds of every candidate per round: ``{name: [t_round0, ...]}`` (candidates alternate order)."""
    reps = {}
    for name, fn in cands.items():
        fn()  # warm-up (and compile)
        t = _sample(fn, 1)
        reps[name] = max(1, min(200, int(min_sample_s / max(t, 1e-7))))
    out = {name: [] for name in cands}
    names = list(cands)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(_sample(cands[name], reps[name]))
    return out


def spread(xs):
    """(median, 25th percentile, 75th percentile)."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), q[0], q[2]


def copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = statistics.median(interleaved({"copy": lambda: dst.copy_(src)}, rounds=5)["copy"])
    return 2 * nbytes / t / 1e9


def make_case(geometry, batch: int, q_len: int, context: int, dtype, seed: int = 0):
    """Paged and dense copies of the same K/V; ``context`` includes the ``q_len`` new tokens."""
    h_q, h_kv, d = GEOMETRIES[geometry]
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, -1).to(torch.int32)
    q = torch.randn(batch * q_len, h_q, d, generator=g).to(dtype)
    dense = lambda c: c[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # noqa: E731
    group = h_q // h_kv
    # folded queries [B, H_kv, q_len * G, D], rows (query, group head)
    q_f = q.view(batch, q_len, h_kv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, h_kv, q_len * group, d)
    mask = None
    if q_len > 1:  # bottom-right causal: query i sits at position context - q_len + i
        pos = context - q_len + torch.arange(q_len).repeat_interleave(group)
        mask = torch.arange(context)[None, :] <= pos[:, None]
    return dict(q=q, q_f=q_f.contiguous(), mask=mask, k_cache=k_cache, v_cache=v_cache, block_table=table,
                seq_lens=torch.full((batch,), context, dtype=torch.int32),
                cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32), max_seqlen_q=q_len,
                k_dense=dense(k_cache), v_dense=dense(v_cache), batch=batch, q_len=q_len, group=group)


def run_ideal(c):
    return F.scaled_dot_product_attention(c["q_f"], c["k_dense"], c["v_dense"], attn_mask=c["mask"])


def run_kvops(c):
    return kvops.paged_attention(c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"], c["seq_lens"],
                                 c["block_table"], c["max_seqlen_q"])


# one graph per (geometry, dtype, batch == 1) under dynamic shapes (sizes 0/1 specialize): above Dynamo's default 8
torch._dynamo.config.recompile_limit = 64
run_compiled = torch.compile(run_kvops, fullgraph=True, dynamic=True)
run_ideal_compiled = torch.compile(run_ideal, fullgraph=True, dynamic=True)


def run_checked(c):
    """Eager kvops in the default value-check mode ("eager": the index tensors' contents are checked per call)."""
    with kvops.value_checks("eager"):
        return run_kvops(c)


def graph_entry_us(rounds: int = 5) -> float:
    """Per-call cost of entering a compiled graph (guards, wrappers): a compiled one-multiply over a decode's
    inputs minus the eager multiply, in microseconds. Every compiled B = 1 call pays it once."""
    c = make_case("qwen2.5-0.5b", 1, 1, 256, torch.float32)
    mul = lambda c: c["q"] * 2  # noqa: E731
    cmul = torch.compile(mul, fullgraph=True, dynamic=True)
    t = interleaved({"eager": lambda: mul(c), "compiled": lambda: cmul(c)}, rounds)
    return (statistics.median(t["compiled"]) - statistics.median(t["eager"])) * 1e6


def unfold(c, out_f):
    """Ideal's ``[B, H_kv, q_len * G, D]`` back to kvops' packed ``[T, H_q, D]``."""
    b, h_kv, _, d = out_f.shape
    return out_f.view(b, h_kv, c["q_len"], c["group"], d).permute(0, 2, 1, 3, 4).reshape(-1, h_kv * c["group"], d)


def measure(c, modes, rounds, extras=False):
    """Ratios of every candidate to the ideal; with ``extras`` (B = 1: per-call overheads matter) also compiled
    kvops vs the compiled ideal (both pay the graph entry) and eager kvops with the default value checks."""
    ref = unfold(c, run_ideal(c)).float()
    err = max((f(c).float() - ref).abs().max().item() for f in (run_kvops, run_compiled))  # same attention
    cands = {"ideal": lambda: run_ideal(c)}
    if "eager" in modes:
        cands["eager"] = lambda: run_kvops(c)
    if "compiled" in modes:
        cands["compiled"] = lambda: run_compiled(c)
    if extras:
        cands["ideal_compiled"] = lambda: run_ideal_compiled(c)
        cands["checked"] = lambda: run_checked(c)
    times = interleaved(cands, rounds)
    res = {"err": err, "ms": {n: statistics.median(ts) * 1e3 for n, ts in times.items()}}
    for n in cands:
        if n != "ideal":
            res[n] = spread([a / b for a, b in zip(times[n], times["ideal"])])
    if extras and "compiled" in cands:
        res["compiled_vs_compiled"] = spread([a / b for a, b in zip(times["compiled"], times["ideal_compiled"])])
    kv_bytes = c["k_dense"].numel() * 2 * c["k_dense"].element_size()
    res["gbs"] = {n: kv_bytes / (ms * 1e-3) / 1e9 for n, ms in res["ms"].items()}
    return res


def fmt_ratio(r):
    return f"{r[0]:5.2f} [{r[1]:.2f}-{r[2]:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per configuration")
    parser.add_argument("--quick", action="store_true", help="B in {1, 8} x context in {256, 1024}, 5 rounds")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--value-checks", default="off", choices=("eager", "async", "off"),
                        help="kvops.set_value_checks mode while timing (default off: the kernels; B = 1 rows also "
                             "time the default eager mode)")
    parser.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                        help="auto: thread CPU time at 1 thread, wall time otherwise")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"),
                        help="folder for the table (paged_decode.txt) and plot (paged_decode.png)")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.contexts, args.rounds = [1, 8], [256, 1024], 5

    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    kvops.set_value_checks(args.value_checks)
    native = kvops.native.available()
    emit(f"torch {torch.__version__}; CPU kernel: {'native C++' if native else 'composite torch (no native build)'}; "
         f"block_size {BLOCK_SIZE}; value checks {args.value_checks}; ratios = kvops / ideal per interleaved round: "
         f"median [25th-75th pct] of {args.rounds} rounds")
    panels = {}
    global clock
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock_name = args.clock if args.clock != "auto" else ("cpu" if threads == 1 else "wall")
        clock = CLOCK[clock_name]
        emit(f"\n=== {threads} thread(s), {clock_name} clock: copy bandwidth (read + write) "
             f"{copy_bandwidth_gbs():.1f} GB/s; torch.compile graph entry {graph_entry_us():.1f} us per call ===")
        header = (f"{'case':<34} | {'ideal ms':>9} {'eager ms':>9} {'comp ms':>9} | {'eager/ideal':>18} "
                  f"{'compiled/ideal':>18} | {'GB/s ideal':>10} {'eager':>6} {'comp':>6} | target")
        emit(header)
        emit("-" * len(header))
        for geometry in args.geometries:
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                shapes = [("decode", b, 1, s) for b in args.batches for s in args.contexts]
                if not args.no_prefill:
                    shapes.append(("prefill", 4, 128, 640))
                for kind, batch, q_len, context in shapes:
                    c = make_case(geometry, batch, q_len, context, dtype)
                    r = measure(c, args.modes, args.rounds, extras=batch == 1)
                    del c
                    target = TARGETS["prefill"] if kind == "prefill" else TARGETS["decode"].get((batch, context))
                    name = (f"{geometry} {dtype_name[:4]} " + (f"B={batch} ctx={context}" if kind == "decode"
                                                                  else "prefill 4x(512+128)"))
                    ms, gbs = r["ms"], r["gbs"]
                    emit(f"{name:<34} | {ms['ideal']:>9.3f} {ms.get('eager', 0):>9.3f} {ms.get('compiled', 0):>9.3f} | "
                         f"{fmt_ratio(r['eager']) if 'eager' in r else '':>18} "
                         f"{fmt_ratio(r['compiled']) if 'compiled' in r else '':>18} | {gbs['ideal']:>10.2f} "
                         f"{gbs.get('eager', 0):>6.2f} {gbs.get('compiled', 0):>6.2f} | "
                         f"{'<= ' + str(target) if target else '':<7} (max err {r['err']:.1e})")
                    if "checked" in r:
                        emit(f"{'':<34} | eager with value checks (default mode) / ideal {fmt_ratio(r['checked'])}"
                             + (f"; compiled / compiled ideal {fmt_ratio(r['compiled_vs_compiled'])}"
                                if "compiled_vs_compiled" in r else ""))
                    if kind == "decode":
                        for mode in args.modes:
                            panel = f"{geometry} {dtype_name} {mode}"
                            series = panels.setdefault(panel, {}).setdefault(f"B={batch}, {threads}T", [])
                            series.append((context, *r[mode]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_decode.txt").write_text("\n".join(lines) + "\n")
    png = save_ratio_plot(out / "paged_decode.png", panels, "context (tokens)", "kvops / ideal",
                          targets={p: 1.2 for p in panels})
    print(f"\ntable: {out / 'paged_decode.txt'}" + (f"; plot: {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
