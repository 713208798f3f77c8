"""Eager cost of the value checks (docs/semantics.md §7): ``paged_cache_write`` and ``paged_attention`` per call,
value checks ``"eager"`` (the default: one host read of the index tensors per call) vs. ``"off"``.

Workload (synthetic, random values): Llama-3.1-8B KV geometry (8 KV heads x 128, 32 query heads), block_size 16,
N new tokens written to random distinct slots of bfloat16 caches (``paged_cache_write``), and a decode batch of N
sequences of 64 tokens each over float32 caches (``paged_attention``, ``q_len = 1``; float32 because bf16 attention is
emulated on CPUs without AVX512-BF16, which only slows the run down). The two modes are timed *interleaved* (rounds of
one sample of each mode, alternating which goes first; a sample times back-to-back calls for about 2 ms), so drift
hits both alike. Times are the process's CPU time (``time.process_time``, one torch thread), which other jobs on a
shared machine disturb far less than wall time; on CPU a host sync costs no waiting, so CPU time is the whole cost.
Printed per (op, N): median µs per call with checks on and off, the median and the [p10, p90] spread of the
per-round ratio on/off, the added µs, and the check's own cost timed alone (the robust figure when the op's
time varies more than the check costs). Only relative numbers mean anything; nothing is asserted.

    python benchmarks/value_checks.py [--rounds 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds per case")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch

import kvops
from kvops._checks import values  # the check alone, to isolate its cost from the op's noise

H_Q, H_KV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B attention geometry (models.md)
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


def interleaved(fn, rounds: int, sample_s: float = 2e-3):
    """Per-call times (s) of ``fn`` with value checks "eager" and "off": ``rounds`` samples of each, interleaved
    (alternating which mode goes first); a sample times ``reps`` back-to-back calls, ``reps`` calibrated so that a
    sample takes about ``sample_s``."""
    for mode in ("eager", "off"):  # warm-up both paths
        with kvops.value_checks(mode):
            fn()
    t0 = time.process_time()
    fn()
    reps = max(1, int(sample_s / max(time.process_time() - t0, 1e-7)))
    on, off = [], []
    for r in range(rounds):
        order = (("eager", on), ("off", off)) if r % 2 == 0 else (("off", off), ("eager", on))
        for mode, out in order:
            with kvops.value_checks(mode):
                t0 = time.process_time()
                for _ in range(reps):
                    fn()
                out.append((time.process_time() - t0) / reps)
    return on, off


def alone(check, reps: int = 300) -> float:
    """Median per-call CPU time (s) of the check by itself (default "eager" mode), over 5 batches of ``reps``."""
    check()
    times = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            check()
        times.append((time.process_time() - t0) / reps)
    return statistics.median(times)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(args) -> None:
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds, "
          f"H_q {H_Q} / H_kv {H_KV} x D {HEAD_DIM}, block_size {BLOCK_SIZE}")
    print(f"{'op':<18}{'N':>6}{'on µs':>10}{'off µs':>10}{'ratio':>8}{'[p10, p90]':>16}{'added µs':>10}"
          f"{'check alone µs':>16}")
    for name, make, sizes in (("paged_cache_write", write_case, (16, 512, 8192)),
                              ("paged_attention", attention_case, (16, 512))):
        for n in sizes:
            fn, check = make(n)
            on, off = interleaved(fn, args.rounds if n < 512 else max(20, args.rounds // 5))
            ratios = [a / b for a, b in zip(on, off)]
            m_on, m_off = statistics.median(on) * 1e6, statistics.median(off) * 1e6
            spread = f"[{quantile(ratios, 0.1):.2f}, {quantile(ratios, 0.9):.2f}]"
            print(f"{name:<18}{n:>6}{m_on:>10.1f}{m_off:>10.1f}{statistics.median(ratios):>8.2f}{spread:>16}"
                  f"{m_on - m_off:>10.1f}{alone(check) * 1e6:>16.1f}")


if __name__ == "__main__":
    main(ARGS)
