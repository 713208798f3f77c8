"""Cost of the attention features in kvops.paged_attention: each feature's decode time over the same call without it.

Candidates, on the same paged cache (block_size 16, randomly permuted block table, K/V and q ~ N(0, 1)), each a
decode batch (B sequences, one query each, over a context of C tokens): **none** (no feature), **alibi**
(``alibi_slopes [H_q]``), **rope** (RoPE at read time, ``rope_theta=1e4``), **leftpad** (``cache_leftpad`` all 0:
the same keys as none), **window** (``window_left = C / 2``: half the keys) and **sink+window** (4 sink tokens and
the same window), plus the **ideal** (SDPA over a contiguous cache, as in benchmarks/paged_decode.py). Value checks
are off while timing (the kernels alone).

Timing: 1 CPU thread by default, clock = the thread's CPU time (``time.thread_time``: time the process is preempted
by other jobs is not counted); candidates run interleaved (order reversed every round), each sample a batch of calls
lasting >= ~20 ms; the table gives each candidate's median time and its ratio over none (median and 25th-75th
percentile of the per-round ratios). Only ratios are meaningful; nothing is asserted. Target: alibi, rope and leftpad
within 1.15x of none; window and sink+window below 0.7x (they read half the keys).

    python benchmarks/paged_features.py [--rounds 7] [--threads 1] [--geometries qwen2.5-0.5b llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GEOMETRIES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}  # (H_q, H_kv, D), as paged_decode.py


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES),
                        help="attention geometries (query heads / KV heads x head_dim of these models)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="cache and query dtypes")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="decode batch sizes")
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024], help="context lengths in tokens")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: thread CPU time; more: wall time)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvops  # noqa: E402


def candidates(geometry, dtype, batch, context):
    h_q, h_kv, d = GEOMETRIES[geometry]
    dt = getattr(torch, dtype)
    bs, blocks = 16, -(-context // 16)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch * blocks, bs, h_kv, d, generator=g).to(dt)
    v_cache = torch.randn(batch * blocks, bs, h_kv, d, generator=g).to(dt)
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, h_q, d, generator=g).to(dt)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    features = {
        "none": {}, "alibi": dict(alibi_slopes=torch.rand(h_q, generator=g) * 0.1), "rope": dict(rope_theta=1e4),
        "leftpad": dict(cache_leftpad=torch.zeros(batch, dtype=torch.int32)),
        "window": dict(window_left=context // 2), "sink+window": dict(window_left=context // 2, sink_tokens=4),
    }
    out = {name: (lambda kw=kw: kvops.paged_attention(q, k_cache, v_cache, cu, lens, table, 1, **kw))
           for name, kw in features.items()}
    kd = torch.randn(batch, h_kv, context, d, generator=g).to(dt)
    vd = torch.randn(batch, h_kv, context, d, generator=g).to(dt)
    qd = q.view(batch, h_kv, h_q // h_kv, d)
    out["ideal"] = lambda: F.scaled_dot_product_attention(qd, kd, vd)
    return out


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    kvops.set_value_checks("off")
    print(f"=== {args.threads} CPU thread(s), {'thread CPU' if args.threads == 1 else 'wall'} clock; ratios over "
          f"'none' (median [25th-75th percentile] of per-round ratios) ===")
    for geometry in args.geometries:
        for dtype in args.dtypes:
            for batch in args.batches:
                for context in args.contexts:
                    fns = candidates(geometry, dtype, batch, context)
                    for fn in fns.values():
                        fn()
                    t0 = clock()
                    fns["none"]()
                    reps = max(3, int(0.02 / max(clock() - t0, 1e-6)))
                    times = {name: [] for name in fns}
                    for r in range(args.rounds):
                        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                            t0 = clock()
                            for _ in range(reps):
                                fns[name]()
                            times[name].append((clock() - t0) / reps * 1e6)
                    cells = []
                    for name, ts in times.items():
                        ratios = [t / n for t, n in zip(ts, times["none"])]
                        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
                        cells.append(f"{name} {statistics.median(ts):.0f} us {statistics.median(ratios):.2f} "
                                     f"[{q1:.2f}-{q3:.2f}]")
                    print(f"{geometry} {dtype} B={batch} ctx={context}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
