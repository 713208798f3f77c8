"""Cascade attention: decode of sequences sharing a prefix, kvops.cascade_attention against kvops.paged_attention.

The batch: B sequences whose block tables start with the same blocks (a shared prompt of P tokens, as prefix caching
or parallel sampling leaves it), each followed by its own S tokens in its own blocks (block_size 16, blocks randomly
permuted, K/V and q ~ N(0, 1)); one decode query per sequence. Candidates: **plain** (``kvops.paged_attention`` over
every sequence's whole table: the shared blocks are read once per sequence), **cascade** (``kvops.cascade_attention``
with ``kvops.plan_cascade``'s plan, made once outside the timed region: the prefix read once for all B queries with
GQA folded into one query block, then each suffix, merged; docs/cascade.md) and, as a lower bound of its parts,
**prefix only** (level 1 alone) and **merge** (``kvops.merge_attention_states`` alone). Results agree (max |diff|
printed per row). A second table times the merge (the public call, and its CPU kernel without the argument checks)
against the obvious torch composite (``composite_merge``) at T = B and T = 1024 query rows. Value checks are off while timing (the kernels alone).

Timing (benchmarks/_harness.py): 1 CPU thread by default, clock = the thread's CPU time; candidates interleaved
(order rotated every round); each figure median [p25-p75] of the per-round values. Target (``TARGET``): cascade at
least 3x faster than plain (plain / cascade >= 3) at every measured case (not in ``--quick``, whose shapes are too
small to share much); the verdict block says which hold.

    python benchmarks/cascade.py [--rounds 5] [--batches 64] [--prefix 4096] [--suffix 128] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

GEOMETRIES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # (H_q, H_kv, D): docs/models.md
TARGET = 3.0  # plain / cascade >= 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES),
                        help="attention geometries (query heads / KV heads x head_dim of these models)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="cache and query dtypes")
    parser.add_argument("--batches", nargs="+", type=int, default=[64], help="sequences sharing the prefix")
    parser.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens (a multiple of 16)")
    parser.add_argument("--suffix", type=int, default=128, help="each sequence's own tokens after the prefix")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: thread CPU time; more: wall time)")
    parser.add_argument("--quick", action="store_true",
                        help="qwen2.5-0.5b, float32, B=8, prefix 256, suffix 32, 3 rounds (options given explicitly "
                             "still apply to what they name)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, key, value in (("--geometries", "geometries", ["qwen2.5-0.5b"]), ("--dtypes", "dtypes", ["float32"]),
                                 ("--batches", "batches", [8]), ("--prefix", "prefix", 256),
                                 ("--suffix", "suffix", 32), ("--rounds", "rounds", 3)):
            if flag not in given:
                setattr(args, key, value)
    if args.prefix % 16:
        parser.error(f"--prefix must be a multiple of the block size 16, got {args.prefix}")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

import kvops  # noqa: E402
from kvops.cpu import merge as cpu_merge  # noqa: E402  (the merge's CPU kernel without the argument checks)
from kvops.ops import cascade as _cascade  # noqa: E402  (level 1 alone, for the breakdown)


def batch(geometry, dtype, b, prefix, suffix, bs=16):
    h_q, h_kv, d = GEOMETRIES[geometry]
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    shared, own = prefix // bs, -(-suffix // bs)
    pages = shared + b * own
    k = torch.randn(pages, bs, h_kv, d, generator=g).to(dt)
    v = torch.randn(pages, bs, h_kv, d, generator=g).to(dt)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    table = torch.empty(b, shared + own, dtype=torch.int32)
    table[:, :shared] = perm[:shared]
    table[:, shared:] = perm[shared:].view(b, own)
    return dict(q=torch.randn(b, h_q, d, generator=g).to(dt), k_cache=k, v_cache=v,
                cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
                seq_lens=torch.full((b,), prefix + suffix, dtype=torch.int32), block_table=table, max_seqlen_q=1)


def candidates(a, plan):
    args = (a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"], 1)
    o, lse = kvops.paged_attention(*args, return_lse=True)
    scale = a["q"].shape[-1] ** -0.5
    return {
        "plain": lambda: kvops.paged_attention(*args),
        "cascade": lambda: kvops.cascade_attention(*args, plan),
        "prefix only": lambda: _cascade._prefix_gemm(a["q"], a["k_cache"], a["v_cache"], a["block_table"], plan,
                                                     scale, "NHD"),
        "merge": lambda: kvops.merge_attention_states(o, lse, o, lse),
    }


def composite_merge(o_a, lse_a, o_b, lse_b):
    """The obvious torch composite of the merge (no empty-part handling): the baseline of the merge table."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = w_a + w_b
    c_a, c_b = (w_a / s).t().unsqueeze(-1), (w_b / s).t().unsqueeze(-1)
    return (o_a.float() * c_a + o_b.float() * c_b).to(o_a.dtype), m + torch.log(s)


def merge_table(report, args, clock) -> None:
    """``kvops.merge_attention_states`` against :func:`composite_merge` at decode (T = B) and chunk (T = 1024) rows."""
    table = report.table("merge: kvops.merge_attention_states vs the obvious torch composite",
                         [("geometry", 13), ("dtype", 9), ("T", 5), ("composite us", 22, "{:.0f}"),
                          ("kvops us", 22, "{:.0f}"), ("kvops/composite", 20), ("kernel/composite", 17)])
    for geometry in args.geometries:
        h_q, _, d = GEOMETRIES[geometry]
        for dtype in args.dtypes:
            for t in sorted({args.batches[0], 1024 if not args.quick else 64}):
                g = torch.Generator().manual_seed(1)
                o_a, o_b = (torch.randn(t, h_q, d, generator=g).to(getattr(torch, dtype)) for _ in range(2))
                lse_a, lse_b = torch.randn(h_q, t, generator=g), torch.randn(h_q, t, generator=g)
                fns = {"composite": lambda: composite_merge(o_a, lse_a, o_b, lse_b),
                       "kvops": lambda: kvops.merge_attention_states(o_a, lse_a, o_b, lse_b),
                       "kernel": lambda: cpu_merge.merge_attention_states(o_a, lse_a, o_b, lse_b)}
                timing = harness.interleave(fns, args.rounds * 3, clock=clock, min_sample_s=0.02)
                r = timing.ratio("kvops", "composite")
                table.row(geometry, dtype, t, timing.time("composite", 1e6), timing.time("kvops", 1e6), r,
                          timing.ratio("kernel", "composite"))
                report.finding(f"merge {geometry} {dtype} T={t}: kvops/composite {r}")


MEANING = ("on this host, decode of {case} sequences sharing a prefix runs only {value:.2f}x faster with "
           "cascade_attention than with paged_attention ({over:.0%} short of {bound:g}x)")


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = harness.pick_clock(args.threads)[0]
    kvops.set_value_checks("off")
    report = harness.Report("cascade", args)
    report.start(threads=args.threads)
    report.note(f"{clock} clock, {args.rounds} interleaved rounds; value checks off; ms: median time per call; "
                f"plain/cascade: per-round speedup; prefix {args.prefix} tokens shared, {args.suffix} own per sequence")
    for geometry in args.geometries:
        h_q, h_kv, d = GEOMETRIES[geometry]
        for dtype in args.dtypes:
            table = report.table(f"{geometry} ({h_q}/{h_kv} heads x {d}), {dtype}",
                                 [("case", 8), ("plain ms", 20), ("cascade ms", 20), ("prefix ms", 9, "{:.1f}"),
                                  ("merge ms", 8, "{:.2f}"), ("plain/cascade", 20), ("max|diff|", 9, "{:.1e}")])
            for b in args.batches:
                a = batch(geometry, dtype, b, args.prefix, args.suffix)
                plan = kvops.plan_cascade(a["block_table"], a["seq_lens"], a["cu_seqlens_q"], 16)
                fns = candidates(a, plan)
                diff = (fns["plain"]().float() - fns["cascade"]().float()).abs().max().item()
                t = harness.interleave(fns, args.rounds, clock=clock, min_sample_s=0.02)
                speedup = harness.ratio(t.times["plain"], t.times["cascade"])
                case = f"B={b}"
                table.row(case, t.time("plain", 1e3), t.time("cascade", 1e3), t.time("prefix only", 1e3).median,
                          t.time("merge", 1e3).median, speedup, diff)
                if args.quick:  # a smoke run's shapes are too small for the target
                    report.finding(f"{geometry} {dtype} {case}: plain / cascade {speedup}")
                else:
                    report.target(f"plain / cascade >= {TARGET:g}", f"{geometry} {dtype} {case}", speedup, TARGET,
                                  ">=", MEANING.replace("{case}", str(b)))
    merge_table(report, args, clock)
    report.finish()


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
