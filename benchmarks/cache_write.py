"""Cache writes on CPU: kvops' fused writes vs. the plain aten indexing Inductor fuses itself, and eager overhead.

Geometry: 8 KV heads x head_dim 128 (Llama-3-8B / Qwen2.5-7B KV geometry, docs/models.md), block_size 16, N tokens per call,
N in {16, 512, 8192}; dtypes bfloat16 and float8_e4m3fn (per-tensor scales; fp8 only for the paged ops: contiguous
caches have no fp8 path). Caches are "plain" (separate K and V tensors) or "joint" (K/V as ``unbind`` views of one
``[P, block_size, 2, H, D]`` / ``[B, S, 2, H, D]`` allocation). Slots are a random permutation (no padding). Inputs are
synthetic ``randn`` values. Three tables, every ratio a candidate's time over its baseline's time *in the same round*:

* **compiled paged**: ``torch.compile(fullgraph=True)`` of ``kvops.paged_cache_write(key * 0.5, value, ...)`` vs the
  same function written as ``k_cache.view(-1, H, D)[slot_mapping] = key * 0.5`` (and the V store; fp8: the same
  ``x / scale`` saturated cast), which Inductor lowers to its own fused ``index_put_``. Target <= 1.0x.
* **compiled contiguous**: ``kvops.cache_write(key * 0.5, value, k_cache, v_cache, start)`` vs
  ``k_cache[:, start:start + T] = key * 0.5`` (and V), both compiled. Target <= 1.0x.
* **eager paged**: ``kvops.paged_cache_write(key, value, ...)`` vs ``k_cache.view(-1, H, D).index_copy_(0, slots,
  key)`` (and V; fp8: quantize, then ``index_copy_`` on ``uint8`` views, as kvops' CPU kernel does). Target <= 1.2x.
  When ``kvops.value_checks`` exists (value checks on by default in eager), the table has a second column measured
  inside ``kvops.value_checks("off")``.

Timing (benchmarks/_harness.py, shared by every benchmark): candidates are interleaved round by round (the order
rotated every round, each sample a batch of calls lasting >= ~2 ms after a warm-up that compiles), so machine noise
hits all of them alike; a table cell is the median [p25-p75] of the per-round ratios. Nothing is asserted; only the
ratios are meaningful; the verdict block at the end says which targets hold. Threads default to 1 (the benchmark
machine is shared; multi-threaded timings there measure the scheduler), and with one thread the clock is the
thread's CPU time (``time.thread_time``: time this thread was descheduled by other processes is not counted;
``--clock wall`` for ``time.perf_counter``, the default with more threads).

    python benchmarks/cache_write.py [--rounds 15] [--threads 1] [--clock thread|wall] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case (default 15; --quick: 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=("thread", "wall"), default=None,
                        help="thread CPU time (default with --threads 1) or wall time")
    parser.add_argument("--quick", action="store_true", help="N in {16, 512} and 7 rounds")
    parser.add_argument("--tables", default="paged,contiguous,eager", help="comma-separated subset to run")
    harness.add_json_arg(parser)
    return parser.parse_args(argv)

if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
from torch._inductor.utils import fresh_inductor_cache  # noqa: E402

import kvops  # noqa: E402

H, D, BLOCK_SIZE = 8, 128, 16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x, scale):
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# --- paged writes ---------------------------------------------------------------------------------------------------
def paged_case(n, dtype, joint, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = max(4, -(-2 * n // BLOCK_SIZE))
    if joint:
        kv = torch.zeros(p, BLOCK_SIZE, 2, H, D).to(dtype)
        k_cache, v_cache = kv.unbind(2)
    else:
        k_cache, v_cache = torch.zeros(p, BLOCK_SIZE, H, D).to(dtype), torch.zeros(p, BLOCK_SIZE, H, D).to(dtype)
    src = torch.bfloat16 if dtype == FP8 else dtype
    key, value = torch.randn(n, H, D, generator=g).to(src), torch.randn(n, H, D, generator=g).to(src)
    slots = torch.randperm(p * BLOCK_SIZE, generator=g)[:n]
    scales = (torch.tensor([0.02]), torch.tensor([0.03])) if dtype == FP8 else (None, None)
    return key, value, k_cache, v_cache, slots, scales


def kvops_paged(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    kvops.paged_cache_write(key * 0.5, value, k_cache, v_cache, slots, None, k_scale, v_scale)


def aten_paged(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    k, v = key * 0.5, value
    if k_scale is not None:
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    k_cache.view(-1, H, D)[slots] = k
    v_cache.view(-1, H, D)[slots] = v


def eager_kvops(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    kvops.paged_cache_write(key, value, k_cache, v_cache, slots, None, k_scale, v_scale)


def eager_index_copy(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    kc, vc = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    if k_scale is not None:  # index_copy_ has no fp8 CPU kernel: quantize, then copy bytes (as kvops' CPU kernel)
        key, value = quantize(key, k_scale).view(torch.uint8), quantize(value, v_scale).view(torch.uint8)
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    kc.index_copy_(0, slots, key)
    vc.index_copy_(0, slots, value)


# --- contiguous writes ----------------------------------------------------------------------------------------------
def contiguous_case(n, dtype, joint, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = 2 * n + 16
    if joint:
        k_cache, v_cache = torch.zeros(1, s, 2, H, D, dtype=dtype).unbind(2)
    else:
        k_cache, v_cache = torch.zeros(1, s, H, D, dtype=dtype), torch.zeros(1, s, H, D, dtype=dtype)
    key, value = torch.randn(1, n, H, D, generator=g).to(dtype), torch.randn(1, n, H, D, generator=g).to(dtype)
    return key, value, k_cache, v_cache


START = 7


def kvops_contiguous(key, value, k_cache, v_cache):
    kvops.cache_write(key * 0.5, value, k_cache, v_cache, START)


def aten_contiguous(key, value, k_cache, v_cache):
    t = key.shape[1]
    k_cache[:, START : START + t] = key * 0.5
    v_cache[:, START : START + t] = value


# --- timing ---------------------------------------------------------------------------------------------------------
MEANING = {
    "compiled": "under torch.compile, kvops' fused {what} takes {value:.2f}x the time of the index_put_ Inductor "
                "generates itself ({over:.0%} past the target): a model gains nothing from the kvops op in this case "
                "on this host, and should expect that much more time in its cache writes",
    "eager": "in eager mode, kvops.paged_cache_write takes {value:.2f}x the time of a plain index_copy_ "
             "({over:.0%} past the target): eager models pay that much more per cache write on this host",
}


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = args.clock or ("thread" if args.threads == 1 else "wall")
    sizes = (16, 512) if args.quick else (16, 512, 8192)
    rounds = 7 if args.quick else args.rounds
    report = harness.Report("cache_write", args)
    report.start(threads=args.threads)
    report.note(f"clock {clock}; H_kv {H}, head_dim {D}, block_size {BLOCK_SIZE}, {rounds} interleaved rounds; cells: "
                "kvops time / baseline time per round, median [p25-p75]; baseline: the aten baseline's median time "
                "per call in us")
    tables = set(args.tables.split(","))
    # a fresh Inductor cache: the FX graph cache does not key on kvops' lowerings, so a warm one may serve code
    # generated by an older lowering
    with fresh_inductor_cache():
        if "paged" in tables:
            compiled_paged(report, sizes, rounds, clock)
        if "contiguous" in tables:
            compiled_contiguous(report, sizes, rounds, clock)
    if "eager" in tables:
        eager_paged(report, sizes, rounds, clock)
    report.finish()


COLUMNS = [("dtype", 13), ("cache", 6), ("N", 5, "{:d}")]


def compiled_paged(report, sizes, rounds, clock):
    target = "compiled paged write: kvops <= 1.0x Inductor's index_put_"
    table = report.table("compiled paged write: kvops.paged_cache_write / Inductor's index_put_ (target <= 1.0x)",
                         [*COLUMNS, ("kvops/aten", 17), ("aten us", 8, "{:.1f}")])
    for dtype in (torch.bfloat16, FP8):
        for joint in (False, True):
            for n in sizes:
                key, value, kc, vc, slots, (ks, vs) = paged_case(n, dtype, joint)
                torch._dynamo.reset()
                ours = torch.compile(kvops_paged, fullgraph=True)
                theirs = torch.compile(aten_paged, fullgraph=True)
                t = harness.interleave({"aten": lambda: theirs(key, value, kc, vc, slots, ks, vs),
                                  "kvops": lambda: ours(key, value, kc, vc, slots, ks, vs)}, rounds, clock=clock)
                cache = "joint" if joint else "plain"
                table.row(str(dtype)[6:], cache, n, t.ratio("kvops", "aten"), t.time("aten", 1e6).median)
                report.target(target, f"{str(dtype)[6:]} {cache} N={n}", t.ratio("kvops", "aten"), 1.0,
                              meaning=MEANING["compiled"].replace("{what}", "paged_cache_write"))


def compiled_contiguous(report, sizes, rounds, clock):
    target = "compiled contiguous write: kvops <= 1.0x Inductor's slice copy"
    table = report.table("compiled contiguous write: kvops.cache_write / k_cache[:, s:s+T] = key (target <= 1.0x)",
                         [*COLUMNS, ("kvops/aten", 17), ("aten us", 8, "{:.1f}")])
    for joint in (False, True):
        for n in sizes:
            key, value, kc, vc = contiguous_case(n, torch.bfloat16, joint)
            torch._dynamo.reset()
            ours = torch.compile(kvops_contiguous, fullgraph=True)
            theirs = torch.compile(aten_contiguous, fullgraph=True)
            t = harness.interleave({"aten": lambda: theirs(key, value, kc, vc),
                              "kvops": lambda: ours(key, value, kc, vc)}, rounds, clock=clock)
            cache = "joint" if joint else "plain"
            table.row("bfloat16", cache, n, t.ratio("kvops", "aten"), t.time("aten", 1e6).median)
            report.target(target, f"bfloat16 {cache} N={n}", t.ratio("kvops", "aten"), 1.0,
                          meaning=MEANING["compiled"].replace("{what}", "cache_write"))


def eager_paged(report, sizes, rounds, clock):
    target = "eager paged write: kvops (value checks off) <= 1.2x index_copy_"
    table = report.table("eager paged write: kvops.paged_cache_write / index_copy_ (target <= 1.2x, value checks off)",
                         [*COLUMNS, ("checks default", 17), ("checks off", 17), ("index_copy_ us", 14, "{:.1f}")])
    off = lambda: kvops.value_checks("off")  # noqa: E731
    for dtype in (torch.bfloat16, FP8):
        for joint in (False, True):
            for n in sizes:
                key, value, kc, vc, slots, (ks, vs) = paged_case(n, dtype, joint)
                t = harness.interleave({
                    "aten": lambda: eager_index_copy(key, value, kc, vc, slots, ks, vs),
                    "kvops": lambda: eager_kvops(key, value, kc, vc, slots, ks, vs),
                    "off": (lambda: eager_kvops(key, value, kc, vc, slots, ks, vs), off),
                }, rounds, clock=clock)
                cache = "joint" if joint else "plain"
                table.row(str(dtype)[6:], cache, n, t.ratio("kvops", "aten"), t.ratio("off", "aten"),
                          t.time("aten", 1e6).median)
                report.target(target, f"{str(dtype)[6:]} {cache} N={n}", t.ratio("off", "aten"), 1.2,
                              meaning=MEANING["eager"])


if __name__ == "__main__":
    main(ARGS)
