"""Eager cost of the value checks (docs/semantics.md §7): ``paged_cache_write`` and ``paged_attention`` per call,
value checks ``"eager"`` (the default: one host read of the index tensors per call) vs. ``"off"``.

Workload (synthetic, random values): Llama-3.1-8B KV geometry (8 KV heads x 128, 32 query heads), block_size 16,
N new tokens written to random distinct slots of bfloat16 caches (``paged_cache_write``), and a decode batch of N
sequences of 64 tokens each over float32 caches (``paged_attention``, ``q_len = 1``; float32 because bf16 attention is
emulated on CPUs without AVX512-BF16, which only slows the run down). The two modes are timed *interleaved*
(benchmarks/_harness.py, as every benchmark: rounds of one sample of each mode, order rotated every round; a sample
times back-to-back calls for about 2 ms), so drift hits both alike. Times are the calling thread's CPU time
(``time.thread_time``, one torch thread), which other jobs on a shared machine disturb far less than wall time; on
CPU a host sync costs no waiting, so CPU time is the whole cost. Printed per (op, N): median us per call with checks
on and off, the median [p25-p75] of the per-round ratio on/off, the added us, and the check's own cost timed alone
(the robust figure when the op's time varies more than the check costs). Only relative numbers mean anything;
nothing is asserted; the verdict block says what the run found.

    python benchmarks/value_checks.py [--rounds 100] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds per case")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="N = 16 only, at most 10 rounds")
    harness.add_json_arg(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

import kvops  # noqa: E402
from kvops._checks import values  # noqa: E402  (the check alone, to isolate its cost from the op's noise)

H_Q, H_KV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B attention geometry (docs/models.md)
DTYPE = torch.bfloat16


def write_case(n: int):
    num_blocks = -(-2 * n // BLOCK_SIZE)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, H_KV, HEAD_DIM, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(n, H_KV, HEAD_DIM, dtype=DTYPE), torch.randn(n, H_KV, HEAD_DIM, dtype=DTYPE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:n]
    return (lambda: kvops.paged_cache_write(key, value, k_cache, v_cache, slots),
            lambda: values.check_paged_write(slots, k_cache))


def attention_case(n: int, context: int = 64, dtype=torch.float32):
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = n * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, H_KV, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks).to(torch.int32).view(n, per_seq)
    seq_lens = torch.full((n,), context, dtype=torch.int32)
    cu = torch.arange(n + 1, dtype=torch.int32)
    q = torch.randn(n, H_Q, HEAD_DIM, dtype=dtype)
    return (lambda: kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, 1),
            lambda: values.check_paged_attention(q, k_cache, cu, seq_lens, table, 1))


def interleaved(fn, rounds: int, clock: str) -> harness.Timings:
    """Per-call times of ``fn`` with value checks "eager" ("on") and "off", ``rounds`` interleaved rounds."""
    return harness.interleave({"on": (fn, lambda: kvops.value_checks("eager")),
                               "off": (fn, lambda: kvops.value_checks("off"))}, rounds, clock=clock)


def alone(check, clock: str, reps: int = 300) -> float:
    """Median per-call time (s) of the check by itself (default "eager" mode), over 5 rounds of ``reps`` calls."""
    return harness.interleave({"check": check}, 5, clock=clock, reps=reps).time("check").median


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = harness.pick_clock(args.threads)[0]
    report = harness.Report("value_checks", args)
    report.start(threads=args.threads)
    rounds_text = "at most 10" if args.quick else f"{args.rounds} (a fifth, at least 20, for N >= 512)"
    report.note(f"{clock} clock, {rounds_text} interleaved rounds, H_q {H_Q} / "
                f"H_kv {H_KV} x D {HEAD_DIM}, block_size {BLOCK_SIZE}; on/off: per-round ratio")
    table = report.table("eager cost of the value checks: mode \"eager\" (on, the default) vs \"off\"",
                         [("op", 17), ("N", 5, "{:d}"), ("on us", 8, "{:.1f}"), ("off us", 8, "{:.1f}"),
                          ("on/off", 17), ("added us", 8, "{:.1f}"), ("check alone us", 14, "{:.1f}")])
    for name, make, sizes in (("paged_cache_write", write_case, (16, 512, 8192)),
                              ("paged_attention", attention_case, (16, 512))):
        for n in sizes[:1] if args.quick else sizes:
            fn, check = make(n)
            rounds = args.rounds if n < 512 else max(20, args.rounds // 5)
            t = interleaved(fn, min(rounds, 10) if args.quick else rounds, clock)
            m_on, m_off = t.time("on", 1e6).median, t.time("off", 1e6).median
            check_us = alone(check, clock) * 1e6
            table.row(name, n, m_on, m_off, t.ratio("on", "off"), m_on - m_off, check_us)
            report.finding(f"{name}, N={n}: the check adds {check_us:.1f} us per call (timed alone), "
                           f"{check_us / m_off:.1%} of the call with checks off")
    report.finish()


if __name__ == "__main__":
    main(ARGS)
