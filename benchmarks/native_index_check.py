"""Cost of the native CPU paged-attention kernel's own index check (kvops/native/paged_attention.cpp).

The kernel checks, before any parallel region, every index value it addresses memory with
(``cu_seqlens_q``, ``seq_lens``, the block ids of the first ``ceil(seq_len / block_size)`` entries of each
``block_table`` row), in every value-check mode and inside compiled graphs. That check is the function behind
``kvops::_paged_attention_values_bad`` (``values_bad``), so its cost is timed as that op alone (an upper bound: the op
adds a dispatcher call the kernel does not pay) against one call of the kernel ``kvops::_paged_attention_native``
on the same tensors.

Workload (synthetic: K/V, q ~ N(0, 1), a randomly permuted block table): decode (``q_len = 1``), Llama-3.1-8B
attention geometry (32 query / 8 KV heads x 128), block_size 16, float32 caches, B in {1, 8, 32} x context in
{256, 1024, 4096}. Candidates run interleaved (rounds of one sample each, alternating which goes first; a sample
times back-to-back calls for ~2 ms of the thread's CPU time, ``time.thread_time``, one torch thread). Printed per
case: median µs per call of kernel and check, and the median and [p25, p75] of the per-round ratio check / kernel.
Only ratios mean anything; nothing is asserted.

    python benchmarks/native_index_check.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per case")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch

import kvops.native as native

H_Q, H_KV, D, BLOCK_SIZE = 32, 8, 128, 16


def case(batch: int, context: int):
    g = torch.Generator().manual_seed(batch * 10_000 + context)
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks + 3
    k = torch.randn(num_blocks, BLOCK_SIZE, H_KV, D, generator=g)
    v = torch.randn(num_blocks, BLOCK_SIZE, H_KV, D, generator=g)
    q = torch.randn(batch, H_Q, D, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: batch * blocks].view(batch, blocks).to(torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    kernel = lambda: torch.ops.kvops._paged_attention_native(  # noqa: E731
        q, k, v, cu, lens, table, 1, D**-0.5, True, -1, 0.0, None, None, None)
    check = lambda: torch.ops.kvops._paged_attention_values_bad(  # noqa: E731
        cu, lens, table, batch, 1, num_blocks, BLOCK_SIZE)
    return kernel, check


def sample(fn, reps: int) -> float:
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t0) / reps


def reps_for(fn) -> int:
    t = sample(fn, 3)
    return max(3, int(2e-3 / max(t, 1e-7)))


def main(args) -> None:
    torch.set_num_threads(1)
    assert native.available(), "the native kernel could not be built"
    print(f"{'B':>3} {'context':>7} {'kernel us':>10} {'check us':>9} {'check/kernel':>13} {'[p25, p75]':>18}")
    for batch in (1, 8, 32):
        for context in (256, 1024, 4096):
            kernel, check = case(batch, context)
            rk, rc = reps_for(kernel), reps_for(check)
            tk, tc, ratios = [], [], []
            for r in range(args.rounds):
                pair = [(kernel, rk, tk), (check, rc, tc)]
                for fn, reps, out in (pair if r % 2 else pair[::-1]):
                    out.append(sample(fn, reps))
                ratios.append(tc[-1] / tk[-1])
            q = statistics.quantiles(ratios, n=4)
            print(f"{batch:>3} {context:>7} {statistics.median(tk) * 1e6:>10.1f} {statistics.median(tc) * 1e6:>9.2f} "
                  f"{statistics.median(ratios):>12.3%} [{q[0]:.3%}, {q[2]:.3%}]")


if __name__ == "__main__":
    main(ARGS)
