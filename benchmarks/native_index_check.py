"""Cost of the native CPU paged-attention kernel's own index check (kvops/native/paged_checks.h).

The kernel checks, before any parallel region, every index value it addresses memory with
(``cu_seqlens_q``, ``seq_lens``, the block ids of the first ``ceil(seq_len / block_size)`` entries of each
``block_table`` row), in every value-check mode and inside compiled graphs. That check is the function behind
``kvops::_paged_attention_values_bad`` (``values_bad``), so its cost is timed as that op alone (an upper bound: the op
adds a dispatcher call the kernel does not pay) against one call of the kernel ``kvops::_paged_attention_native``
on the same tensors.

Workload (synthetic: K/V, q ~ N(0, 1), a randomly permuted block table): decode (``q_len = 1``), Llama-3.1-8B
attention geometry (32 query / 8 KV heads x 128), block_size 16, float32 caches, B in {1, 8, 32} x context in
{256, 1024, 4096}. Candidates run interleaved (benchmarks/_harness.py, as every benchmark: rounds of one sample
each, order rotated every round; a sample times back-to-back calls for ~2 ms of the thread's CPU time,
``time.thread_time``, one torch thread). Printed per case: median us per call of kernel and check, and the median
[p25-p75] of the per-round ratio check / kernel; the verdict block gives the largest ratio. Only ratios mean
anything; nothing is asserted.

    python benchmarks/native_index_check.py [--rounds 40] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per case (--quick: at most 5)")
    parser.add_argument("--quick", action="store_true", help="B in {1, 8} x context in {256, 1024}, at most 5 rounds")
    harness.add_json_arg(parser)
    return parser.parse_args(argv)

if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

import kvops.native as native  # noqa: E402

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


def main(args) -> None:
    torch.set_num_threads(1)
    assert native.available(), "the native kernel could not be built"
    batches, contexts = ((1, 8), (256, 1024)) if args.quick else ((1, 8, 32), (256, 1024, 4096))
    rounds = min(args.rounds, 5) if args.quick else args.rounds
    report = harness.Report("native_index_check", args)
    report.start(threads=1)
    table = report.table(f"the native kernel's index check alone / one kernel call ({rounds} interleaved rounds, "
                         "thread CPU time)", [("B", 3, "{:d}"), ("context", 7, "{:d}"), ("kernel us", 9, "{:.1f}"),
                                              ("check us", 8, "{:.2f}"), ("check/kernel", 22, "{:.3%}")])
    worst = None
    for batch in batches:
        for context in contexts:
            kernel, check = case(batch, context)
            t = harness.interleave({"kernel": kernel, "check": check}, rounds, clock="thread")
            r = t.ratio("check", "kernel")
            table.row(batch, context, t.time("kernel", 1e6).median, t.time("check", 1e6).median, r)
            if worst is None or r.median > worst[0].median:
                worst = (r, batch, context)
    report.finding(f"the index check costs at most {worst[0].format('{:.2%}').rstrip()} of a kernel call "
                   f"(B={worst[1]}, context {worst[2]})")
    report.finish()


if __name__ == "__main__":
    main(ARGS)
