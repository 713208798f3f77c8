"""Cache writes on CPU: kvops' fused writes vs. the plain aten indexing Inductor fuses itself, and eager overhead.

Geometry: 8 KV heads x head_dim 128 (Llama-3-8B / Qwen2.5-7B KV geometry, models.md), block_size 16, N tokens per call,
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

Timing: candidates are interleaved round by round (each round times every candidate once, ``--inner`` calls each),
so machine noise hits all of them alike; a table cell is the median of the per-round ratios and its spread the
25th-75th percentile of those ratios. Nothing is asserted; only the ratios are meaningful. Threads default to 1 (the
benchmark machine is shared; multi-threaded timings there measure the scheduler), and with one thread the clock is
the thread's CPU time (``time.thread_time``: time this thread was descheduled by other processes is not counted;
``--clock wall`` for ``time.perf_counter``, the default with more threads).

    python benchmarks/cache_write.py [--rounds 15] [--threads 1] [--clock thread|wall] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=("thread", "wall"), default=None,
                        help="thread CPU time (default with --threads 1) or wall time")
    parser.add_argument("--quick", action="store_true", help="N in {16, 512} and 7 rounds")
    parser.add_argument("--tables", default="paged,contiguous,eager", help="comma-separated subset to run")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch
from torch._inductor.utils import fresh_inductor_cache

import kvops

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
CLOCK = time.perf_counter


def interleaved_ratios(candidates, rounds, inner):
    """``candidates``: {name: (fn, context factory)}; the first is the baseline. Returns {name: [ratio per round]}."""
    for fn, ctx in candidates.values():  # warm-up (compiles)
        with ctx():
            fn()
            fn()
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, (fn, ctx) in candidates.items():
            with ctx():
                t0 = CLOCK()
                for _ in range(inner):
                    fn()
                times[name].append((CLOCK() - t0) / inner)
    base = next(iter(times))
    return {name: [t / b for t, b in zip(ts, times[base])] for name, ts in times.items() if name != base}, times[base]


def summary(ratios):
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return f"{statistics.median(ratios):5.2f}x [{q[0]:.2f}-{q[2]:.2f}]"


def inner_for(n):
    return 200 if n <= 16 else (40 if n <= 512 else 4)


def main(args) -> None:
    torch.set_num_threads(args.threads)
    global CLOCK
    clock = args.clock or ("thread" if args.threads == 1 else "wall")
    CLOCK = time.thread_time if clock == "thread" else time.perf_counter
    sizes = (16, 512) if args.quick else (16, 512, 8192)
    rounds = 7 if args.quick else args.rounds
    value_checks = getattr(kvops, "value_checks", None)
    print(f"threads={args.threads}, clock={clock}, H_kv={H}, head_dim={D}, block_size={BLOCK_SIZE}, rounds={rounds}; "
          f"cells: median ratio [25th-75th percentile]; baseline median time in us")

    tables = set(args.tables.split(","))
    # a fresh Inductor cache: the FX graph cache does not key on kvops' lowerings, so a warm one may serve code
    # generated by an older lowering
    with fresh_inductor_cache():
        if "paged" in tables:
            compiled_paged(sizes, rounds)
        if "contiguous" in tables:
            compiled_contiguous(sizes, rounds)
    if "eager" in tables:
        eager_paged(sizes, rounds, value_checks)


def compiled_paged(sizes, rounds):
    nothing = contextlib.nullcontext
    print("\n## compiled paged write: kvops.paged_cache_write / Inductor's index_put_ (target <= 1.0x)")
    print(f"{'dtype':13} {'cache':6} {'N':>5} | {'ratio':22} | {'aten us':>8}")
    for dtype in (torch.bfloat16, FP8):
        for joint in (False, True):
            for n in sizes:
                key, value, kc, vc, slots, (ks, vs) = paged_case(n, dtype, joint)
                torch._dynamo.reset()
                ours = torch.compile(kvops_paged, fullgraph=True)
                theirs = torch.compile(aten_paged, fullgraph=True)
                ratios, base = interleaved_ratios({
                    "aten": (lambda: theirs(key, value, kc, vc, slots, ks, vs), nothing),
                    "kvops": (lambda: ours(key, value, kc, vc, slots, ks, vs), nothing),
                }, rounds, inner_for(n))
                print(f"{str(dtype)[6:]:13} {'joint' if joint else 'plain':6} {n:5} | {summary(ratios['kvops']):22} | "
                      f"{statistics.median(base) * 1e6:8.1f}")



def compiled_contiguous(sizes, rounds):
    nothing = contextlib.nullcontext
    print("\n## compiled contiguous write: kvops.cache_write / k_cache[:, s:s+T] = key (target <= 1.0x)")
    print(f"{'dtype':13} {'cache':6} {'N':>5} | {'ratio':22} | {'aten us':>8}")
    for joint in (False, True):
        for n in sizes:
            key, value, kc, vc = contiguous_case(n, torch.bfloat16, joint)
            torch._dynamo.reset()
            ours = torch.compile(kvops_contiguous, fullgraph=True)
            theirs = torch.compile(aten_contiguous, fullgraph=True)
            ratios, base = interleaved_ratios({
                "aten": (lambda: theirs(key, value, kc, vc), nothing),
                "kvops": (lambda: ours(key, value, kc, vc), nothing),
            }, rounds, inner_for(n))
            print(f"{'bfloat16':13} {'joint' if joint else 'plain':6} {n:5} | {summary(ratios['kvops']):22} | "
                  f"{statistics.median(base) * 1e6:8.1f}")



def eager_paged(sizes, rounds, value_checks):
    nothing = contextlib.nullcontext
    off = (lambda: value_checks("off")) if value_checks is not None else None
    print("\n## eager paged write: kvops.paged_cache_write / index_copy_ (target <= 1.2x)")
    print(f"{'dtype':13} {'cache':6} {'N':>5} | {'checks default':22} | {'checks off':22} | {'index_copy_ us':>8}")
    for dtype in (torch.bfloat16, FP8):
        for joint in (False, True):
            for n in sizes:
                key, value, kc, vc, slots, (ks, vs) = paged_case(n, dtype, joint)
                candidates = {
                    "aten": (lambda: eager_index_copy(key, value, kc, vc, slots, ks, vs), nothing),
                    "kvops": (lambda: eager_kvops(key, value, kc, vc, slots, ks, vs), nothing),
                }
                if off is not None:
                    candidates["off"] = (lambda: eager_kvops(key, value, kc, vc, slots, ks, vs), off)
                ratios, base = interleaved_ratios(candidates, rounds, inner_for(n))
                off_cell = summary(ratios["off"]) if off is not None else "(no kvops.value_checks)"
                print(f"{str(dtype)[6:]:13} {'joint' if joint else 'plain':6} {n:5} | {summary(ratios['kvops']):22} | "
                      f"{off_cell:22} | {statistics.median(base) * 1e6:8.1f}")


if __name__ == "__main__":
    main(ARGS)
